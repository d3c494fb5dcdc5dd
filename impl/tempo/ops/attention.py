"""Lean attention core: out = dropout(softmax(scores)) @ V (Tempo §3.3, with FlashAttention's
seed trick for the dropout mask).

HF eager attention keeps, per head and query, the softmax output P (2 bytes/score in half),
the dropout mask (1 byte) and the dropped-out P (2 bytes): Megatron's 5as^2b. This op keeps P
and V only. The dropout mask is a function of an RNG seed and is regenerated in backward; the
dropped-out probabilities are recomputed from P and the mask when dV needs them, then freed.

Scores arrive already scaled and masked (the additive attention mask); the matmul that made
them keeps Q and K as it always does. P is kept in V's dtype and computed in float32, which
also covers autocast: under autocast torch would keep a float32 P beside the half copy the
P @ V matmul makes; here the only copy kept is the half one.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from measure.checks import finite

from .._common import (
    check_float,
    check_probability,
    check_training,
    chunks,
    dropout_keep_mask,
    new_seed,
    opmath,
    use_triton,
)
from ..sizes import attention_heads_per_chunk


def _keep_scale(p: float, seed: Tensor, chunk_index: int, shape: torch.Size, device, dtype) -> Tensor | None:
    """keep / (1 - p) as a float mask for one chunk, or None without dropout."""
    if p == 0.0:
        return None
    keep = dropout_keep_mask(seed, chunk_index, shape, p, device)
    return keep.to(dtype) * (1.0 / (1.0 - p))


def attention_core_fwd_torch(scores: Tensor, value: Tensor, p: float, seed: Tensor) -> tuple[Tensor, Tensor]:
    """Chunks of heads at a time, so the float32 softmax and the dropped-out P stay small."""
    sq, sk, dv = scores.shape[-2], scores.shape[-1], value.shape[-1]
    n = math.prod(scores.shape[:-2])  # not -1 in reshape: any of Sq, Sk, Dv may be 0
    s3, v3 = scores.reshape(n, sq, sk), value.reshape(n, sk, dv)
    f = opmath(scores.dtype)
    # Allocated in their final shapes and filled through 3-D views: the op returns them, and a
    # custom op's outputs must not be views (autograd would refuse in-place changes to `out`, which
    # torch's matmul output allows).
    probs = torch.empty(scores.shape, dtype=value.dtype, device=scores.device)
    out = torch.empty((*scores.shape[:-1], dv), dtype=value.dtype, device=scores.device)
    p3, o3 = probs.view(n, sq, sk), out.view(n, sq, dv)
    for i, part in chunks(n, attention_heads_per_chunk(sq, sk)):
        _forward_chunk(s3[part], v3[part], p3[part], o3[part], p, seed, i, f)
    return out, probs


# One chunk of heads a call: its temporaries are freed when it returns, before the next chunk's
# are made (a loop body's would outlive their iteration until rebound). What they hold at most,
# per element of a chunk, is stated in tempo.sizes (ATTENTION_CPU_BYTES_PER_CHUNK_ELEM).
def _forward_chunk(scores, value, probs, out, p: float, seed: Tensor, index: int, f: torch.dtype) -> None:
    pc = torch.softmax(scores.to(f), dim=-1).to(value.dtype)
    probs.copy_(pc)
    scale = _keep_scale(p, seed, index, pc.shape, pc.device, f)
    dropped = pc if scale is None else (pc.to(f) * scale).to(value.dtype)
    out.copy_(torch.matmul(dropped, value))


def attention_core_bwd_torch(
    grad_out: Tensor,
    grad_probs: Tensor | None,
    probs: Tensor,
    value: Tensor,
    p: float,
    seed: Tensor,
    scores_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    sq, sk, dv = probs.shape[-2], probs.shape[-1], value.shape[-1]
    n = math.prod(probs.shape[:-2])
    p3, v3, go3 = probs.reshape(n, sq, sk), value.reshape(n, sk, dv), grad_out.reshape(n, sq, dv)
    gp3 = grad_probs.reshape(n, sq, sk) if grad_probs is not None else None
    f = opmath(probs.dtype)
    grad_scores = torch.empty(probs.shape, dtype=scores_dtype, device=probs.device)
    grad_value = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    gs3, gv3 = grad_scores.view(n, sq, sk), grad_value.view(n, sk, dv)
    for i, part in chunks(n, attention_heads_per_chunk(sq, sk)):
        grad_probs_chunk = gp3[part] if gp3 is not None else None
        _backward_chunk(go3[part], grad_probs_chunk, p3[part], v3[part], gs3[part], gv3[part], p, seed, i, f)
    return grad_scores, grad_value


def _backward_chunk(
    grad_out, grad_probs, probs, value, grad_scores, grad_value, p: float, seed: Tensor, index: int, f
) -> None:
    pf = probs.to(f)
    scale = _keep_scale(p, seed, index, pf.shape, pf.device, f)
    dropped = probs if scale is None else (pf * scale).to(value.dtype)
    grad_value.copy_(torch.matmul(dropped.transpose(-1, -2), grad_out))
    del dropped
    # in place where it can be: every float32 temporary is a chunk's size
    grad_p = torch.matmul(grad_out, value.transpose(-1, -2)).to(f)
    if scale is not None:
        grad_p.mul_(scale)
        del scale
    if grad_probs is not None:
        grad_p.add_(grad_probs)
    # rowsum(dP * P) as a batched matrix product: no product tensor
    row_dot = torch.matmul(grad_p.unsqueeze(-2), pf.unsqueeze(-1)).squeeze(-1)
    grad_scores.copy_(grad_p.sub_(row_dot).mul_(pf))


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("tempo::attention_core", mutates_args=())
def attention_core_op(scores: Tensor, value: Tensor, p: float, seed: Tensor) -> tuple[Tensor, Tensor]:
    """(dropout(softmax(scores)) @ value, softmax(scores)); P in value's dtype."""
    if use_triton(scores, value):
        from ..kernels.attention import attention_core_fwd_triton

        return attention_core_fwd_triton(scores, value, p, int(seed))
    return attention_core_fwd_torch(scores, value, p, seed)


@attention_core_op.register_fake
def _(scores, value, p, seed):
    return value.new_empty((*scores.shape[:-1], value.shape[-1])), scores.new_empty(
        scores.shape, dtype=value.dtype
    )


@torch.library.custom_op("tempo::attention_core_bwd", mutates_args=())
def attention_core_bwd(
    grad_out: Tensor,
    grad_probs: Tensor | None,
    probs: Tensor,
    value: Tensor,
    p: float,
    seed: Tensor,
    scores_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    # the forward's choice (use_triton(scores, value)): a float64 scores took the PyTorch path,
    # whose dropout mask the kernel's would not regenerate
    if use_triton(grad_out, probs, value) and scores_dtype != torch.float64:
        from ..kernels.attention import attention_core_bwd_triton

        return attention_core_bwd_triton(grad_out, grad_probs, probs, value, p, int(seed), scores_dtype)
    return attention_core_bwd_torch(grad_out, grad_probs, probs, value, p, seed, scores_dtype)


@attention_core_bwd.register_fake
def _(grad_out, grad_probs, probs, value, p, seed, scores_dtype):
    # Both real kernels return contiguous tensors, whatever V's strides (HF passes a transposed view).
    return probs.new_empty(probs.shape, dtype=scores_dtype), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output) -> None:
    scores, value, p, seed = inputs
    _out, probs = output
    ctx.save_for_backward(probs, value, seed)
    ctx.p = p
    ctx.scores_dtype = scores.dtype
    # An output nothing used gets None, not a tensor of zeros: P is returned but rarely used, and
    # its zero gradient would be one more probabilities-sized tensor alive in backward.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out: Tensor | None, grad_probs: Tensor | None):
    probs, value, seed = ctx.saved_tensors
    if grad_out is None:  # only P was used: the output's gradient is zero (out's size, not P's)
        grad_out = value.new_zeros((*probs.shape[:-1], value.shape[-1]))
    grad_scores, grad_value = attention_core_bwd(
        grad_out.contiguous(), grad_probs, probs, value, ctx.p, seed, ctx.scores_dtype
    )
    return grad_scores, grad_value, None, None


attention_core_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def attention_core(
    scores: Tensor, value: Tensor, dropout_p: float = 0.0, training: bool = True
) -> tuple[Tensor, Tensor]:
    """``dropout(softmax(scores, -1)) @ value`` keeping only P and V; returns (out, P).

    scores: (..., Sq, Sk), already scaled and masked; value: (..., Sk, Dv).
    """
    check_float("attention scores", scores)
    check_float("attention value", value)
    check_probability(dropout_p)
    check_training(training)
    if scores.dim() < 2 or value.dim() < 2:
        raise ValueError(
            "attention_core takes scores (..., Sq, Sk) and value (..., Sk, Dv), at least 2-D each; got "
            f"shapes {list(scores.shape)} and {list(value.shape)}"
        )
    if scores.shape[:-2] != value.shape[:-2]:
        raise ValueError(
            f"scores (..., Sq, Sk) and value (..., Sk, Dv) must have the same leading dims (no "
            f"broadcasting): {list(scores.shape)} vs {list(value.shape)}"
        )
    if scores.shape[-1] != value.shape[-2]:
        raise ValueError(
            "scores (..., Sq, Sk) and value (..., Sk, Dv) disagree on Sk: "
            f"{list(scores.shape)} vs {list(value.shape)}"
        )
    if torch.is_autocast_enabled(value.device.type):
        value = value.to(torch.get_autocast_dtype(value.device.type))
    p = float(dropout_p) if training else 0.0
    with torch.autocast(value.device.type, enabled=False):
        return attention_core_op(scores.contiguous(), value, p, new_seed())


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    scaling: float | None = None,
    dropout_p: float = 0.0,
    training: bool = True,
) -> tuple[Tensor, Tensor]:
    """Eager attention with the lean core: (B, H, S, D) in, (out (B, H, Sq, D), P) out."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_float(f"attention {name}", t)
    if len({query.dtype, key.dtype, value.dtype}) > 1:
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    dims_agree = query.dim() >= 2 and query.dim() == key.dim() == value.dim()
    if not dims_agree or query.shape[:-2] != key.shape[:-2] or query.shape[-1] != key.shape[-1]:
        raise ValueError(
            "query (..., Sq, D), key (..., Sk, D) and value (..., Sk, Dv) must agree on the leading "
            f"dims and D: got {list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
        )
    if attention_mask is not None and not isinstance(attention_mask, Tensor):
        raise ValueError(f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}")
    if scaling is not None and not finite(scaling):
        raise ValueError(f"scaling must be a finite number or None (1/sqrt(D)), got {scaling!r}")
    if attention_mask is not None:
        scores_shape = (*query.shape[:-1], key.shape[-2])
        try:
            if torch.broadcast_shapes(attention_mask.shape, scores_shape) != scores_shape:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(
                f"attention_mask {list(attention_mask.shape)} must broadcast to the scores' "
                f"{list(scores_shape)} (..., Sq, Sk)"
            ) from None
        if attention_mask.dtype == torch.bool:  # torch's SDPA's convention: True attends
            zero = torch.zeros((), dtype=query.dtype, device=attention_mask.device)
            attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
        elif not attention_mask.is_floating_point():  # an integer mask added as 0/1 was no mask at all
            raise ValueError(
                f"attention_mask must be float (added to the scores) or bool (True: attend), "
                f"got {attention_mask.dtype}"
            )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    return attention_core(scores, value, dropout_p, training)
