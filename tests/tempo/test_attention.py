"""Lean attention core: keeps softmax probabilities and V, regenerates the dropout mask."""

from __future__ import annotations

import pytest
import torch

import tempo
from measure.saved import saved_bytes
from tempo.ops import attention as A


def reference(q, k, v, mask, keep=None, p=0.0):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    probs = torch.softmax(s, -1)
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs @ v


def qkv(b=2, h=3, s=40, d=8, dtype=torch.float64):
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.zeros(b, 1, 1, s, dtype=dtype)
    mask[0, ..., -5:] = torch.finfo(dtype).min  # padded keys in the first sequence
    return q, k, v, mask


def test_no_dropout_matches_eager_and_gradcheck():
    q, k, v, mask = qkv(s=12)
    out, _ = tempo.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.0)
    torch.testing.assert_close(out, reference(q, k, v, mask))
    assert torch.autograd.gradcheck(
        lambda q, k, v: tempo.scaled_dot_product_attention(q, k, v, mask)[0], (q, k, v)
    )


def test_dropout_gradcheck_fixed_seed():
    q, k, v, mask = qkv(s=12)

    def f(q, k, v):
        torch.manual_seed(3)
        return tempo.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.3)[0]

    # fast mode (the Jacobian against random vectors): the full one took ~30 s of the suite, and
    # the backward is checked element by element through the same mask in the test below
    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


def test_dropout_backward_matches_autograd_through_the_same_mask():
    """Recover the mask the forward used (V = identity exposes dropped P), then compare the
    backward with autograd through an explicitly masked reference."""
    b, h, s = 2, 2, 300  # several chunks of heads
    scores = torch.randn(b, h, s, s, dtype=torch.float64)
    seed = torch.tensor(99)
    dropped, probs = A.attention_core_op(
        scores, torch.eye(s, dtype=torch.float64).expand(b, h, s, s), 0.2, seed
    )
    keep = (dropped != 0).double()
    v = torch.randn(b, h, s, 16, dtype=torch.float64)
    go = torch.randn(b, h, s, 16, dtype=torch.float64)
    gs, gv = A.attention_core_bwd(go, None, probs, v, 0.2, seed, torch.float64)
    s_ref, v_ref = scores.clone().requires_grad_(), v.clone().requires_grad_()
    out_ref = (torch.softmax(s_ref, -1) * keep / 0.8) @ v_ref
    gs_ref, gv_ref = torch.autograd.grad(out_ref, (s_ref, v_ref), go)
    torch.testing.assert_close(gs, gs_ref)
    torch.testing.assert_close(gv, gv_ref)
    # negative control: another seed's mask gives another gradient
    gs_wrong, _ = A.attention_core_bwd(go, None, probs, v, 0.2, seed + 1, torch.float64)
    assert not torch.allclose(gs_wrong, gs_ref)


def test_gradient_through_returned_probabilities():
    q, k, v, mask = qkv(s=10)

    def f(q, k, v):
        out, probs = tempo.scaled_dot_product_attention(q, k, v, mask)
        return out.sum() + (probs**2).sum()

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_keeps_probabilities_and_v_only():
    b, h, s, d = 2, 4, 64, 16
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    class Core(torch.nn.Module):
        def forward(self, q, k, v):
            return tempo.scaled_dot_product_attention(q, k, v, None, dropout_p=0.1)[0]

    r = saved_bytes(Core(), q, k, v)
    # Q and K (inputs) are kept by the QK^T matmul; the core keeps bf16 P and the seed; V is an input.
    assert r.activation_bytes == b * h * s * s * 2 + 8
    assert r.input_bytes == 3 * b * h * s * d * 2


def test_autocast_keeps_half_probabilities():
    q, k, v, _ = qkv(s=16, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, probs = tempo.scaled_dot_product_attention(q, k, v)
    assert probs.dtype == torch.bfloat16 and out.dtype == torch.bfloat16


def test_bad_shapes_are_refused_clearly():
    with pytest.raises(ValueError, match="disagree on Sk"):
        tempo.attention_core(torch.randn(1, 2, 4, 5), torch.randn(1, 2, 6, 3))
    with pytest.raises(ValueError, match="same leading dims"):
        tempo.attention_core(torch.randn(1, 2, 4, 5), torch.randn(1, 1, 5, 3))
    with pytest.raises(TypeError, match="floating"):
        tempo.attention_core(torch.ones(1, 2, 4, 5, dtype=torch.long), torch.randn(1, 2, 5, 3))


def test_opcheck():
    torch.library.opcheck(
        A.attention_core_op,
        (
            torch.randn(2, 2, 5, 5, requires_grad=True),
            torch.randn(2, 2, 5, 3, requires_grad=True),
            0.2,
            torch.tensor(5),
        ),
    )


def test_opcheck_backward_with_a_transposed_value_view():
    """HF passes V as a transposed view; the fake kernel must promise the real strides."""
    v = torch.randn(2, 5, 2, 3).transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D)
    out, probs = A.attention_core_op(torch.randn(2, 2, 5, 5), v, 0.1, torch.tensor(5))
    torch.library.opcheck(
        A.attention_core_bwd, (torch.randn_like(out), None, probs, v, 0.1, torch.tensor(5), torch.float32)
    )
