"""Triton kernels for Tempo's in-place LayerNorm (see tempo/ops/layernorm.py for the method).

Forward: one program per row; writes y and rstd (float32). Backward: each program walks a
group of rows, writes dx for each and accumulates its partial d_gamma / d_beta in registers;
the partials (one row per program) are summed by torch afterwards. The backward reads either the
output y (x_hat recovered as (y - beta) / gamma) or, for keep_input, the input x (x_hat from the
row's mean, recomputed here, and the forward's rstd).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..layernorm_rows import ROWS_PER_PROGRAM, _rows, gamma_floor


@triton.jit
def _ln_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, rstd_ptr, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: an offset past 2^31 elements wraps in int32
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(inside, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (xc * rstd * w + b).to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _ln_bwd_kernel(
    g_ptr,
    s_ptr,
    rstd_ptr,
    w_ptr,
    b_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    rows,
    D,
    floor,
    xhat_max,
    FROM_INPUT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # int64: an offset past 2^31 elements wraps in int32
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    w = tl.load(w_ptr + cols, mask=inside, other=1.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    w_safe = tl.where(tl.abs(w) < floor, tl.where(w < 0, -floor, floor), w)
    dw_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        live = row < rows
        m = inside & live
        g = tl.load(g_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=live, other=0.0)
        if FROM_INPUT:
            mean = tl.sum(s, axis=0) / D
            x_hat = tl.where(m, (s - mean) * rstd, 0.0)
            centred = x_hat * w
        else:
            centred = tl.where(m, s - b, 0.0)
            x_hat = tl.minimum(tl.maximum(centred / w_safe, -xhat_max), xhat_max)
        gw = g * w
        mean_gw = tl.sum(gw, axis=0) / D
        mean_gwx = tl.sum(g * centred, axis=0) / D
        dx = rstd * (gw - mean_gw - x_hat * mean_gwx)
        tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
        dw_acc += g * x_hat
        db_acc += g
    tl.store(dw_part_ptr + pid * D + cols, dw_acc, mask=inside)
    tl.store(db_part_ptr + pid * D + cols, db_acc, mask=inside)


def layer_norm_fwd_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, normalized_ndim: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, d = _rows(x, normalized_ndim)
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    _ln_fwd_kernel[(rows,)](x, weight, bias, y, rstd, d, eps, BLOCK_D=triton.next_power_of_2(d))
    return y, rstd


def layer_norm_bwd_triton(
    grad: torch.Tensor,
    src: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    normalized_ndim: int,
    from_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``src``: the output y, or the input x with ``from_input``; both contiguous."""
    rows, d = _rows(src, normalized_ndim)
    programs = triton.cdiv(rows, ROWS_PER_PROGRAM)
    dx = torch.empty(src.shape, dtype=src.dtype, device=src.device)
    dw_part = torch.empty(programs, d, dtype=torch.float32, device=src.device)
    db_part = torch.empty(programs, d, dtype=torch.float32, device=src.device)
    _ln_bwd_kernel[(programs,)](
        grad,
        src,
        rstd,
        weight,
        bias,
        dx,
        dw_part,
        db_part,
        rows,
        d,
        gamma_floor(src.dtype),
        math.sqrt(d),
        FROM_INPUT=from_input,
        ROWS=ROWS_PER_PROGRAM,
        BLOCK_D=triton.next_power_of_2(d),
    )
    # Fresh tensors, not views: a custom op's outputs must not be views.
    dw = dw_part.sum(dim=0).to(weight.dtype).reshape(weight.shape).clone()
    db = db_part.sum(dim=0).to(bias.dtype).reshape(bias.shape).clone()
    return dx, dw, db
