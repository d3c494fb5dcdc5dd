"""Tempo's ops: one file each (math, custom op, autograd); kernels live in tempo/kernels.

``workspace_bytes`` says how much transient memory an op call needs besides its inputs and
outputs, so the fake-tensor memory estimator (measure/memory.py), which cannot see inside a
custom op, can add it: pass it as the estimator's ``op_workspace``. On CUDA (Triton kernels)
that is what the kernels' wrappers allocate; on CPU it is the chunked PyTorch path's bound
(chunks of CHUNK_ELEMS elements, at most cpu_bytes_per_chunk_elem(op) bytes of temporaries per
element of a chunk; the attention core's and SwiGLU's, in numbers, in tempo.sizes).
"""

from __future__ import annotations

import itertools
import math

import torch

from ..layernorm_rows import ROWS_PER_PROGRAM
from ..sizes import (
    CHUNK_ELEMS,
    DW_BLOCK_BYTES_PER_ELEM,
    attention_core_workspace_bytes,
    dw_block_rows,
    swiglu_down_workspace_bytes,
)

# Upper bounds on the PyTorch path's live temporaries per element of a chunk, measured with the
# profiler and checked in tests/measure/test_measure.py (largest: the GELU backward's Newton solve with
# both branches alive, ~77 B; every other op stays under 35 B).
CPU_BYTES_PER_CHUNK_ELEM = {"tempo::gelu_bwd": 96}
CPU_BYTES_PER_CHUNK_ELEM_DEFAULT = 40


def cpu_bytes_per_chunk_elem(op_name: str) -> int:
    return CPU_BYTES_PER_CHUNK_ELEM.get(op_name, CPU_BYTES_PER_CHUNK_ELEM_DEFAULT)


def _cpu_chunk_bytes(op_name: str, numel: int) -> int:
    return min(numel, CHUNK_ELEMS) * cpu_bytes_per_chunk_elem(op_name)


# The ops whose kernels compute in float64 (their use_triton(..., float64=True)); on CUDA every
# other op takes its PyTorch path for float64 tensors, and is priced as that path
FLOAT64_KERNEL_OPS = (
    "tempo::rms_norm_fwd",
    "tempo::rms_norm_bwd",
    "tempo::swiglu_down",
    "tempo::swiglu_down_bwd",
)


def _path(op_name: str, args: tuple, target: str) -> str:
    """The path a call of ``op_name`` takes on ``target``: 'cuda' (the kernels) or 'cpu' (the
    PyTorch path, which CUDA takes too for float64, tensors or the attention core's scores' dtype,
    where the op's kernels compute in float32)."""
    if target != "cuda" or op_name in FLOAT64_KERNEL_OPS:
        return target
    float64 = any(
        a is torch.float64 or (isinstance(a, torch.Tensor) and a.dtype == torch.float64) for a in args
    )
    return "cpu" if float64 else "cuda"


def value_flattens(value: torch.Tensor) -> bool:
    """Whether V (..., Sk, Dv) is one batch of matrices as a view: else torch.matmul, and the CPU
    path's reshape, copy it first (HF's transposed V: (B, S, H, D) seen as (B, H, S, D))."""
    if value.numel() == 0:  # any strides view as any shape
        return True
    # the rule of view(): each leading dim of more than one element steps over the next one's
    leading = [(n, st) for n, st in zip(value.shape[:-2], value.stride()[:-2], strict=True) if n > 1]
    return all(st == inner_st * inner_n for (_, st), (inner_n, inner_st) in itertools.pairwise(leading))


def workspace_bytes(op_name: str, args: tuple, kwargs: dict, target: str) -> int:
    """Transient bytes of one call of ``op_name`` when it runs on ``target`` ('cuda' or 'cpu')."""
    if not op_name.startswith("tempo::"):  # another library's op: not ours to price
        return 0
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return 0
    first = tensors[0]
    target = _path(op_name, args, target)
    on_cuda = target == "cuda"
    if op_name in ("tempo::attention_core", "tempo::attention_core_bwd"):
        forward = op_name == "tempo::attention_core"
        # forward: (scores, value, p, seed); backward: (grad_out, grad_probs, probs, value, p, seed,
        # scores_dtype)
        if forward:
            probs, value, p, scores_dtype = args[0], args[1], args[2], args[0].dtype
        else:
            probs, value, p, scores_dtype = args[2], args[3], args[4], args[6]
        dropout, differs = float(p) > 0.0, scores_dtype != value.dtype
        copied = 0 if value_flattens(value) else value.numel() * value.element_size()
        return attention_core_workspace_bytes(
            tuple(probs.shape), value.element_size(), dropout, target, forward, differs, copied
        )
    if op_name in ("tempo::linear_cross_entropy", "tempo::linear_cross_entropy_bwd"):  # no kernel: chunks
        forward = op_name == "tempo::linear_cross_entropy"
        h, weight, rows_per_chunk = (args[0], args[1], args[3]) if forward else (args[1], args[2], args[4])
        chunk = min(h.shape[0], int(rows_per_chunk))
        # a chunk's logits in h's dtype and in float32, and torch's log-softmax of them (float32);
        # backward also its copy in h's dtype for the matmuls (checked by tests/measure)
        per_logit = h.element_size() + 4 + 4 + (0 if forward else h.element_size())
        logits = chunk * weight.shape[0] * per_logit
        if forward or weight.element_size() > 2:
            return logits
        # a 16-bit dW: its float32 sum over the chunks, and one block's product with its float32
        # copy, made before the dW output exists (whose bytes the caller counts)
        vocab, hidden = weight.shape
        block = dw_block_rows(vocab, hidden) * hidden * DW_BLOCK_BYTES_PER_ELEM
        return logits + vocab * hidden * 4 + max(0, block - vocab * hidden * weight.element_size())
    if op_name == "tempo::layer_norm_bwd" and on_cuda:
        d = args[3].numel()
        rows = first.numel() // max(d, 1)
        return 2 * math.ceil(rows / ROWS_PER_PROGRAM) * d * 4  # per-program dgamma/dbeta partials (float32)
    if op_name == "tempo::rms_norm_bwd" and on_cuda:  # (grad, y, rstd, weight)
        d = args[3].numel()
        rows = first.numel() // max(d, 1)
        math_bytes = 8 if args[1].dtype == torch.float64 else 4
        return math.ceil(rows / ROWS_PER_PROGRAM) * d * math_bytes  # per-program dgamma partials
    if op_name in ("tempo::swiglu_down", "tempo::swiglu_down_bwd"):  # gate = args[1] in backward
        forward = op_name == "tempo::swiglu_down"
        gate = args[0] if forward else args[1]
        return swiglu_down_workspace_bytes(gate.numel() * gate.element_size(), target, forward)
    if on_cuda:
        return 0
    return _cpu_chunk_bytes(op_name, first.numel())
