"""megatron-core layer specs of the engine's own, for models megatron-core's specs do not build.

* The parallel block (GPT-J, Falcon-7B; ``ModelSpec.parallel_block``): attention and MLP both read
  one norm of the layer's input and both add to its residual,

      y = x + dropout(attention(norm(x))) + dropout(mlp(norm(x))),

  where megatron-core's layer runs them in sequence on two norms. The layer keeps megatron-core's
  modules (so tensor and sequence parallelism, initialisation and the engine's recomputation and
  offloading apply unchanged) and only wires them side by side; the spec has no second norm.
* A norm that allows sequence parallelism without Transformer Engine or Apex (megatron-core's torch
  norm refuses it): torch's LayerNorm or RMSNorm, run on this rank's sequence shard (a norm is per
  token: nothing to communicate), its weights marked ``sequence_parallel`` so that their gradients,
  partial sums over the shards, are summed over the TP group (mist.engine.run does, as
  megatron-core's finalize_model_grads does for TE's norms). Used for every norm of the model, the
  final one included. Its RMSNorm keeps for backward what fused kernels (Apex, Transformer Engine)
  and Mist's model keep: the input and one float32 rstd per token. torch's RMSNorm keeps four times
  the input's bytes (float32 copies; measured on a bf16 input), which put a 4-layer Llama's
  non-recomputed activations 14% above the model's prediction.
"""

from __future__ import annotations

import functools
from dataclasses import replace


def layer_spec(normalization: str, parallel_block: bool):
    """One decoder layer: megatron-core's local layer spec with the norm below and, for
    ``parallel_block``, the parallel block (one norm; no pre-MLP norm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    spec = get_gpt_layer_local_spec(normalization=normalization)
    submodules = replace(spec.submodules, input_layernorm=SequenceParallelNorm)
    if parallel_block:
        submodules = replace(submodules, pre_mlp_layernorm=IdentityOp)
        spec = replace(spec, module=_parallel_block_class())
    else:
        submodules = replace(submodules, pre_mlp_layernorm=SequenceParallelNorm)
    return replace(spec, submodules=submodules)


def block_spec(normalization: str, parallel_block: bool, layers: int, tempo: bool = False):
    """The decoder of one pipeline stage of ``layers`` layers (layer_spec's, or with ``tempo``
    Tempo's: tempo.megatron), final norm included."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if tempo:
        if parallel_block:
            raise ValueError("Tempo's layers are built as sequential layers, not the parallel block")
        from tempo.megatron import tempo_block_spec

        return tempo_block_spec(normalization, layers)
    layer = layer_spec(normalization, parallel_block)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=SequenceParallelNorm)


def rms_norm(x, weight, eps: float):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 as torch's RMSNorm does; keeps
    only x and the per-token rstd for backward."""
    return _lean_rms_norm_function().apply(x, weight, eps)


@functools.cache
def _lean_rms_norm_function():
    """The autograd function, defined on first use (torch is not imported at import time)."""
    import torch

    class LeanRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16/fp16 in float32, as torch's
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            ctx.save_for_backward(x, weight, rstd)
            return (xf * rstd).to(x.dtype) * weight

        @staticmethod
        def backward(ctx, dy):
            x, weight, rstd = ctx.saved_tensors
            wide = rstd.dtype
            xhat = x.to(wide) * rstd
            g = dy.to(wide) * weight.to(wide)
            # d/dx of x * rstd(x): rstd * (g - xhat * mean(g * xhat)) over the row
            dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
            dw = (dy.to(wide) * xhat.to(x.dtype).to(wide)).reshape(-1, x.shape[-1]).sum(0)
            return dx.to(x.dtype), dw.to(weight.dtype), None

    return LeanRMSNorm


@functools.cache
def _lean_rms_norm_class():
    import torch
    from torch import nn

    class LeanRMSNormModule(nn.Module):
        """torch's RMSNorm's parameters and result; keeps x and rstd only (``rms_norm``)."""

        def __init__(self, hidden_size: int, eps: float, dtype) -> None:
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

        def forward(self, x):
            return rms_norm(x, self.weight, self.eps)

    return LeanRMSNormModule


class SequenceParallelNorm:
    """torch's LayerNorm or RMSNorm (as the config says) whose weights are marked for the TP-group
    sum of their gradients under sequence parallelism. Built by megatron-core's build_module with
    its norms' arguments."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        from torch import nn

        kinds = {"LayerNorm": nn.LayerNorm, "RMSNorm": _lean_rms_norm_class()}
        if config.normalization not in kinds:
            raise ValueError(f"normalization must be one of {sorted(kinds)}, got {config.normalization!r}")
        norm = kinds[config.normalization](hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


@functools.cache
def _parallel_block_class():
    """The layer class, defined on first use: importing megatron-core is not import-time work."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.utils import make_viewless_tensor

    class ParallelBlockLayer(TransformerLayer):
        """y = x + dropout(attention(norm(x))) + dropout(mlp(norm(x))), one norm. Attention and
        MLP each reduce their output over the TP group (two messages a layer, as megatron-core's
        sequential layer; Mist's model prices the parallel block's one)."""

        def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, **kwargs):
            given = sorted(k for k, v in kwargs.items() if v is not None)
            if given:  # cross-attention, inference, packed sequences, fused rotary: not trained here
                raise ValueError(f"the parallel block does not take {', '.join(given)}")
            residual = hidden_states
            normed = self.input_layernorm(hidden_states)
            attention = self.self_attention(
                normed,
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                packed_seq_params=None,
            )
            mlp = self.mlp(normed)
            fused = self.config.bias_dropout_fusion
            with self.bias_dropout_add_exec_handler():
                hidden = self.self_attn_bda(self.training, fused)(attention, residual, self.hidden_dropout)
                hidden = self.mlp_bda(self.training, fused)(mlp, hidden, self.hidden_dropout)
            # as megatron-core's layer: a viewless output (pipeline sends and checkpoints need one)
            return make_viewless_tensor(inp=hidden, requires_grad=hidden.requires_grad, keep_graph=True), None

    return ParallelBlockLayer
