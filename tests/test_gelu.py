"""In-place GELU: forward identical to torch, backward exact to the conditioning bound."""

from __future__ import annotations

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


def mixed_inputs(approximate: str, n: int = 200_000) -> torch.Tensor:
    """Broad values, a dense band around GELU's minimum, large |x|, and the specials."""
    x_min = G.branch_point(approximate)[0]
    return torch.cat([
        torch.randn(n, dtype=torch.float64) * 3,
        x_min + 0.05 * torch.randn(n // 20, dtype=torch.float64),
        torch.empty(n // 20, dtype=torch.float64).uniform_(-40, 40),
        torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, x_min], dtype=torch.float64),
    ])  # fmt: skip


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


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", FLOATS)
def test_forward_is_torch_gelu(approximate, dtype):
    x = mixed_inputs(approximate, 20_000).to(dtype)
    assert torch.equal(
        tempo.gelu(x, approximate).isnan(), torch.nn.functional.gelu(x, approximate=approximate).isnan()
    )
    torch.testing.assert_close(
        tempo.gelu(x, approximate),
        torch.nn.functional.gelu(x, approximate=approximate),
        rtol=0,
        atol=0,
        equal_nan=True,
    )


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize(("dtype", "target"), [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_gradient_normwise_against_autograd(approximate, dtype, target):
    x = mixed_inputs(approximate).to(dtype)
    _, gy, g_ours = grads(x, approximate, tempo.gelu)
    x_ref = x.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(torch.nn.functional.gelu(x_ref, approximate=approximate), x_ref, gy)
    assert torch.equal(g_ours.isnan(), g_ref.isnan()), "NaN must propagate exactly as in torch's backward"
    ok = torch.isfinite(g_ref)
    err = (g_ours[ok].double() - g_ref[ok].double()).norm() / g_ref[ok].double().norm()
    assert err <= target, f"relative error {err:.3e} > {target:.0e}"


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", FLOATS)
def test_gradient_elementwise_within_conditioning_bound(approximate, dtype):
    """|dGELU_ours - GELU'(x)| <= min(sqrt(2 M dy), 2 M dy / |GELU'(x)|) + rounding, per element,
    where dy is the actual error of the stored y against exact float64 GELU(x) (see ops/gelu.py)."""
    x = mixed_inputs(approximate, 50_000).to(dtype)
    x = x[torch.isfinite(x)]
    y, packed = G.gelu_fwd(x, approximate)
    ones = torch.ones_like(y)
    d_ours = G.gelu_backward_torch(ones, y, packed, approximate).double()
    x64 = x.double()
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


def test_non_contiguous_input():
    x = torch.randn(30, 40, dtype=torch.float64).t().requires_grad_()
    (g,) = torch.autograd.grad(tempo.gelu(x).sum(), x)
    x2 = x.detach().clone().requires_grad_()
    (g2,) = torch.autograd.grad(torch.nn.functional.gelu(x2).sum(), x2)
    torch.testing.assert_close(g, g2, rtol=1e-10, atol=1e-12)


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
