"""GELU's math, shared by the op (ops/gelu.py) and its Triton kernels (kernels/gelu.py): both
forms, the asymptote limits, the branch point at GELU's minimum. See ops/gelu.py for why."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

APPROXIMATIONS = ("none", "tanh")
NEWTON_STEPS = 4  # enough for float64 from the starting points above (tests check it)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
# max |GELU''| over the real line, attained at x = 0 for both forms: used by the error bound.
GELU_CURVATURE_BOUND = _SQRT_2_OVER_PI
# Beyond these GELU has reached its asymptotes to float64 precision, in both forms: for
# x >= 10, GELU(x) = x and GELU'(x) = 1 (relative error < 1e-21); for x <= -40, |GELU(x)| and
# |GELU'(x)| are < 1e-340, below float64's smallest subnormal (4.9e-324): 0. Evaluating at x clamped to
# [FLAT_BELOW, FLAT_ABOVE] keeps x^3 and x * pdf from overflowing into inf * 0 = NaN
# (x = +-inf, or |x| > ~1e13 in the tanh form in float32).
FLAT_ABOVE = 10.0
FLAT_BELOW = -40.0


def _check_approximate(approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")


def gelu_and_derivative(x: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """GELU(x) and GELU'(x) in x's dtype, for every x: +-inf give their limits, NaN gives NaN."""
    xc = torch.clamp(x, FLAT_BELOW, FLAT_ABOVE)  # NaN stays NaN
    if approximate == "tanh":
        u = _SQRT_2_OVER_PI * (xc + _TANH_CUBIC * xc**3)
        t = torch.tanh(u)
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * xc * xc)
        y, d = 0.5 * xc * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * xc * (1.0 - t * t) * du
    else:
        cdf = torch.special.ndtr(xc)
        y, d = xc * cdf, cdf + xc * torch.exp(-0.5 * xc * xc - _HALF_LOG_2PI)
    return torch.where(x > FLAT_ABOVE, x, y), d


def _log_neg_gelu_and_derivative(x: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """log(-GELU(x)) and its derivative, for x < 0, without underflow."""
    if approximate == "tanh":
        two_u = 2.0 * _SQRT_2_OVER_PI * (x + _TANH_CUBIC * x**3)
        dtwo_u = 2.0 * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x * x)
        return torch.log(-x) + nn.functional.logsigmoid(two_u), 1.0 / x + torch.sigmoid(-two_u) * dtwo_u
    log_cdf = torch.special.log_ndtr(x)
    return torch.log(-x) + log_cdf, 1.0 / x + torch.exp(-0.5 * x * x - _HALF_LOG_2PI - log_cdf)


def _second_derivative(x: float, approximate: str) -> float:
    """GELU''(x) in closed form (Python floats)."""
    if approximate == "tanh":
        u = _SQRT_2_OVER_PI * (x + _TANH_CUBIC * x**3)
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x * x)
        d2u = _SQRT_2_OVER_PI * 6.0 * _TANH_CUBIC * x
        sech2 = 1.0 - math.tanh(u) ** 2
        # GELU = x (1 + tanh u) / 2  =>  GELU'' = sech^2(u) (u' + x u''/2 - x u'^2 tanh u)
        return sech2 * (du + 0.5 * x * d2u - x * du * du * math.tanh(u))
    return math.exp(-0.5 * x * x - _HALF_LOG_2PI) * (2.0 - x * x)


@functools.cache
def branch_point(approximate: str) -> tuple[float, float, float]:
    """(x_min, GELU(x_min), GELU''(x_min)) in float64, found by Newton on GELU' = 0."""
    _check_approximate(approximate)
    x = -0.75
    for _ in range(30):
        _, d = gelu_and_derivative(torch.tensor(x, dtype=torch.float64), approximate)
        x -= d.item() / _second_derivative(x, approximate)
    y, _ = gelu_and_derivative(torch.tensor(x, dtype=torch.float64), approximate)
    return x, y.item(), _second_derivative(x, approximate)


@functools.cache  # called per chunk of every forward: depends on (dtype, approximate) only
def branch_threshold(dtype: torch.dtype, approximate: str) -> tuple[float, bool]:
    """(t, inclusive) such that, for x of ``dtype``, x < x_min  <=>  x <= t (or x < t).

    x_min rounded to a half dtype would misfile its neighbours; t is exactly representable.
    """
    x_min = branch_point(approximate)[0]
    t = torch.tensor(x_min, dtype=dtype).item()
    return t, t < x_min
