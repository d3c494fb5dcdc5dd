"""In-place GELU (Tempo, Andoorveedu et al., NeurIPS'22, §3.1), made exact.

Forward keeps only the output y = GELU(x) (which the next Linear keeps anyway, so it costs
nothing extra) and one bit per element saying on which side of GELU's minimum x_min ≈ -0.7518
the input lay. The input itself is not kept. Backward recovers x from (y, side) and evaluates
the exact derivative at it.

Recovering x: GELU is monotone on each side of x_min, so x is the root of GELU(x) = y on the
marked branch. We solve it with a fixed number of Newton steps (fixed so GPU threads never
diverge) from starting points that are already close:

* right branch, y >= 0:  x0 = y / Phi(y)  (one fixed-point step of x = y / Phi(x));
* right branch, y < 0:   x0 = x_min + sqrt(2 (y - y_min) / c), c = GELU''(x_min) (the parabola
  at the minimum);
* left branch: the same parabola mirrored, or, far out, the tail asymptote
  y ~ -phi(x)  =>  x0 = -sqrt(-2 log(-y sqrt(2 pi))); whichever fits y better.

The left branch is solved in log space (log(-GELU(x)) = log(-y)) because y decays like
exp(-x^2/2) there; log Phi comes from log_ndtr / logsigmoid, which do not underflow.
Where the stored y underflowed to exactly 0 on the left branch, x is beyond recovery but the
derivative there is below the smallest normal number of the dtype times |x|: we return 0, as
torch's own backward does for such inputs.

How exact can this be? Round-off in y is the only limit. Along a branch, (GELU')^2 as a
function of y has derivative 2 GELU''(x), so if y is off by dy the recovered derivative is off
by at most

    |d GELU'| <= min( sqrt(2 M |dy|),  2 M |dy| / |GELU'(x)| ),   M = max |GELU''| = sqrt(2/pi).

Away from x_min that is ~|dy|; right at x_min it is the square-root term (about 1e-4 for a
float32 y, 3e-8 for float64): recovering x from a rounded y is ill-conditioned exactly where
GELU' = 0. The tests check every element against this bound, and norm-wise agreement with
autograd through torch's gelu (<= 1e-5 float32, <= 1e-10 float64).

Special values are decided here, not inherited from torch, and every path (this PyTorch one,
the Triton kernels, every dtype, both approximations) gives the same. They are the limits:

    GELU(+inf) = +inf,   GELU(-inf) = 0 (-0.0),   GELU(NaN) = NaN,
    GELU'(+inf) = 1,     GELU'(-inf) = 0,          GELU'(NaN) = NaN.

torch's CPU kernel gives NaN for GELU(-inf), and for GELU(+inf) too on some CPUs and dtypes
(float32 and bfloat16 with approximate='none' on an AMD EPYC, torch 2.13). More generally, outside
[FLAT_BELOW, FLAT_ABOVE] = [-40, 10] GELU has reached its asymptotes to float64 precision (x above,
-0.0 below), and that is what the forward returns there (torch's float32 erf form also overflows
to inf for x > ~1.7e38); inside, it is exactly torch's GELU. The backward gives dx = grad where
x = +inf (it sees y = +inf on the right branch), dx = 0 where x = -inf (y = 0 on the left branch,
as for every input whose GELU underflows; for a finite grad), and NaN where x was NaN.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from .._common import check_float, chunks, opmath, pack_bits, packed_numel, unpack_bits, use_triton

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


def left_of_minimum(x: Tensor, approximate: str) -> Tensor:
    t, inclusive = branch_threshold(x.dtype, approximate)
    return x <= t if inclusive else x < t


def recover_input(y: Tensor, left: Tensor, approximate: str, steps: int = NEWTON_STEPS) -> Tensor:
    """Solve GELU(x) = y on the branch ``left`` marks (True: x < x_min). Returns x in y's dtype.

    Each branch is solved only on its own elements: the left one (log-space, log_ndtr) costs
    several times the right one, and about a quarter of a layer's inputs lie left of x_min.
    """
    x = torch.empty_like(y)
    right = ~left
    x[right] = _solve_right_branch(y[right], approximate, steps)
    if left.any():
        x[left] = _solve_left_branch(y[left], approximate, steps)
    return x


def _solve_right_branch(y: Tensor, approximate: str, steps: int) -> Tensor:
    x_min, y_min, curv = branch_point(approximate)
    tiny = torch.finfo(y.dtype).tiny
    # The parabola at the minimum: |x - x_min| ~ sqrt(2 (y - y_min) / c).
    half_width = torch.sqrt(torch.clamp(y - y_min, min=0.0) * (2.0 / curv))
    x = torch.where(y >= 0, y / torch.special.ndtr(y), x_min + half_width)
    for _ in range(steps):
        g, dg = gelu_and_derivative(x, approximate)
        x = torch.clamp(x - (g - y) / torch.clamp(dg, min=tiny), min=x_min)
    # GELU(+inf) = +inf; Newton would compute g - y = inf - inf = NaN there.
    return torch.where(y == math.inf, y, x)


def _solve_left_branch(y: Tensor, approximate: str, steps: int) -> Tensor:
    x_min, y_min, curv = branch_point(approximate)
    tiny = torch.finfo(y.dtype).tiny
    half_width = torch.sqrt(torch.clamp(y - y_min, min=0.0) * (2.0 / curv))
    log_neg_y = torch.log(-torch.clamp(y, max=-tiny))
    x_tail = -torch.sqrt(torch.clamp(-2.0 * (log_neg_y + _HALF_LOG_2PI), min=0.0))
    x_parab = x_min - half_width
    # Start from whichever guess fits log(-y) better (the two regimes cross near x ~ -1.5).
    r_parab = (
        _log_neg_gelu_and_derivative(torch.clamp(x_parab, max=-1e-3), approximate)[0] - log_neg_y
    ).abs()
    r_tail = (_log_neg_gelu_and_derivative(torch.clamp(x_tail, max=-1e-3), approximate)[0] - log_neg_y).abs()
    x = torch.where(r_parab <= r_tail, x_parab, x_tail)
    for _ in range(steps):
        h, dh = _log_neg_gelu_and_derivative(x, approximate)
        x = torch.clamp(x - (h - log_neg_y) / torch.clamp(dh, min=tiny), max=x_min)
    return x


def gelu_backward_torch(grad: Tensor, y: Tensor, packed: Tensor, approximate: str) -> Tensor:
    """PyTorch implementation of the backward (CPU; the reference for the Triton kernel)."""
    math_dtype = opmath(y.dtype)
    y_flat, g_flat = y.reshape(-1), grad.reshape(-1)
    dx = torch.empty_like(g_flat)
    for _, part in chunks(y_flat.numel()):
        yf = y_flat[part].to(math_dtype)
        left = unpack_bits(packed[part.start // 8 : (part.stop + 7) // 8], yf.numel())
        _, dgelu = gelu_and_derivative(recover_input(yf, left, approximate), approximate)
        # Left branch with y == 0: GELU underflowed (or x = -inf), |GELU'| < |x| * tiny: 0, as
        # torch's backward gives for finite such x.
        dgelu = torch.where(left & (yf == 0), 0.0, dgelu)
        # NaN in, NaN out: said here rather than left to how the solver's clamps treat NaN.
        dgelu = torch.where(yf.isnan(), yf, dgelu)
        dx[part] = g_flat[part].to(math_dtype) * dgelu
    return dx.view(y.shape)


def gelu_forward_torch(x: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """torch's GELU on [FLAT_BELOW, FLAT_ABOVE], the asymptotes outside (+-inf included; see the
    module docstring). ``x`` must be contiguous."""
    x_flat = x.view(-1)
    y = nn.functional.gelu(x, approximate=approximate)
    y_flat = y.view(-1)
    packed = torch.empty(packed_numel(x_flat.numel()), dtype=torch.uint8, device=x.device)
    for _, part in chunks(x_flat.numel()):
        xp = x_flat[part]
        packed[part.start // 8 : (part.stop + 7) // 8] = pack_bits(left_of_minimum(xp, approximate))
        y_flat[part] = torch.where(xp > FLAT_ABOVE, xp, torch.where(xp < FLAT_BELOW, -0.0, y_flat[part]))
    return y, packed


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("tempo::gelu_fwd", mutates_args=())
def gelu_fwd(x: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """GELU(x) and the bit-packed branch mask. ``x`` must be contiguous."""
    if use_triton(x):
        from ..kernels.gelu import gelu_fwd_triton

        return gelu_fwd_triton(x, approximate)
    return gelu_forward_torch(x, approximate)


@gelu_fwd.register_fake
def _(x: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(packed_numel(x.numel()), dtype=torch.uint8)


@torch.library.custom_op("tempo::gelu_bwd", mutates_args=())
def gelu_bwd(grad: Tensor, y: Tensor, packed: Tensor, approximate: str) -> Tensor:
    grad = grad.contiguous()
    if use_triton(grad, y):
        from ..kernels.gelu import gelu_bwd_triton

        return gelu_bwd_triton(grad, y, packed, approximate)
    return gelu_backward_torch(grad, y, packed, approximate)


@gelu_bwd.register_fake
def _(grad: Tensor, y: Tensor, packed: Tensor, approximate: str) -> Tensor:
    return torch.empty_like(y)


def _setup_context(ctx, inputs, output) -> None:
    y, packed = output
    ctx.save_for_backward(y, packed)
    ctx.approximate = inputs[1]


def _backward(ctx, grad_y: Tensor, _grad_packed: Tensor | None):
    y, packed = ctx.saved_tensors
    return gelu_bwd(grad_y, y, packed, ctx.approximate), None


gelu_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """Drop-in for ``torch.nn.functional.gelu`` that keeps y and 1 bit/element for backward."""
    check_float("gelu input", x)
    _check_approximate(approximate)
    y, _ = gelu_fwd(x.contiguous(), approximate)
    return y


class TempoGELU(nn.Module):
    """Drop-in for ``nn.GELU`` (and HF's GELUActivation / NewGELUActivation)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        _check_approximate(approximate)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
