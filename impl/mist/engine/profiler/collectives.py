"""Collective benchmarks among local processes (gloo on a CPU, NCCL on GPUs)."""

from __future__ import annotations

from pathlib import Path

import torch

from measure.results import write_text_atomic
from measure.units import MiB

from .ranks import init_rank, interleaved_seconds_all_ranks, median_rows, run_ranks, write_line_csv

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def _pipeline_message(tensor: torch.Tensor, rank: int, n: int) -> None:
    """One pipeline message: even ranks send the tensor to the next (odd) rank, which receives it."""
    import torch.distributed as dist

    if rank % 2 == 0 and rank + 1 < n:
        dist.send(tensor, rank + 1)
    elif rank % 2 == 1:
        dist.recv(tensor, rank - 1)


def _collective_worker(
    rank: int, n: int, port: int, device: str, sizes: list[int], repeats: int, rounds: int, out
) -> None:
    import torch.distributed as dist

    dev = init_rank(rank, n, port, device)
    calls = {}
    try:
        for nbytes in sizes:
            # data_size is the full tensor (all-reduce's, all-gather's output, reduce-scatter's input),
            # as RuntimeModel.collective prices it (the artifact's all-gather rows are each rank's
            # input: profile_data.GATHER_ROWS_PER_RANK)
            full = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
            shard = torch.empty(nbytes // 2 // n, dtype=torch.bfloat16, device=dev)
            calls[("all_reduce", nbytes)] = lambda full=full: dist.all_reduce(full)
            calls[("all_gather", nbytes)] = lambda full=full, shard=shard: dist.all_gather_single(full, shard)
            calls[("reduce_scatter", nbytes)] = lambda f=full, sh=shard: dist.reduce_scatter_single(sh, f)
            calls[("send_recv", nbytes)] = lambda full=full: _pipeline_message(full, rank, n)
        # back-to-back calls, averaged (as nccl-tests): one rank's late start is spread thin
        seconds = interleaved_seconds_all_ranks(calls, repeats, rounds, dev)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out.put({c: [(b, sec) for (name, b), sec in seconds.items() if name == c] for c in COLLECTIVES})


def profile_collectives(
    n: int,
    device: str,
    sizes: list[int] | None = None,
    repeats: int = 10,
    rounds: int = 5,
    launches: int = 1,
) -> dict[str, list[tuple[float, float]]]:
    """Seconds of each collective among ``n`` local processes, {name: [(bytes, seconds)]}: the
    median over ``rounds`` of a window of ``repeats`` calls, every point's window in each round,
    and over ``launches`` (``run_ranks``)."""

    if n < 2:
        raise ValueError(f"collectives need at least 2 processes, got {n}")
    if device.startswith("cuda") and n > torch.cuda.device_count():
        raise ValueError(f"{n} processes need {n} GPUs; this machine has {torch.cuda.device_count()}")
    if sizes is None:  # small messages on a CPU, Megatron-sized ones on GPUs
        sizes = [2**k for k in (range(20, 29, 2) if device.startswith("cuda") else range(12, 23, 2))]
    results = run_ranks(_collective_worker, n, (device, sizes, repeats, rounds), launches)
    return {name: median_rows([r[name] for r in results]) for name in results[0]}


def write_collectives(
    out: Path, n: int, device: str, repeats: int = 10, rounds: int = 5, launches: int = 1
) -> list[Path]:
    """Benchmark the collectives among ``n`` processes into ``out`` (the artifact's CSV format)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, rows in profile_collectives(
        n, device, repeats=repeats, rounds=rounds, launches=launches
    ).items():
        if name == "send_recv":  # a message between two processes, whatever n: the artifact's p2p file
            sizes = ",".join(f"{b / MiB:.6f}" for b, _ in rows)
            rates = ",".join(f"{b / sec / 1e9:.6f}" for b, sec in rows)
            path = out / "p2p_intra_node.csv"
            write_text_atomic(path, f"{sizes}\n{rates}\n")  # whole or not at all, as write_line_csv
            written.append(path)
            continue
        written.append(write_line_csv(out / f"prim_gpt_local_{name}_{n}gpus.csv", rows))
    return written
