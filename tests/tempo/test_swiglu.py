"""SwiGLU fused with the down projection: LlamaMLP's output and gradients bit for bit, keeping gate
and up only (not silu(gate) or their product)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from measure.saved import saved_bytes
from tempo.ops import swiglu as S


class TempoMLP(torch.nn.Module):
    """LlamaMLP's forward with the fused tail (what a model patch installs)."""

    def __init__(self, mlp: LlamaMLP) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        m = self.mlp
        return S.swiglu_down(m.gate_proj(x), m.up_proj(x), m.down_proj.weight, m.down_proj.bias)


def _mlp(dtype, bias=False):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    h, f = 2 * int(torch.randint(4, 24, (), generator=gen)), int(torch.randint(16, 96, (), generator=gen))
    config = LlamaConfig(
        hidden_size=h,
        intermediate_size=f,
        mlp_bias=bias,
        hidden_act="silu",
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    mlp = LlamaMLP(config)
    mlp = mlp.to(dtype)
    x = torch.randn(2, int(torch.randint(1, 40, (), generator=gen)), h, generator=gen).to(dtype)
    return mlp, x


def _run(module, x, gy):
    x = x.detach().clone().requires_grad_()
    params = list(module.parameters())
    y = module(x)
    return y.detach(), torch.autograd.grad(y, [x, *params], gy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
def test_bit_for_bit_llama_mlp(dtype, bias):
    mlp, x = _mlp(dtype, bias)
    gy = torch.randn(*x.shape).to(dtype)
    y_ref, g_ref = _run(mlp, x, gy)
    y, g = _run(TempoMLP(mlp), x, gy)
    assert torch.equal(y, y_ref)
    for a, r in zip(g, g_ref, strict=True):
        assert torch.equal(a, r)


def test_gradcheck_float64():
    gate, up = (torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(S.swiglu_down, (gate, up, w, b))


def test_keeps_gate_and_up_only():
    mlp, x = _mlp(torch.float32)
    x.requires_grad_()
    f, tokens = mlp.intermediate_size, x.shape[0] * x.shape[1]
    ours = saved_bytes(TempoMLP(mlp), x)
    ref = saved_bytes(mlp, x)
    # the projections' shared input x, then gate and up: 2 ffn-wide tensors
    assert ours.activation_bytes == 2 * tokens * f * 4
    # negative control: autograd keeps gate, silu(gate), up and their product
    assert ref.activation_bytes == 4 * tokens * f * 4


def test_autocast_matches_llama_mlp():
    mlp, x = _mlp(torch.float32)
    gy = torch.randn(*x.shape, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, g_ref = _run(mlp, x, gy)
        y, g = _run(TempoMLP(mlp), x, gy)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    for a, r in zip(g, g_ref, strict=True):
        assert a.dtype == r.dtype and torch.equal(a, r)


def test_opcheck_and_compile():
    gate, up = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    w = torch.randn(5, 6, requires_grad=True)
    torch.library.opcheck(S.swiglu_down_op, (gate, up, w, None))
    compiled = torch.compile(S.swiglu_down, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(gate, up, w), S.swiglu_down(gate, up, w))


def test_bad_input_is_refused_clearly():
    g = torch.randn(4, 6)
    with pytest.raises(ValueError, match="gate and up must have one shape"):
        S.swiglu_down(g, torch.randn(4, 7), torch.randn(5, 6))
    with pytest.raises(ValueError, match=r"weight must be \[hidden, ffn\]"):
        S.swiglu_down(g, g, torch.randn(5, 7))
    with pytest.raises(ValueError, match="bias must be"):
        S.swiglu_down(g, g, torch.randn(5, 6), torch.randn(4))
    with pytest.raises(ValueError, match="must share a dtype"):
        S.swiglu_down(g, g, torch.randn(5, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating tensors only"):
        S.swiglu_down(g.long(), g, torch.randn(5, 6))
