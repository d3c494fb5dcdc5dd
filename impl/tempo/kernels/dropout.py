"""Triton kernel for lean dropout: the keep-mask comes from Philox (tl.rand) at (seed, index),
so forward and backward regenerate the same mask and nothing is stored.

Element indices, int64, are the Philox counter: Triton splits a 64-bit offset into two counter
words, so the mask does not repeat past 2^32 elements (an attention's b a s^2 probabilities reach
that: seq 8192 with 64 heads), and below 2^32 it is the mask the 32-bit counter gave.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def keep_mask(seed, offsets, p):
    """Which elements dropout keeps: Philox at (seed, the int64 element offsets), >= p. The Triton
    kernels' one home of the mask (the PyTorch path draws its own: _common.dropout_keep_mask)."""
    return tl.rand(seed, offsets.to(tl.int64)) >= p


@triton.jit
def _dropout_kernel(x_ptr, y_ptr, n, p, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(
        0, BLOCK
    )  # int64: an offset past 2^31 elements wraps in int32
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    keep = keep_mask(seed, offs, p)
    y = tl.where(keep, x / (1.0 - p), 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)


def dropout_triton(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    _dropout_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, p, seed, BLOCK=BLOCK)
    return y
