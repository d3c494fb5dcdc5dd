"""Triton kernel for lean dropout: the keep-mask comes from Philox (tl.rand) at (seed, index),
so forward and backward regenerate the same mask and nothing is stored.

Element indices are used as 32-bit Philox counters: tensors beyond 2^32 elements would reuse
mask bits (not a concern for activation tensors of practical size); the pointer offsets are
int64, which reach past 2^31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _dropout_kernel(x_ptr, y_ptr, n, p, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(
        0, BLOCK
    )  # int64: an offset past 2^31 elements wraps in int32
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    keep = tl.rand(seed, offs.to(tl.int32)) >= p  # a 32-bit Philox counter (the module docstring)
    y = tl.where(keep, x / (1.0 - p), 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)


def dropout_triton(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    _dropout_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, p, seed, BLOCK=BLOCK)
    return y
