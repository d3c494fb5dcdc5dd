"""The GPU part of ``cta_mlp`` (in ``nox -s gpu_check``): measured on one GPU, all ratios from one run.

* single-GPU emulation of Y = gelu(X W1) W2 (W 8192 x 8192, bf16), the whole GPU for every method:
  back-to-back cuBLAS GEMMs, the best micro-batched pair on two streams, the two Triton stage
  kernels back to back (no waits), the ticketed CTA-pipelined kernel, and the two stage kernels
  as two 'devices' on halves of the SMs linked by ready counters (the multi-GPU mechanism);
* the stage kernel's throughput against torch.matmul (cuBLAS) on 8192^3;
* the simulator's single-GPU parameters measured here: GEMM efficiency (cuBLAS 8192^3 over the
  data-sheet peak), cuBLAS's tile efficiency by rows (128 ... 16384 rows of 8192 x 8192) and the
  gap between dependent kernels; the simulator rerun with them.

``--device cpu`` (GPU_CHECK_DRY_RUN) runs the same code at toy sizes under the interpreter.

Every method's output is checked against a float32 reference, on another input before it is
timed and on the timed input after: one off by more than ``wrong_result_bound`` fails the
measurement (``WrongResult``), so a tile a race or a missed wait left wrong is not timed.

The CTA kernels' waits have the default bound (``ctapipe.WAIT_TIMEOUT_S``). Their give-ups are
checked after each method's first call and after its timed calls (not inside them: a check waits
for the GPU); after one give-up the object's later calls do not wait, so a lost signal costs one
bound, and the measurement fails with ``StageTimeout`` naming the stage, the tile and itself.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ctapipe.sim import candidate_chunks
from measure.results import Run
from measure.timing import time_fn

from . import claims

GPU_ROWS = [1024, 4096, 16384]
DRY_ROWS = [64]


def wrong_result_bound(dtype: torch.dtype, width: int) -> float:
    """The largest max|error| / max|y| a method's output may have against the float32 reference
    (claims.wrong_result_bound): ``WRONG_RESULT_EPS`` units of the dtype's rounding (h and y are
    rounded to it; a review's bf16 simulation of the 8192-wide MLP: 0.4 of a unit) and as many of
    float32 sums in another order (a random walk over the width; the interpreter's float32: 2
    units). One 128 x 128 tile of h never written: 0.13 of max|y| in that simulation; a 128 x 64
    block of it: 0.09; the bf16 bound: 0.06."""
    return claims.wrong_result_bound(torch.finfo(dtype).eps, width)


class WrongResult(RuntimeError):
    """A method's output is not the MLP's: the measurement fails rather than record its time."""


def _checked_error(name: str, y: torch.Tensor, ref: torch.Tensor, bound: float) -> float:
    """max|y - ref| / max|ref|, or WrongResult naming the method where it is over ``bound``."""
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    if not err <= bound:  # NaN too
        raise WrongResult(f"{name}'s output is off by {err:.2e} of max|y| (bound {bound:.2e}): not timed")
    return err


def _mlp_methods(m: int, d: int, device: str, dtype: torch.dtype, tiling) -> dict:
    """Every method on [m, d] rows, each checked on another input first (memory a method left
    unwritten may hold the previous method's right answer for the timed input, never for this
    one), then timed, then checked again on the timed input."""
    from baselines.cta.single_gpu import MicrobatchedMLP, back_to_back_mlp
    from ctapipe import PartitionedMLP, StageTimeout, TicketMLP, launch_stage

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, d, generator=g).to(device, dtype)
    w1 = (torch.randn(d, d, generator=g) / d**0.5).to(device, dtype)
    w2 = (torch.randn(d, d, generator=g) / d**0.5).to(device, dtype)
    x_check = torch.randn(m, d, generator=g).to(device, dtype)
    ref, ref_check = (back_to_back_mlp(a.float(), w1.float(), w2.float(), "gelu") for a in (x, x_check))
    h = torch.empty(m, d, dtype=dtype, device=device)
    y = torch.empty(m, d, dtype=dtype, device=device)
    # bounded waits (the default), checked outside the timed calls
    ticketed = TicketMLP("gelu", tiling, check=False)
    partitioned = PartitionedMLP("gelu", tiling, check=False)
    gave_up = {"cta_ticketed": ticketed.raise_if_gave_up, "cta_sm_partitions": partitioned.raise_if_gave_up}

    def triton_pair(a):
        launch_stage(a, w1, h, act="gelu", tiling=tiling)
        launch_stage(h, w2, y, tiling=tiling)
        return y

    methods = {
        "cublas_back_to_back": lambda a: back_to_back_mlp(a, w1, w2, "gelu"),
        "triton_back_to_back": triton_pair,
        "cta_ticketed": lambda a: ticketed(a, w1, w2),
        "cta_sm_partitions": lambda a: partitioned(a, w1, w2),
    }
    # the chunkings the latency model prices (and the distributed baseline times), but M itself:
    # that is back to back, timed above
    microbatchings = {
        f"microbatch_{c}": MicrobatchedMLP(c, "gelu") for c in candidate_chunks(m, tiling.block_m) if c < m
    }
    for name, pipelined in microbatchings.items():
        methods[name] = lambda a, mb=pipelined: mb(a, w1, w2)
    out = {}
    repeats = 20 if device == "cuda" else 1
    bound = wrong_result_bound(dtype, d)
    for name, fn in methods.items():
        check = gave_up.get(name, lambda: None)
        try:
            y_check = fn(x_check)
            check()  # before the error: the tiles that gave up wrote nothing
            err = _checked_error(name, y_check, ref_check, bound)
            median_s = time_fn(lambda fn=fn: fn(x), device, warmup=3, repeats=repeats).median_s
            y_timed = fn(x)
            check()
            err = max(err, _checked_error(name, y_timed, ref, bound))
        except (StageTimeout, WrongResult) as e:
            e.add_note(f"measurement failed: single-GPU MLP, M={m}, width {d}, method {name}")
            raise
        out[name] = {"median_s": median_s, "rel_error": err, "rel_error_bound": bound}
    micro = {name: out[name]["median_s"] for name in microbatchings}
    best = min(micro, key=micro.get) if micro else None
    out["summary"] = {
        "best_microbatch": best,
        "cta_vs_cublas_back_to_back": 1
        - out["cta_ticketed"]["median_s"] / out["cublas_back_to_back"]["median_s"],
        "cta_vs_triton_back_to_back": 1
        - out["cta_ticketed"]["median_s"] / out["triton_back_to_back"]["median_s"],
        "cta_vs_best_microbatch": (1 - out["cta_ticketed"]["median_s"] / micro[best]) if best else None,
        "sm_partitions_vs_triton_back_to_back": 1
        - out["cta_sm_partitions"]["median_s"] / out["triton_back_to_back"]["median_s"],
    }
    return out


def _kernel_throughput(n: int, device: str, dtype: torch.dtype, tiling) -> dict:
    from ctapipe import launch_stage

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    repeats = 20 if device == "cuda" else 1
    t_triton = time_fn(
        lambda: launch_stage(a, b, c, tiling=tiling), device, warmup=3, repeats=repeats
    ).median_s
    t_cublas = time_fn(lambda: a @ b, device, warmup=3, repeats=repeats).median_s
    flops = 2.0 * n**3
    return {
        "n": n,
        "triton_tflops": flops / t_triton / 1e12,
        "cublas_tflops": flops / t_cublas / 1e12,
        "triton_over_cublas": t_cublas / t_triton,
    }


def _efficiency_by_rows(d: int, device: str, dtype: torch.dtype, hw) -> list:
    """[(rows, tile efficiency)] of cuBLAS on [rows, d] @ [d, d]: the efficiency that makes the
    model's kernel time (its waves of tiles) reproduce the measured time."""
    from ctapipe import sim

    at_peak = dataclasses.replace(hw, gemm_efficiency=1.0, efficiency_by_rows=())
    out = []
    cuda = device == "cuda"
    rows = 128 if cuda else 16  # (toy sizes in the CPU dry run)
    b = torch.randn(d, d, device=device, dtype=dtype)
    while rows <= (16384 if cuda else 64):
        a = torch.randn(rows, d, device=device, dtype=dtype)
        seconds = time_fn(lambda a=a: a @ b, device, warmup=3, repeats=20 if cuda else 1).median_s
        out.append((rows, sim.kernel_s(at_peak, rows, d, d, sim.Chain(rows, d)) / seconds))
        rows *= 2
    return out


def tile_efficiency(hw, n: int, tiling, seconds: float) -> float:
    """The efficiency of ``tiling``'s tiles that makes the model's n x n x n stage kernel take the
    measured ``seconds``: the model prices a CTA kernel as its launch and then its waves of tiles
    over the SMs, so both are taken out here, not left in the efficiency, where the model would
    count them again (throughput over peak: 0.677 for a true 0.7 on an H200, the kernel then priced
    3.4% slow)."""
    if not seconds > hw.launch_s:
        raise ValueError(f"a kernel measured at {seconds} s is no longer than the launch ({hw.launch_s} s)")
    at_peak = dataclasses.replace(hw, cta_efficiency=(((tiling.block_m, tiling.block_n), 1.0),))
    rows, cols = tiling.tiles(n, n)
    waves_at_peak = math.ceil(rows * cols / hw.sms) * at_peak.cta_tile_s(n, tiling, n)
    return waves_at_peak / (seconds - hw.launch_s)


def _kernel_gap(device: str) -> float:
    """Per-kernel cost of a chain of dependent tiny kernels (launch + ramp + tail)."""
    x = torch.zeros(1, device=device)
    count = 200

    def chain():
        for _ in range(count):
            x.add_(1.0)

    return time_fn(chain, device, warmup=2, repeats=5 if device == "cuda" else 1).median_s / count


# the SXM parts the data sheets have; an H100's PCIe and NVL forms have other peaks and links
SXM_SHEETS = ("h100", "h200", "b200")


def sheet_of(device_name: str) -> str:
    """The data sheet of the GPU torch names ``device_name``: ValueError, in one line naming those
    accepted, for any other (a model priced on another GPU's peak would be labelled as this one)."""
    words = device_name.lower().replace("-", " ").split()  # whole words: a GH200 is no H200
    found = [sheet for sheet in SXM_SHEETS if sheet in words]
    if len(found) != 1 or "pcie" in words or "nvl" in words:
        raise ValueError(
            f"no data sheet for {device_name!r} in the latency model: it has the SXM {', '.join(SXM_SHEETS)}"
        )
    return found[0]


def part_gpu(run: Run, device: str = "cuda"):
    """Measure; on a GPU return the latency model's hardware with this GPU's measured single-GPU
    parameters (None in the CPU dry run)."""
    from ctapipe import INTERPRETER_TILING, Tiling, sim

    cuda = device == "cuda"
    name = torch.cuda.get_device_name().lower() if cuda else "cpu"
    base = sim.from_sheet(sheet_of(name) if cuda else "h200")  # before any measuring
    tiling = Tiling() if cuda else INTERPRETER_TILING
    d = 8192 if cuda else 32
    rows = GPU_ROWS if cuda else DRY_ROWS
    dtype = torch.bfloat16 if cuda else torch.float32
    base_key = {"width": d, "dtype": str(dtype), "tiling": vars(tiling)}
    store = run.file(f"gpu_{device}.json", device)
    for m in rows:
        r = store.compute(
            {"measure": "mlp", "rows": m, **base_key}, lambda m=m: _mlp_methods(m, d, device, dtype, tiling)
        )
        s = r["summary"]
        print(
            f"single GPU, M={m}: CTA ticketed vs cuBLAS back-to-back {s['cta_vs_cublas_back_to_back']:+.1%}, "
            f"vs Triton back-to-back {s['cta_vs_triton_back_to_back']:+.1%}, vs best micro-batching "
            f"({s['best_microbatch']}) {s['cta_vs_best_microbatch'] or 0:+.1%}; SM partitions vs Triton "
            f"back-to-back {s['sm_partitions_vs_triton_back_to_back']:+.1%}"
        )
    # the stage kernel's efficiency per tile shape: the latency model's CTA tiles (Hardware.cta_efficiency)
    shapes = {}
    for shape in [tiling, *(Tiling(128, 256, 64),) * cuda]:
        key = {"measure": "kernel_throughput", **base_key, "tiling": vars(shape)}
        r = shapes[shape] = store.compute(key, lambda s=shape: _kernel_throughput(d, device, dtype, s))
        print(f"stage kernel, {shape.block_m} x {shape.block_n} tiles: {r['triton_tflops']:.1f} TFLOP/s")
    k = shapes[tiling]  # the default tiles': cuBLAS's throughput beside them
    print(f"stage kernel {k['triton_tflops']:.1f} TFLOP/s vs cuBLAS {k['cublas_tflops']:.1f} TFLOP/s")
    gap = store.compute({"measure": "kernel_gap_s"}, lambda: _kernel_gap(device))
    curve = store.compute(
        {"measure": "efficiency_by_rows", "width": d, "dtype": str(dtype)},
        lambda: _efficiency_by_rows(d, device, dtype, base),
    )
    print("cuBLAS tile efficiency by rows: " + ", ".join(f"{r}: {e:.0%}" for r, e in curve))
    if not cuda:
        return None
    return dataclasses.replace(
        base,
        name=f"{base.name}-measured",
        gemm_efficiency=k["cublas_tflops"] * 1e12 / base.flops,
        kernel_gap_s=gap,
        efficiency_by_rows=tuple((int(r), float(e)) for r, e in curve),
        cta_efficiency=tuple(
            ((t.block_m, t.block_n), tile_efficiency(base, d, t, 2.0 * d**3 / (r["triton_tflops"] * 1e12)))
            for t, r in shapes.items()
        ),
        source=f"{base.source}; GEMM efficiency by rows, the CTA kernel's by tile shape and kernel gap "
        f"measured on {name}",
    )
