"""What the multi-process benchmarks share: forked ranks, their group, interleaved timing windows."""

from __future__ import annotations

import os
import pickle
import statistics
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from measure.launch import HOST, serve_rendezvous
from measure.results import write_text_atomic
from measure.units import MiB


def _window_seconds_all_ranks(call: Callable[[], object], repeats: int, dev: torch.device) -> float:
    """Mean seconds of ``repeats`` back-to-back calls started together on every rank (a barrier
    first); the slowest rank's, which is what finishes a collective step."""
    import torch.distributed as dist

    cuda = dev.type == "cuda"
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    if cuda:
        torch.cuda.synchronize()
    mean = torch.tensor([(time.perf_counter() - t0) / repeats], dtype=torch.float64, device=dev)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return float(mean)


def interleaved_seconds_all_ranks(
    calls: dict[Hashable, Callable[[], object]], repeats: int, rounds: int, dev: torch.device
) -> dict[Hashable, float]:
    """{key: seconds} of each of ``calls`` ({key: call}): per round, one window of ``repeats``
    back-to-back calls of each in turn (``_window_seconds_all_ranks``); the median window over
    ``rounds``. On a CPU gloo's latency drifts between modes (~0.3 to ~4 ms a call) over seconds:
    one window per point would catch one mode, and comparing two points (sharded against plain,
    one size against another) would compare two modes; interleaved rounds see the same drift."""
    for call in calls.values():  # warm-up (connections, NCCL communicators, FSDP2's lazy init)
        call(), call()
    windows: dict = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            windows[key].append(_window_seconds_all_ranks(call, repeats, dev))
    return {key: statistics.median(w) for key, w in windows.items()}


# What a benchmark rank imports before it runs: its ranks are forked from one server process that
# imported these once (multiprocessing's forkserver), not started as fresh interpreters (~5 s a
# launch of 2 ranks on 2 cores, twelve launches a 2-process fit). The server has only imported
# (no threads, no torch ops), as fork_launch's; it exits once this process and its ranks have.
_RANK_PRELOAD = [
    "measure.forkserver_guard",  # first (its package imports nothing): the server dies with its client
    "torch.distributed",
    "torch.distributed.fsdp",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.spec_utils",
    "mist.engine.profiler",
]


def _rank_main(rank: int, launcher: int, worker: Callable, *args) -> None:
    """A benchmark rank: dies with the server that forked it and with ``launcher``, the process
    that launched it (the server outlives ``launcher`` while its ranks live: they hold its
    liveness pipe), then ``worker(rank, *args)``."""
    from measure.parallel import die_with_launcher, launcher_gone, no_tqdm_semaphore

    die_with_launcher(launcher)
    no_tqdm_semaphore()  # an interrupted run kills its ranks
    try:
        worker(rank, *args)
    except BaseException:
        # a peer gone with a killed run fails this rank's collective before its watchdog exits
        # it: exit as that would, not through torch's start_processes, which writes the traceback
        # to an error file that only the killed launcher would have removed (one was left in
        # test_killed_benchmark_leaves_no_rank[SIGKILL], in a loaded suite)
        if launcher_gone():
            os._exit(1)
        raise


_RESULT_KEY = "rank0-result"


class RankResult:
    """Where rank 0 puts its result for ``run_ranks`` (``put``): the launch's rendezvous store,
    which the launcher serves and reads once the ranks have ended. Neither a multiprocessing queue
    (a named semaphore a rank rebuilds as it starts: a run ended at that moment left the rank
    printing a traceback for the semaphore its launcher had removed, probe round 5, F22) nor a
    file (a killed launcher would leave it behind)."""

    def __init__(self, port: int) -> None:
        self.port = port

    def put(self, result: object) -> None:
        from torch.distributed import TCPStore

        TCPStore(HOST, self.port, is_master=False).set(_RESULT_KEY, pickle.dumps(result))


def run_ranks(worker: Callable, n: int, args: tuple, launches: int) -> list:
    """Rank 0's result of ``worker(rank, n, port, *args, out)`` (``out.put(result)``, a
    ``RankResult``) on ``n`` forked processes, for each of ``launches`` launches (a fresh process
    group each, joining a store this process serves on ``port``: measure.launch). On a CPU gloo's
    latency settles into a mode for a launch's whole life (the same all-reduce: ~0.4 ms a call in
    one launch, ~1.7 ms in the next), so a benchmark point is the median over launches."""
    import torch.multiprocessing as mp

    if launches < 1:
        raise ValueError(f"launches must be at least 1, got {launches}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)  # read when the server starts (the first launch)
    results = []
    for _ in range(launches):
        store = serve_rendezvous()
        ranks = mp.start_processes(
            _rank_main,
            (os.getpid(), worker, n, store.port, *args, RankResult(store.port)),
            nprocs=n,
            join=False,
            start_method="forkserver",
        )
        try:
            # a second at a time: a signal taken just before an unbounded wait's system call
            # began would leave it waiting for a rank to end before the interrupt ran
            while not ranks.join(timeout=1.0):
                pass
        except BaseException:  # a failed rank, or this run interrupted: the others go now, not at exit
            for rank in ranks.processes:
                rank.kill()
            raise
        if not store.check([_RESULT_KEY]):  # get() would wait for it
            raise RuntimeError(f"{worker.__name__}: the ranks ended without rank 0's result")
        results.append(pickle.loads(store.get(_RESULT_KEY)))
        del store
    return results


def median_rows(launches: list[list[tuple]]) -> list[tuple]:
    """Rows (size, seconds, ...) measured in several launches: each row's size and the median of
    each of its times."""
    return [
        (rows[0][0], *(statistics.median(times) for times in list(zip(*rows, strict=True))[1:]))
        for rows in zip(*launches, strict=True)
    ]


def init_rank(rank: int, n: int, port: int, device: str) -> torch.device:
    """Join a benchmark's ``n``-process group as ``rank`` (NCCL on GPUs, gloo on a CPU) set up as a
    rank of mist.engine.run: its own GPU, or one thread (measure.launch); the device to use. The
    group's store is the launcher's, served on ``port``."""
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, n, is_master=False)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=n)
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def write_line_csv(path: Path, rows: list[tuple[float, float]]) -> Path:
    """(bytes, seconds) rows in the artifact's collective file format (a negative difference of two
    timings is written as 0). Whole or not at all: a kill mid-write leaves the file it replaces."""
    lines = ["data_size(MB),time(ms)"] + [f"{b / MiB:.6f},{max(sec, 0.0) * 1e3:.4f}" for b, sec in rows]
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path
