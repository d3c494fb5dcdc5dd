"""Correctly rounded arithmetic the kernels share (Triton's float32 ``/`` and ``sqrt`` are
approximate on the GPU, a few ulps; torch's ops, the kernels' references, round to nearest)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def div_rn(a, b, F64: tl.constexpr):
    """a / b rounded to nearest (float64's ``/`` already is; float32's is approximate on the GPU)."""
    if F64:
        return a / b
    else:
        return tl.div_rn(a, b)
