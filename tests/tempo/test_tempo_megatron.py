"""Tempo's megatron-core layer spec (tempo/megatron.py): the plain layer's output and gradients in
float64 at TP 1 and 2 (gloo), with and without sequence parallelism; exact gradients with dropout
(against a finite difference); and the bytes each keeps for backward equal to their closed forms.

The ranks run tests/tempo/megatron_check.py, forked from one process that imported megatron-core
(measure.fork_launch), one rank per TP rank."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from measure import fork_launch

from .megatron_check import BATCH, FFN, HEADS, HIDDEN, SEQ

pytest.importorskip("megatron.core")

E = 8  # float64 bytes
STATS = 8  # a norm's per-token statistics: float64 for float64 (float32 for narrower dtypes)
MASK = SEQ * SEQ  # the causal mask the layers are given ([1, 1, s, s] bool), saved by the masking
SEED = 8  # a dropout seed: one int64


def tempo_bytes(tp: int, sequence_parallel: bool, mlp: str, dropout: bool) -> int:
    """What a Tempo layer keeps on one rank, per layer, for n = s b tokens of hidden h, heads a,
    ffn f, TP t (norms on a 1/t sequence shard under sequence parallelism):

        2 (n h e + n r) / t_sp            two norms: output and rstd (not the input, nor the mean)
      + 3 n h e / t + b (a / t) s^2 e     q, k, v (one projection) and the softmax output P
      + mask + seed                       the attention mask; the attention dropout's seed
      + n h e / t                         the context (the output projection's input)
      + n f e / t + n f / (8 t)           GELU: its output (the down projection's input) and a bit
        or 2 n f e / t                    SwiGLU: gate and up (their product recomputed)
      + 2 seed                            with dropout: the two hidden dropouts' seeds (no masks)
    """
    n, shard = SEQ * BATCH, tp if sequence_parallel else 1
    norms = 2 * (n * HIDDEN * E + n * STATS) // shard
    attention = 3 * n * HIDDEN * E // tp + BATCH * HEADS // tp * SEQ * SEQ * E + MASK + SEED
    context = n * HIDDEN * E // tp
    act = n * FFN * E // tp + math.ceil(n * FFN / tp / 8) if mlp == "gelu" else 2 * n * FFN * E // tp
    return norms + attention + context + act + (2 * SEED if dropout else 0)


def plain_bytes(tp: int, sequence_parallel: bool, mlp: str, normalization: str) -> int:
    """What megatron-core's local layer (with norms that allow sequence parallelism) keeps on one
    rank, no dropout: each norm its input and statistics (LayerNorm mean and rstd, RMSNorm rstd)
    and its output (kept by the next linear layer), q, k, v, P, the mask and the context as Tempo's;
    GELU its input and output; SwiGLU (megatron-core 0.16's glu) the gate-and-up projection, silu(gate),
    up + offset (a copy) and their product."""
    n, shard = SEQ * BATCH, tp if sequence_parallel else 1
    stats = 2 if normalization == "LayerNorm" else 1
    norms = 2 * (2 * n * HIDDEN * E + stats * n * STATS) // shard
    attention = 3 * n * HIDDEN * E // tp + BATCH * HEADS // tp * SEQ * SEQ * E + MASK
    act = (2 if mlp == "gelu" else 5) * n * FFN * E // tp
    return norms + attention + n * HIDDEN * E // tp + act


CASES = [  # (TP, sequence parallel, MLP, normalization)
    (1, False, "gelu", "LayerNorm"),
    (1, False, "swiglu", "RMSNorm"),
    (2, False, "gelu", "LayerNorm"),
    (2, True, "gelu", "LayerNorm"),
    (2, True, "swiglu", "RMSNorm"),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("tp", "sequence_parallel", "mlp", "normalization"), CASES)
def test_tempo_megatron_layer_is_the_plain_layer_keeping_less(
    tmp_path, tp, sequence_parallel, mlp, normalization
):
    out = tmp_path / "check.json"
    args = [
        "--out",
        str(out),
        "--seed",
        str(random.randrange(2**31)),
        "--mlp",
        mlp,
        "--normalization",
        normalization,
        "--bias",
        *(["--sequence-parallel"] if sequence_parallel else []),
    ]
    launcher = fork_launch.shared("mist.engine.run:preload")
    done = launcher.run(tp, "tests.tempo.megatron_check", args, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    # float64 throughout: the same ops up to reassociation (attention's matmul and scale, the
    # norms' backward from the output), a few units of 2^-52 times the layer's depth of ops
    assert max(r["errors"].values()) < 1e-11, r["errors"]
    # a central difference of step 1e-5: truncation ~1e-10, cancellation ~1e-16 / 1e-5 (relative
    # to |dx| |direction|); a mask not regenerated exactly would be off by O(1)
    assert r["dropout_gradient_error"] < 1e-6, r
    assert r["dropout_changes_output_by"] > 0.05, r  # negative control: the dropouts drop
    assert r["tempo_bytes"] == tempo_bytes(tp, sequence_parallel, mlp, dropout=False), r
    assert r["tempo_dropout_bytes"] == tempo_bytes(tp, sequence_parallel, mlp, dropout=True), r
    assert r["plain_bytes"] == plain_bytes(tp, sequence_parallel, mlp, normalization), r
    assert r["tempo_bytes"] < 0.75 * r["plain_bytes"], r
    assert r["value_flattens"] and all(r["value_flattens"]), r  # no copy of V for the planner to price


def test_a_norm_spec_for_one_normalization_refuses_a_config_of_another():
    """The spec's normalization and the config's must agree (the probe's: a LayerNorm spec built
    RMSNorms silently from an RMSNorm config)."""
    from types import SimpleNamespace

    from tempo.megatron import TempoNorm

    config = SimpleNamespace(normalization="RMSNorm", params_dtype=None, sequence_parallel=False)
    with pytest.raises(ValueError, match="made for LayerNorm, the config says 'RMSNorm'"):
        TempoNorm(config, 8, normalization="LayerNorm")
    config.params_dtype = torch.float32
    norm = TempoNorm(config, 8, normalization="RMSNorm")
    assert type(norm).__name__ == "TempoRMSNorm" and norm.weight.sequence_parallel is False
    # megatron's norms compute with weight + 1 under this flag; Tempo's took the weight as stored
    config.layernorm_zero_centered_gamma = True
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma must be False"):
        TempoNorm(config, 8, normalization="RMSNorm")
