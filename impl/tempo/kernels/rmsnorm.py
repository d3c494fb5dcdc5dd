"""Triton kernels for Tempo's in-place RMSNorm (see tempo/ops/rmsnorm.py for the method).

Forward: one program per row; writes y = gamma * round(x * rstd) and rstd, rounded as the PyTorch
path (and HF's LlamaRMSNorm) rounds: x * rstd in float32, rounded to x's dtype, then scaled by gamma
in y's dtype. Backward: each program walks ROWS_PER_PROGRAM rows, writes dx for each from (y, rstd,
gamma) and accumulates its partial dgamma in registers; the partials (one row per program) are
summed by torch afterwards, as the LayerNorm backward does.

The math runs in rstd's dtype: float32, or float64 for float64 inputs, as the PyTorch path's
``opmath``. Python floats reach a kernel as float32 arguments, so eps and the gamma floor come in
as constexprs (tl.full then builds them in the math dtype: float64's are not rounded to float32).
Triton's float32 ``/`` and ``tl.sqrt`` are approximate on the GPU (2 ulp); the per-row rstd and
mean and the per-element y / gamma use the correctly rounded forms, as torch's ops are, so the
kernels round where the PyTorch path rounds; the row sums are reduced in Triton's order, not
torch's, so results agree to a few ulps (what the tests check), not to the bit. Row offsets are
int64: rows * D may pass 2^31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import opmath
from ..layernorm_rows import ROWS_PER_PROGRAM, _rows, gamma_floor
from .rounding import div_rn


@triton.jit
def _sqrt(a, F64: tl.constexpr):
    if F64:
        return tl.sqrt(a)
    else:
        return tl.sqrt_rn(a)


@triton.jit
def _rms_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    D,
    EPS: tl.constexpr,
    F64: tl.constexpr,
    Y_F64: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    f = rstd_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + cols, mask=inside, other=0.0).to(f)
    mean_sq = div_rn(tl.sum(x * x, axis=0), tl.full((), D, f), F64)
    rstd = div_rn(tl.full((), 1.0, f), _sqrt(mean_sq + tl.full((), EPS, f), F64), F64)
    # HF's rounding: x_hat to x's dtype first, then the product with gamma in y's dtype (float32
    # math for half types, whose product of two halves is exact before the final rounding).
    x_hat = (x * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    y_math = tl.float64 if Y_F64 else tl.float32
    y = w.to(y_math) * x_hat.to(y_math)
    tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_bwd_kernel(
    g_ptr,
    y_ptr,
    rstd_ptr,
    w_ptr,
    dx_ptr,
    dw_part_ptr,
    rows,
    D,
    FLOOR: tl.constexpr,
    F64: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # int64: an offset past 2^31 elements wraps in int32
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    f = dw_part_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=inside, other=1.0).to(f)
    floor = tl.full((), FLOOR, f)
    w_safe = tl.where(tl.abs(w) < floor, tl.where(w < 0, -floor, floor), w)
    d = tl.full((), D, f)
    xhat_max = _sqrt(d, F64)  # an RMS-normalised row never exceeds sqrt(D)
    dw_acc = tl.zeros((BLOCK_D,), dtype=f)
    for i in range(ROWS):
        row = pid.to(tl.int64) * ROWS + i
        live = row < rows
        m = inside & live
        g = tl.load(g_ptr + row * D + cols, mask=m, other=0.0).to(f)
        y = tl.load(y_ptr + row * D + cols, mask=m, other=0.0).to(f)
        rstd = tl.load(rstd_ptr + row, mask=live, other=0.0).to(f)
        q = div_rn(y, w_safe, F64)
        # The clamp by selects, not tl.minimum / tl.maximum: a NaN y must stay NaN (as torch.clamp
        # keeps it), and those drop NaN on the GPU but not in the interpreter.
        x_hat = tl.where(q > xhat_max, xhat_max, tl.where(q < -xhat_max, -xhat_max, q))
        mean_gy = div_rn(tl.sum(g * y, axis=0), d, F64)  # = mean(g gamma x_hat), exact whatever gamma
        dx = rstd * (g * w - x_hat * mean_gy)
        tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
        dw_acc += g * x_hat
    tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw_acc, mask=inside)


def rms_norm_fwd_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd[rows]) over the last dim of a contiguous ``x``; y in promote(x, weight)'s dtype and
    rstd in x's math dtype, as the PyTorch path."""
    rows, d = _rows(x, 1)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(rows, dtype=opmath(x.dtype), device=x.device)
    _rms_fwd_kernel[(rows,)](
        x,
        weight.contiguous(),
        y,
        rstd,
        d,
        EPS=float(eps),
        F64=rstd.dtype == torch.float64,
        Y_F64=y.dtype == torch.float64,
        BLOCK_D=triton.next_power_of_2(d),
    )
    return y, rstd


def rms_norm_bwd_triton(
    grad: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in y's dtype, dgamma in weight's) from the kept output; ``grad`` and ``y`` contiguous."""
    rows, d = _rows(y, 1)
    programs = triton.cdiv(rows, ROWS_PER_PROGRAM)
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    dw_part = torch.empty(programs, d, dtype=opmath(y.dtype), device=y.device)
    _rms_bwd_kernel[(programs,)](
        grad,
        y,
        rstd,
        weight.contiguous(),
        dx,
        dw_part,
        rows,
        d,
        FLOOR=gamma_floor(y.dtype),
        F64=dw_part.dtype == torch.float64,
        ROWS=ROWS_PER_PROGRAM,
        BLOCK_D=triton.next_power_of_2(d),
    )
    # Fresh tensor, not a view: a custom op's outputs must not be views.
    return dx, dw_part.sum(dim=0).to(weight.dtype).reshape(weight.shape).clone()
