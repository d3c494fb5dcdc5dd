"""CTA-pipelining's evaluation: ``nox -s cta_mlp`` (CPU), ``--device cuda`` adds the GPU part.

Parts (``--parts``):
  sim        latency model sweep: chain of 8192 x 8192 GEMMs, one layer per GPU, M = 1k..32k,
             H200 and B200, 2/4/8 GPUs: back-to-back, best micro-batching, TP, CTA-pipelining,
             CTA + TP; the assumptions are stored with the results; and the 2-GPU result at every
             corner of the assumptions' band (ctapipe.sim.BAND: GEMM efficiency, the CTA kernels'
             efficiency and tile shape, kernel gap, flag latency), into sim_band.json
  kernels    the Triton kernels against torch.matmul (under TRITON_INTERPRET=1 on a CPU),
             including two concurrent processes with a late producer and the negative control
  baselines  the torch.distributed baselines on 2 processes (gloo on a CPU), outputs checked
  gpu        (cuda) single-GPU emulation: ticketed MLP vs back-to-back vs micro-batched on two
             streams, the kernel's throughput vs cuBLAS, and the simulator's single-GPU
             parameters measured here (GEMM efficiency, kernel gap), re-simulated with them
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from measure.cli import quiet_broken_pipe
from measure.launch import run_torchrun
from measure.results import ResultFile, Run

from ..experiment import config_from_command_line, experiment_run, option
from . import EXPERIMENT
from .claims import PAPER

SIM_ROWS = [1024, 2048, 4096, 8192, 16384, 32768]
SIM_GPUS = [2, 4, 8]


SIM_WIDTH = 8192


def sim_key(hardware: str, gpus: int, rows: int) -> dict:
    return {"hardware": hardware, "gpus": gpus, "rows": rows, "width": SIM_WIDTH}


def part_sim(run: Run, hardware: dict | None = None, name: str = "sim") -> ResultFile:
    from ctapipe import sim

    hardware = hardware or sim.hardware_presets()
    config = {"hardware": {k: sim.assumptions(h) for k, h in hardware.items()}}
    store = run.file(f"{name}.json", config=config)
    for hw in hardware.values():
        for n in SIM_GPUS:
            for m in SIM_ROWS:
                store.compute(sim_key(hw.name, n, m), lambda hw=hw, n=n, m=m: sim.compare(hw, m, n))
    _print_sim(store, hardware)
    return store


def part_band(run: Run) -> ResultFile:
    """The latency model's 2-GPU result over the range of its assumptions (``sim.BAND``'s corners)."""
    from ctapipe import sim

    store = run.file("sim_band.json", config={"band": {k: list(v) for k, v in sim.BAND.items()}})
    for hw in sim.hardware_presets().values():
        r = store.compute(
            {"hardware": hw.name, "gpus": 2, "rows": SIM_ROWS, "width": SIM_WIDTH},
            lambda hw=hw: sim.band(hw, 2, SIM_ROWS, SIM_WIDTH),
        )
        print(
            f"{hw.name}, 2 GPUs, over the assumptions' band: CTA {r['microbatch_low']:+.1%} .. "
            f"{r['microbatch_high']:+.1%} against the best micro-batching, {r['tp_low']:+.1%} .. "
            f"{r['tp_high']:+.1%} against TP"
        )
    return store


def _print_sim(store: ResultFile, hardware: dict) -> None:
    us = 1e6
    for hw in hardware.values():
        print(f"\n{hw.name}: {hw.source}")
        print(
            f"  assumed: GEMM efficiency {hw.gemm_efficiency:.0%}, link efficiency {hw.link_efficiency:.0%}, "
            f"kernel gap {hw.kernel_gap_s * us:.1f} us, p2p latency {hw.p2p_latency_s * us:.1f} us, "
            f"flag latency {hw.flag_latency_s * us:.1f} us, all-reduce: ring or NVLS, the faster"
        )
        for n in SIM_GPUS:
            print(f"  {n} GPUs, latency in us:")
            print(
                "        M  back-to-back  micro-batch (chunk)     TP    CTA  CTA+TP   CTA vs mb   CTA vs TP"
            )
            for m in SIM_ROWS:
                r = store.get(sim_key(hw.name, n, m)).result
                ctatp = f"{r['cta_tp_s'] * us:6.0f}" if "cta_tp_s" in r else "     -"
                print(
                    f"  {m:>7}  {r['back_to_back_s'] * us:12.0f}  {r['microbatch_s'] * us:11.0f} "
                    f"({r['microbatch_chunk']:>5})  {r['tp_s'] * us:5.0f}  {r['cta_s'] * us:5.0f}  {ctatp}"
                    f"  {r['cta_vs_microbatch']:+10.1%}  {r['cta_vs_tp']:+10.1%}"
                )
    for hw in hardware.values():
        two = [store.get(sim_key(hw.name, 2, m)).result for m in SIM_ROWS]
        best_mb, best_tp = max(r["cta_vs_microbatch"] for r in two), max(r["cta_vs_tp"] for r in two)
        print(
            f"{hw.name}, 2 GPUs, best over M: CTA {best_mb:.1%} below the best micro-batching (paper: up "
            f"to {PAPER['microbatch'][2]:.1%}), {best_tp:.1%} below TP (paper: up to {PAPER['tp'][2]:.1%})"
        )


def _two_process_chain() -> dict:
    """The two-GEMM chain on two processes, the producer 1 s late: with the consumer's wait, and
    without it, the producer started after the consumer (the negative control)."""
    from ctapipe import INTERPRETER_TILING
    from ctapipe.emulate import run_chain_processes
    from ctapipe.reference import chain

    g = torch.Generator().manual_seed(1)
    m, d, f = 48, 32, 48
    x, w1, w2 = (
        torch.randn(m, d, generator=g),
        torch.randn(d, f, generator=g) / 6,
        torch.randn(f, d, generator=g) / 7,
    )
    ref = chain(x, [w1, w2], ["gelu", "none"])
    out = {}
    for wait in (True, False):
        t0 = time.perf_counter()
        # with the wait: the producer 1 s late; without (negative control): after the consumer
        y = run_chain_processes(
            x,
            [w1, w2],
            ["gelu", "none"],
            INTERPRETER_TILING,
            wait=wait,
            delays=[1.0, 0.0],
            producer_last=not wait,
        )
        out["with_wait" if wait else "negative_control_no_wait"] = {
            "max_abs_error": float((y - ref).abs().max()),
            "seconds": time.perf_counter() - t0,
        }
    return out


def part_kernels(run: Run, device: str) -> ResultFile:
    from ctapipe import INTERPRETER_TILING, TicketMLP, Tiling, launch_stage
    from ctapipe.reference import chain
    from ctapipe.triton_compat import interpreting

    cuda = device == "cuda"
    tiling = Tiling() if cuda else INTERPRETER_TILING
    shapes = [(4096, 8192, 8192), (1000, 4096, 11008)] if cuda else [(64, 32, 48), (37, 24, 56)]
    interpreter = interpreting()
    store = run.file(f"kernels_{device}.json", device, config={"interpreter": interpreter})
    dtype = torch.bfloat16 if cuda else torch.float32
    for m, d, f in shapes:

        def check(m=m, d=d, f=f) -> dict:
            g = torch.Generator().manual_seed(m + d + f)
            x = torch.randn(m, d, generator=g).to(device, dtype)
            w1 = (torch.randn(d, f, generator=g) / d**0.5).to(device, dtype)
            w2 = (torch.randn(f, d, generator=g) / f**0.5).to(device, dtype)
            ref = chain(x.float(), [w1.float(), w2.float()], ["gelu", "none"])
            rows = tiling.tiles(m, f)[0]
            ready = torch.zeros(rows, dtype=torch.int32, device=device)
            h, y = (
                torch.empty(m, f, dtype=dtype, device=device),
                torch.empty(m, d, dtype=dtype, device=device),
            )
            launch_stage(x, w1, h, ready_out=ready, act="gelu", tiling=tiling)
            # bounded waits (ctapipe.WAIT_TIMEOUT_S): a give-up raises StageTimeout
            launch_stage(h, w2, y, ready_in=ready, wait_target=tiling.tiles(m, f)[1], tiling=tiling)
            mlp = TicketMLP("gelu", tiling)
            y_ticket = mlp(x, w1, w2)
            scale = float(ref.abs().max())
            return {
                "stages_rel_error": float((y.float() - ref).abs().max()) / scale,
                "ticket_rel_error": float((y_ticket.float() - ref).abs().max()) / scale,
                "ticket_status": int(mlp.status[0]),
            }

        r = store.compute({"check": "mlp", "m": m, "d": d, "f": f, "tiling": vars(tiling)}, check)
        print(
            f"kernels {m}x{d}x{f}: stages {r['stages_rel_error']:.1e}, ticketed {r['ticket_rel_error']:.1e} "
            "relative max error vs torch.matmul"
        )

    if cuda:  # the chain of two CPU processes under Triton's interpreter: kernels_cpu.json's, not a GPU's
        return store
    key = {"check": "chain", "processes": 2, "producer_delay_s": 1.0, "tiling": vars(INTERPRETER_TILING)}
    r = store.compute(key, _two_process_chain)
    print(
        "2 concurrent processes, producer 1 s late: with the wait max error "
        f"{r['with_wait']['max_abs_error']:.1e}; without it, producer after the consumer (negative control) "
        f"{r['negative_control_no_wait']['max_abs_error']:.2f}"
    )
    return store


def part_baselines(run: Run) -> ResultFile:
    args = {"rows": 512, "width": 64, "dtype": "fp32", "repeats": 3, "smallest_chunk": 64}
    store = run.file("baselines_cpu.json")

    def launch() -> dict:
        with tempfile.TemporaryDirectory(prefix="cta_mlp_") as tmp:
            out = Path(tmp) / "r.json"
            flags = [
                "--rows",
                str(args["rows"]),
                "--width",
                str(args["width"]),
                "--dtype",
                args["dtype"],
                "--repeats",
                str(args["repeats"]),
                "--smallest-chunk",
                str(args["smallest_chunk"]),
                "--out",
                str(out),
            ]
            done = run_torchrun(2, "artifacts.cta_mlp.distributed", flags, timeout=600)
            if done.returncode:
                raise RuntimeError(f"distributed baselines failed:\n{done.stderr[-3000:]}")
            report = json.loads(out.read_text())
            report.pop("provenance")  # for the report used alone: the point carries its own
            return report

    r = store.compute({"chain": "2 gloo processes", **args}, launch)
    errors = {k: v["error"] for k, v in r["methods"].items()}
    print(f"baselines on 2 gloo processes, max relative error vs the reference chain: {errors}")
    return store


@dataclass(frozen=True)
class CtaMlpConfig:
    """What a run of this experiment computes (its command line: ``config_from_command_line``)."""

    parts: tuple[str, ...] = option(
        ("sim", "kernels", "baselines"), "the parts to run", choices=("sim", "kernels", "baselines", "gpu")
    )
    device: str = option("cpu", "where the kernels and the gpu part run", choices=("cpu", "cuda"))
    gpu_dry_run: bool = option(False, "the gpu part on a CPU at toy sizes (tests it)")


def main(argv: list[str] | None = None) -> None:
    config, args, ap = config_from_command_line(CtaMlpConfig, EXPERIMENT, argv, __doc__)
    if config.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
    if config.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if config.device == "cpu" and "gpu" in config.parts and not config.gpu_dry_run:
        ap.error("the gpu part needs --device cuda (or --gpu-dry-run)")
    if config.gpu_dry_run and "gpu" not in config.parts:  # it would be ignored without a word
        ap.error("--gpu-dry-run applies to the gpu part only; add gpu to --parts")
    if config.device == "cuda" and "gpu" in config.parts:  # the latency model's sheet, before any work
        from .gpu import sheet_of

        try:
            sheet_of(torch.cuda.get_device_name())
        except ValueError as e:
            ap.error(str(e))
    with experiment_run(args, EXPERIMENT) as run:
        if "sim" in config.parts:
            part_sim(run)
            part_band(run)
        if "kernels" in config.parts:
            part_kernels(run, config.device)
        if "baselines" in config.parts:
            part_baselines(run)
        if "gpu" in config.parts:
            from .gpu import part_gpu

            measured = part_gpu(run, config.device)
            if measured is not None:  # the latency model with this GPU's measured parameters
                part_sim(run, {measured.name: measured}, name="sim_measured")
    print(f"\nresults in {args.results}; figures: nox -s figures")


if __name__ == "__main__":
    with quiet_broken_pipe():  # `| head`: ends quietly, status 141
        main()
