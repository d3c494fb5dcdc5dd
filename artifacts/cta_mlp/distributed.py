"""A chain of GEMMs, one layer per rank, by every method on real devices:

    torchrun --nproc-per-node N -m artifacts.cta_mlp.distributed --rows 8192 --width 8192 --out r.json

Back-to-back GEMMs, micro-batching (every chunk of the sweep), Megatron TP, and on GPUs
CTA-pipelining through symmetric memory. Every output is checked against a plain PyTorch chain;
latency is the slowest rank's, median of ``--repeats``. On a CPU (gloo) only the torch.distributed
baselines run (CTA-pipelining there: ctapipe.emulate); CPU latencies say nothing about GPUs.

The CTA chain's waits have the default bound (``ctapipe.WAIT_TIMEOUT_S``), checked after the timed
passes: after a give-up a rank's later passes do not wait (one bound lost, not one a pass), and
every rank then fails the run naming the ranks and tiles that gave up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from baselines.cta.microbatch import pipelined_chain
from baselines.cta.tensor_parallel import shard_chain, tp_chain
from ctapipe.reference import chain as reference_chain
from ctapipe.sim import candidate_chunks
from measure.cli import OneLineParser, check_writable_file
from measure.launch import launch_env_problem
from measure.parallel import die_with_launcher
from measure.results import device_description, git_state, package_versions, utc_now, write_json_atomic
from measure.training import DTYPES


def _timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median over repeats of the slowest rank's time (every rank starts at a barrier)."""
    out, samples = None, []
    for i in range(repeats + 1):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i:  # the first call warms up (compiles, connects)
            samples.append(float(took))
    return statistics.median(samples), out


def _timed_cta_chain(
    x: torch.Tensor, weights: list[torch.Tensor], acts: list[str], device: torch.device, repeats: int
) -> tuple[float, torch.Tensor]:
    """(median seconds, output) of the chain CTA-pipelined over the ranks (one stage each, on the
    GPU); RuntimeError on every rank where any rank's bounded wait gave up."""
    from ctapipe import StageTimeout, Tiling
    from ctapipe.chain import ChainStage, symmetric_buffers

    rank, ranks = dist.get_rank(), dist.get_world_size()
    m, width = x.shape
    tiling = Tiling()
    buffers = symmetric_buffers(m, [width] * (ranks + 1), x.dtype, tiling)
    stage = ChainStage(rank, ranks, weights[rank], acts[rank], buffers, tiling)  # default wait bound
    stage.warm_up(m)
    torch.cuda.synchronize()
    # unchecked passes (a check waits for the GPU: not inside the timing), checked after them
    latency, y = _timed(lambda: stage(x if rank == 0 else None, check=False), device, repeats)
    failure = None
    try:
        stage.raise_if_gave_up()
    except StageTimeout as e:
        failure = str(e)
    failures = [None] * ranks
    dist.all_gather_object(failures, failure)
    if any(failures):
        raise RuntimeError(
            "CTA-pipelining measurement failed: a bounded wait gave up (StageTimeout): "
            + "; ".join(f for f in failures if f)
        )
    return latency, y


def run(m: int, width: int, dtype: torch.dtype, repeats: int, smallest_chunk: int, seed: int = 0) -> dict:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)  # every rank draws the same weights and input
    x = torch.randn(m, width, generator=g).to(device, dtype)
    weights = [(torch.randn(width, width, generator=g) / width**0.5).to(device, dtype) for _ in range(ranks)]
    acts = ["gelu"] * (ranks - 1) + ["none"]
    ref = reference_chain(x.float(), [w.float() for w in weights], acts)
    last = rank == ranks - 1
    tol = 5e-2 if dtype != torch.float32 else 1e-4

    def error(y) -> float | None:
        return float((y.float() - ref).abs().max() / ref.abs().max()) if y is not None else None

    results: dict[str, dict] = {}
    for chunk in candidate_chunks(m, smallest_chunk):
        name = "back_to_back" if chunk == m else f"microbatch_{chunk}"
        mine = x if rank == 0 else None
        latency, y = _timed(
            lambda c=chunk, a=mine: pipelined_chain(a, weights[rank], acts[rank], m, c), device, repeats
        )
        results[name] = {"latency_s": latency, "chunk": chunk, "error": error(y if last else None)}
    shards = shard_chain(weights, rank, ranks)
    latency, y = _timed(lambda: tp_chain(x, shards, acts), device, repeats)
    results["tp"] = {"latency_s": latency, "error": error(y if last else None)}
    if cuda:
        latency, y = _timed_cta_chain(x, weights, acts, device, repeats)
        results["cta"] = {"latency_s": latency, "error": error(y if last else None)}
    gathered = [None] * ranks
    dist.all_gather_object(gathered, results)
    final = gathered[-1]  # the last rank holds the outputs (TP: every rank; all checked there)
    bad = {k: v["error"] for k, v in final.items() if v["error"] is None or v["error"] > tol}
    if bad:
        raise RuntimeError(f"outputs differ from the reference chain (relative max error > {tol}): {bad}")
    micro = {k: v for k, v in final.items() if "chunk" in v}  # back to back is one chunk of M
    best = min(micro, key=lambda k: micro[k]["latency_s"])
    return {
        "methods": final,
        "best_microbatch": best,
        "gpus": ranks,
        "m": m,
        "width": width,
        "dtype": str(dtype),
        "device": device.type,
    }


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(
        prog="torchrun ... -m artifacts.cta_mlp.distributed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rows", type=int, default=8192, help="M, the rows of X")
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--smallest-chunk", type=int, default=128)
    ap.add_argument("--out", type=Path, help="write rank 0's report (JSON)")
    args = ap.parse_args(argv)
    for flag in ("rows", "width", "repeats", "smallest_chunk"):  # 0 rows: unchecked, then torch's error
        if (value := getattr(args, flag)) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if (problem := launch_env_problem("artifacts.cta_mlp.distributed")) is not None:
        ap.error(problem)
    if args.out:  # before the measurement, not after it
        try:
            check_writable_file(args.out)
        except ValueError as e:
            ap.error(f"--out: {e}")
    die_with_launcher()  # a rank never outlives torchrun, nor a killed run torchrun was started by
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    report = run(args.rows, args.width, DTYPES[args.dtype], args.repeats, args.smallest_chunk)
    if dist.get_rank() == 0:
        for name, r in report["methods"].items():
            print(f"{name:>16}: {r['latency_s'] * 1e3:8.3f} ms  (max rel. error {r['error']:.1e})")
        if args.out:  # whole or not at all; what ran where, as a result file's provenance says
            provenance = {
                "git": git_state(),
                "packages": package_versions(),
                "device": device_description("cuda" if torch.cuda.is_available() else "cpu"),
                "finished_utc": utc_now(),
            }
            write_json_atomic(args.out, {**report, "provenance": provenance})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
