"""Tempo inside megatron-core: a GPT layer spec whose layers keep what Tempo's layers keep for
backward (Andoorveedu et al., NeurIPS 2022, arXiv 2210.10246), built on megatron-core's local
(non-Transformer-Engine) spec, so tensor and sequence parallelism, initialisation, pipeline
stages and recomputation apply unchanged:

* the norms (LayerNorm or RMSNorm) keep their output, which the next linear layer keeps anyway,
  instead of their input (Tempo §3.2; ``TempoLayerNorm``, ``TempoRMSNorm``);
* the MLP's GELU keeps its output and one bit an element instead of its input (§3.1), and a
  SwiGLU MLP keeps gate and up only, its product recomputed for the down projection (beyond the
  paper: ``swiglu_down``);
* the attention core keeps the softmax output and V, not the dropout mask nor the dropped-out
  probabilities (§3.3): scores scaled and masked as megatron-core's ``DotProductAttention`` does;
* the dropouts after attention and after the MLP keep a seed instead of a mask: the mask is
  regenerated in backward (``tempo.dropout``).

Under sequence parallelism a norm runs on this rank's sequence shard (a norm is per token) and its
weights are marked ``sequence_parallel``: their gradients are partial sums over the TP group, to be
summed as megatron-core's ``finalize_model_grads`` sums Transformer Engine's norms' (mist.engine.run
does). megatron-core's own torch norm refuses sequence parallelism.

Dropout seeds come from torch's CPU generator, drawn where megatron-core draws its masks (inside the
tensor-parallel RNG tracker's fork for the attention dropout and, under sequence parallelism, for
the whole block). On a CPU (mist.engine.cpu_shim) that fork switches the CPU generator, so the seeds
differ between TP ranks exactly where megatron-core's masks do; on GPUs the fork switches the CUDA
generator only, and TP ranks draw the same seed (their masks then fall on different heads or
sequence shards: the same pattern, not the same elements). Gradients are exact either way.

    from tempo.megatron import tempo_layer_spec
    model = GPTModel(config, tempo_layer_spec("LayerNorm"), vocab_size, max_sequence_length)
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops.attention import attention_core
from .ops.dropout import dropout
from .ops.gelu import gelu
from .ops.layernorm import TempoLayerNorm
from .ops.rmsnorm import TempoRMSNorm
from .ops.swiglu import swiglu_down

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
MASKED_SCORE = -10000.0  # megatron-core's attention_mask_func fills masked scores with this


def tempo_layer_spec(normalization: str = "LayerNorm"):
    """megatron-core's local GPT layer spec with Tempo's norms, MLP, attention core and dropouts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    spec = get_gpt_layer_local_spec(normalization=normalization)
    attention = spec.submodules.self_attention
    core = replace(attention.submodules, core_attention=_attention_class())
    attention = replace(attention, submodules=core)
    norm = _norm_spec(normalization)
    submodules = replace(
        spec.submodules,
        input_layernorm=norm,
        self_attention=attention,
        self_attn_bda=tempo_bias_dropout_add,
        pre_mlp_layernorm=norm,
        mlp=replace(spec.submodules.mlp, module=_mlp_class()),
        mlp_bda=tempo_bias_dropout_add,
    )
    return replace(spec, submodules=submodules)


def tempo_block_spec(normalization: str, layers: int):
    """A decoder of ``layers`` Tempo layers whose final norm is Tempo's too (megatron-core's
    default final norm would keep its input and refuse sequence parallelism)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(
        layer_specs=[tempo_layer_spec(normalization)] * layers, layer_norm=_norm_spec(normalization)
    )


def _norm_spec(normalization: str):
    """TempoNorm, told the spec's normalization (held against the config's when built)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=TempoNorm, params={"normalization": normalization})


class TempoNorm:
    """Tempo's LayerNorm or RMSNorm, as ``config.normalization`` says, its weights marked for the
    TP-group sum of their gradients under sequence parallelism. Built by megatron-core's
    build_module with its norms' arguments."""

    def __new__(
        cls, config, hidden_size: int, eps: float = 1e-5, normalization: str | None = None, **_unused
    ):
        if getattr(config, "layernorm_zero_centered_gamma", False):  # weight + 1 in megatron's norms
            raise ValueError(
                "Tempo's norms take the weight as it is stored, not zero-centred: "
                "layernorm_zero_centered_gamma must be False with the Tempo spec"
            )
        if normalization is not None and normalization != config.normalization:
            raise ValueError(
                f"the Tempo spec was made for {normalization}, the config says {config.normalization!r}"
            )
        if config.normalization == "LayerNorm":
            norm = TempoLayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = TempoRMSNorm(hidden_size, eps=eps).to(config.params_dtype)
        else:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {config.normalization!r}")
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def tempo_bias_dropout_add(training: bool, fused: bool):
    """megatron-core's ``get_bias_dropout_add`` with Tempo's dropout: residual + dropout(x + bias),
    keeping a seed, not a mask (``fused`` is megatron-core's kernel choice; the math is the same)."""

    def bias_dropout_add(x_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, prob: float) -> Tensor:
        x, bias = x_with_bias
        residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)  # as megatron-core
        if bias is not None:
            x = x + bias
        return residual + dropout(x, prob, training)

    return bias_dropout_add


@functools.cache
def _attention_class():
    """The core attention class, defined on first use: importing megatron-core is not import-time
    work."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class TempoDotProductAttention(DotProductAttention):
        """megatron-core's unfused core attention, dropout(softmax(scale q k^T, masked)) v, keeping
        the softmax output and v only (``tempo.attention_core``)."""

        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            if getattr(config, "window_size", None) is not None:
                raise ValueError("the Tempo attention core takes full causal attention, not a sliding window")
            if config.apply_query_key_layer_scaling:  # megatron-core rescales in its fp32 softmax
                raise ValueError(
                    "the Tempo attention core takes no query-key layer scaling "
                    "(apply_query_key_layer_scaling=False)"
                )
            if getattr(config, "softmax_type", "vanilla") != "vanilla":
                raise ValueError(
                    f"the Tempo attention core takes the plain softmax, not {config.softmax_type!r}"
                )

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("the Tempo attention core takes no packed sequences and no attention bias")
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
                key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
            sq, sk = scores.shape[-2:]
            if attention_mask is None and sq > 1:  # the causal mask megatron-core makes when given none
                attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
            if attention_mask is not None:
                scores = scores.masked_fill(attention_mask, MASKED_SCORE)
            p = self.config.attention_dropout
            # as megatron-core draws its mask: in the TP RNG tracker's fork unless the whole block is
            if self.config.sequence_parallel:
                context, _ = attention_core(scores, v, p, self.training)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    context, _ = attention_core(scores, v, p, self.training)
            # [b, heads, s, d] -> [s, b, heads * d]
            context = context.permute(2, 0, 1, 3).contiguous()
            return context.view(*context.shape[:2], self.hidden_size_per_partition)

    return TempoDotProductAttention


class _UnknownMlpNotice(logging.Filter):
    """Drops megatron-core's notice that a layer's MLP is not its own MLP class (``_mlp_class``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type:")


@functools.cache
def _mlp_class():
    """The MLP class, defined on first use (as ``_attention_class``)."""
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.mlp import MLP

    # megatron-core's layer passes its TP group to an MLP whose class is MLP itself and, for any
    # other class, logs "Unknown MLP type ... Using default kwargs" at every layer it builds;
    # TempoMLP without the group takes the default one, which is that group. The notice names
    # only the spec's class (ModuleSpec), so this drops it for any MLP class in the process
    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_UnknownMlpNotice())

    class TempoMLP(MLP):
        """megatron-core's MLP with GELU keeping its output and one bit an element, or SwiGLU
        (gated, SiLU) fused with the down projection's saved input: the same linear layers and
        tensor parallelism, the activation's saved tensors Tempo's."""

        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            act, gated = config.activation_func, config.gated_linear_unit
            if not ((act is F.gelu and not gated) or (act is F.silu and gated)):
                raise ValueError(
                    "the Tempo MLP takes GELU (activation_func=F.gelu, not gated) or SwiGLU "
                    f"(activation_func=F.silu, gated_linear_unit=True), got {act} with gated={gated}"
                )
            if act is F.gelu and config.bias_activation_fusion:  # megatron-core's fused one is tanh's
                raise ValueError(
                    "the Tempo MLP's GELU is exact: set bias_activation_fusion=False "
                    "(megatron-core's fused bias-GELU is the tanh approximation)"
                )
            if config.activation_func_clamp_value is not None or config.glu_linear_offset != 0.0:
                raise ValueError("the Tempo MLP's SwiGLU is silu(gate) * up: no clamp, no linear offset")

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if per_token_scale is not None:
                raise ValueError("the Tempo MLP is not a mixture-of-experts expert (no per-token scale)")
            fc1, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                fc1 = fc1 + bias
            if not self.config.gated_linear_unit:
                return self.linear_fc2(gelu(fc1))
            gate, up = torch.chunk(fc1, 2, dim=-1)  # megatron-core's order: the gate first
            fc2 = self.linear_fc2
            partial = swiglu_down(gate, up, fc2.weight)  # this rank's share of the down projection
            # reduced over the TP group as RowParallelLinear reduces it
            if fc2.sequence_parallel:
                out = reduce_scatter_to_sequence_parallel_region(partial, group=fc2.tp_group)
            else:
                out = reduce_from_tensor_model_parallel_region(partial, group=fc2.tp_group)
            if fc2.skip_bias_add or fc2.bias is None:
                return out, fc2.bias
            return out + fc2.bias, None

    return TempoMLP
