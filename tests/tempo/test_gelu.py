"""In-place GELU: forward identical to torch (at +-inf and NaN the decided limits), backward exact
to the conditioning bound."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tempo
from measure.saved import saved_bytes
from tempo._common import pack_bits, unpack_bits
from tempo.ops import gelu as G

APPROX = ["none", "tanh"]
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INF = float("inf")


def mixed_inputs(approximate: str, n: int = 200_000) -> torch.Tensor:
    """Broad values, a dense band around GELU's minimum, large |x|, and the specials."""
    x_min = G.branch_point(approximate)[0]
    return torch.cat(
        [
            torch.randn(n, dtype=torch.float64) * 3,
            x_min + 0.05 * torch.randn(n // 20, dtype=torch.float64),
            torch.empty(n // 20, dtype=torch.float64).uniform_(-40, 40),
            torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, x_min], dtype=torch.float64),
        ]
    )


def exact_gelu_and_derivative(x: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference without cancellation: Phi from log_ndtr (tail-accurate)."""
    x = x.double()
    if approximate == "tanh":
        return G.gelu_and_derivative(x, approximate)  # tanh/sigmoid forms have no cancellation
    cdf = torch.where(x < 0, torch.exp(torch.special.log_ndtr(x)), -torch.expm1(torch.special.log_ndtr(-x)))
    pdf = torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
    return x * cdf, cdf + x * pdf


def grads(x: torch.Tensor, approximate: str, fn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = fn(x, approximate=approximate)
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    return y.detach(), gy, gx


def assert_decided_forward(x: torch.Tensor, y: torch.Tensor) -> None:
    """GELU at +-inf and NaN as decided in ops/gelu.py, asserted rather than compared with torch,
    whose CPU kernel gives NaN for -inf everywhere and for +inf on some CPUs."""
    for special in (x == INF, x == -INF, x.isnan()):
        assert special.any(), "the input must hold every special value"
    assert torch.all(y[x == INF] == INF)
    assert torch.all(y[x == -INF] == 0)
    assert torch.all(y[x.isnan()].isnan())


def assert_decided_backward(x: torch.Tensor, gy: torch.Tensor, gx: torch.Tensor) -> None:
    """GELU'(+inf) = 1 (dx = grad), GELU'(-inf) = 0, NaN in -> NaN out; finite elsewhere (gy finite)."""
    assert torch.all(torch.isfinite(gy))
    for special in (x == INF, x == -INF, x.isnan()):
        assert special.any(), "the input must hold every special value"
    assert torch.equal(gx[x == INF], gy[x == INF])
    assert torch.all(gx[x == -INF] == 0)
    assert torch.all(gx[x.isnan()].isnan())
    assert torch.all(torch.isfinite(gx[~x.isnan()]))


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", FLOATS)
def test_forward_is_torch_gelu_inside_and_the_asymptotes_outside(approximate, dtype):
    x = mixed_inputs(approximate, 20_000).to(dtype)
    y = tempo.gelu(x, approximate)
    # torch on the same tensor, so each element goes through the same (vector or scalar) code in torch.
    ref = torch.nn.functional.gelu(x, approximate=approximate)
    inside = (x >= G.FLAT_BELOW) & (x <= G.FLAT_ABOVE)
    assert torch.equal(y[inside], ref[inside]), "bit-for-bit torch's GELU on [-40, 10]"
    # Outside, GELU has reached its asymptotes to float64 precision: x above, 0 below (+-inf included).
    above, below = x > G.FLAT_ABOVE, x < G.FLAT_BELOW
    assert above.any() and below.any()
    assert torch.equal(y[above], x[above])
    assert torch.all(y[below] == 0)
    assert_decided_forward(x, y)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize(("dtype", "target"), [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_gradient_normwise_against_autograd(approximate, dtype, target):
    x = mixed_inputs(approximate).to(dtype)
    _, gy, g_ours = grads(x, approximate, tempo.gelu)
    x_ref = x.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(torch.nn.functional.gelu(x_ref, approximate=approximate), x_ref, gy)
    # Against torch's backward on finite inputs only (its results at +-inf are NaN, not GELU's limits).
    finite = torch.isfinite(x)
    assert torch.all(torch.isfinite(g_ref[finite])), "the reference must be usable on finite inputs"
    err = (g_ours[finite].double() - g_ref[finite].double()).norm() / g_ref[finite].double().norm()
    assert err <= target, f"relative error {err:.3e} > {target:.0e}"
    assert_decided_backward(x, gy, g_ours)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", FLOATS)
def test_special_and_huge_inputs_get_the_decided_values(approximate, dtype):
    """+-inf, NaN and finite |x| up to the dtype's max, through tempo.gelu and its autograd.
    Huge |x| is where inf * 0 = NaN lurks (x^3 in the tanh form overflows for |x| > ~1e13 in
    float32, and torch's own backward gives NaN there)."""
    big = torch.finfo(dtype).max
    mag = torch.empty(500, dtype=torch.float64).uniform_(math.log(11.0), math.log(big)).exp()
    sign = torch.where(torch.rand(500) < 0.5, -1.0, 1.0).double()
    x = torch.cat(
        [
            (sign * mag).clamp(-big, big),
            torch.tensor([INF, -INF, float("nan"), big, -big, 11.0, -41.0], dtype=torch.float64),
        ]
    ).to(dtype)
    y, gy, gx = grads(x, approximate, tempo.gelu)
    assert_decided_forward(x, y)
    assert_decided_backward(x, gy, gx)
    above, below = x > G.FLAT_ABOVE, x < G.FLAT_BELOW
    assert torch.equal(y[above], x[above]) and torch.all(y[below] == 0)
    assert torch.equal(gx[above], gy[above]), "GELU' = 1 for x > 10 (to float64 precision)"
    assert torch.all(gx[below] == 0), "GELU' = 0 for x < -40 (to float64 precision)"


def assert_within_conditioning_bound(
    x: torch.Tensor, y: torch.Tensor, d_ours: torch.Tensor, approximate: str
) -> None:
    """|d_ours - GELU'(x)| <= min(sqrt(2 M dy), 2 M dy / |GELU'(x)|) + rounding, per element, where
    dy is the actual error of the stored y against exact float64 GELU(x) (see ops/gelu.py); 0 exactly
    where y underflowed to 0 left of the minimum. x finite; y = the stored forward output."""
    dtype = y.dtype
    x64, d_ours = x.double(), d_ours.double()
    y_exact, d_exact = exact_gelu_and_derivative(x64, approximate)
    u = torch.finfo(dtype).eps / 2
    compute_u = torch.finfo(torch.float32 if dtype != torch.float64 else torch.float64).eps / 2
    dy = (y.double() - y_exact).abs() + 4 * compute_u * y_exact.abs()
    m = G.GELU_CURVATURE_BOUND
    bound = torch.minimum(torch.sqrt(2 * m * dy), 2 * m * dy / d_exact.abs().clamp_min(1e-300))
    bound = bound + 2 * u * d_exact.abs() + 8 * compute_u + torch.finfo(dtype).tiny
    underflow = (y == 0) & (x64 < G.branch_point(approximate)[0])
    assert torch.all(d_ours[underflow] == 0)
    err = (d_ours - d_exact).abs()
    worst = (err / bound)[~underflow].max().item()
    assert worst <= 1.0, f"an element exceeds the bound by {worst:.2f}x"


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", FLOATS)
def test_gradient_elementwise_within_conditioning_bound(approximate, dtype):
    """Every element of the backward within the derived conditioning bound: the solve, and the
    op as dispatched (a 16-bit y's looked up on a CPU)."""
    x = mixed_inputs(approximate, 50_000).to(dtype)
    x = x[torch.isfinite(x)]
    y, packed = G.gelu_fwd(x, approximate)
    for backward in (G.gelu_backward_torch, G.gelu_bwd):
        d_ours = backward(torch.ones_like(y), y, packed, approximate)
        assert_within_conditioning_bound(x, y, d_ours, approximate)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", G.TABLE_DTYPES)
def test_table_backward_is_the_solve_for_every_16_bit_output(approximate, dtype):
    """Exhaustive: every bit pattern of a 16-bit y (NaNs, infinities, subnormals, -0 included) on
    both sides of the minimum, each with a random gradient: the looked-up backward is the solve,
    bit for bit. Negative controls: the table read with the sides swapped, or indexed by y's bits
    as a signed number (the negative half wrapped), differs."""
    unsigned = torch.arange(1 << 16, dtype=torch.int32)
    y = torch.where(unsigned >= 1 << 15, unsigned - (1 << 16), unsigned).to(torch.int16).view(dtype)
    y = y.repeat(2)
    left = torch.arange(2 << 16) >= 1 << 16
    packed = pack_bits(left)
    grad = torch.randn(y.shape).to(dtype)
    solved = G.gelu_backward_torch(grad, y, packed, approximate)
    looked_up = G.gelu_backward_table(grad, y, packed, approximate)
    assert torch.equal(looked_up.isnan(), solved.isnan())
    assert torch.equal(looked_up[~solved.isnan()], solved[~solved.isnan()])
    table = G._derivative_table(dtype, approximate, y.device)
    bits = y.view(torch.int16).to(torch.int32)
    for wrong in ((bits & 0xFFFF) + (~left).to(torch.int32) * (1 << 16), bits.remainder(2 << 16)):
        misread = grad.float() * table.index_select(0, wrong)
        differs = (misread.to(dtype) != solved) & ~solved.isnan()
        assert differs.sum() > 1000


@pytest.mark.parametrize("approximate", APPROX)
def test_gradcheck_float64(approximate):
    x = (torch.randn(64, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: tempo.gelu(t, approximate), (x,))


def test_opcheck():
    torch.library.opcheck(G.gelu_fwd, (torch.randn(37, 5, requires_grad=True), "tanh"))
    y, p = G.gelu_fwd(torch.randn(37, 5), "none")
    torch.library.opcheck(G.gelu_bwd, (torch.randn(37, 5), y, p, "none"))


def test_saves_output_and_one_bit_per_element():
    x = torch.randn(8, 64, 100, requires_grad=True)
    model = torch.nn.Sequential(tempo.TempoGELU(), torch.nn.Linear(100, 10))
    r = saved_bytes(model, x)
    # y (shared with the Linear's saved input) + 8*64*100/8 mask bytes; the input x is not kept.
    assert r.activation_bytes == x.numel() * 4 + x.numel() // 8
    assert r.input_bytes == 0


@pytest.mark.parametrize("approximate", APPROX)
def test_non_contiguous_input(approximate):
    """A transposed input gives exactly what its contiguous copy gives, and the gradient is GELU'(x)
    within the per-element conditioning bound (a flat rtol cannot hold near GELU's minimum, where
    recovering x from the rounded y is ill-conditioned)."""
    x = torch.randn(30, 40, dtype=torch.float64).t()
    outs = []
    for inp, contiguous in ((x, False), (x.contiguous(), True)):
        inp = inp.detach().clone().requires_grad_()  # clone keeps the strides
        assert inp.is_contiguous() == contiguous
        y = tempo.gelu(inp, approximate)
        (g,) = torch.autograd.grad(y, inp, torch.ones_like(y))  # grad 1: g is the derivative itself
        outs.append((y.detach(), g))
    (y, g), (y_c, g_c) = outs
    assert torch.equal(y, y_c) and torch.equal(g, g_c)
    assert_within_conditioning_bound(x, y, g, approximate)


def test_bad_input_is_refused_clearly():
    with pytest.raises(TypeError, match="floating"):
        tempo.gelu(torch.arange(5))
    with pytest.raises(ValueError, match="approximate must be one of"):
        tempo.gelu(torch.randn(3), "erf")


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 300))
def test_bit_packing_roundtrip(n):
    mask = torch.rand(n) < 0.5
    packed = pack_bits(mask)
    assert packed.numel() == (n + 7) // 8
    assert torch.equal(unpack_bits(packed, n), mask)
