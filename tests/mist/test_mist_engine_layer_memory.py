"""What a megatron-core layer, built as the engine builds it, keeps for backward: exactly the
bytes the symbolic trace counts (mist.model.symbolic), with two stated CPU-side terms.

The memory model prices what Megatron-LM builds; the engine builds the same (its defaults where
megatron-core's differ: mist.engine.megatron.model_settings). The negative control is the layer
with megatron-core's own defaults (softmax in float32, SwiGLU unfused), which keeps more.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from measure.saved import SavedTensorsMeter
from mist import Plan, StagePlan, cluster, model
from mist.model.symbolic import FP32, b, layer_costs, numeric, s, t, trace_layer

CASES = [  # (preset, overrides): learned positions + GeLU; rotary + SwiGLU; the parallel block
    ("gpt3-tiny", {"dropout": 0.0}),
    ("gpt3-tiny", {"dropout": 0.1}),
    ("llama-tiny", {}),
    ("llama-tiny", {"parallel_block": True}),
    ("gpt3-tiny", {"dropout": 0.1, "tempo": True}),  # Tempo's layers (tempo.megatron)
    ("llama-tiny", {"tempo": True}),
]


def _kept_bytes(name: str, overrides: dict, micro_batch: int, megatron_core_defaults: bool = False) -> int:
    """Bytes one layer's forward keeps for backward (each storage once), the causal mask excepted:
    it is the model's, one for all layers."""
    from megatron.core.models.gpt import GPTModel

    from mist.engine.layers import block_spec
    from mist.engine.megatron import model_settings
    from mist.engine.profiler.megatron_layer import megatron_state
    from mist.engine.run import _config

    m = model(name, hidden=256, seq=128, flash=False, **overrides)
    plan = Plan.of(
        m,
        cluster("cpu", 1),
        stages=[StagePlan(layers=1)],
        global_batch=micro_batch,
        tp=1,
        dp=1,
        micro_batch=micro_batch,
    )
    settings = model_settings(plan, m)
    with megatron_state():
        config = _config(m, plan, torch.bfloat16)
        if megatron_core_defaults:
            config = dataclasses.replace(config, attention_softmax_in_fp32=True, bias_activation_fusion=False)
        spec = block_spec(settings["normalization"], m.parallel_block, 1, m.tempo)
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=m.vocab,
            max_sequence_length=m.seq,
            pre_process=True,
            post_process=True,
            share_embeddings_and_output_weights=False,
            position_embedding_type=settings["position_embedding_type"],
        ).train()
        layer = gpt.decoder.layers[0]
        x = torch.randn(m.seq, micro_batch, m.hidden, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(1, 1, m.seq, m.seq, dtype=torch.bool).tril().logical_not()
        rope = gpt.rotary_pos_emb(m.seq) if m.positions == "rotary" else None
        with SavedTensorsMeter(layer, inputs=(x, mask)) as meter:
            layer(x, attention_mask=mask, rotary_pos_emb=rope)
    report = meter.report()
    return report.total_bytes - mask.numel() * mask.element_size()


def _counted_bytes(name: str, overrides: dict, micro_batch: int) -> int:
    """The symbolic trace's bytes, and where torch on a CPU keeps otherwise than on a GPU:
    LayerNorm's mean and rstd in bf16 (CUDA's in float32), and megatron-core's unfused rotary
    embedding's cos and sin for q and for k (4 tables of s x head dim, bf16; the GPU's fused kernel
    keeps none). Dropout masks are a byte an element, as CUDA's: the engine's CPU stand-in
    (cpu_shim.one_byte_dropout_masks; torch's CPU dropout keeps one in the activations' dtype).
    Tempo's layers keep no dropout masks (its GELU's bits are bytes on every device) and float32
    rstd on every device, and one 8-byte seed a dropout (the attention core's always)."""
    m = model(name, hidden=256, seq=128, flash=False, **overrides)
    point = {**numeric(m), b: micro_batch, s: m.seq, t: 1}
    counted = int(layer_costs(m).saved_bytes.subs(point))
    ops = trace_layer(m)
    stats = [x for op in ops if op.kind == "norm" for x in op.saved if x.itemsize == FP32]
    layer_norm_stats = sum(int(x.numel.subs(point)) for x in stats) if m.norm == "layernorm" else 0
    rotary_tables = 4 * m.seq * (m.hidden // m.heads) * 2 if m.positions == "rotary" else 0
    if m.tempo:
        return counted + rotary_tables + 8 * (1 + 2 * (m.dropout > 0))
    return counted - layer_norm_stats * (FP32 - 2) + rotary_tables


@pytest.mark.parametrize(("name", "overrides"), CASES)
def test_a_megatron_layer_keeps_what_the_symbolic_trace_counts(name, overrides):
    micro_batch = random.randint(1, 4)
    assert _kept_bytes(name, overrides, micro_batch) == _counted_bytes(name, overrides, micro_batch)


@pytest.mark.parametrize(("name", "overrides"), [c for c in CASES if not c[1].get("tempo")])
def test_megatron_core_defaults_keep_more_than_counted(name, overrides):
    """Negative control: float32 softmax probabilities (4 more bytes a score) and, for SwiGLU,
    silu's output and a copy of the up projection."""
    micro_batch = random.randint(1, 4)
    kept = _kept_bytes(name, overrides, micro_batch, megatron_core_defaults=True)
    m = model(name, hidden=256, seq=128, flash=False, **overrides)
    scores = micro_batch * m.heads * m.seq**2
    assert kept >= _counted_bytes(name, overrides, micro_batch) + 2 * scores


@pytest.mark.parametrize(("name", "overrides"), [c for c in CASES if c[1].get("tempo")])
def test_megatron_core_layers_keep_more_than_tempo_counted(name, overrides):
    """Negative control of the Tempo cases: the same layer built of megatron-core's modules keeps
    at least each norm's input more (2 x tokens x hidden bf16) than Tempo's trace counts."""
    micro_batch = random.randint(1, 4)
    kept = _kept_bytes(name, {**overrides, "tempo": False}, micro_batch)
    m = model(name, hidden=256, seq=128, flash=False, **overrides)
    assert kept >= _counted_bytes(name, overrides, micro_batch) + 2 * micro_batch * m.seq * m.hidden * 2
