"""Throughput (sequences/s) against batch size, every configuration up to its maximum batch.

Tempo's claim is that its larger batch trains faster (+16% BERT-Large, +19% GPT-2, +26%
RoBERTa over HF at each one's maximum batch). Per (model, seq, precision, configuration):

1. the estimated maximum batch under the memory budget (fake-tensor estimate of an AdamW step);
2. on a GPU, the measured maximum: real steps under the allocator cap of the emulated GPU
   (measure.oom), starting from the estimate and catching out-of-memory;
3. training-step time at batch 1, 2, 4, ... and at the maximum, on the device it runs on.

On a CPU there is no memory wall: the budget is stated, the maximum is the estimator's, and
whether the larger batch pays off there is reported as measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from measure.budget import GpuBudget
from measure.memory import default_dtype
from measure.oom import device_fits, emulate_gpu_memory, largest_fitting
from measure.parallel import map_points
from measure.results import ResultFile, Results, Run
from measure.timing import time_fn
from measure.training import Precision, make_optimizer, train_step
from measure.units import GiB
from tempo.maxbatch import estimator
from tempo.models import build_model, make_batch


@dataclass(frozen=True)
class ThroughputSetup:
    cases: tuple[tuple[str, int], ...]  # (model, seq)
    configs: tuple[str, ...]
    precision: str
    gpu: str  # the memory budget: a GPU size ("16GB"), or usable bytes as such on a CPU
    reserve: bool  # subtract the CUDA context and fragmentation reserve from ``gpu``
    warmup: int
    repeats: int

    @property
    def budget(self) -> GpuBudget:
        if self.reserve:
            return GpuBudget.parse(self.gpu)
        return GpuBudget.parse(self.gpu, context_bytes=0, fragmentation=0.0)


def ladder(max_batch: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch``, then ``max_batch`` itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch] if max_batch > 0 else []


def ready_optimizer(model, optimizer, precision: Precision, batch: dict) -> None:
    """Run steps until the optimizer holds its state (fp16 skips steps while the loss scale
    overflows): without it the first measured steps would be missing Adam's memory and work."""
    for _ in range(40):
        train_step(model, batch, optimizer, precision)
        if len(optimizer.state) > 0:
            return
    raise RuntimeError("the optimizer never took a step (loss scale kept overflowing)")


def estimate_point(model: str, seq: int, configuration: str, setup: ThroughputSetup) -> dict:
    b, report = estimator(model, "pretraining", seq, setup.precision, configuration).max_batch(
        setup.budget.usable_bytes
    )
    peak = None if report is None else round(report.peak_gib, 3)
    return {"estimated_max_batch": b, "estimated_peak_gib": peak}


def throughput_point(
    model: str, seq: int, configuration: str, setup: ThroughputSetup, device: str, estimate: dict
) -> dict:
    dev = torch.device(device)
    precision = Precision(setup.precision)
    est_batch = estimate["estimated_max_batch"]
    out = dict(estimate)

    def batch(b: int) -> dict:
        return make_batch(model, "pretraining", b, seq, device=dev)

    def measure(max_batch: int) -> dict:
        with dev, default_dtype(precision.model_dtype):
            m = build_model(model, "pretraining", configuration).train()
        opt = make_optimizer(m, precision)
        ready_optimizer(m, opt, precision, batch(1))
        if dev.type == "cuda":

            def two_steps(b: int) -> None:  # the second step runs at the steady state's peak
                data = batch(b)
                for _ in range(2):
                    train_step(m, data, opt, precision)

            max_batch, tried = largest_fitting(
                lambda b: device_fits(lambda: two_steps(b), dev), start=max(est_batch, 1)
            )
            out.update(measured_max_batch=max_batch, search_trials=tried)
        seqs_per_s = {}
        for b in ladder(max_batch):
            data = batch(b)
            t = time_fn(lambda d=data: train_step(m, d, opt, precision), device, setup.warmup, setup.repeats)
            seqs_per_s[str(b)] = b / t.median_s
        return seqs_per_s

    if dev.type == "cuda":
        with emulate_gpu_memory(setup.budget.capacity_bytes, setup.budget.context_bytes, dev) as cap:
            out["allocator_cap_gib"] = round(cap / GiB, 3)
            out["seqs_per_s"] = measure(est_batch)
    else:
        out["seqs_per_s"] = measure(est_batch)
    top = max(map(int, out["seqs_per_s"]), default=0)
    out["max_batch"] = top
    out["seqs_per_s_at_max_batch"] = out["seqs_per_s"].get(str(top), 0.0)
    return out


def throughput_key(model: str, seq: int, configuration: str, setup: ThroughputSetup) -> dict:
    """Everything that decides a point's result; the device is in its provenance (one file per type)."""
    return {
        "model": model,
        "seq": seq,
        "configuration": configuration,
        "precision": setup.precision,
        "gpu": setup.gpu,
        "reserve": setup.reserve,
        "warmup": setup.warmup,
        "repeats": setup.repeats,
    }


def run_throughput(run: Run, setup: ThroughputSetup, device: str, jobs: int) -> ResultFile:
    """One result file per device type; each (model, seq, precision, configuration) is a point.
    The estimates (CPU-bound) run first in worker processes, then the device measurements."""
    store = run.file(f"throughput_{torch.device(device).type}.json", device)
    todo = [
        (m, s, c)
        for m, s in setup.cases
        for c in setup.configs
        if not store.done(throughput_key(m, s, c, setup))
    ]
    estimates = {
        args: r
        for args, r, _ in map_points(estimate_point, [(*t, setup) for t in todo], jobs, "max-batch estimates")
    }
    for model, seq, conf in tqdm(todo, desc=f"throughput on {device}", unit="config"):
        est = estimates[(model, seq, conf, setup)]
        key = throughput_key(model, seq, conf, setup)
        store.compute(key, lambda m=model, s=seq, c=conf, e=est: throughput_point(m, s, c, setup, device, e))
    return store


def headline(store: Results) -> list[str]:
    """Each configuration's throughput at its own maximum batch, against HF eager at its own."""
    lines = []
    for p in store:
        k, r = p.key, p.result
        base = store.get({**k, "configuration": "hf-eager"})
        ratio = (
            f"{r['seqs_per_s_at_max_batch'] / base.result['seqs_per_s_at_max_batch'] - 1:+.1%}"
            if base and base.result["seqs_per_s_at_max_batch"]
            else ""
        )
        measured = r.get("measured_max_batch")
        budget = (
            f"{k['gpu']}{' less the reserve' if k['reserve'] else ''} on {p.provenance['device']['device']}"
        )
        lines.append(
            f"  {k['model'] + ' ' + str(k['seq']) + ' ' + k['precision']:<28} {k['configuration']:<16} "
            f"est. max {r['estimated_max_batch']:>4}"
            + (f"  measured max {measured:>4}" if measured is not None else "")
            + f"  {r['seqs_per_s_at_max_batch']:9.2f} seq/s at batch {r['max_batch']:<4} {ratio:>7}"
            + f"  ({budget})"
        )
    return lines
