"""Run a CTA-pipelined chain on a CPU: one process per emulated device, kernels under the Triton
interpreter, buffers and counters in shared memory. For correctness (tests, ``nox -s cta_mlp``),
not speed: the processes run concurrently, so the consumer's waits are really exercised.

Nothing here can hang or leak a process: every wait is bounded (the kernels' waits by
``wait_timeout_s``, the start barrier and the whole run by ``timeout_s``), a rank whose tile gave
up makes the parent raise ``StageTimeout``, and a rank never outlives the parent: on Linux the
kernel kills it when the parent dies (``PR_SET_PDEATHSIG``), and on every platform a watchdog
thread in the rank exits it once its parent is gone (polled every ``_WATCHDOG_S``)."""

from __future__ import annotations

import os
import time

import torch
import torch.multiprocessing as mp

from measure.parallel import die_with_parent

from .chain import ChainStage, PeerBuffers, shared_buffers
from .gemm import WAIT_TIMEOUT_S, StageTimeout, check_operands, check_tiling
from .tiling import Tiling

_WATCHDOG_S = 0.2
_REPORT = ("gave_up", "tile", "row_block", "column_block", "seen", "target")  # a rank's StageTimeout


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
    wait_timeout_s,
    timeout_s,
    parent,
    y,
    reports,
    start,
    last_done,
):
    die_with_parent(parent, watchdog_s=_WATCHDOG_S)
    stage = ChainStage(rank, ranks, weight, act, buffers, tiling, max_spins, wait_timeout_s)
    stage.warm_up(x.shape[0])
    start.wait(timeout_s)  # every rank compiled: start together (the pipelined launch)
    time.sleep(delay)
    if rank == 0 and last_done is not None and not last_done.wait(timeout_s):
        raise TimeoutError("the last rank never finished")  # (negative control: producer after the consumer)
    try:
        out = stage(x if rank == 0 else None, wait=wait)
    except StageTimeout as e:
        reports[rank] = torch.tensor([getattr(e, k) for k in _REPORT], dtype=torch.int64)
        out = None
    if out is not None:
        y.copy_(out)
    if rank == ranks - 1 and last_done is not None:
        last_done.set()


def _run_ranks(ctx, rank_args: list[tuple], timeout_s: float) -> None:
    """Start one process per rank on ``_rank_main`` and join them within ``timeout_s``; the ranks
    still running are killed, also on an interrupt or an error here, so none outlives the call.
    Raises TimeoutError past the timeout, RuntimeError if a rank failed."""
    procs = []
    try:
        for args in rank_args:
            procs.append(ctx.Process(target=_rank_main, args=args))
            procs[-1].start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        for p in alive:
            p.join()
    ranks = len(rank_args)
    if alive:
        raise TimeoutError(f"{len(alive)} of {ranks} ranks still running after {timeout_s:.0f} s (killed)")
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"ranks {failed} failed (exit codes {[procs[r].exitcode for r in failed]})")


def _raise_on_give_up(reports: torch.Tensor, bound: float, max_spins: int) -> None:
    """StageTimeout for the first rank whose tile gave up waiting (the ranks after it starve)."""
    ranks = len(reports)
    for r, report in enumerate(reports.tolist()):
        if report[0]:
            f = dict(zip(_REPORT, report, strict=True))
            raise StageTimeout(
                f"chain rank {r} of {ranks}",
                f["tile"],
                f["row_block"],
                f["column_block"],
                f["seen"],
                f["target"],
                f["gave_up"],
                bound,
                max_spins,
            )


def _chain_widths(
    x: torch.Tensor, weights: list[torch.Tensor], acts: list[str], wait: bool, producer_last: bool
) -> list[int]:
    """The chain's widths (X's, then each rank's output's), after checking ``run_chain_processes``'
    inputs: an activation a rank, weights that chain, ``producer_last`` only without the wait."""
    ranks = len(weights)
    check_operands(x=x, **{f"w{r}": w for r, w in enumerate(weights)})  # here, not in each rank
    if producer_last and wait:
        raise ValueError("producer_last needs wait=False: a waiting consumer would wait forever")
    if len(acts) != ranks:
        raise ValueError(f"{ranks} weights need {ranks} activations, got {len(acts)}")
    dims = [x.shape[1]] + [w.shape[1] for w in weights]
    if any(w.shape[0] != d for w, d in zip(weights, dims, strict=False)):
        raise ValueError(f"weights do not chain: {[tuple(w.shape) for w in weights]} from width {x.shape[1]}")
    return dims


def run_chain_processes(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    acts: list[str],
    tiling: Tiling,
    wait: bool = True,
    delays: list[float] | None = None,
    max_spins: int = 0,
    timeout_s: float = 120.0,
    producer_last: bool = False,
    wait_timeout_s: float | None = None,
) -> torch.Tensor:
    """Y of the chain (a tile that gave up waiting raises, so a returned Y had every wait met).
    ``delays[r]``: seconds rank r sleeps before its launch (to make a producer late on
    purpose). ``producer_last`` (only without the wait, else it would deadlock): rank 0 starts
    after the last rank finished, so a consumer that does not wait surely reads an unwritten inbox.
    ``wait_timeout_s`` / ``max_spins``: the kernels' wait bounds (None: gemm.WAIT_TIMEOUT_S).

    Raises ``StageTimeout`` (the first rank whose tile gave up, named with the tile), TimeoutError
    past ``timeout_s``, RuntimeError if a rank failed; the ranks still running are killed, and none
    outlives this process."""
    ranks = len(weights)
    dims = _chain_widths(x, weights, acts, wait, producer_last)
    check_tiling(tiling)
    delays = delays or [0.0] * ranks
    if len(delays) != ranks or not all(isinstance(d, int | float) and 0 <= d < timeout_s for d in delays):
        raise ValueError(f"delays: one for each of the {ranks} ranks, each in [0, timeout_s), got {delays!r}")
    buffers = shared_buffers(x.shape[0], dims, x.dtype, tiling)
    y = torch.zeros(x.shape[0], dims[-1], dtype=x.dtype).share_memory_()
    reports = torch.zeros(ranks, len(_REPORT), dtype=torch.int64).share_memory_()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(ranks)
    last_done = ctx.Event() if producer_last else None
    x.share_memory_()
    parent = os.getpid()
    rank_args = [
        (
            r,
            ranks,
            x,
            weights[r].share_memory_(),
            acts[r],
            buffers[r],
            tiling,
            wait,
            delays[r],
            max_spins,
            wait_timeout_s,
            timeout_s,
            parent,
            y,
            reports,
            barrier,
            last_done,
        )
        for r in range(ranks)
    ]
    # the spawned ranks inherit it as they start; this process's own setting is left as it was
    interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _run_ranks(ctx, rank_args, timeout_s)
    finally:
        if interpret is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = interpret
    _raise_on_give_up(reports, WAIT_TIMEOUT_S if wait_timeout_s is None else wait_timeout_s, max_spins)
    return y.clone()
