"""Lean dropout: keeps a seed, regenerates the same mask in backward."""

from __future__ import annotations

import pytest
import torch

import tempo
from measure.saved import saved_bytes
from tempo.ops import dropout as D


def test_backward_uses_the_forward_mask():
    x = torch.randn(3, 70_000, requires_grad=True)  # spans several chunks
    y = tempo.dropout(x, 0.3)
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    keep = y != 0
    torch.testing.assert_close(y[keep], x[keep] / 0.7)
    torch.testing.assert_close(gx, gy * keep / 0.7)


def test_negative_control_wrong_seed_is_detected():
    """The check above must be able to fail: a backward with another seed gives another mask."""
    x = torch.randn(10_000)
    seed = torch.tensor(1234)
    y = D.dropout_op(x, 0.3, seed)
    g_wrong = D.dropout_op(torch.ones_like(x), 0.3, seed + 1)
    assert not torch.equal(g_wrong != 0, y != 0)


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
