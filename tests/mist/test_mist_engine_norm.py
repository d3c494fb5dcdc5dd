"""The engine's RMSNorm: torch's RMSNorm's result and gradients, keeping only x and rstd."""

from __future__ import annotations

import torch

from mist.engine.layers import rms_norm


def _saved_bytes(fn, *inputs) -> int:
    """Bytes of the storages autograd keeps for backward of ``fn(*inputs)``, each counted once."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def test_rms_norm_matches_torch_in_float64(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(6, 3, 40, dtype=torch.float64, generator=gen).requires_grad_()
    w = (1 + torch.rand(40, dtype=torch.float64, generator=gen)).requires_grad_()
    dy = torch.randn(6, 3, 40, dtype=torch.float64, generator=gen)
    ref = torch.nn.functional.rms_norm(x, (40,), w, eps=1e-5)
    ours = rms_norm(x, w, 1e-5)
    want = torch.autograd.grad(ref, (x, w), dy)
    got = torch.autograd.grad(ours, (x, w), dy)
    # the same math in another order: float64 rounding, scaled by the values' sizes
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10 * b.abs().max().item())


def test_rms_norm_keeps_the_input_and_rstd_only():
    """A bf16 input of N tokens x h: x (2 bytes an element), rstd (4 bytes a token) and the weight;
    torch's RMSNorm, the negative control, keeps about four times the input's bytes."""
    x = torch.randn(128, 4, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, dtype=torch.bfloat16, requires_grad=True)
    ours = _saved_bytes(lambda a: rms_norm(a, w, 1e-5), x)
    assert ours == x.numel() * 2 + 128 * 4 * 4 + 256 * 2
    theirs = _saved_bytes(lambda a: torch.nn.functional.rms_norm(a, (256,), w, eps=1e-5), x)
    assert theirs > 3 * x.numel() * 2
