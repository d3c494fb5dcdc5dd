"""Sizes Tempo's ops work in, and the attention core's and SwiGLU's transient bytes, in plain
numbers.

No torch here: Mist's planner prices Tempo's layers with ``attention_core_workspace_bytes`` and
``swiglu_down_workspace_bytes`` without loading torch (``python -m mist plan`` stays
torch-free). ``tempo.ops.workspace_bytes`` applies the same functions to an op call's tensors
for the fake-tensor memory estimator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# The PyTorch paths work through big tensors in chunks of this many elements, so their
# temporaries (float32 upcasts, Newton iterates, masks) stay a few MB whatever the tensor size,
# as in the fused Triton kernels, which need none. A multiple of 8 (whole mask bytes).
CHUNK_ELEMS = 1 << 17

# The memory-lean loss sums a 16-bit dW over its row chunks in float32; each chunk's product is
# made this many bytes (in 16 bits) at a time: a block of vocab rows, big enough for the GEMM's
# speed. Adding it into the float32 sum makes a float32 copy of it on a CPU (measured), so a block
# holds 6 bytes an element while it is added.
DW_BLOCK_BYTES = 16 * 2**20
DW_BLOCK_BYTES_PER_ELEM = 2 + 4

# The attention core's PyTorch path, per element of a chunk of heads, by (forward, dropout): its
# float32 softmax or dP, the float32 copy of P, and with dropout the keep mask and the dropped-out
# P. Measured with the profiler, bf16: forward 8 and 14 B; backward 10 and 14 B, 12 without
# dropout when the returned P's gradient is added too (float32 less). Bound and tightness are
# checked in tests/measure/test_measure.py.
ATTENTION_CPU_BYTES_PER_CHUNK_ELEM = {
    (True, False): 8,
    (True, True): 16,
    (False, False): 12,
    (False, True): 16,
}


def dw_block_rows(vocab: int, hidden: int) -> int:
    """Vocab rows of a 16-bit loss chunk's dW product made at once (its transient: rows x hidden)."""
    return max(1, min(vocab, DW_BLOCK_BYTES // (2 * max(hidden, 1))))


def attention_heads_per_chunk(sq: int, sk: int) -> int:
    """Heads of (Sq, Sk) scores the attention core's PyTorch path takes at a time."""
    return max(1, CHUNK_ELEMS // max(sq * sk, 1))


def attention_core_workspace_bytes(
    probs_shape: Sequence[int],
    itemsize: int,
    dropout: bool,
    target: str,
    forward: bool,
    scores_dtype_differs: bool = False,
    value_copy_bytes: int = 0,
) -> int:
    """Transient bytes of the attention core's forward or backward besides its inputs and outputs,
    for probabilities of ``probs_shape`` (..., Sq, Sk) kept in ``itemsize`` bytes (V's dtype);
    ``scores_dtype_differs``: the scores' dtype (and their gradient's) is not V's;
    ``value_copy_bytes``: V's bytes where its leading dims do not flatten into one as a view (HF's
    V, a transposed (B, S, H, D)), so the batched matrix products work on a copy; 0 where they do
    (megatron-core's (S, B, H, D) permuted, as ``tempo.megatron`` passes it).

    CUDA (tempo/kernels/attention.py): the dropped-out P for cuBLAS, with dropout only, and in
    forward V's copy, made by the P @ V product; backward also dP_dropped where the scores' dtype
    differs (else dS is written over it), and not V's copy: it is freed with its product, before dV
    (its size) exists. CPU, the PyTorch path (which CUDA runs too for float64: give ``target``
    'cpu' then): one chunk of heads, and V's copy, which its reshape makes and holds through
    forward and backward."""
    numel = math.prod(probs_shape)
    if target == "cuda":
        dropped = numel * itemsize if dropout else 0
        if forward:
            return dropped + value_copy_bytes
        return dropped + (numel * itemsize if scores_dtype_differs else 0)
    sq, sk = probs_shape[-2:]
    chunk = min(numel, attention_heads_per_chunk(sq, sk) * sq * sk)
    return chunk * ATTENTION_CPU_BYTES_PER_CHUNK_ELEM[(forward, dropout)] + value_copy_bytes


def swiglu_down_workspace_bytes(ffn_bytes: int, target: str, forward: bool) -> int:
    """Transient bytes of ``swiglu_down``'s forward or backward besides its inputs and outputs,
    for gate and up of ``ffn_bytes`` each (not chunked: ffn-wide temporaries).

    CPU (PyTorch path): two ffn-wide tensors either way (forward silu(gate) and h; backward dh and
    silu(gate) or dh * up). CUDA (tempo/kernels/swiglu.py): forward h for the down projection;
    backward none (h is dropped before dh exists and d_gate is written over dh)."""
    if target != "cuda":
        return 2 * ffn_bytes
    return ffn_bytes if forward else 0
