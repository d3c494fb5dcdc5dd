"""In-place RMSNorm: LlamaRMSNorm's output, exact gradients from (y, rstd, gamma), only y kept."""

from __future__ import annotations

import pytest
import torch

from measure.saved import saved_bytes
from tempo.ops import rmsnorm as R

from .norm_bounds import assert_within, exact_and_bounds, unit


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


def rms_bounds(x, w, gy, eps):
    """{dx, dgamma: (exact float64, bound)} for Tempo's RMSNorm (tests/tempo/norm_bounds.py): y is
    rounded twice (x_hat to x's dtype, then y, as HF's), dx to y's dtype then x's."""
    y_dtype = torch.promote_types(x.dtype, w.dtype)
    u_c = unit(torch.float64 if y_dtype == torch.float64 else torch.float32)
    u_y = unit(x.dtype) + unit(y_dtype)
    u_out = {"dx": unit(x.dtype) + unit(y_dtype), "dgamma": unit(w.dtype)}
    return exact_and_bounds(x, w, None, gy, eps, centred=False, u_y=u_y, u_c=u_c, u_out=u_out)


def test_float64_gradients_equal_the_reference():
    x, w, gy = _draw(torch.float64)
    eps = float(torch.empty(()).uniform_(1e-8, 1e-4))
    y, (dx, dw) = grads(R.rms_norm, x, w, gy, eps)
    y_ref, _ = grads(hf_rms_norm, x, w, gy, eps)
    torch.testing.assert_close(y, y_ref, rtol=1e-15, atol=0)
    assert_within({"dx": dx, "dgamma": dw}, rms_bounds(x, w, gy, eps), factor=2)  # the reference errs too


def test_gradcheck_float64():
    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: R.rms_norm(x, w, 1e-6), (x, w))


@pytest.mark.parametrize(
    ("dtype", "wdtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_output_is_llamas_and_gradients_within_rounding(dtype, wdtype):
    x, w, gy = _draw(dtype)
    w = w.to(wdtype)
    gy = gy.to(torch.promote_types(dtype, wdtype))
    y, (dx, dw) = grads(R.rms_norm, x, w, gy, 1e-6)
    y_ref, _ = grads(hf_rms_norm, x, w, gy, 1e-6)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)  # bit for bit, in HF's dtype
    assert dx.dtype == dtype and dw.dtype == wdtype
    assert_within({"dx": dx, "dgamma": dw}, rms_bounds(x, w, gy, 1e-6))


def test_the_rounding_bound_admits_hf_and_refuses_a_wrong_gradient():
    """The bound admits HF's own float32 autograd (it is as wide as it must be) and refuses an error
    of 1e-3 of an element's magnitude scale, and a gradient without the projection term
    r x_hat mean(g gamma x_hat) (drawn with g along gamma x_hat, so that term is not ~0)."""
    x, w, gy = _draw(torch.float32)
    _, (hf_dx, hf_dw) = grads(hf_rms_norm, x, w, gy, 1e-6)
    bounds = rms_bounds(x, w, gy, 1e-6)
    assert_within({"dx": hf_dx, "dgamma": hf_dw}, bounds)

    (dx, _), (dw, _) = bounds["dx"], bounds["dgamma"]
    xd, wd = x.double(), w.double()
    r = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    x_hat = xd * r
    gw = wd * gy.double()
    scale = r * (gw.abs() + x_hat.abs() * (gw * x_hat).abs().mean(-1, keepdim=True))  # what dx sums
    one_element = dx.clone()
    i = int(torch.randint(0, dx.numel(), ()))
    one_element.view(-1)[i] += 1e-3 * scale.view(-1)[i]
    with pytest.raises(AssertionError, match="dx: an element exceeds"):
        assert_within({"dx": one_element, "dgamma": dw}, bounds)

    g_along = (wd * x_hat + 0.1 * gy.double()).float()  # mean(g gamma x_hat) ~ mean(gamma^2 x_hat^2)
    bounds = rms_bounds(x, w, g_along, 1e-6)
    no_projection = r * wd * g_along.double()
    with pytest.raises(AssertionError, match="dx: an element exceeds"):
        assert_within({"dx": no_projection, "dgamma": bounds["dgamma"][0]}, bounds)


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
