"""Triton kernels for the lean attention core (see tempo/ops/attention.py).

Row-wise kernels around two cuBLAS matmuls:
  forward:  P = softmax(S) (kept), D = P * keep / (1 - p) (transient)  ->  out = D @ V
  backward: dD = dOut @ V^T  ->  dS = P * (dP - rowsum(dP * P)), dP = dD * keep / (1 - p),
            and D again (transient)  ->  dV = D^T @ dOut
The keep-mask is Philox at (seed, flat score index), regenerated in backward. Without dropout D
is P and never written. dS is written over dD where their dtypes agree (one program reads its
whole row before it writes it), so backward's only probabilities-sized buffer besides its output
is D, with dropout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dropout import keep_mask


@triton.jit
def _softmax_dropout_fwd_kernel(
    s_ptr, p_ptr, d_ptr, Sk, p_drop, seed, HAS_DROPOUT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # int64: an offset past 2^31 elements wraps in int32
    cols = tl.arange(0, BLOCK)
    inside = cols < Sk
    s = tl.load(s_ptr + row * Sk + cols, mask=inside, other=float("-inf")).to(tl.float32)
    e = tl.exp(s - tl.max(s, axis=0))
    probs = e / tl.sum(e, axis=0)
    tl.store(p_ptr + row * Sk + cols, probs.to(p_ptr.dtype.element_ty), mask=inside)
    if HAS_DROPOUT:
        keep = keep_mask(seed, row * Sk + cols, p_drop)
        probs = tl.where(keep, probs / (1.0 - p_drop), 0.0)
        tl.store(d_ptr + row * Sk + cols, probs.to(d_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _softmax_dropout_bwd_kernel(
    dd_ptr,
    gp_ptr,
    p_ptr,
    ds_ptr,
    d_ptr,
    Sk,
    p_drop,
    seed,
    HAS_DROPOUT: tl.constexpr,
    HAS_GRAD_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: an offset past 2^31 elements wraps in int32
    cols = tl.arange(0, BLOCK)
    inside = cols < Sk
    probs = tl.load(p_ptr + row * Sk + cols, mask=inside, other=0.0).to(tl.float32)
    grad = tl.load(dd_ptr + row * Sk + cols, mask=inside, other=0.0).to(tl.float32)
    dropped = probs
    if HAS_DROPOUT:
        keep = keep_mask(seed, row * Sk + cols, p_drop)
        grad = tl.where(keep, grad / (1.0 - p_drop), 0.0)
        dropped = tl.where(keep, probs / (1.0 - p_drop), 0.0)
    if HAS_GRAD_PROBS:
        grad += tl.load(gp_ptr + row * Sk + cols, mask=inside, other=0.0).to(tl.float32)
    ds = probs * (grad - tl.sum(grad * probs, axis=0))
    tl.store(ds_ptr + row * Sk + cols, ds.to(ds_ptr.dtype.element_ty), mask=inside)
    if HAS_DROPOUT:
        tl.store(d_ptr + row * Sk + cols, dropped.to(d_ptr.dtype.element_ty), mask=inside)


def attention_core_fwd_triton(
    scores: torch.Tensor, value: torch.Tensor, p: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    sk = scores.shape[-1]
    rows = scores.numel() // sk
    probs = torch.empty(scores.shape, dtype=value.dtype, device=scores.device)
    dropped = torch.empty_like(probs) if p > 0.0 else probs
    _softmax_dropout_fwd_kernel[(rows,)](
        scores, probs, dropped, sk, p, seed, HAS_DROPOUT=p > 0.0, BLOCK=triton.next_power_of_2(sk)
    )
    return torch.matmul(dropped, value), probs


def attention_core_bwd_triton(
    grad_out: torch.Tensor,
    grad_probs: torch.Tensor | None,
    probs: torch.Tensor,
    value: torch.Tensor,
    p: float,
    seed: int,
    scores_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    sk = probs.shape[-1]
    rows = probs.numel() // sk
    grad_dropped = torch.matmul(grad_out, value.transpose(-1, -2)).contiguous()
    if grad_dropped.dtype == scores_dtype:  # written row by row over what it is computed from
        grad_scores = grad_dropped
    else:
        grad_scores = torch.empty(probs.shape, dtype=scores_dtype, device=probs.device)
    dropped = torch.empty_like(probs) if p > 0.0 else probs
    gp = grad_probs.contiguous() if grad_probs is not None else probs  # dummy pointer when absent
    _softmax_dropout_bwd_kernel[(rows,)](
        grad_dropped,
        gp,
        probs,
        grad_scores,
        dropped,
        sk,
        p,
        seed,
        HAS_DROPOUT=p > 0.0,
        HAS_GRAD_PROBS=grad_probs is not None,
        BLOCK=triton.next_power_of_2(sk),
    )
    return grad_scores, torch.matmul(dropped.transpose(-1, -2), grad_out)
