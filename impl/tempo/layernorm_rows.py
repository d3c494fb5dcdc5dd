"""LayerNorm's row layout and γ floor, shared by the op (ops/layernorm.py), its Triton kernels
(kernels/layernorm.py) and the workspace estimate (ops/__init__.py)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Rows a kernel program normalises; its backward writes one float32 partial dγ/dβ row per program.
ROWS_PER_PROGRAM = 16


def gamma_floor(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-6


def _rows(x: Tensor, normalized_ndim: int) -> tuple[int, int]:
    # Counted from the shape, not as numel // D: D may be 0.
    lead = x.dim() - normalized_ndim
    return math.prod(x.shape[:lead]), math.prod(x.shape[lead:])
