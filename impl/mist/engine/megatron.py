"""A plan in Megatron's terms: the one translation of a Plan and its ModelSpec into megatron-core's
settings, and the one list of what a Megatron model cannot be built as.

``mist.engine.run`` (which builds megatron-core models) and ``mist.export`` (which writes
Megatron-LM's command line from these settings) both read it, each adding only what its own
runtime cannot do. Torch-free: the
activation is named, not a function.
"""

from __future__ import annotations

from ..model.specs import ModelSpec
from ..plan import Plan


def model_settings(plan: Plan, model: ModelSpec) -> dict[str, object]:
    """megatron-core's settings (TransformerConfig fields, and GPTModel's ``vocab_size``,
    ``max_sequence_length``, ``position_embedding_type``) that the plan and the model decide (its
    stages' TP and DP lifted to the plan's level where all stages share them)."""
    plan = plan.with_stage_parallelism_lifted()
    layers = [s.layers for s in plan.stages]
    uneven = len(layers) > 1 and len(set(layers)) > 1
    return {
        "num_layers": model.layers,
        "hidden_size": model.hidden,
        "num_attention_heads": model.heads,
        "num_query_groups": model.kv,
        "ffn_hidden_size": model.ffn_hidden,
        "add_bias_linear": False,  # the priced layers have no biases
        "normalization": "RMSNorm" if model.norm == "rmsnorm" else "LayerNorm",
        "gated_linear_unit": model.gated_mlp,
        "activation": "silu" if model.gated_mlp else "gelu",
        "hidden_dropout": model.dropout,
        "attention_dropout": model.dropout,
        "tensor_model_parallel_size": plan.tp,
        "pipeline_model_parallel_size": len(plan.stages),
        "sequence_parallel": plan.sequence_parallel and plan.tp > 1,
        "num_layers_in_first_pipeline_stage": layers[0] if uneven else None,
        "num_layers_in_last_pipeline_stage": layers[-1] if uneven else None,
        "position_embedding_type": "rope" if model.positions == "rotary" else "learned_absolute",
        "max_sequence_length": model.seq,
        "vocab_size": model.vocab,
        # Megatron-LM's defaults where megatron-core's dataclass has others (arguments.py lists
        # them as "incompatible defaults"): the softmax in the activations' precision, and
        # SwiGLU fused (--bias-swiglu-fusion; GeLU's fusion needs biases). Both change what
        # a layer keeps for backward, and the memory model prices what Megatron-LM builds.
        "attention_softmax_in_fp32": False,
        "bias_activation_fusion": model.gated_mlp,
    }


def megatron_limits(plan: Plan, model: ModelSpec) -> dict[str, str]:
    """What a Megatron GPT model cannot be built as for ``plan``, by name (empty: it can). The names
    let a runtime that builds a part itself (mist.engine.run's parallel block) drop that one.
    Stages that all share a TP and DP other than the plan's are that plan with them lifted."""
    plan = plan.with_stage_parallelism_lifted()
    limits = {}
    if model.parallel_block:
        limits["parallel_block"] = (
            "attention and MLP in parallel on one norm (Falcon): Megatron's layer runs them in sequence, "
            "a different model from the one priced (`parallel_block: false` in model_overrides plans the "
            "sequential one)"
        )
    if any((s.tp or plan.tp, s.dp or plan.dp) != (plan.tp, plan.dp) for s in plan.stages):
        limits["stage_parallelism"] = (
            "stages with TP/DP of their own that differ (Megatron uses one TP and DP for all stages)"
        )
    if plan.pre_post is not None:
        limits["pre_post"] = (
            "a strategy of the embedding/head's own (pre_post; Megatron's follow their stage's)"
        )
    layers = [s.layers for s in plan.stages]
    if len(set(layers[1:-1])) > 1:
        limits["uneven_middle_stages"] = (
            f"uneven middle stages {layers} (Megatron: only the first and last may differ)"
        )
    if model.tempo:
        limits["tempo"] = "Tempo's layers (tempo.megatron's spec; Megatron-LM builds its own layers)"
    if any(s.offload_weights or s.offload_grads for s in plan.stages):
        limits["offload_weights_grads"] = "CPU offloading of weights or gradients"
    return limits
