"""megatron-core's layer as the benchmarks build it: its global state, config and inputs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from measure.timing import time_fn


def layer_inputs(
    b: int, s: int, h: int, dtype: torch.dtype, dev: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """A megatron-core layer's input ([s, b, h], megatron's order), causal mask and output gradient."""
    x = torch.randn(s, b, h, dtype=dtype, device=dev, requires_grad=True)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=dev).tril().logical_not()
    return x, mask, torch.randn(s, b, h, dtype=dtype, device=dev)


class Layers(nn.Module):
    """The layers of a ZeRO benchmark in sequence, as one module: FSDP2's root in the ZeRO-3 one. In
    the engine the root is the whole model (it holds the embedding and the head), and only a layer
    that is not the root frees its gathered weights after forward and gathers them again for
    backward."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask)
            x = x[0] if isinstance(x, tuple) else x
        return x


@contextlib.contextmanager
def megatron_state(tp: int = 1):
    """megatron-core's parallel state (TP ``tp``; its modules need one), on a one-process group
    where none is initialised, torn down after; an existing group or state is used as it is."""
    import torch.distributed as dist

    from .. import cpu_shim

    cpu_shim.install()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    own_state = not ps.model_parallel_is_initialized()
    try:
        if own_state:
            ps.initialize_model_parallel(tp, 1)
            model_parallel_cuda_manual_seed(0)
        with cpu_shim.gpu_standins():  # as the engine runs them
            yield
    finally:
        if own_state:
            ps.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def megatron_config(h: int, heads: int, tp: int, dtype: torch.dtype, gated_ffn: int | None = None):
    """One TP rank's share of a GPT-3 layer as megatron-core configures it (as mist.engine.run's);
    with ``gated_ffn``, of a Llama layer (RMSNorm, SwiGLU of that width, fused as the engine's, no
    dropout: profile_data.gated_layer)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    gated = gated_ffn is not None
    return TransformerConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=heads // tp,
        ffn_hidden_size=(gated_ffn if gated else 4 * h) // tp,
        kv_channels=h // heads,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0 if gated else 0.1,
        attention_dropout=0.0 if gated else 0.1,
        attention_softmax_in_fp32=False,  # Megatron-LM's default (mist.engine.megatron.model_settings)
        normalization="RMSNorm" if gated else "LayerNorm",
        gated_linear_unit=gated,
        activation_func=torch.nn.functional.silu if gated else torch.nn.functional.gelu,
        bias_activation_fusion=gated,
        cuda_graph_scope=[],  # the whole layer, as megatron-core's default "full", which warns
    )


def engine_layer(
    h: int,
    heads: int,
    tp: int,
    dtype: torch.dtype,
    device: str,
    tempo: bool = False,
    gated_ffn: int | None = None,
) -> nn.Module:
    """One rank's share of a decoder layer built from the spec mist.engine.run builds its layers
    from (inside ``megatron_state``): megatron-core's local spec with the engine's norms
    (``layers.layer_spec``), or with ``tempo`` Tempo's (tempo.megatron); ``gated_ffn``: a Llama
    layer. Its config is ``megatron_config``'s (the profiled shape, dropout as the model family
    has it), not a plan's. Not megatron-core's local spec itself: its torch norm keeps float32
    weights when built alone (the engine's half-precision wrapper casts them; nothing does here),
    a layer the engine never runs."""
    from megatron.core.transformer.spec_utils import build_module

    from ..layers import layer_spec

    normalization = "LayerNorm" if gated_ffn is None else "RMSNorm"
    if tempo:
        from tempo.megatron import tempo_layer_spec

        spec = tempo_layer_spec(normalization)
    else:
        spec = layer_spec(normalization, False)
    config = megatron_config(h, heads, tp, dtype, gated_ffn)
    return build_module(spec, config=config, layer_number=1).to(device).train()


def forward_backward_seconds(forward: Callable, backward_from: Callable, device: str, repeats: int):
    """(forward, backward) seconds: the forward timed alone, the backward as (both) - forward."""

    def both():
        backward_from(forward())

    fwd = time_fn(forward, device, warmup=1, repeats=repeats).median_s
    total = time_fn(both, device, warmup=1, repeats=repeats).median_s
    return fwd, max(total - fwd, 0.0)
