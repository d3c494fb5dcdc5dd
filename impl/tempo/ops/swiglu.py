"""SwiGLU fused with the down projection's saved input (beyond the paper: Llama-family MLPs).

A Llama MLP is ``down(silu(gate) * up)`` with ``gate = x W_g``, ``up = x W_u``. Autograd keeps four
ffn-wide tensors per token for it: gate (for SiLU's derivative), silu(gate) and up (for the
product's), and their product h (the down projection's input, for its weight gradient). Only gate
and up are needed: backward recomputes silu(gate) and h from them, one layer at a time, so the
layer keeps two ffn-wide tensors instead of four.

``swiglu_down(gate, up, weight, bias)`` is ``F.linear(F.silu(gate) * up, weight, bias)`` computed
with the same ops as HuggingFace's LlamaMLP, so its output is theirs bit for bit, and its
backward is autograd's ops on the recomputed tensors (``aten.silu_backward`` included), so the
gradients are too. Under autocast the down projection's weight is cast to the autocast dtype, as
F.linear does.

On CUDA the elementwise parts (h = silu(gate) * up forward; d_gate, d_up from dh = grad @ W_down
backward) run as Triton kernels (tempo/kernels/swiglu.py) that recompute silu in registers and
round where these ops round; the matmuls stay with cuBLAS. The PyTorch path here is their reference.
Backward in both: h is recomputed for the down weight's gradient and dropped before dh exists, so
at most two ffn-wide temporaries live at once besides the outputs (on CUDA one: d_gate is written
over dh).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._common import check_float, use_triton


def _hidden(gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(silu(gate), silu(gate) * up), as LlamaMLP computes them."""
    act = F.silu(gate)
    return act, act * up


def swiglu_forward_torch(gate: Tensor, up: Tensor) -> Tensor:
    """h = silu(gate) * up with LlamaMLP's ops (PyTorch path; the reference for the kernel)."""
    return _hidden(gate, up)[1]


def swiglu_backward_torch(dh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(d gate, d up) from dh = grad @ W_down with autograd's ops (PyTorch path; the reference for
    the kernel). silu(gate) is dropped before dh * up is formed: two ffn-wide temporaries at most."""
    dup = dh * F.silu(gate)
    return torch.ops.aten.silu_backward(dh * up, gate), dup


def swiglu_hidden(gate: Tensor, up: Tensor) -> Tensor:
    """h = silu(gate) * up: the Triton kernel on CUDA, else the PyTorch path."""
    if use_triton(gate, up, float64=True):
        from ..kernels.swiglu import swiglu_fwd_triton

        return swiglu_fwd_triton(gate, up)
    return swiglu_forward_torch(gate, up)


@torch.library.custom_op("tempo::swiglu_down", mutates_args=())
def swiglu_down_op(gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(swiglu_hidden(gate, up), weight, bias)


@swiglu_down_op.register_fake
def _(gate, up, weight, bias):
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


@torch.library.custom_op("tempo::swiglu_down_bwd", mutates_args=())
def swiglu_down_bwd(grad: Tensor, gate: Tensor, up: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(d gate, d up, d weight) from the kept gate and up (silu(gate) and h recomputed)."""
    h = swiglu_hidden(gate, up)
    dweight = grad.reshape(-1, grad.shape[-1]).t().matmul(h.reshape(-1, h.shape[-1]))
    del h  # dead before dh exists: one ffn-wide tensor fewer at the backward's peak
    dh = grad.matmul(weight)  # the linear's input gradient
    if use_triton(dh, gate, up, float64=True):
        from ..kernels.swiglu import swiglu_bwd_triton

        dgate, dup = swiglu_bwd_triton(dh, gate, up, overwrite_dh=True)  # dh is ours, dead after
        return dgate, dup, dweight
    dgate, dup = swiglu_backward_torch(dh, gate, up)
    return dgate, dup, dweight


@swiglu_down_bwd.register_fake
def _(grad, gate, up, weight):
    return gate.new_empty(gate.shape), up.new_empty(up.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    gate, up, weight, bias = inputs
    ctx.save_for_backward(gate, up, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad: Tensor):
    gate, up, weight = ctx.saved_tensors
    dgate, dup, dweight = swiglu_down_bwd(grad.contiguous(), gate, up, weight)
    dbias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
    return dgate, dup, dweight, dbias


swiglu_down_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu_down(gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(F.silu(gate) * up, weight, bias)`` keeping only gate and up for backward.
    gate, up: [..., F]; weight: [H, F] (the down projection's); bias: [H] or None."""
    for name, t in (("gate", gate), ("up", up), ("weight", weight)):
        check_float(f"swiglu_down {name}", t)
    if bias is not None:
        check_float("swiglu_down bias", bias)
    device = gate.device.type
    if torch.is_autocast_enabled(device):  # the down projection runs in the autocast dtype, as F.linear
        dtype = torch.get_autocast_dtype(device)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    if gate.shape != up.shape or gate.dim() < 1:
        raise ValueError(f"gate and up must have one shape, got {list(gate.shape)} and {list(up.shape)}")
    if weight.dim() != 2 or weight.shape[1] != gate.shape[-1]:
        raise ValueError(
            f"weight must be [hidden, ffn] with ffn = gate's last dim {gate.shape[-1]}, "
            f"got {list(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}] (the weight's rows), got {list(bias.shape)}")
    if not (gate.dtype == up.dtype == weight.dtype) or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(
            f"gate, up, weight (and bias) must share a dtype, got {gate.dtype}, {up.dtype}, {weight.dtype}"
            + ("" if bias is None else f", {bias.dtype}")
        )
    with torch.autocast(device, enabled=False):
        return swiglu_down_op(gate.contiguous(), up.contiguous(), weight, bias)


class TempoSwiGLUMLP(torch.nn.Module):
    """A Llama-family MLP (``down(silu(gate(x)) * up(x))``) whose tail is ``swiglu_down``: the same
    three projection modules (parameters shared), two ffn-wide tensors kept instead of four."""

    def __init__(
        self, gate_proj: torch.nn.Linear, up_proj: torch.nn.Linear, down_proj: torch.nn.Linear
    ) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: Tensor) -> Tensor:
        return swiglu_down(self.gate_proj(x), self.up_proj(x), self.down_proj.weight, self.down_proj.bias)
