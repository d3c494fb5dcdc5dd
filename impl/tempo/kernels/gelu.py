"""Triton kernels for Tempo's in-place GELU (math in float32; see tempo/ops/gelu.py for the method).

Forward: y = GELU(x) and one bit per element (x < x_min), 8 elements packed per byte.
Backward: recover x from (y, bit) by the same Newton iteration as the PyTorch path and multiply
the incoming gradient by GELU'(x). libdevice's erfc is not available under TRITON_INTERPRET,
so log Phi in the far left tail uses the Laplace continued fraction of Mills' ratio.

Special values as decided in ops/gelu.py: GELU(+inf) = +inf, GELU(-inf) = -0.0, GELU(NaN) = NaN;
GELU'(+inf) = 1, GELU'(-inf) = 0, NaN gives NaN. They are set by explicit selects, not left to
how tl.maximum / tl.minimum treat NaN (which differs between the GPU and the interpreter).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..gelu_math import FLAT_ABOVE, FLAT_BELOW, NEWTON_STEPS, branch_point, branch_threshold

BLOCK = 1024  # elements per program; a multiple of 8 so each program owns whole mask bytes
_K = tl.constexpr(math.sqrt(2.0 / math.pi))
_A = tl.constexpr(0.044715)
_INV_SQRT2 = tl.constexpr(1.0 / math.sqrt(2.0))
_HALF_LOG_2PI = tl.constexpr(0.5 * math.log(2.0 * math.pi))
_TAIL_X = tl.constexpr(-2.5)  # below this log Phi(x) comes from the continued fraction (20 terms: ~1e-9 abs.)
_TAIL_TERMS = tl.constexpr(20)
_TINY = tl.constexpr(1.1754943508222875e-38)
_INF = tl.constexpr(float("inf"))
_FLAT_ABOVE = tl.constexpr(FLAT_ABOVE)  # GELU' = 1 above, 0 below, to float64 precision
_FLAT_BELOW = tl.constexpr(FLAT_BELOW)
# NB: write `tensor * CONST`, not `CONST * tensor`: under TRITON_INTERPRET the latter yields a
# constexpr-wrapped tensor that tl.exp rejects.


@triton.jit
def _gelu_and_derivative(x, TANH: tl.constexpr):
    """GELU(x) and GELU'(x) for every x, +-inf included: the math runs at x clamped to where GELU
    has reached its asymptotes (by selects, so NaN stays NaN), so +-inf and huge |x| never make
    inf * 0 = NaN; above the clamp GELU(x) = x, below it the clamped values are the limits."""
    xc = tl.where(x > _FLAT_ABOVE, _FLAT_ABOVE, tl.where(x < _FLAT_BELOW, _FLAT_BELOW, x))
    if TANH:
        du = (xc * xc * (3.0 * _A) + 1.0) * _K
        s = 1.0 / (1.0 + tl.exp((xc + xc * xc * xc * _A) * (-2.0 * _K)))  # = (1 + tanh u) / 2
        y = xc * s
        d = s + 2.0 * xc * s * (1.0 - s) * du
    else:
        cdf = 0.5 * (1.0 + tl.erf(xc * _INV_SQRT2))
        y = xc * cdf
        d = cdf + xc * tl.exp(-0.5 * xc * xc - _HALF_LOG_2PI)
    return tl.where(x > _FLAT_ABOVE, x, y), d


@triton.jit
def _log_neg_gelu_and_derivative(x, TANH: tl.constexpr):
    """log(-GELU(x)) and its derivative for x < 0."""
    if TANH:
        v = (x + x * x * x * _A) * (2.0 * _K)
        dv = (x * x * (3.0 * _A) + 1.0) * (2.0 * _K)
        log_sig = tl.minimum(v, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(v)))
        return tl.log(-x) + log_sig, 1.0 / x + dv / (1.0 + tl.exp(v))
    else:
        t = tl.maximum(-x, -_TAIL_X)
        f = t
        for k in tl.static_range(_TAIL_TERMS, 0, -1):
            f = t + k / f
        log_cdf_tail = -0.5 * x * x - _HALF_LOG_2PI - tl.log(f)
        log_cdf_body = tl.log(0.5 * (1.0 + tl.erf(x * _INV_SQRT2)))
        log_cdf = tl.where(x > _TAIL_X, log_cdf_body, log_cdf_tail)
        return tl.log(-x) + log_cdf, 1.0 / x + tl.exp(-0.5 * x * x - _HALF_LOG_2PI - log_cdf)


@triton.jit
def _gelu_fwd_kernel(
    x_ptr, y_ptr, bits_ptr, n, thr, INCLUSIVE: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)  # int64: an offset past 2^31 elements wraps in int32
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    y, _ = _gelu_and_derivative(x, TANH)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)
    left = tl.where(INCLUSIVE, x <= thr, x < thr).to(tl.int32)
    weights = 1 << (tl.arange(0, 8)).to(tl.int32)
    packed = tl.sum(tl.reshape(left, (BLOCK // 8, 8)) * weights[None, :], axis=1)
    byte_offs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(bits_ptr + byte_offs, packed.to(tl.uint8), mask=byte_offs < (n + 7) // 8)


@triton.jit
def _gelu_bwd_kernel(
    g_ptr,
    y_ptr,
    bits_ptr,
    dx_ptr,
    n,
    x_min,
    y_min,
    curv,
    TANH: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # int64: an offset past 2^31 elements wraps in int32
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    y = tl.load(y_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    grad = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    byte = tl.load(bits_ptr + offs // 8, mask=inside, other=0).to(tl.int32)
    left = ((byte >> (offs % 8)) & 1) != 0

    half_width = tl.sqrt(tl.maximum(y - y_min, 0.0) * (2.0 / curv))
    # right branch: x >= x_min
    cdf_y = 0.5 * (1.0 + tl.erf(y * _INV_SQRT2))
    xr = tl.where(y >= 0.0, y / cdf_y, x_min + half_width)
    for _ in tl.static_range(STEPS):
        g, dg = _gelu_and_derivative(xr, TANH)
        xr = tl.maximum(xr - (g - y) / tl.maximum(dg, _TINY), x_min)
    xr = tl.where(y == _INF, y, xr)  # GELU(+inf) = +inf; Newton would compute inf - inf = NaN
    # left branch: x < x_min, solved in log space
    log_neg_y = tl.log(-tl.minimum(y, -_TINY))
    x_tail = -tl.sqrt(tl.maximum(-2.0 * (log_neg_y + _HALF_LOG_2PI), 0.0))
    x_parab = x_min - half_width
    h_parab, _ = _log_neg_gelu_and_derivative(tl.minimum(x_parab, -1e-3), TANH)
    h_tail, _ = _log_neg_gelu_and_derivative(tl.minimum(x_tail, -1e-3), TANH)
    xl = tl.where(tl.abs(h_parab - log_neg_y) <= tl.abs(h_tail - log_neg_y), x_parab, x_tail)
    for _ in tl.static_range(STEPS):
        h, dh = _log_neg_gelu_and_derivative(xl, TANH)
        xl = tl.minimum(xl - (h - log_neg_y) / tl.maximum(dh, _TINY), x_min)

    x = tl.where(left, xl, xr)
    _, dgelu = _gelu_and_derivative(x, TANH)
    dgelu = tl.where(left & (y == 0.0), 0.0, dgelu)  # GELU underflowed (x = -inf included): 0
    dgelu = tl.where(y != y, y, dgelu)  # NaN in, NaN out (on the GPU tl.maximum drops NaN)
    tl.store(dx_ptr + offs, (grad * dgelu).to(dx_ptr.dtype.element_ty), mask=inside)


def gelu_fwd_triton(x: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    y = torch.empty_like(x)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    thr, inclusive = branch_threshold(x.dtype, approximate)
    grid = (triton.cdiv(n, BLOCK),)
    _gelu_fwd_kernel[grid](x, y, bits, n, thr, INCLUSIVE=inclusive, TANH=approximate == "tanh", BLOCK=BLOCK)
    return y, bits


def gelu_bwd_triton(
    grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor, approximate: str
) -> torch.Tensor:
    n = y.numel()
    dx = torch.empty_like(y)
    x_min, y_min, curv = branch_point(approximate)
    grid = (triton.cdiv(n, BLOCK),)
    _gelu_bwd_kernel[grid](
        grad,
        y,
        bits,
        dx,
        n,
        x_min,
        y_min,
        curv,
        TANH=approximate == "tanh",
        STEPS=NEWTON_STEPS,
        BLOCK=BLOCK,
    )
    return dx
