"""Micro-benchmarks: each Tempo op forward+backward against PyTorch eager, same shapes.

On CPU (default suite) benchmarks are disabled and each case runs once as a smoke test; the
GPU check (`nox -s gpu_check`) times them at BERT-Large sizes with --benchmark-enable and saves
the JSON (machine, commit, timings) under artifacts/tempo_layer/results/.
"""

from __future__ import annotations

import pytest
import torch

import tempo

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# BERT-Large, batch 8, seq 512 on GPU; tiny on CPU (a smoke test only).
B, S, H, A = (8, 512, 1024, 16) if DEVICE == "cuda" else (2, 64, 128, 4)
DTYPE = torch.bfloat16


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _cases():
    def gelu(impl):
        x = torch.randn(B, S, 4 * H, device=DEVICE, dtype=DTYPE, requires_grad=True)
        fn = tempo.gelu if impl == "tempo" else torch.nn.functional.gelu
        return lambda: fn(x).backward(torch.ones_like(x))

    def layernorm(impl):
        x = torch.randn(B, S, H, device=DEVICE, dtype=DTYPE, requires_grad=True)
        ln = torch.nn.LayerNorm(H, device=DEVICE, dtype=DTYPE)
        mod = tempo.TempoLayerNorm.from_layernorm(ln) if impl == "tempo" else ln
        return lambda: mod(x).backward(torch.ones_like(x))

    def dropout(impl):
        x = torch.randn(B, S, H, device=DEVICE, dtype=DTYPE, requires_grad=True)
        fn = tempo.dropout if impl == "tempo" else torch.nn.functional.dropout
        return lambda: fn(x, 0.1, True).backward(torch.ones_like(x))

    def attention(impl):
        shape = (B, A, S, H // A)
        q, k, v = (torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))

        def eager():
            s = q @ k.transpose(-1, -2) * (H // A) ** -0.5
            p = torch.nn.functional.dropout(torch.softmax(s, -1), 0.1, True)
            (p @ v).sum().backward()

        def ours():
            tempo.scaled_dot_product_attention(q, k, v, None, dropout_p=0.1)[0].sum().backward()

        return ours if impl == "tempo" else eager

    return {"gelu": gelu, "layernorm": layernorm, "dropout": dropout, "attention": attention}


@pytest.mark.parametrize("impl", ["tempo", "torch"])
@pytest.mark.parametrize("op", ["gelu", "layernorm", "dropout", "attention"])
def test_fwd_bwd(benchmark, op, impl):
    step = _cases()[op](impl)
    benchmark.group = f"{op} fwd+bwd {DEVICE} {str(DTYPE).removeprefix('torch.')} B{B} S{S} H{H}"

    def run():
        step()
        _sync()

    benchmark.pedantic(run, rounds=20 if DEVICE == "cuda" else 1, warmup_rounds=3 if DEVICE == "cuda" else 0)
