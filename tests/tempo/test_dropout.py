"""Lean dropout: keeps a seed, regenerates the same mask in backward."""

from __future__ import annotations

import pytest
import torch

import tempo
from measure.saved import saved_bytes
from tempo.ops import dropout as D


def keep_mask_of(p: float, x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """The keep mask dropout_op draws from ``seed``, read off the op itself (on ones, so a zero in
    the output means dropped: random inputs may hold exact zeros)."""
    return D.dropout_op(torch.ones_like(x), p, seed) != 0


def assert_gradient_uses_the_mask(x, y, gy, gx, p, keep):
    """y = x * keep / (1 - p) and gx = gy * keep / (1 - p)."""
    torch.testing.assert_close(y, x * keep / (1 - p))
    torch.testing.assert_close(gx, gy * keep / (1 - p))


def test_backward_uses_the_forward_mask():
    x = torch.randn(3, 70_000, requires_grad=True)  # spans several chunks
    rng_state = torch.get_rng_state()
    y = tempo.dropout(x, 0.3)
    torch.set_rng_state(rng_state)  # the same draw again: the seed tempo.dropout took
    keep = tempo.dropout(torch.ones_like(x), 0.3) != 0
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    assert_gradient_uses_the_mask(x.detach(), y.detach(), gy, gx, 0.3, keep)


def test_the_check_holds_where_the_input_is_zero():
    """Zeros in x (randn draws them now and then) are kept or dropped as the mask says."""
    x = torch.randn(4, 1000)
    x[:, ::7] = 0.0
    x.requires_grad_()
    seed = torch.randint(0, 2**31 - 2, ())
    y = D.dropout_op(x, 0.5, seed)
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    keep = keep_mask_of(0.5, x, seed)
    assert_gradient_uses_the_mask(x.detach(), y.detach(), gy, gx, 0.5, keep)
    assert (gx[:, ::7] != 0).any()  # a kept zero of x still passes its gradient


def test_negative_control_a_backward_with_another_seed_fails_the_check():
    """The check above must be able to fail: the backward of a dropout with another seed (the
    real autograd path, only the seed differs) against the forward output of this one."""
    x = torch.randn(3, 70_000, requires_grad=True)
    seed = torch.randint(0, 2**31 - 2, ())
    y = D.dropout_op(x, 0.3, seed)
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    keep = keep_mask_of(0.3, x, seed)
    assert_gradient_uses_the_mask(x.detach(), y.detach(), gy, gx, 0.3, keep)  # the right seed passes
    (gx_wrong,) = torch.autograd.grad(D.dropout_op(x, 0.3, seed + 1), x, gy)
    with pytest.raises(AssertionError, match="not close"):
        assert_gradient_uses_the_mask(x.detach(), y.detach(), gy, gx_wrong, 0.3, keep)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_drop_rate_is_p(p):
    n = 200_000
    frac = (tempo.dropout(torch.ones(n), p) == 0).double().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(frac - p) < 6 * sigma


def test_gradcheck_float64_fixed_seed():
    x = torch.randn(50, dtype=torch.float64, requires_grad=True)

    def f(t):
        torch.manual_seed(7)
        return tempo.dropout(t, 0.4)

    assert torch.autograd.gradcheck(f, (x,))


def test_keeps_only_a_seed():
    x = torch.randn(64, 128, requires_grad=True)
    r = saved_bytes(tempo.TempoDropout(0.1), x)
    assert r.activation_bytes == 8  # one int64 seed, no mask


def test_eval_and_p0_are_identity():
    x = torch.randn(10)
    m = tempo.TempoDropout(0.5).eval()
    assert m(x) is x
    assert tempo.dropout(x, 0.0) is x


def test_opcheck_and_bad_p():
    torch.library.opcheck(D.dropout_op, (torch.randn(9, 4, requires_grad=True), 0.2, torch.tensor(3)))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        tempo.dropout(torch.randn(3), 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_accepted_dtype_against_a_float64_reference(dtype):
    """y = x keep / (1 - p) and dx = dy keep / (1 - p) in the input's dtype, each element within two
    roundings of the float64 product (the scale's and the product's; plus the subnormal spacing,
    where a small product underflows), the mask read off the op."""
    p = 0.3
    x = torch.randn(4, 20_000, dtype=torch.float64).to(dtype).requires_grad_()
    seed = torch.randint(0, 2**31 - 2, ())
    y = D.dropout_op(x, p, seed)
    gy = torch.randn(y.shape, dtype=torch.float64).to(dtype)
    (gx,) = torch.autograd.grad(y, x, gy)
    keep = keep_mask_of(p, x, seed)
    assert y.dtype == gx.dtype == dtype
    for out, inp in ((y, x), (gx, gy)):
        assert _within_two_roundings(out, inp.detach().double() * keep / (1 - p))


def _within_two_roundings(out: torch.Tensor, exact: torch.Tensor) -> bool:
    info = torch.finfo(out.dtype)
    err = (out.detach().double() - exact).abs()
    return bool((err <= info.eps * exact.abs() + info.smallest_normal * info.eps).all())


def test_negative_control_a_float32_dropout_rounded_through_bfloat16_fails_the_bound():
    x = torch.randn(4, 20_000)
    seed = torch.randint(0, 2**31 - 2, ())
    y = D.dropout_op(x, 0.3, seed)
    exact = x.double() * keep_mask_of(0.3, x, seed) / 0.7
    assert _within_two_roundings(y, exact)
    assert not _within_two_roundings(y.to(torch.bfloat16).float(), exact)
