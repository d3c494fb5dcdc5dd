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

On a CPU with a 16-bit y (bfloat16, float16) the backward looks the derivative up instead: y
takes at most 2^16 values, so GELU' at the recovered x is a function of (y's bits, side) with 2^17
values, made once per dtype, approximation and device by the same solve (``_derivative_table``)
and bit-identical to solving each element (tested). Measured on this project's CPU (one thread,
2^20 bfloat16 elements): 172 ms solving, ~8 ms looking up; torch's own GELU backward 2.6 ms.

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
from ..gelu_math import (
    _HALF_LOG_2PI,
    FLAT_ABOVE,
    FLAT_BELOW,
    GELU_CURVATURE_BOUND,  # noqa: F401 (the error bound's constant, read with the op)
    NEWTON_STEPS,
    _check_approximate,
    _log_neg_gelu_and_derivative,
    branch_point,
    branch_threshold,
    gelu_and_derivative,
)


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


def _derivative_at(y: Tensor, left: Tensor, approximate: str) -> Tensor:
    """GELU'(x) at the x recovered from (y, side), in y's dtype."""
    _, dgelu = gelu_and_derivative(recover_input(y, left, approximate), approximate)
    # Left branch with y == 0: GELU underflowed (or x = -inf), |GELU'| < |x| * tiny: 0, as
    # torch's backward gives for finite such x.
    dgelu = torch.where(left & (y == 0), 0.0, dgelu)
    # NaN in, NaN out: said here rather than left to how the solver's clamps treat NaN.
    return torch.where(y.isnan(), y, dgelu)


def gelu_backward_torch(grad: Tensor, y: Tensor, packed: Tensor, approximate: str) -> Tensor:
    """PyTorch implementation of the backward, solving for every element (float32 and float64 on
    a CPU; the reference for the Triton kernel and for the 16-bit table)."""
    math_dtype = opmath(y.dtype)
    y_flat, g_flat = y.reshape(-1), grad.reshape(-1)
    dx = torch.empty_like(g_flat)
    for _, part in chunks(y_flat.numel()):
        yf = y_flat[part].to(math_dtype)
        left = unpack_bits(packed[part.start // 8 : (part.stop + 7) // 8], yf.numel())
        dx[part] = g_flat[part].to(math_dtype) * _derivative_at(yf, left, approximate)
    return dx.view(y.shape)


TABLE_DTYPES = (torch.float16, torch.bfloat16)  # y's dtypes whose backward looks the derivative up
_HALF = 1 << 16  # a 16-bit y's bit patterns; the table's left-branch half starts here


@functools.lru_cache(maxsize=16)
def _derivative_table(dtype: torch.dtype, approximate: str, device: torch.device) -> Tensor:
    """GELU' (in opmath(dtype)) at the x recovered from every ``dtype`` bit pattern of y: entry u
    for y's bits read as an unsigned 16-bit number u, right of the minimum; entry 2^16 + u left."""
    unsigned = torch.arange(_HALF, dtype=torch.int32, device=device)
    y = torch.where(unsigned >= _HALF // 2, unsigned - _HALF, unsigned).to(torch.int16).view(dtype)
    y = y.to(opmath(dtype)).repeat(2)
    left = torch.arange(2 * _HALF, device=device) >= _HALF
    return _derivative_at(y, left, approximate)


def gelu_backward_table(grad: Tensor, y: Tensor, packed: Tensor, approximate: str) -> Tensor:
    """The backward for a 16-bit ``y``: the derivative looked up by (y's bits, side)."""
    table = _derivative_table(y.dtype, approximate, y.device)
    y_flat, g_flat = y.reshape(-1), grad.reshape(-1)
    dx = torch.empty_like(g_flat)
    for _, part in chunks(y_flat.numel()):
        left = unpack_bits(packed[part.start // 8 : (part.stop + 7) // 8], part.stop - part.start)
        # in place: a chunk's temporaries stay ~14 B an element (the solve's: up to 96)
        index = y_flat[part].view(torch.int16).to(torch.int32).bitwise_and_(_HALF - 1).add_(left, alpha=_HALF)
        dx[part] = table.index_select(0, index).mul_(g_flat[part])
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
    if y.dtype in TABLE_DTYPES:
        return gelu_backward_table(grad, y, packed, approximate)
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
