"""The PyTorch paths' chunk loops make only scratch: their results go into tensors made before the
loop, so a device peak that leaves the loops' allocations out (tempo._common.CHUNK_SCRATCH, as
mist.engine.run's CPU peak does in place of Tempo's fused kernels) still counts every result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from measure.cpu_peak import cpu_peak_bytes
from tempo._common import CHUNK_ELEMS, CHUNK_SCRATCH, new_seed
from tempo.ops import attention, dropout, gelu, layernorm, rmsnorm

ROWS, WIDTH = 3 * CHUNK_ELEMS // 256, 256  # three chunks of rows (norms) or elements (the rest)


def _cases(rng: np.random.Generator) -> dict:
    def _bf16(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape)).to(torch.bfloat16)

    x, w, b = _bf16(ROWS, WIDTH), _bf16(WIDTH), _bf16(WIDTH)
    y, packed = gelu.gelu_forward_torch(x, "none")
    y_rms, rstd = rmsnorm.rms_norm_forward_torch(x, w, 1e-5)
    y_ln, ln_rstd = layernorm.layer_norm_forward_torch(x, w, b, 1, 1e-5)
    # attention: 6 (batch x head) rows of 128 x 128 scores: a chunk holds 8, so take 24 in 3 chunks
    scores, value = _bf16(24, 128, 128), _bf16(24, 128, 32)
    out, probs = attention.attention_core_fwd_torch(scores, value, 0.1, new_seed())
    return {
        "gelu forward": lambda: gelu.gelu_forward_torch(x, "none"),
        "gelu backward": lambda: gelu.gelu_backward_torch(x, y, packed, "none"),
        "gelu backward (table)": lambda: gelu.gelu_backward_table(x, y, packed, "none"),
        "rmsnorm forward": lambda: rmsnorm.rms_norm_forward_torch(x, w, 1e-5),
        "rmsnorm backward": lambda: rmsnorm.rms_norm_backward_torch(x, y_rms, rstd, w),
        "layernorm forward": lambda: layernorm.layer_norm_forward_torch(x, w, b, 1, 1e-5),
        "layernorm backward": lambda: layernorm.layer_norm_backward_torch(x, y_ln, ln_rstd, w, b, 1),
        "dropout": lambda: dropout.dropout_apply_torch(x, 0.1, new_seed()),
        "attention forward": lambda: attention.attention_core_fwd_torch(scores, value, 0.1, new_seed()),
        "attention backward": lambda: attention.attention_core_bwd_torch(
            out, probs, probs, value, 0.1, new_seed(), torch.bfloat16
        ),
    }


def _bytes(result) -> int:
    tensors = result if isinstance(result, tuple) else (result,)
    return sum(t.numel() * t.element_size() for t in tensors)


NAMES = (
    "gelu forward",
    "gelu backward",
    "gelu backward (table)",
    "rmsnorm forward",
    "rmsnorm backward",
    "layernorm forward",
    "layernorm backward",
    "dropout",
    "attention forward",
    "attention backward",
)


@pytest.mark.parametrize("name", NAMES)
def test_chunk_loops_make_only_scratch(name, rng):
    cases = _cases(rng)
    assert set(cases) == set(NAMES)
    call = cases[name]
    call()  # once before: the GELU table is made on first use and kept
    left_out, result = cpu_peak_bytes(call, exclude=(CHUNK_SCRATCH,))
    counted, _ = cpu_peak_bytes(call)
    assert left_out >= _bytes(result), (left_out, _bytes(result))  # every result counted
    assert counted > left_out, (counted, left_out)  # the control: the loops do make scratch
