"""Memory-lean LM loss (beyond the paper: Llama-family heads): the head's matmul and the
cross-entropy over the vocabulary in row chunks, never holding the full logits.

``linear_cross_entropy(h, weight, labels)`` is ``F.cross_entropy(h @ weight.T, labels)`` (mean over
the labels that are not ``ignore_index``, logits in float32 as HF's Llama computes its loss). For a
128k vocabulary the float32 logits of a long sequence dominate memory (4 V bytes a token, plus
their softmax); here a chunk of rows at a time is projected, its log-sum-exp and target logit
taken, and the chunk dropped. Backward recomputes each chunk's logits and turns them into
d logits = (softmax - one_hot) / n in place, then dh and dW: only h, the weight, the labels and one
float per row are kept. The idea is the fused linear cross-entropy of Liger-Kernel and of
Wijmans et al. (Cut Your Losses, arXiv 2411.09009); written here from the math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._common import check_float

IGNORE_INDEX = -100  # as torch's cross_entropy and HF's labels
ROWS_PER_CHUNK = 1024  # rows projected at once: the transient logits are ROWS_PER_CHUNK x V floats


def _chunk_logits(h: Tensor, weight: Tensor) -> Tensor:
    f = torch.float64 if h.dtype == torch.float64 else torch.float32
    return F.linear(h, weight).to(f)


@torch.library.custom_op("tempo::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    h: Tensor, weight: Tensor, labels: Tensor, rows_per_chunk: int
) -> tuple[Tensor, Tensor]:
    """(mean loss over counted rows, per-row log-sum-exp); h [N, H], weight [V, H], labels [N]."""
    n = h.shape[0]
    f = torch.float64 if h.dtype == torch.float64 else torch.float32
    lse = torch.empty(n, dtype=f, device=h.device)
    total = torch.zeros((), dtype=f, device=h.device)
    counted = labels != IGNORE_INDEX
    for start in range(0, n, rows_per_chunk):
        part = slice(start, min(start + rows_per_chunk, n))
        logits = _chunk_logits(h[part], weight)
        lse[part] = torch.logsumexp(logits, dim=-1)
        # torch's own log_softmax, as F.cross_entropy computes it: the same values, to the bit
        logp = torch.log_softmax(logits, dim=-1)
        del logits
        keep = counted[part]
        target = logp.gather(1, labels[part].clamp_min(0)[:, None])[:, 0]
        total -= torch.where(keep, target, 0.0).sum()
    return total / counted.sum(), lse  # every row ignored: NaN, as torch's mean cross-entropy


@linear_cross_entropy_op.register_fake
def _(h, weight, labels, rows_per_chunk):
    f = torch.float64 if h.dtype == torch.float64 else torch.float32
    return h.new_empty((), dtype=f), h.new_empty(h.shape[0], dtype=f)


@torch.library.custom_op("tempo::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(
    grad: Tensor, h: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, rows_per_chunk: int
) -> tuple[Tensor, Tensor]:
    """(dh, dW) for the mean loss, scaled by ``grad``; each chunk's logits recomputed."""
    n = h.shape[0]
    counted = labels != IGNORE_INDEX
    scale = grad / counted.sum()
    dh = torch.empty_like(h)
    dw = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
    for start in range(0, n, rows_per_chunk):
        part = slice(start, min(start + rows_per_chunk, n))
        # d logits = (softmax - one_hot) x scale, in the order torch's log_softmax backward takes
        # (softmax x scale, then - scale at the label), from torch's log_softmax: F.cross_entropy's
        # gradient to the bit, so training follows the unpatched model's (not only to rounding)
        d_logits = torch.log_softmax(_chunk_logits(h[part], weight), dim=-1).exp_()
        row_scale = (scale * counted[part])[:, None]
        d_logits *= row_scale
        target = labels[part].clamp_min(0)[:, None]
        d_logits.scatter_(1, target, d_logits.gather(1, target) - row_scale)
        d_logits = d_logits.to(h.dtype)
        dh[part] = d_logits @ weight
        dw += (d_logits.t() @ h[part]).to(dw.dtype)
    return dh, dw.to(weight.dtype)


@linear_cross_entropy_bwd.register_fake
def _(grad, h, weight, labels, lse, rows_per_chunk):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    h, weight, labels, rows_per_chunk = inputs
    _loss, lse = output
    ctx.save_for_backward(h, weight, labels, lse)
    ctx.rows_per_chunk = rows_per_chunk


def _backward(ctx, grad_loss: Tensor, _grad_lse: Tensor | None):
    h, weight, labels, lse = ctx.saved_tensors
    dh, dw = linear_cross_entropy_bwd(grad_loss, h, weight, labels, lse, ctx.rows_per_chunk)
    return dh, dw, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def _has_values(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return not (is_fake(t) or t.is_meta or torch.compiler.is_compiling())


def linear_cross_entropy(
    h: Tensor, weight: Tensor, labels: Tensor, rows_per_chunk: int = ROWS_PER_CHUNK
) -> Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against ``labels`` (``IGNORE_INDEX`` rows not counted),
    without the full logits. h: [..., H]; weight: [V, H]; labels: [...] (h's leading shape)."""
    check_float("linear_cross_entropy h", h)
    check_float("linear_cross_entropy weight", weight)
    if weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [vocab, hidden] with hidden = h's last dim {h.shape[-1]}, "
                         f"got {list(weight.shape)}")  # fmt: skip
    if h.dtype != weight.dtype:
        raise ValueError(f"h and weight must share a dtype, got {h.dtype} and {weight.dtype}")
    if labels.dtype not in (torch.int64, torch.int32) or tuple(labels.shape) != tuple(h.shape[:-1]):
        raise ValueError(f"labels must be integers of h's leading shape {list(h.shape[:-1])}, "
                         f"got {labels.dtype} {list(labels.shape)}")  # fmt: skip
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    if _has_values(labels):  # fake tensors (memory estimates) and compiled graphs have no values to read
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"labels must be in [0, {weight.shape[0]}) or {IGNORE_INDEX} (ignored)")
    flat = h.reshape(-1, h.shape[-1]).contiguous()
    loss, _ = linear_cross_entropy_op(flat, weight, labels.reshape(-1).long(), int(rows_per_chunk))
    return loss
