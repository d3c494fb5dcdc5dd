"""ZeRO-2 and ZeRO-3 as the engine runs them, measured on whole layers."""

from __future__ import annotations

from pathlib import Path

import torch

from ...model.runtime import ZERO2_LAYER, ZERO3_LAYER
from .megatron_layer import Layers, layer_inputs, megatron_config, megatron_state
from .ranks import init_rank, interleaved_seconds_all_ranks, median_rows, run_ranks, write_line_csv


def _layers_step(shape: tuple, sharded: bool, stage: int, count: int, mesh, dev, dtype) -> tuple:
    """(step, one layer's weight bytes): ``count`` megatron-core layers of ``shape`` (b, s, h,
    heads, tp), plain or sharded as mist.engine.run shards them at ZeRO ``stage``, and a function
    running their forward + backward once."""
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from torch.distributed.fsdp import fully_shard

    from ..zero import ShardedMasterAdamW

    b, s, h, heads, tp = shape  # micro-batch, sequence, hidden, heads, TP
    config = megatron_config(h, heads, tp, dtype)
    torch.manual_seed(0)
    layers = [
        build_module(get_gpt_layer_local_spec(), config=config, layer_number=i + 1).to(dev, dtype)
        for i in range(count)
    ]  # every parameter in them in the layer's dtype, as megatron's Float16Module
    weight_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    module, optimizer = Layers(layers), None
    if sharded and stage == 3:  # as shard_parameters: each layer, then the root
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
    if sharded and stage == 2:  # the engine's optimizer: its backward hooks reduce
        buckets = [list(layer.parameters()) for layer in layers]  # as layer_buckets
        optimizer = ShardedMasterAdamW(buckets, dist.group.WORLD, 1e-3, shard_grads=True)
    x, mask, grad = layer_inputs(b, s, h, dtype, dev)

    def step():
        module(x, attention_mask=mask).backward(grad)
        # every micro-batch as the first: accumulating into earlier gradients is
        # priced apart (stage_cost's gradient accumulation), for either variant
        module.zero_grad(set_to_none=True)
        if optimizer is not None:
            optimizer.reduced.clear()

    return step, weight_bytes


def _zero_worker(
    rank: int,
    n: int,
    port: int,
    device: str,
    stage: int,
    shapes: list,
    dtype,
    repeats: int,
    rounds: int,
    out,
) -> None:
    """One rank of ``profile_zero_layers``: per shape, megatron-core's layers timed forward +
    backward plain and sharded as mist.engine.run shards them, interleaved, all ranks at once."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dev = init_rank(rank, n, port, device)
    # ZeRO-2 reduces each layer's gradients to the layer's owner: n layers, one owned by each rank
    # (as the engine's equal layers are shared out); ZeRO-3 is the same on every layer: one
    count = n if stage == 2 else 1
    calls, weight_bytes = {}, {}
    try:
        with megatron_state():  # DP = n: the group is this one
            mesh = DeviceMesh.from_group(dist.group.WORLD, dev.type)
            for shape in shapes:
                for sharded in (False, True):
                    calls[shape, sharded], weight_bytes[shape] = _layers_step(
                        shape, sharded, stage, count, mesh, dev, dtype
                    )
            seconds = interleaved_seconds_all_ranks(calls, repeats, rounds, dev)
    finally:
        dist.destroy_process_group()
    if rank == 0:  # a layer's share of what sharding added
        out.put([(weight_bytes[sh], (seconds[sh, True] - seconds[sh, False]) / count) for sh in shapes])


def profile_zero_layers(
    stage: int,
    n: int,
    device: str,
    hidden: int,
    heads: int,
    seq: int,
    micro_batch: int,
    dtype: torch.dtype,
    repeats: int = 5,
    rounds: int = 10,
    launches: int = 1,
) -> list[tuple[float, float]]:
    """What ZeRO ``stage`` (2 or 3) adds to one layer's forward + backward among ``n`` processes,
    as mist.engine.run runs it: [(the layer's full weight bytes, seconds)] for the layer and for
    one TP-2 rank's share of it (two sizes: a line can be fitted), the median over ``launches``.
    A micro-benchmark of the mechanism, like the collectives', that prices what they miss (the
    copies, hooks, and waits for the other ranks inside backward):

    * ZeRO-3: FSDP2 over the data-parallel group, the layer not its root: the weights gathered
      for forward and again for backward, the gradients reduce-scattered, its copies in and out
      (on this project's 2-core CPU about twice the raw collectives it issues);
    * ZeRO-2: the engine's ShardedMasterAdamW, whose backward hooks reduce each layer's gradients
      to the layer's owner in one message as backward makes them, blocking."""
    if stage not in (2, 3):
        raise ValueError(f"the ZeRO layer benchmark is for stages 2 and 3, got {stage}")
    if n < 2:
        raise ValueError(f"ZeRO-{stage} needs at least 2 processes, got {n}")
    if heads % 2:
        raise ValueError(f"the ZeRO-{stage} benchmark halves the layer (heads / 2): heads {heads} is odd")
    if device.startswith("cuda") and n > torch.cuda.device_count():
        raise ValueError(f"{n} processes need {n} GPUs; this machine has {torch.cuda.device_count()}")
    shapes = [(micro_batch, seq, hidden, heads, tp) for tp in (1, 2)]
    return median_rows(run_ranks(_zero_worker, n, (device, stage, shapes, dtype, repeats, rounds), launches))


def write_zero_layers(stage: int, out: Path, n: int, device: str, *args, **kwargs) -> Path:
    """``profile_zero_layers`` into ``out`` as a collective's file (the layer's weights as the size)."""
    rows = profile_zero_layers(stage, n, device, *args, **kwargs)  # refuses stages other than 2 and 3
    name = {2: ZERO2_LAYER, 3: ZERO3_LAYER}[stage]
    return write_line_csv(out / f"prim_gpt_local_{name}_{n}gpus.csv", rows)
