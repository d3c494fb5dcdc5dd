"""In-place LayerNorm: same output as nn.LayerNorm, exact gradients from (y, rstd, gamma, beta)."""

from __future__ import annotations

import pytest
import torch

import tempo
from measure.saved import saved_bytes
from tempo.ops import layernorm as L


def ref_grads(x, w, b, gy, eps=1e-5, shape=None):
    xs = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y = torch.nn.functional.layer_norm(xs[0], shape or w.shape, xs[1], xs[2], eps)
    return y.detach(), torch.autograd.grad(y, xs, gy)


def ours_grads(x, w, b, gy, eps=1e-5, shape=None):
    xs = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y = tempo.layer_norm(xs[0], shape or w.shape, xs[1], xs[2], eps)
    return y.detach(), torch.autograd.grad(y, xs, gy)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 3e-2)]
)
def test_matches_torch(dtype, tol):
    d = 96
    x = (torch.randn(3, 50, d) * 2 + 0.5).to(dtype)
    w, b = (1 + 0.3 * torch.randn(d)).to(dtype), (0.2 * torch.randn(d)).to(dtype)
    gy = torch.randn(3, 50, d).to(dtype)
    y, g = ours_grads(x, w, b, gy)
    y_ref, g_ref = ref_grads(x, w, b, gy)
    assert torch.equal(y, y_ref)
    for name, a, r in zip(("dx", "dgamma", "dbeta"), g, g_ref, strict=True):
        err = (a.double() - r.double()).norm() / r.double().norm()
        assert err <= tol, f"{name}: relative error {err:.2e}"


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


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="normalized_shape"):
        tempo.layer_norm(torch.randn(4, 8), (7,))
    with pytest.raises(ValueError, match="weight has shape"):
        tempo.layer_norm(torch.randn(4, 8), (8,), torch.ones(7))
    with pytest.raises(TypeError, match="floating"):
        tempo.layer_norm(torch.ones(4, 8, dtype=torch.int32), (8,))
