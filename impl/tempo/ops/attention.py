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

import torch
from torch import Tensor

from .._common import check_float, check_probability, dropout_keep_mask, new_seed, opmath, use_triton


def _keep_scale(probs: Tensor, p: float, seed: Tensor) -> Tensor | None:
    """keep / (1 - p) as a float mask, or None without dropout."""
    if p == 0.0:
        return None
    keep = dropout_keep_mask(seed, probs.shape, p, probs.device)
    return keep.to(opmath(probs.dtype)) * (1.0 / (1.0 - p))


def attention_core_fwd_torch(scores: Tensor, value: Tensor, p: float, seed: Tensor) -> tuple[Tensor, Tensor]:
    probs = torch.softmax(scores.to(opmath(scores.dtype)), dim=-1).to(value.dtype)
    scale = _keep_scale(probs, p, seed)
    dropped = probs if scale is None else (probs.to(scale.dtype) * scale).to(value.dtype)
    return torch.matmul(dropped, value), probs


def attention_core_bwd_torch(
    grad_out: Tensor, grad_probs: Tensor | None, probs: Tensor, value: Tensor, p: float, seed: Tensor,
    scores_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    f = opmath(probs.dtype)
    scale = _keep_scale(probs, p, seed)
    dropped = probs if scale is None else (probs.to(f) * scale).to(value.dtype)
    grad_value = torch.matmul(dropped.transpose(-1, -2), grad_out)
    grad_p = torch.matmul(grad_out, value.transpose(-1, -2)).to(f)
    if scale is not None:
        grad_p = grad_p * scale
    if grad_probs is not None:
        grad_p = grad_p + grad_probs.to(f)
    pf = probs.to(f)
    grad_scores = pf * (grad_p - (grad_p * pf).sum(dim=-1, keepdim=True))
    return grad_scores.to(scores_dtype), grad_value


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
    out_shape = (*torch.broadcast_shapes(scores.shape[:-2], value.shape[:-2]), scores.shape[-2], value.shape[-1])
    return value.new_empty(out_shape), scores.new_empty(scores.shape, dtype=value.dtype)


@torch.library.custom_op("tempo::attention_core_bwd", mutates_args=())
def attention_core_bwd(
    grad_out: Tensor, grad_probs: Tensor | None, probs: Tensor, value: Tensor, p: float, seed: Tensor,
    scores_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    if use_triton(grad_out, probs, value):
        from ..kernels.attention import attention_core_bwd_triton

        return attention_core_bwd_triton(grad_out, grad_probs, probs, value, p, int(seed), scores_dtype)
    return attention_core_bwd_torch(grad_out, grad_probs, probs, value, p, seed, scores_dtype)


@attention_core_bwd.register_fake
def _(grad_out, grad_probs, probs, value, p, seed, scores_dtype):
    return probs.new_empty(probs.shape, dtype=scores_dtype), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:
    scores, value, p, seed = inputs
    _out, probs = output
    ctx.save_for_backward(probs, value, seed)
    ctx.p = p
    ctx.scores_dtype = scores.dtype


def _backward(ctx, grad_out: Tensor, grad_probs: Tensor | None):
    probs, value, seed = ctx.saved_tensors
    grad_scores, grad_value = attention_core_bwd(
        grad_out.contiguous(), grad_probs, probs, value, ctx.p, seed, ctx.scores_dtype
    )
    return grad_scores, grad_value, None, None


attention_core_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def attention_core(scores: Tensor, value: Tensor, dropout_p: float = 0.0, training: bool = True) -> tuple[Tensor, Tensor]:
    """``dropout(softmax(scores, -1)) @ value`` keeping only P and V; returns (out, P).

    scores: (..., Sq, Sk), already scaled and masked; value: (..., Sk, Dv).
    """
    check_float("attention scores", scores)
    check_float("attention value", value)
    check_probability(dropout_p)
    if scores.shape[-1] != value.shape[-2]:
        raise ValueError(
            f"scores (..., Sq, Sk) and value (..., Sk, Dv) disagree on Sk: {list(scores.shape)} vs {list(value.shape)}"
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
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    return attention_core(scores, value, dropout_p, training)
