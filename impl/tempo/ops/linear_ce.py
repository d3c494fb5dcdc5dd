"""Memory-lean LM loss (beyond the paper: Llama-family heads): the head's matmul and the
cross-entropy over the vocabulary in row chunks, never holding the full logits.

``linear_cross_entropy(h, weight, labels)`` is ``F.cross_entropy(h @ weight.T, labels)`` (mean over
the labels that are not ``ignore_index``, logits in float32 as HF's Llama computes its loss). For a
128k vocabulary the float32 logits of a long sequence dominate memory (4 V bytes a token, plus
their softmax); here a chunk of rows at a time is projected, its log-softmax at the target
taken, and the chunk dropped. Backward recomputes each chunk's logits and turns them into
d logits = (softmax - one_hot) / n in place, then dh and dW: only h, the weight and the labels are
kept. A 16-bit dW is summed over the chunks in float32, as Megatron-LM sums micro-batches'
gradients in a float32 buffer: each chunk's product is a 16-bit GEMM (rounded once, relative to
that chunk's part) and only the sum's end is rounded again, 1.2-1.35x the error of HF's single
GEMM against float64 (a review's measurement, 64-512 chunks). Summed in 16 bits, each chunk
rounded the running sum: 4.6x at 68 chunks. The idea is the fused linear
cross-entropy of Liger-Kernel and of Wijmans et al. (Cut Your Losses, arXiv 2411.09009); written
here from the math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from measure.checks import whole

from .._common import check_float, opmath
from ..sizes import dw_block_rows

IGNORE_INDEX = -100  # as torch's cross_entropy and HF's labels
ROWS_PER_CHUNK = 1024  # rows projected at once: the transient logits are ROWS_PER_CHUNK x V floats


def _chunk_logits(h: Tensor, weight: Tensor) -> Tensor:
    return F.linear(h, weight).to(opmath(h.dtype))


def _add_chunk_dw(dw: Tensor, d_logits: Tensor, h: Tensor) -> None:
    """dw += d_logitsᵀ h. A float32 sum of 16-bit products: each block's product is one GEMM in
    the inputs' dtype (its speed; rounded to it once), added into the float32 sum."""
    if dw.dtype == d_logits.dtype:
        dw.addmm_(d_logits.t(), h)
        return
    step = dw_block_rows(dw.shape[0], dw.shape[1])
    for v in range(0, dw.shape[0], step):
        dw[v : v + step] += d_logits[:, v : v + step].t() @ h


@torch.library.custom_op("tempo::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    h: Tensor, weight: Tensor, labels: Tensor, rows_per_chunk: int, mean: bool
) -> Tensor:
    """The loss over counted rows (their mean, or their sum); h [N, H], weight [V, H], labels [N]."""
    total = torch.zeros((), dtype=opmath(h.dtype), device=h.device)
    counted = labels != IGNORE_INDEX
    for start in range(0, h.shape[0], rows_per_chunk):
        part = slice(start, min(start + rows_per_chunk, h.shape[0]))
        # torch's own log_softmax, as F.cross_entropy takes it (its sum over the counted rows may
        # still round differently from torch's reduction)
        logp = torch.log_softmax(_chunk_logits(h[part], weight), dim=-1)
        target = logp.gather(1, labels[part].clamp_min(0)[:, None])[:, 0]
        del logp
        total -= torch.where(counted[part], target, 0.0).sum()
    return total / counted.sum() if mean else total  # mean of no row: NaN, as torch's cross-entropy


@linear_cross_entropy_op.register_fake
def _(h, weight, labels, rows_per_chunk, mean):
    return h.new_empty((), dtype=opmath(h.dtype))


@torch.library.custom_op("tempo::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(
    grad: Tensor, h: Tensor, weight: Tensor, labels: Tensor, rows_per_chunk: int, mean: bool
) -> tuple[Tensor, Tensor]:
    """(dh, dW) of the loss, scaled by ``grad``; each chunk's logits recomputed. dW is summed over
    the chunks in float32 (float64 for float64): for 16-bit weights a V x H float32 buffer of the
    chunks' 16-bit products, rounded to the weight's dtype at the end."""
    counted = labels != IGNORE_INDEX
    # the mean's divisor; no counted row: zero gradients, as torch's (not 0/0)
    scale = grad / counted.sum().clamp_min(1) if mean else grad
    dh = torch.empty_like(h)
    dw = torch.zeros_like(weight, dtype=opmath(weight.dtype))
    for start in range(0, h.shape[0], rows_per_chunk):
        part = slice(start, min(start + rows_per_chunk, h.shape[0]))
        # d logits = (softmax - one_hot) x scale: softmax x scale, then - scale at the label, the
        # order torch's log_softmax backward takes
        d_logits = torch.log_softmax(_chunk_logits(h[part], weight), dim=-1).exp_()
        row_scale = (scale * counted[part])[:, None]
        d_logits *= row_scale
        target = labels[part].clamp_min(0)[:, None]
        d_logits.scatter_(1, target, d_logits.gather(1, target) - row_scale)
        d_logits = d_logits.to(h.dtype)
        torch.mm(d_logits, weight, out=dh[part])
        _add_chunk_dw(dw, d_logits, h[part])
    return dh, dw.to(weight.dtype)


@linear_cross_entropy_bwd.register_fake
def _(grad, h, weight, labels, rows_per_chunk, mean):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    h, weight, labels, rows_per_chunk, mean = inputs
    ctx.save_for_backward(h, weight, labels)
    ctx.rows_per_chunk, ctx.mean = rows_per_chunk, mean


def _backward(ctx, grad_loss: Tensor):
    h, weight, labels = ctx.saved_tensors
    dh, dw = linear_cross_entropy_bwd(grad_loss, h, weight, labels, ctx.rows_per_chunk, ctx.mean)
    return dh, dw, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def _has_values(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return not (is_fake(t) or t.is_meta or torch.compiler.is_compiling())


def linear_cross_entropy(
    h: Tensor, weight: Tensor, labels: Tensor, rows_per_chunk: int = ROWS_PER_CHUNK, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of ``h @ weight.T`` against ``labels`` (``IGNORE_INDEX`` rows not counted),
    without the full logits: their mean (``reduction="mean"``) or sum ("sum"). h: [..., H]; weight:
    [V, H]; labels: [...] (h's leading shape)."""
    check_float("linear_cross_entropy h", h)
    check_float("linear_cross_entropy weight", weight)
    if weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [vocab, hidden] with hidden = h's last dim {h.shape[-1]}, "
            f"got {list(weight.shape)}"
        )
    if h.dtype != weight.dtype:
        raise ValueError(f"h and weight must share a dtype, got {h.dtype} and {weight.dtype}")
    if not isinstance(labels, Tensor):
        raise ValueError(f"labels must be a tensor of integers, got {type(labels).__name__}")
    if labels.dtype not in (torch.int64, torch.int32) or tuple(labels.shape) != tuple(h.shape[:-1]):
        raise ValueError(
            f"labels must be integers of h's leading shape {list(h.shape[:-1])}, "
            f"got {labels.dtype} {list(labels.shape)}"
        )
    if not whole(rows_per_chunk, 1):
        raise ValueError(f"rows_per_chunk must be a whole number >= 1, got {rows_per_chunk!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if _has_values(labels):  # fake tensors (memory estimates) and compiled graphs have no values to read
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"labels must be in [0, {weight.shape[0]}) or {IGNORE_INDEX} (ignored)")
    flat, chunk = h.reshape(-1, h.shape[-1]).contiguous(), int(rows_per_chunk)  # numpy's: an int
    return linear_cross_entropy_op(flat, weight, labels.reshape(-1).long(), chunk, reduction == "mean")
