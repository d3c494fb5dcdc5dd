"""Run a CTA-pipelined chain on a CPU: one process per emulated device, kernels under the Triton
interpreter, buffers and counters in shared memory. For correctness (tests, ``nox -s cta_mlp``),
not speed: the processes run concurrently, so the consumer's waits are really exercised."""

from __future__ import annotations

import os
import time

import torch
import torch.multiprocessing as mp

from .chain import ChainStage, PeerBuffers, shared_buffers
from .gemm import Tiling


def _rank_main(
    rank,
    ranks,
    x,
    weight,
    act,
    buffers: PeerBuffers,
    tiling,
    wait,
    delay,
    max_spins,
    y,
    status,
    start,
    last_done,
):
    stage = ChainStage(rank, ranks, weight, act, buffers, tiling, max_spins)
    stage.warm_up(x.shape[0])
    start.wait()  # every rank compiled: start together (the pipelined launch)
    time.sleep(delay)
    if rank == 0 and last_done is not None:
        last_done.wait()  # the producer only after the consumers finished (negative control)
    out = stage(x if rank == 0 else None, wait=wait)
    if out is not None:
        y.copy_(out)
    status[rank] = stage.status[0]
    if rank == ranks - 1 and last_done is not None:
        last_done.set()


def run_chain_processes(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    acts: list[str],
    tiling: Tiling,
    wait: bool = True,
    delays: list[float] | None = None,
    max_spins: int = 2_000_000,
    timeout_s: float = 120.0,
    producer_last: bool = False,
) -> tuple[torch.Tensor, list[int]]:
    """Y of the chain and each rank's status (1: a tile gave up waiting). ``delays[r]``: seconds rank r
    sleeps before its launch (to make a producer late on purpose). ``producer_last`` (only without
    the wait, else it would deadlock): rank 0 starts after the last rank finished, so a consumer
    that does not wait surely reads an unwritten inbox. Raises TimeoutError past ``timeout_s``
    (the processes are killed)."""
    ranks = len(weights)
    if producer_last and wait:
        raise ValueError("producer_last needs wait=False: a waiting consumer would wait forever")
    if len(acts) != ranks:
        raise ValueError(f"{ranks} weights need {ranks} activations, got {len(acts)}")
    dims = [x.shape[1]] + [w.shape[1] for w in weights]
    if any(w.shape[0] != d for w, d in zip(weights, dims, strict=False)):
        raise ValueError(f"weights do not chain: {[tuple(w.shape) for w in weights]} from width {x.shape[1]}")
    delays = delays or [0.0] * ranks
    buffers = shared_buffers(x.shape[0], dims, x.dtype, tiling)
    y = torch.zeros(x.shape[0], dims[-1], dtype=x.dtype).share_memory_()
    status = torch.zeros(ranks, dtype=torch.int32).share_memory_()
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the spawned processes
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(ranks)
    last_done = ctx.Event() if producer_last else None
    x.share_memory_()
    procs = []
    for r in range(ranks):
        args = (r, ranks, x, weights[r].share_memory_(), acts[r], buffers[r], tiling, wait, delays[r],
                max_spins, y, status, barrier, last_done)  # fmt: skip
        procs.append(ctx.Process(target=_rank_main, args=args))
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    if alive:
        raise TimeoutError(f"{len(alive)} of {ranks} ranks still running after {timeout_s:.0f} s (killed)")
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"ranks {failed} failed (exit codes {[procs[r].exitcode for r in failed]})")
    return y.clone(), status.tolist()
