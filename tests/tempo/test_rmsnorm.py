"""In-place RMSNorm: LlamaRMSNorm's output, exact gradients from (y, rstd, gamma), only y kept."""

from __future__ import annotations

import pytest
import torch

from measure.saved import saved_bytes
from tempo.ops import rmsnorm as R


def hf_rms_norm(x, weight, eps):
    """HuggingFace's LlamaRMSNorm.forward, written out (the reference)."""
    h = x.to(torch.float32) if x.dtype != torch.float64 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def grads(fn, x, w, gy, eps):
    xs = [t.detach().clone().requires_grad_() for t in (x, w)]
    y = fn(xs[0], xs[1], eps)
    return y.detach(), torch.autograd.grad(y, xs, gy)


def _draw(dtype, rows=None, d=None):
    rng = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    rows = rows or int(torch.randint(1, 80, (), generator=rng))
    d = d or int(torch.randint(1, 200, (), generator=rng))
    x = (torch.randn(2, rows, d, generator=rng, dtype=torch.float64) * 2 + 0.3).to(dtype)
    w = 1 + 0.3 * torch.randn(d, generator=rng, dtype=torch.float64)
    # |gamma| kept off the op's floor (there x_hat is approximate by design: its own test below)
    w = (torch.where(w < 0, -1.0, 1.0) * w.abs().clamp_min(1e-3)).to(dtype)
    gy = torch.randn(2, rows, d, generator=rng, dtype=torch.float64).to(dtype)
    return x, w, gy


def exact_gradients(x, w, gy, eps):
    """(dx, dgamma, scale_dx, scale_dw) in float64 from the inputs as given: the closed form
    dx = r (gamma g - x_hat mean(g gamma x_hat)), dgamma = sum over rows of g x_hat, and the sums
    of magnitudes its rounding errors scale with (r (|gamma g| + |x_hat| mean|g gamma x_hat|) for
    dx, sum over rows of |g x_hat| for dgamma)."""
    x, w, g = x.double(), w.double(), gy.double()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x * r
    m = (g * w * x_hat).mean(-1, keepdim=True)
    big_m = (g * w * x_hat).abs().mean(-1, keepdim=True)
    dx = r * (w * g - x_hat * m)
    dw = (g * x_hat).reshape(-1, x.shape[-1]).sum(0)
    scale_dx = r * ((w * g).abs() + x_hat.abs() * big_m)
    scale_dw = (g * x_hat).abs().reshape(-1, x.shape[-1]).sum(0)
    return dx, dw, scale_dx, scale_dw


def unit(dtype: torch.dtype) -> float:
    """The unit roundoff: half the distance from 1 to the next number."""
    return torch.finfo(dtype).eps / 2


def assert_within_rounding_bound(x, w, gy, eps, dx, dw, reference_rounds=False):
    """Element by element, |ours - exact| <= u_out |exact| + K scale, K from a worst-case count of
    the op's roundings (ops/rmsnorm.py): rstd = 1/sqrt(mean(x^2) + eps) to (d/2 + 3) u_c (a sum of
    d positive terms), x_hat rounded to x's dtype, y to its own, x_hat = y / gamma, mean(g y) over d
    terms, dgamma's sum over the rows; u_c the compute dtype's unit roundoff (float32, float64 for
    float64), u_out the result's. ``reference_rounds``: the reference computed in the same dtype
    (float64) errs as much again."""
    d, rows = x.shape[-1], x.numel() // max(x.shape[-1], 1)
    y_dtype = torch.promote_types(x.dtype, w.dtype)
    u_c = unit(torch.float64 if y_dtype == torch.float64 else torch.float32)
    e_r = (d / 2 + 3) * u_c
    e_y = e_r + u_c + unit(x.dtype) + unit(y_dtype)  # y against gamma * exact x_hat
    e_xhat = e_y + 2 * u_c  # x_hat = y / gamma
    k_dx = 2 * e_r + e_xhat + e_y + (d + 8) * u_c
    k_dw = e_xhat + (rows + 2) * u_c
    if reference_rounds:
        k_dx, k_dw = 2 * k_dx, 2 * k_dw
    rdx, rdw, scale_dx, scale_dw = exact_gradients(x, w, gy, eps)
    for name, ours, exact, k, scale, out in (
        ("dx", dx, rdx, k_dx, scale_dx, dx.dtype), ("dgamma", dw, rdw, k_dw, scale_dw, dw.dtype),
    ):  # fmt: skip
        u_out = unit(out) + unit(y_dtype)  # rounded to y's dtype, then to the result's
        bound = u_out * exact.abs() + k * scale + torch.finfo(out).tiny
        worst = ((ours.double() - exact).abs() / bound).max().item() if exact.numel() else 0.0
        assert worst <= 1.0, f"{name}: an element exceeds its rounding bound by {worst:.2f}x"


def test_float64_gradients_equal_the_reference():
    x, w, gy = _draw(torch.float64)
    eps = float(torch.empty(()).uniform_(1e-8, 1e-4))
    y, (dx, dw) = grads(R.rms_norm, x, w, gy, eps)
    y_ref, _ = grads(hf_rms_norm, x, w, gy, eps)
    torch.testing.assert_close(y, y_ref, rtol=1e-15, atol=0)
    assert_within_rounding_bound(x, w, gy, eps, dx, dw, reference_rounds=True)


def test_gradcheck_float64():
    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: R.rms_norm(x, w, 1e-6), (x, w))


@pytest.mark.parametrize(("dtype", "wdtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
])  # fmt: skip
def test_output_is_llamas_and_gradients_within_rounding(dtype, wdtype):
    x, w, gy = _draw(dtype)
    w = w.to(wdtype)
    gy = gy.to(torch.promote_types(dtype, wdtype))
    y, (dx, dw) = grads(R.rms_norm, x, w, gy, 1e-6)
    y_ref, _ = grads(hf_rms_norm, x, w, gy, 1e-6)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)  # bit for bit, in HF's dtype
    assert dx.dtype == dtype and dw.dtype == wdtype
    assert_within_rounding_bound(x, w, gy, 1e-6, dx, dw)


def test_the_rounding_bound_admits_hf_and_refuses_a_wrong_gradient():
    """The bound admits HF's own float32 autograd (it is as wide as it must be) and refuses an error
    of 1e-3 of the scale in one element, and a gradient without the projection term
    r x_hat mean(g gamma x_hat) (drawn with g along gamma x_hat, so that term is not ~0)."""
    x, w, gy = _draw(torch.float32)
    _, (hf_dx, hf_dw) = grads(hf_rms_norm, x, w, gy, 1e-6)
    assert_within_rounding_bound(x, w, gy, 1e-6, hf_dx, hf_dw)

    dx, dw, scale, _ = exact_gradients(x, w, gy, 1e-6)
    one_element = dx.clone()
    i = int(torch.randint(0, dx.numel(), ()))
    one_element.view(-1)[i] += 1e-3 * scale.view(-1)[i]
    with pytest.raises(AssertionError, match="dx: an element exceeds"):
        assert_within_rounding_bound(x, w, gy, 1e-6, one_element.float(), dw.float())

    xd, wd = x.double(), w.double()
    r = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    g_along = (wd * xd * r + 0.1 * gy.double()).float()  # mean(g gamma x_hat) ~ mean(gamma^2 x_hat^2)
    dx, dw, _, _ = exact_gradients(x, w, g_along, 1e-6)
    no_projection = r * wd * g_along.double()
    with pytest.raises(AssertionError, match="dx: an element exceeds"):
        assert_within_rounding_bound(x, w, g_along, 1e-6, no_projection.float(), dw.float())


def test_keeps_output_not_input():
    d = 64
    x = torch.randn(4, 32, d, requires_grad=True)
    model = torch.nn.Sequential(R.TempoRMSNorm(d), torch.nn.Linear(d, 8))
    r = saved_bytes(model, x)
    rows = 4 * 32
    assert r.activation_bytes == rows * d * 4 + rows * 4  # y (the Linear's input too) + rstd per row
    assert r.input_bytes == 0
    # negative control: the reference keeps its input (and more)
    ref = torch.nn.Sequential(torch.nn.RMSNorm(d), torch.nn.Linear(d, 8))
    assert saved_bytes(ref, x).input_bytes > 0


def test_gamma_zero_stays_finite_and_other_channels_exact():
    x, w, gy = _draw(torch.float64, d=32)
    w[5] = 0.0
    _, (dx, dw) = grads(R.rms_norm, x, w, gy, 1e-6)
    _, (rdx, rdw) = grads(hf_rms_norm, x, w, gy, 1e-6)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    keep = torch.arange(32) != 5
    torch.testing.assert_close(dw[keep], rdw[keep])
    torch.testing.assert_close(dx[..., keep], rdx[..., keep])


def test_from_hf_module_shares_weight_and_eps():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
    ours = R.TempoRMSNorm.from_rmsnorm(hf)
    assert ours.weight is hf.weight and ours.variance_epsilon == 1e-5
    x = torch.randn(3, 9, 48, dtype=torch.bfloat16)
    assert torch.equal(ours(x), hf(x))


def test_opcheck():
    x, w = torch.randn(7, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    torch.library.opcheck(R.rms_norm_fwd, (x, w, 1e-6))
    y, rstd = R.rms_norm_fwd(x.detach(), w.detach(), 1e-6)
    torch.library.opcheck(R.rms_norm_bwd, (torch.randn_like(y), y, rstd, w.detach()))


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="weight must have one dim equal to the input's last"):
        R.rms_norm(torch.randn(4, 8), torch.ones(7))
    with pytest.raises(TypeError, match="floating tensors only"):
        R.rms_norm(torch.ones(4, 8, dtype=torch.int64), torch.ones(8))
    with pytest.raises(ValueError, match="eps must be a finite number"):
        R.rms_norm(torch.randn(4, 8), torch.ones(8), float("nan"))


def test_compiled_matches_eager():
    x, w, gy = _draw(torch.float32)
    compiled = torch.compile(R.rms_norm, backend="aot_eager", fullgraph=True)
    y, (dx, dw) = grads(compiled, x, w, gy, 1e-6)
    y_ref, (rdx, rdw) = grads(R.rms_norm, x, w, gy, 1e-6)
    assert torch.equal(y, y_ref) and torch.equal(dx, rdx) and torch.equal(dw, rdw)
