"""The DP step collectives as mist.engine.run issues them, timed by running the engine's code:
ZeRO-0/1's gradient sum (ContiguousGrads' in-place all-reduce of its buffer) and the updated
weights' sync (ShardedMasterAdamW.broadcast_weights: one broadcast per owner of its share).
Megatron-LM's distributed optimizer issues a reduce-scatter and an all-gather instead; on gloo
those cost more than what the engine issues (measured here on 2 processes, 2026-12-04: 25.6 MB
reduce-scattered in 26.7 ms against 22.7 ms all-reduced; all-gathered in 13.2 ms, broadcast in
5.2 ms), so a model pricing them would mistake the engine's ZeRO-1 and ZeRO-2 for dearer than
they are."""

from __future__ import annotations

from pathlib import Path

import torch

from ...model.runtime import ENGINE_COLLECTIVES, ZERO_GRAD_SUM, ZERO_WEIGHT_SYNC
from .ranks import init_rank, interleaved_seconds_all_ranks, median_rows, run_ranks, write_line_csv


def sizes_for_layer(hidden: int) -> list[int]:
    """A quarter of, one and four GPT layers' half-precision weights (12 h^2 parameters a layer):
    the sizes of the buckets, layers and stages the model prices these collectives for."""
    layer = 2 * 12 * hidden * hidden
    return [layer // 4, layer, 4 * layer]


def _sync_worker(rank: int, n: int, port: int, device: str, sizes: list[int], repeats: int, rounds: int, out):
    """One rank of ``profile_zero_sync``: per size, ``n`` half-precision parameters of that many
    bytes in all, one owned by each rank (as the engine shares out equal layers), summed and
    synchronised by the engine's own objects, interleaved, all ranks at once."""
    import torch.distributed as dist

    from ..zero import ContiguousGrads, ShardedMasterAdamW

    dev = init_rank(rank, n, port, device)
    calls = {}
    try:
        for nbytes in sizes:
            params = [
                torch.nn.Parameter(torch.randn(nbytes // 2 // n, dtype=torch.bfloat16, device=dev))
                for _ in range(n)
            ]
            grads = ContiguousGrads(params)  # every .grad a view into one buffer
            owners = ShardedMasterAdamW([[p] for p in params], dist.group.WORLD, lr=1e-3)
            calls[ZERO_GRAD_SUM, nbytes] = lambda g=grads: g.all_reduce(dist.group.WORLD, divide_by=n)
            calls[ZERO_WEIGHT_SYNC, nbytes] = owners.broadcast_weights
        seconds = interleaved_seconds_all_ranks(calls, repeats, rounds, dev)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out.put({kind: [(b, s) for (k, b), s in seconds.items() if k == kind] for kind in ENGINE_COLLECTIVES})


def profile_zero_sync(
    n: int, device: str, sizes: list[int], repeats: int = 10, rounds: int = 5, launches: int = 1
) -> dict[str, list[tuple[float, float]]]:
    """{ZERO_GRAD_SUM, ZERO_WEIGHT_SYNC: [(bytes synchronised, seconds)]} among ``n`` local
    processes, each point the median over ``rounds`` interleaved windows of ``repeats`` calls and
    over ``launches`` (``run_ranks``)."""
    if n < 2:
        raise ValueError(f"the ZeRO sync benchmark needs at least 2 processes, got {n}")
    if device.startswith("cuda") and n > torch.cuda.device_count():
        raise ValueError(f"{n} processes need {n} GPUs; this machine has {torch.cuda.device_count()}")
    if not sizes or any(b < 2 * n for b in sizes):
        raise ValueError(
            f"sizes: at least one, each at least {2 * n} bytes (a bf16 element a rank), got {sizes}"
        )
    results = run_ranks(_sync_worker, n, (device, sizes, repeats, rounds), launches)
    return {kind: median_rows([r[kind] for r in results]) for kind in ENGINE_COLLECTIVES}


def write_zero_sync(out: Path, n: int, device: str, sizes: list[int], **kwargs) -> list[Path]:
    """``profile_zero_sync`` into ``out`` as collectives' files (the bytes synchronised as the size)."""
    rows = profile_zero_sync(n, device, sizes, **kwargs)
    return [
        write_line_csv(out / f"prim_gpt_local_{kind}_{n}gpus.csv", rows[kind]) for kind in ENGINE_COLLECTIVES
    ]
