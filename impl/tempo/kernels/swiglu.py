"""Triton kernels for the elementwise parts of Tempo's SwiGLU (see tempo/ops/swiglu.py): the
matmuls around them stay with cuBLAS.

Forward: h = silu(gate) * up. Backward: from dh (the down projection's input gradient), gate and up,
d_up = dh * silu(gate) and d_gate = silu'(gate) * (dh * up), silu recomputed in registers. Each
rounds where the PyTorch path (LlamaMLP's ops and aten.silu_backward) rounds: silu(gate) and
dh * up are tensors of the input dtype there, so they are rounded to it here before the next
product; the math runs in float32 (float64 for float64), with silu as x / (1 + exp(-x)) and its
derivative as s (1 + x (1 - s)), torch's formulas, so +-inf and NaN come out as torch's do.
Divisions are correctly rounded as torch's are (Triton's float32 ``/`` is approximate on the GPU);
``tl.exp`` is not (a few float32 ulps on the GPU), which shows in float32 outputs only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import div_rn

BLOCK = 1024  # elements per program


@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, h_ptr, n, F64: tl.constexpr, BLOCK: tl.constexpr):
    # int64 offsets: an ffn-wide activation can hold more than 2^31 elements
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    f = tl.float64 if F64 else tl.float32
    x = tl.load(gate_ptr + offs, mask=inside, other=0.0).to(f)
    u = tl.load(up_ptr + offs, mask=inside, other=0.0).to(f)
    act = div_rn(x, 1.0 + tl.exp(-x), F64).to(gate_ptr.dtype.element_ty).to(f)
    tl.store(h_ptr + offs, (act * u).to(h_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_bwd_kernel(
    dh_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, F64: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    f = tl.float64 if F64 else tl.float32
    dt = gate_ptr.dtype.element_ty
    dh = tl.load(dh_ptr + offs, mask=inside, other=0.0).to(f)
    x = tl.load(gate_ptr + offs, mask=inside, other=0.0).to(f)
    u = tl.load(up_ptr + offs, mask=inside, other=0.0).to(f)
    s = div_rn(1.0, 1.0 + tl.exp(-x), F64)
    act = div_rn(x, 1.0 + tl.exp(-x), F64).to(dt).to(f)  # F.silu's own formula, not x * s
    tl.store(dup_ptr + offs, (dh * act).to(dup_ptr.dtype.element_ty), mask=inside)
    dh_up = (dh * u).to(dt).to(f)
    tl.store(
        dgate_ptr + offs, (dh_up * s * (1.0 + x * (1.0 - s))).to(dgate_ptr.dtype.element_ty), mask=inside
    )


def _check(*tensors: torch.Tensor) -> None:
    # The rounding points assume one dtype (swiglu_down guarantees it); mixed ones would need
    # torch's type promotion at each of them.
    if len({t.dtype for t in tensors}) != 1 or len({t.shape for t in tensors}) != 1:
        raise ValueError(
            "swiglu kernels take tensors of one shape and dtype, got "
            + ", ".join(f"{list(t.shape)} {t.dtype}" for t in tensors)
        )


def swiglu_fwd_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up in gate's dtype (one shape and dtype for both)."""
    _check(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    n = gate.numel()
    _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, h, n, F64=gate.dtype == torch.float64, BLOCK=BLOCK)
    return h


def swiglu_bwd_triton(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, overwrite_dh: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) from dh = grad_out @ W_down and the kept gate and up.

    ``overwrite_dh``: write d_gate over ``dh`` (each element is read before it is written), so the
    backward holds one ffn-wide tensor fewer; ``dh`` must then be a contiguous temporary the caller
    no longer needs."""
    _check(dh, gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    if overwrite_dh and not dh.is_contiguous():
        raise ValueError("overwrite_dh needs a contiguous dh")
    dh = dh.contiguous()
    dgate = dh if overwrite_dh else torch.empty_like(gate)
    dup = torch.empty_like(up)
    n = gate.numel()
    _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](
        dh, gate, up, dgate, dup, n, F64=gate.dtype == torch.float64, BLOCK=BLOCK
    )
    return dgate, dup
