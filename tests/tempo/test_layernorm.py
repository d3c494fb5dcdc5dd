"""In-place LayerNorm: same output as nn.LayerNorm, exact gradients from (y, rstd, gamma, beta)."""

from __future__ import annotations

import pytest
import torch

import tempo
from measure.saved import saved_bytes
from tempo.ops import layernorm as L

from .norm_bounds import assert_within, exact_and_bounds, unit


def ref_grads(x, w, b, gy, eps=1e-5, shape=None):
    xs = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y = torch.nn.functional.layer_norm(xs[0], shape or w.shape, xs[1], xs[2], eps)
    return y.detach(), torch.autograd.grad(y, xs, gy)


def ours_grads(x, w, b, gy, eps=1e-5, shape=None, keep_input=False):
    xs = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y = tempo.layer_norm(xs[0], shape or w.shape, xs[1], xs[2], eps, keep_input=keep_input)
    return y.detach(), torch.autograd.grad(y, xs, gy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_matches_torch(dtype):
    """Torch's output bit for bit; gradients element by element within their rounding bound of the
    float64 closed form (tests/tempo/norm_bounds.py), as are torch's own (the bound admits them)."""
    d = 96
    x = (torch.randn(3, 50, d) * 2 + 0.5).to(dtype)
    w, b = (1 + 0.3 * torch.randn(d)).to(dtype), (0.2 * torch.randn(d)).to(dtype)
    w = torch.where(w < 0, -1.0, 1.0).to(dtype) * w.abs().clamp_min(1e-3)  # off the op's gamma floor
    gy = torch.randn(3, 50, d).to(dtype)
    y, g = ours_grads(x, w, b, gy)
    y_ref, g_ref = ref_grads(x, w, b, gy)
    assert torch.equal(y, y_ref)
    u = unit(dtype)
    u_c = unit(torch.float64 if dtype == torch.float64 else torch.float32)
    u_out = {"dx": u, "dgamma": u, "dbeta": u}
    bounds = exact_and_bounds(x, w, b, gy, 1e-5, centred=True, u_y=u, u_c=u_c, u_out=u_out)
    factor = 2 if dtype == torch.float64 else 1  # a float64 reference errs as much as we do
    assert_within(dict(zip(("dx", "dgamma", "dbeta"), g, strict=True)), bounds, factor)
    # torch's CPU half-precision backward sums dbeta in its dtype: bfloat16 ~60x this bound,
    # float16 ~11x (Tempo's sums run in float32 and stay within it)
    if dtype not in (torch.bfloat16, torch.float16):
        assert_within(dict(zip(("dx", "dgamma", "dbeta"), g_ref, strict=True)), bounds, factor)


def test_the_rounding_bound_refuses_a_gradient_without_the_mean_term():
    """Negative control: dx without r mean(g gamma) (drawn with g around 1, so that term is not ~0)
    exceeds the bound the right float32 gradients meet."""
    d = 96
    x, gy = torch.randn(3, 50, d) * 2 + 0.5, 1 + 0.3 * torch.randn(3, 50, d)
    w, b = 1 + 0.1 * torch.rand(d), 0.2 * torch.randn(d)
    u = unit(torch.float32)
    u_out = {"dx": u, "dgamma": u, "dbeta": u}
    bounds = exact_and_bounds(x, w, b, gy, 1e-5, centred=True, u_y=u, u_c=u, u_out=u_out)
    _, (dx, dw, db) = ours_grads(x, w, b, gy)
    assert_within({"dx": dx, "dgamma": dw, "dbeta": db}, bounds)
    xd = x.double()
    r = torch.rsqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5)
    without_mean = bounds["dx"][0].reshape(dx.shape) + r * (gy.double() * w.double()).mean(-1, keepdim=True)
    with pytest.raises(AssertionError, match="dx: an element exceeds"):
        assert_within({"dx": without_mean, "dgamma": dw, "dbeta": db}, bounds)


def test_gradcheck_float64_multi_dim_shape():
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: tempo.layer_norm(x, (3, 5), w, b), (x, w, b))


def test_no_affine_parameters():
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: tempo.layer_norm(x, (16,)), (x,))


def test_gamma_zero_stays_finite_and_other_channels_exact():
    d = 32
    x, gy = torch.randn(10, d, dtype=torch.float64), torch.randn(10, d, dtype=torch.float64)
    w, b = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    w[5] = 0.0
    _, (dx, dw, db) = ours_grads(x, w, b, gy)
    _, (rdx, rdw, rdb) = ref_grads(x, w, b, gy)
    assert all(torch.isfinite(t).all() for t in (dx, dw, db))
    keep = torch.arange(d) != 5
    torch.testing.assert_close(dw[keep], rdw[keep])
    torch.testing.assert_close(db, rdb)
    # dx loses only the x_hat[5] * mean(g * gamma * x_hat) term of channel 5 (x_hat[5] unknowable).
    torch.testing.assert_close(dx[:, keep], rdx[:, keep])


def test_replacing_nn_layernorm_keeps_eps_and_shares_weights():
    ln = torch.nn.LayerNorm(20, eps=1e-12)
    t = tempo.TempoLayerNorm.from_layernorm(ln)
    assert t.eps == 1e-12 and t.weight is ln.weight and t.bias is ln.bias
    x = torch.randn(4, 20)
    torch.testing.assert_close(t(x), ln(x), rtol=0, atol=0)


def test_keeps_output_not_input():
    x = torch.randn(4, 32, 64, requires_grad=True)
    model = torch.nn.Sequential(tempo.TempoLayerNorm(64), torch.nn.Linear(64, 8))
    r = saved_bytes(model, x)
    rows = 4 * 32
    # y (shared with the Linear's input) + rstd per row; no copy of x, no mean.
    assert r.activation_bytes == rows * 64 * 4 + rows * 4
    assert r.input_bytes == 0


def test_autocast_keeps_only_the_half_copy():
    x = torch.randn(4, 32, 64, requires_grad=True)
    model = torch.nn.Sequential(tempo.TempoLayerNorm(64), torch.nn.Linear(64, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = saved_bytes(model, x)
        out = model[0](x)
    assert out.dtype == torch.bfloat16
    rows = 4 * 32
    # bf16 y (the very tensor the Linear keeps) + float32 rstd + the bf16 cast of the Linear weight
    # and of the LayerNorm's weight/bias that autocast makes.
    assert r.by_dtype.get("float32", 0) == rows * 4
    assert r.by_dtype["bfloat16"] == rows * 64 * 2 + 8 * 64 * 2 + 2 * 64 * 2


def test_non_contiguous_input():
    x = torch.randn(16, 10, dtype=torch.float64).t()
    w, b, gy = (
        torch.randn(16, dtype=torch.float64),
        torch.randn(16, dtype=torch.float64),
        torch.randn(10, 16, dtype=torch.float64),
    )
    _, g = ours_grads(x, w, b, gy)
    _, g_ref = ref_grads(x, w, b, gy)
    for a, r in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, r)


def test_opcheck():
    x, w, b = (
        torch.randn(7, 16, requires_grad=True),
        torch.randn(16, requires_grad=True),
        torch.randn(16, requires_grad=True),
    )
    torch.library.opcheck(L.layer_norm_fwd, (x, w, b, 1, 1e-5))
    torch.library.opcheck(L.layer_norm_fwd, (x, w, b, 1, 1e-5, True))  # keep_input
    y, rstd = L.layer_norm_fwd(x.detach(), w.detach(), b.detach(), 1, 1e-5)
    torch.library.opcheck(
        L.layer_norm_bwd, (torch.randn_like(y), x.detach(), rstd, w.detach(), b.detach(), 1, True)
    )


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="normalized_shape"):
        tempo.layer_norm(torch.randn(4, 8), (7,))
    with pytest.raises(ValueError, match="weight has shape"):
        tempo.layer_norm(torch.randn(4, 8), (8,), torch.ones(7))
    with pytest.raises(TypeError, match="floating"):
        tempo.layer_norm(torch.ones(4, 8, dtype=torch.int32), (8,))


# ---------------------------------------------------------------- small gamma against beta (issue #13)


def rel_err(a, r):
    return ((a.double() - r).norm() / r.norm()).item()


def fp64_reference(x, w, b, g):
    xs = [t.double().requires_grad_() for t in (x, w, b)]
    y = torch.nn.functional.layer_norm(xs[0], w.shape, xs[1], xs[2], 1e-5)
    return y.detach(), torch.autograd.grad(y, xs, g.double())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dgamma_error_from_the_rounded_output_is_within_its_bound(dtype):
    """Per channel c: |d_gamma_c error| <= u * sum_rows |g| (|x_hat| + kappa_c) + the rounding of
    d_gamma itself, kappa = |beta| / |gamma| (the module docstring's bound)."""
    rows, d = 400, 96
    x, g = torch.randn(rows, d).to(dtype), torch.randn(rows, d).to(dtype)
    w = (0.05 * (0.5 + torch.rand(d))).to(dtype)  # small gamma, away from the floor
    b = torch.randn(d).to(dtype)
    y, rstd = L.layer_norm_fwd(x, w, b, 1, 1e-5)
    _, dw, _ = L.layer_norm_bwd(g, y, rstd, w, b, 1)
    y_ref, (_, dw_ref, _) = fp64_reference(x, w, b, g)
    x_hat = (y_ref - b.double()) / w.double()
    u = L.unit_roundoff(dtype)
    kappa = L.recovery_amplification(w, b).double()
    bound = 1.01 * u * (g.double().abs() * (x_hat.abs() + kappa)).sum(0) + u * dw_ref.abs()
    err = (dw.double() - dw_ref).abs()
    assert (err <= bound).all(), f"worst error / bound {(err / bound).max():.2f}"
    # Not vacuous: the error is of the bound's order (rounding errors do not all align, so ~1/sqrt(rows)).
    assert (err / bound).max() > 0.02


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keep_input_brings_the_gradients_to_the_rounding_of_their_result(dtype):
    """gamma = 0.05, beta ~ N(0, 1) (kappa_rms 20): from the output, d_gamma is several u off; with
    keep_input it is off by the rounding of the result only, at or below torch's own error."""
    rows, d = 512, 256
    x, g = torch.randn(rows, d).to(dtype), torch.randn(rows, d).to(dtype)
    w, b = torch.full((d,), 0.05).to(dtype), torch.randn(d).to(dtype)
    _, ref = fp64_reference(x, w, b, g)
    u = L.unit_roundoff(dtype)
    _, ours = ours_grads(x, w, b, g)
    _, kept = ours_grads(x, w, b, g, keep_input=True)
    _, torch_grads = ref_grads(x, w, b, g)
    assert rel_err(ours[1], ref[1]) > 4 * u  # the fault: d_gamma from the rounded output
    for name, i in (("dx", 0), ("dgamma", 1), ("dbeta", 2)):
        err, torch_err = rel_err(kept[i], ref[i]), rel_err(torch_grads[i], ref[i])
        assert err <= max(torch_err, u), f"{name}: {err:.2e} (torch {torch_err:.2e}, u {u:.2e})"


def test_keep_input_gradcheck_and_keeps_the_input():
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    w = (0.01 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_()
    b = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: tempo.layer_norm(x, (3, 5), w, b, keep_input=True), (x, w, b)
    )
    x = torch.randn(4, 32, 64, requires_grad=True)
    model = torch.nn.Sequential(tempo.TempoLayerNorm(64, keep_input=True), torch.nn.Linear(64, 8))
    r = saved_bytes(model, x)
    rows = 4 * 32
    assert r.activation_bytes == rows * 64 * 4 + rows * 4  # y (kept by the Linear) + rstd
    assert r.input_bytes == rows * 64 * 4  # and x, as torch's LayerNorm keeps it
    assert "keep_input=True" in repr(model[0])


def test_keep_input_output_may_change_in_place_the_default_one_may_not():
    """With keep_input the output is not needed for backward (as with torch's LayerNorm); by
    default it is the saved state, and autograd refuses an in-place change, as for any op that
    keeps its output."""
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    y = tempo.layer_norm(x, (16,), w, b, keep_input=True)
    y.mul_(2)
    (gx,) = torch.autograd.grad(y.sum(), x)
    (ref,) = torch.autograd.grad(2 * torch.nn.functional.layer_norm(x, (16,), w, b).sum(), x)
    torch.testing.assert_close(gx, ref)
    y = tempo.layer_norm(x, (16,), w, b)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_recovery_amplification():
    ln = tempo.TempoLayerNorm(4)
    with torch.no_grad():
        ln.weight.copy_(torch.tensor([1.0, -0.5, 0.0, 2.0]))
        ln.bias.copy_(torch.tensor([3.0, 1.0, 1.0, 0.0]))
    torch.testing.assert_close(ln.recovery_amplification(), torch.tensor([3.0, 2.0, 1e6, 0.0]))


def test_triton_backward_from_the_input_matches_the_torch_path():
    """The kernel's keep_input branch (interpreter on CPU, compiled on CUDA)."""
    pytest.importorskip("triton")
    from tempo.kernels.layernorm import layer_norm_bwd_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, d = 37, 48  # not multiples of the kernel's blocks
    x, g = torch.randn(rows, d) * 2 + 0.3, torch.randn(rows, d)
    w, b = 0.05 * torch.randn(d), torch.randn(d)
    _, rstd = L.layer_norm_forward_torch(x, w, b, 1, 1e-5)
    ref = L.layer_norm_backward_torch(g, x, rstd, w, b, 1, from_input=True)
    out = layer_norm_bwd_triton(*(t.to(device) for t in (g, x, rstd, w, b)), 1, from_input=True)
    for a, r in zip(out, ref, strict=True):
        torch.testing.assert_close(a.cpu(), r, rtol=1e-5, atol=1e-5)
