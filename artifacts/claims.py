"""Every claim the README's claims table states, in one registry, checked against result files.

    python -m artifacts.claims [EXPERIMENT ...]      paper | reference | this run | verdict
    python -m artifacts.claims --markdown            the README's claims table (generated from here)

Each claim names the paper's number, where our number comes from (an experiment's result file
and how it is read off its points), a tolerance, the command that produces it and whether it
needs a GPU. "Reference" is the committed ``artifacts/<experiment>/reference/`` result, "this run"
the git-ignored ``artifacts/<experiment>/results/`` of this machine. A claim is within its
tolerance, outside it, or not run (no result yet); timings are shown but never judged. The command
exits non-zero if any claim that was run is outside its tolerance.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from measure.results import Results

from .experiment import ARTIFACTS
from .mist_vs_megatron.measured import SYSTEMS as MEASURED_SYSTEMS
from .mist_vs_megatron.measured import measured_speedups
from .tempo_bert.summary import training_summary
from .tempo_llama.summary import ROUNDING_CONTROL, training_gaps

SOURCES = ("reference", "results")


class Missing(LookupError):
    """A point a claim reads is not in the result file (the claim was not run)."""


# ---------------------------------------------------------------- checks


@dataclass(frozen=True)
class Near:
    """This run within ``abs`` (+ ``rel`` x |reference|) of the reference."""

    abs: float = 0.0
    rel: float = 0.0

    def ok(self, value: float, reference: float | None) -> bool | None:
        if reference is None:
            return None
        return abs(value - reference) <= self.abs + self.rel * abs(reference)

    def describe(self, unit: str) -> str:
        if self.abs == 0 and self.rel == 0:
            return "= reference"
        step = f"{self.abs * 100:g} pt" if unit == "%" else _format(self.abs, unit, signed=False)
        parts = [step] if self.abs else []
        parts += [f"{self.rel:.0%} of it"] if self.rel else []
        return "reference ± " + " + ".join(parts)


@dataclass(frozen=True)
class AtMost:
    bound: float

    def ok(self, value: float, reference: float | None) -> bool:
        return value <= self.bound

    def describe(self, unit: str) -> str:
        return f"≤ {_format(self.bound, unit, signed=False)}"


@dataclass(frozen=True)
class AtLeast:
    bound: float

    def ok(self, value: float, reference: float | None) -> bool:
        return value >= self.bound

    def describe(self, unit: str) -> str:
        return f"≥ {_format(self.bound, unit, signed=False)}"


@dataclass(frozen=True)
class Timing:
    """A timing: shown next to the reference, never judged (timings are benchmarks, not tests)."""

    def ok(self, value: float, reference: float | None) -> None:
        return None

    def describe(self, unit: str) -> str:
        return "timing: not judged"


Check = Near | AtMost | AtLeast | Timing


def _format(value: float | None, unit: str, signed: bool = True) -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{value:+.1%}" if signed else f"{value:.1%}"
    if unit == "x":
        return f"{value:.2f}×"
    if unit == "e":
        return f"{value:.1e}"
    if unit == "int":
        return f"{value:.0f}"
    return f"{value:.3g}"


# ---------------------------------------------------------------- claims


@dataclass(frozen=True)
class Claim:
    id: str
    system: str  # Tempo | Mist | CTA-pipelining
    claim: str  # what the paper claims, briefly
    paper: str  # the paper's number, as it states it
    measure: str  # what our number is
    experiment: str  # artifacts/<experiment>
    file: str  # the result file our number is read from
    value: Callable[[Results], float]  # raises Missing when a point it needs is absent
    check: Check
    command: str
    gpu: bool = False
    unit: str = ""
    # Why the committed reference is outside the tolerance and what would bring it in: shown with
    # the verdict; a claim outside without it fails (tests and the command), and one marked but
    # inside fails the tests (the mark must go when the cause is fixed)
    known_outside: str = ""

    def read(self, source: str) -> float | None:
        results = Results.load(ARTIFACTS / self.experiment / source / self.file)
        try:
            value = self.value(results)
        except Missing:
            return None
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _one(results: Results, **fields) -> dict:
    point = results.one(**fields)
    if point is None:
        raise Missing(fields)
    return point.result


def _layer_saving(seq: int, variant: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        ours = _one(r, seq=seq, variant=variant, dtype="bf16", batch=1)["bytes"]
        return 1 - ours / _one(r, seq=seq, variant="hf-eager", dtype="bf16", batch=1)["bytes"]

    return value


def _gelu_error(dtype: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        found = [p.result["relative_error"] for p in r.select(op="gelu_backward", dtype=dtype)]
        if not found:
            raise Missing(dtype)
        return max(found)

    return value


def _per_layer_saving(model: str, seq: int, ours: str, base: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        mine = _one(r, model=model, seq=seq, configuration=ours)["per_layer_bytes"]
        return 1 - mine / _one(r, model=model, seq=seq, configuration=base)["per_layer_bytes"]

    return value


def _batch_ratio(model: str, seq: int, ours: str, base: str, gpu: str, head: str = "pretraining",
                 precision: str = "fp16") -> Callable[[Results], float]:  # fmt: skip
    def value(r: Results) -> float:
        fields = {"model": model, "head": head, "seq": seq, "precision": precision}
        mine = _one(r, **fields, configuration=ours)[gpu]["max_batch"]
        theirs = _one(r, **fields, configuration=base)[gpu]["max_batch"]
        return mine / theirs if theirs else math.inf

    return value


def _training(key: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        summary = training_summary(r)
        if key not in summary:
            raise Missing(key)
        return summary[key]

    return value


def _llama_saving(model: str, ours: str, base: str = "hf-sdpa") -> Callable[[Results], float]:
    def value(r: Results) -> float:
        mine = _one(r, model=model, configuration=ours)["per_layer_bytes"]
        return 1 - mine / _one(r, model=model, configuration=base)["per_layer_bytes"]

    return value


def _llama_formula_error(r: Results) -> float:
    """The largest |measured - closed form| / closed form over every layer point."""
    if not len(r):
        raise Missing("layer points")
    return max(p.result["formula_error"] for p in r)


def _llama_batch_ratio(model: str, seq: int, ours: str, gpu: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        mine = _one(r, model=model, seq=seq, configuration=ours)[gpu]["max_batch"]
        theirs = _one(r, model=model, seq=seq, configuration="hf-sdpa")[gpu]["max_batch"]
        return mine / theirs if theirs else math.inf

    return value


def _llama_training(run: str, over_control: bool = False) -> Callable[[Results], float]:
    """A run's max |loss difference| against HF SDPA (over that of the rounding control)."""

    def value(r: Results) -> float:
        gaps = training_gaps(r)
        if run not in gaps or (over_control and ROUNDING_CONTROL not in gaps):
            raise Missing(run)
        return gaps[run] / gaps[ROUNDING_CONTROL] if over_control else gaps[run]

    return value


def _liger_vs_tempo(r: Results) -> float:
    """1 - Tempo's per-layer bytes / Liger-Kernel's, Llama-3.2-1B (Tempo's from the layer part's
    reference: exact bytes, the same on any machine)."""
    liger = _one(r, model="llama-3.2-1b", configuration="liger")["per_layer_bytes"]
    layer = Results.load(ARTIFACTS / "tempo_llama" / "reference" / "layer_saved_bytes.json")
    return 1 - _one(layer, model="llama-3.2-1b", configuration="tempo+sdpa")["per_layer_bytes"] / liger


def _throughput_gain(model: str, seq: int) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        found = {p.key["configuration"]: p.result for p in r.select(model=model, seq=seq)}
        if "tempo" not in found or "hf-eager" not in found:
            raise Missing(model)
        return found["tempo"]["seqs_per_s_at_max_batch"] / found["hf-eager"]["seqs_per_s_at_max_batch"] - 1

    return value


def _calibration(r: Results) -> float:
    found = [p.result["mean_abs_error"] for p in r.select(model="runtime")]
    if not found:
        raise Missing("runtime")
    return max(found)


def _interference(r: Results) -> float:
    found = [p.result["held_out_mean_abs_error"] for p in r.select(model="interference")]
    if not found:
        raise Missing("interference")
    return max(found)


def _validation(source: str, field: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        rows = [p.result for p in r.select(source=source)]
        if not rows:
            raise Missing(source)
        if field == "time":
            return statistics.fmean(abs(x["time_error"]) for x in rows)
        return statistics.fmean(abs(e) for x in rows for e in x["memory_errors"])

    return value


def _speedup(gpu: str, versus: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        ratios = [
            p.result[versus]["iteration_s"] / p.result["mist"]["iteration_s"]
            for p in r.select(gpu=gpu)
            if "iteration_s" in p.result.get("mist", {}) and "iteration_s" in p.result.get(versus, {})
        ]
        if not ratios:
            raise Missing(gpu)
        return statistics.geometric_mean(ratios)

    return value


def _tuning_time(r: Results) -> float:
    return _one(r, gpu="a100-40gb", model="gpt3-22b", flash=True)["mist"]["tuning_s"]


def _engine(field: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        runs = [p.result for p in r.select(setup="engine")]
        if not runs:
            raise Missing("engine")
        if field == "memory_error":
            return max(abs(rank["memory_error"]) for x in runs for rank in x["ranks"])
        if field == "worst_time_error":
            return max(abs(x["time_error"]) for x in runs)
        return statistics.median(abs(x["time_error"]) for x in runs)

    return value


def _measured_speedup(versus: str, stat: str) -> Callable[[Results], float]:
    """Mist's measured speedup over ``versus`` (the cap-bound cases trained on one device): the
    arithmetic ``mean`` or the ``max`` over cases (as the paper states them), or the ``worst`` case
    with the launch-to-launch spread of the two runs added (a case within it of 1.0 is a tie)."""

    def value(r: Results) -> float:
        rows = measured_speedups(r, versus)
        if not rows:
            raise Missing(versus)
        if stat == "worst":
            return min(x["measured"] + x["spread"] for x in rows)
        return (statistics.mean if stat == "mean" else max)(x["measured"] for x in rows)

    return value


def _measured_runs(r: Results) -> list[dict]:
    cases = [p.result for p in r]  # the file's cases (measured.json: this CPU's; gpu_measured.json)
    if not cases:
        raise Missing("measured")
    return cases


def _measured_time_error(r: Results) -> float:
    """Worst |predicted / measured step time - 1| over every plan a system chose and trained."""
    runs = [x[s] for x in _measured_runs(r) for s in MEASURED_SYSTEMS if s in x]
    return max(abs(x["time_error"]) for x in runs if "time_error" in x)


def _plain_plans_that_fit(r: Results) -> float:
    """The negative control: cases whose plain plan ran within the cap (each must not)."""
    return sum("measured_step_s" in x["plain"] for x in _measured_runs(r))  # ran, with a time


def _kernels(r: Results) -> float:
    found = [p.result for p in r.select(check="mlp")]
    if not found:
        raise Missing("mlp")
    return max(max(x["stages_rel_error"], x["ticket_rel_error"]) for x in found)


def _negative_control(with_wait: bool) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        x = _one(r, check="chain")
        return x["with_wait" if with_wait else "negative_control_no_wait"]["max_abs_error"]

    return value


def _cta_reduction(hardware: str, versus: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        found = [p.result[f"cta_vs_{versus}"] for p in r.select(hardware=hardware, gpus=2)]
        if not found:
            raise Missing(hardware)
        return max(found)

    return value


def _cta_gpu(r: Results) -> float:
    found = [p.result["summary"]["cta_vs_cublas_back_to_back"] for p in r.select(measure="mlp")]
    if not found:
        raise Missing("mlp")
    return max(found)


T, M, C = "Tempo", "Mist", "CTA-pipelining"
LAYER = "nox -s tempo_layer"
LLAMA = "nox -s tempo_llama"
BERT = "nox -s tempo_bert"
MIST = "nox -s mist_vs_megatron"
CTA = "nox -s cta_mlp"
GPU_CHECK = "nox -s gpu_check"
EXACT = Near(abs=0.001)  # exact byte counts: only a change of code moves them
CLAIMS: tuple[Claim, ...] = (
    Claim("tempo-layer-512", T, "keeps less for backward: one BERT-Large layer",
          "26sbh + 3as²b vs 34sbh + 5as²b",
          "saved bytes, Tempo vs HF eager, seq 512 (bf16, batch 1, dropout 0.1)", "tempo_layer",
          "layer_saved_bytes.json", _layer_saving(512, "tempo"), EXACT, LAYER, unit="%"),
    Claim("tempo-layer-128", T, "...at seq 128", "-", "the same at seq 128", "tempo_layer",
          "layer_saved_bytes.json", _layer_saving(128, "tempo"), EXACT, LAYER, unit="%"),
    *(Claim(f"tempo-layer-{v}", T, f"...{name} alone", "-", f"the same, {name} technique alone, seq 512",
            "tempo_layer", "layer_saved_bytes.json", _layer_saving(512, f"{v}-only"), EXACT, LAYER, unit="%")
      for v, name in (("attention", "attention"), ("gelu", "GELU"), ("layernorm", "LayerNorm"),
                      ("dropout", "dropout"))),
    Claim("gelu-backward-fp32", T, "in-place GELU: backward from the output", "polynomial fit (approximate)",
          "GELU backward vs autograd, relative error, fp32 (1M fresh inputs)", "tempo_layer",
          "gelu_backward.json", _gelu_error("fp32"), AtMost(1e-5), LAYER, unit="e"),
    Claim("gelu-backward-fp64", T, "...in float64", "-", "the same in float64", "tempo_layer",
          "gelu_backward.json", _gelu_error("fp64"), AtMost(1e-10), LAYER, unit="e"),
    Claim("tempo-in-model-bert", T, "per layer inside BERT-Large", "-",
          "bytes kept per layer inside the model, Tempo vs HF eager, seq 512", "tempo_bert",
          "activation_memory.json", _per_layer_saving("bert-large", 512, "tempo", "hf-eager"), EXACT, BERT,
          unit="%"),
    Claim("tempo-in-model-gpt2", T, "...inside GPT-2 XL", "-", "the same, GPT-2 XL, seq 1024", "tempo_bert",
          "activation_memory.json", _per_layer_saving("gpt2-xl", 1024, "tempo", "hf-eager"), EXACT, BERT,
          unit="%"),
    Claim("tempo-sdpa-in-model-bert", T, "...composes with SDPA", "-",
          "the same, Tempo + SDPA vs HF SDPA, BERT-Large seq 512", "tempo_bert", "activation_memory.json",
          _per_layer_saving("bert-large", 512, "tempo+sdpa", "hf-sdpa"), EXACT, BERT, unit="%"),
    Claim("maxbatch-bert", T, "larger batches fit", "up to 2×",
          "max batch, Tempo / HF eager, BERT-Large seq 512, fp16 + fp32 AdamW, 16 GB (estimated)",
          "tempo_bert", "max_batch.json", _batch_ratio("bert-large", 512, "tempo", "hf-eager", "V100-16GB"),
          Near(), BERT, unit="x"),
    Claim("maxbatch-roberta", T, "...RoBERTa-large", "up to 2×", "the same, RoBERTa-large seq 512",
          "tempo_bert", "max_batch.json",
          _batch_ratio("roberta-large", 512, "tempo", "hf-eager", "V100-16GB"),
          Near(), BERT, unit="x"),
    Claim("maxbatch-gpt2", T, "...GPT-2 XL", "up to 2×", "the same, GPT-2 XL seq 1024, 80 GB", "tempo_bert",
          "max_batch.json", _batch_ratio("gpt2-xl", 1024, "tempo", "hf-eager", "A100-80GB"), Near(), BERT,
          unit="x"),
    Claim("maxbatch-sdpa", T, "...composes with SDPA", "-",
          "max batch, Tempo + SDPA / HF SDPA, BERT-Large seq 512, 16 GB", "tempo_bert", "max_batch.json",
          _batch_ratio("bert-large", 512, "tempo+sdpa", "hf-sdpa", "V100-16GB"), Near(), BERT, unit="x"),
    Claim("maxbatch-cli-example", T, "...for any model and head", "-",
          "`python -m tempo.maxbatch --model bert-large --head qa --seq 384 --precision fp32 "
          "--gpu-mem 11GB`: "
          "Tempo / HF eager", "tempo_bert", "max_batch.json",
          _batch_ratio("bert-large", 384, "tempo", "hf-eager", "2080Ti-11GB", "qa", "fp32"), Near(), BERT,
          unit="x"),
    Claim("same-training-bert", T, "trains the same model", "same accuracy",
          "BERT (MLM + NSP), dropout off, fp32, 150 steps: max |loss difference| vs HF", "tempo_bert",
          "training.json", _training("bert-mini dropout off: max |loss difference|"), AtMost(1e-3), BERT,
          unit="e"),
    Claim("same-training-gpt2-fp64", T, "...exactly, up to rounding", "-",
          "GPT-2 (LM), dropout off, float64: max |loss difference| vs HF", "tempo_bert", "training.json",
          _training("gpt2-mini dropout off, float64 control: max |loss difference|"), AtMost(1e-5), BERT,
          unit="e"),
    Claim("same-training-dropout", T, "...with dropout on (other masks, same distribution)", "-",
          "BERT, dropout 0.1, 10 dropout seeds each: last-50-step loss, Tempo - baseline, the larger end "
          "of its 90% interval (baseline sd over seeds: ~0.01)", "tempo_bert", "training.json",
          _training("bert-mini dropout 0.1: last-50-step loss, Tempo - baseline, 90% interval bound"),
          AtMost(0.02), BERT),
    Claim("same-training-dropout-band", T, "...", "-",
          "the same runs: median pairwise mean |loss difference|, Tempo-baseline over baseline-baseline",
          "tempo_bert", "training.json",
          _training("bert-mini dropout 0.1: median pairwise mean |loss difference|, Tempo-baseline over "
                    "baseline-baseline"), AtMost(1.25), BERT, unit="x"),
    Claim("dropout-distribution", T, "...dropout masks from a seed: same distribution", "-",
          "BERT encoder output over 400 dropout draws at fixed weights (initial, trained): "
          "|total variance ratio - 1|, Tempo vs HF", "tempo_bert", "training.json",
          _training("dropout at fixed weights: |variance ratio - 1|, Tempo vs HF (worst)"), AtMost(0.01),
          BERT, unit="%"),
    Claim("dropout-distribution-control", T, "...", "-",
          "the same check's negative control: HF at dropout 0.08 and 0.12 vs 0.1, |variance ratio - 1|",
          "tempo_bert", "training.json",
          _training("dropout at fixed weights: |variance ratio - 1|, wrong rates vs HF (least)"),
          AtLeast(0.1), BERT, unit="%"),
    Claim("throughput-bert-gpu", T, "larger batch trains faster", "+16% (BERT-Large)",
          "sequences/s at each one's measured max batch, Tempo vs HF eager, BERT-Large seq 512, 16 GB",
          "tempo_bert", "throughput_cuda.json", _throughput_gain("bert-large", 512), Timing(), GPU_CHECK,
          gpu=True, unit="%"),
    Claim("throughput-gpt2-gpu", T, "...GPT-2", "+19%", "the same, GPT-2 medium seq 1024", "tempo_bert",
          "throughput_cuda.json", _throughput_gain("gpt2-medium", 1024), Timing(), GPU_CHECK, gpu=True,
          unit="%"),
    Claim("throughput-roberta-gpu", T, "...RoBERTa", "+26%", "the same, RoBERTa-large seq 512", "tempo_bert",
          "throughput_cuda.json", _throughput_gain("roberta-large", 512), Timing(), GPU_CHECK, gpu=True,
          unit="%"),
    Claim("throughput-cpu", T, "...on a CPU (no memory wall: not expected)", "-",
          "the same on a CPU: 4-layer BERT (h 256, seq 256, fp32) under a stated 512 MiB budget",
          "tempo_bert",
          "throughput_cpu.json", _throughput_gain("bert-l4h256", 256), Timing(), BERT, unit="%"),
    Claim("llama-layer", T, "beyond the paper: a Llama decoder layer keeps less", "-",
          "bytes one decoder layer keeps, Tempo (RMSNorm + SwiGLU) + SDPA vs HF SDPA, Llama-3.2-1B shapes, "
          "seq 1024 (bf16, batch 1)", "tempo_llama", "layer_saved_bytes.json",
          _llama_saving("llama-3.2-1b", "tempo+sdpa"), AtLeast(0.35), LLAMA, unit="%"),
    Claim("llama-layer-8b", T, "...Llama-3-8B shapes", "-", "the same, Llama-3-8B shapes", "tempo_llama",
          "layer_saved_bytes.json", _llama_saving("llama-3-8b", "tempo+sdpa"), EXACT, LLAMA, unit="%"),
    Claim("llama-layer-formula", T, "...as its closed form says", "-",
          "every configuration, both shapes: worst |measured / closed form - 1|", "tempo_llama",
          "layer_saved_bytes.json", _llama_formula_error, AtMost(0.0), LLAMA, unit="e"),
    Claim("llama-liger", T, "...less than Liger-Kernel keeps", "-",
          "the same layer, Tempo + SDPA vs Liger-Kernel's RMSNorm, SwiGLU and rotary (Triton: GPU only)",
          "tempo_llama", "peers.json", _liger_vs_tempo, AtLeast(0.0), GPU_CHECK, gpu=True, unit="%"),
    Claim("llama-maxbatch", T, "...larger batches fit", "-",
          "max batch, Tempo + SDPA / HF SDPA, Llama-3.2-1B seq 4096, bf16 + fp32 AdamW, 80 GB (estimated)",
          "tempo_llama", "max_batch.json",
          _llama_batch_ratio("llama-3.2-1b", 4096, "tempo+sdpa", "A100-80GB"), Near(), LLAMA, unit="x"),
    Claim("llama-maxbatch-loss", T, "...more with the memory-lean loss", "-",
          "the same, Tempo + SDPA + chunked linear cross-entropy / HF SDPA", "tempo_llama", "max_batch.json",
          _llama_batch_ratio("llama-3.2-1b", 4096, "tempo+sdpa+loss", "A100-80GB"), Near(), LLAMA, unit="x"),
    Claim("llama-same-training", T, "...and trains the same model", "-",
          "small Llama, fp32, 150 steps: max |loss difference|, Tempo + SDPA vs HF SDPA", "tempo_llama",
          "training.json", _llama_training("tempo+sdpa"), AtMost(1e-5), LLAMA, unit="e"),
    Claim("llama-same-training-loss", T, "...also with the memory-lean loss", "-",
          "the same, Tempo + SDPA + chunked linear cross-entropy, over the rounding band (HF with each "
          "batch's rows reversed: the same math summed in another order, against HF)", "tempo_llama",
          "training.json", _llama_training("tempo+sdpa+loss", over_control=True), AtMost(1.0), LLAMA,
          unit="x"),
    Claim("mist-runtime-model", M, "the runtime model predicts a layer closely", "-",
          "per-layer time vs the profiled per-op sums, held-out model sizes: worst mean error over the "
          "five GPU profile sets", "mist_vs_megatron", "calibration.json", _calibration, Near(abs=0.005),
          MIST,
          unit="%"),
    Claim("mist-interference", M, "overlap interference is modelled", "-",
          "overlapped GEMM/NCCL/copy runs held out: worst mean error (L4, A100)", "mist_vs_megatron",
          "calibration.json", _interference, Near(abs=0.005), MIST, unit="%"),
    Claim("mist-validate-l4-time", M, "predicts real runs (Mist's plans, L4)", "~6% (Mist's own model)",
          "`mist validate`: Mist-tuned plans measured on L4 (GPT-3 1.3B, 2 stages), mean "
          "|iteration time error|",
          "mist_vs_megatron", "validation.json", _validation("mist-l4.json", "time"), Near(abs=0.005), MIST,
          unit="%"),
    Claim("mist-validate-l4-memory", M, "...and their memory", "~0.1% (Mist's own model)",
          "the same runs: mean |per-stage peak memory error|", "mist_vs_megatron", "validation.json",
          _validation("mist-l4.json", "memory"), Near(abs=0.005), MIST, unit="%"),
    Claim("mist-validate-a10g-time", M, "...and Megatron-LM runs (A10G)", "-",
          "`mist validate`: Megatron-LM runs on 8 A10G (GPT-3 1.3B-6.7B, pipelines of 2-8 stages), mean "
          "|iteration time error|", "mist_vs_megatron", "validation.json",
          _validation("megatron-a10g.json", "time"), Near(abs=0.005), MIST, unit="%"),
    Claim("mist-tuning-time", M, "tunes fast", "tens of s to >1,000 s",
          "tuning time, GPT-3 22B on 32 A100-40GB, seq 4096, batch 512, 2 CPU cores (s)", "mist_vs_megatron",
          "comparison.json", _tuning_time, Timing(), MIST),
    Claim("mist-vs-megatron-l4", M, "beats Megatron-LM", "1.28× mean (up to 1.73×)",
          "predicted speedup over the Megatron-LM grid, geometric mean, L4 cases", "mist_vs_megatron",
          "comparison.json", _speedup("l4", "megatron"), Near(abs=0.01), MIST, unit="x"),
    Claim("mist-vs-megatron-a100", M, "...", "1.28× mean (up to 1.73×)", "the same, A100 cases",
          "mist_vs_megatron", "comparison.json", _speedup("a100-40gb", "megatron"), Near(abs=0.01), MIST,
          unit="x"),
    Claim("mist-vs-aceso-l4", M, "beats Aceso", "1.27× mean (up to 2.04×)",
          "predicted speedup over the Aceso-style search (10 s budget), geometric mean, L4",
          "mist_vs_megatron",
          "comparison.json", _speedup("l4", "aceso"), Near(abs=0.05), MIST, unit="x"),
    Claim("mist-vs-aceso-a100", M, "...", "1.27× mean (up to 2.04×)", "the same, A100", "mist_vs_megatron",
          "comparison.json", _speedup("a100-40gb", "aceso"), Near(abs=0.05), MIST, unit="x"),
    Claim("mist-engine-memory", M, "plans run; the memory model is right", "-",
          "megatron-core on 2 gloo processes, 6 plans: worst |predicted / measured memory - 1|",
          "mist_vs_megatron", "engine.json", _engine("memory_error"), AtMost(0.10), MIST, unit="%"),
    Claim("mist-engine-time", M, "...and the time model", "-",
          "the same plans: median |predicted / measured step time - 1| (CPU runtime model)",
          "mist_vs_megatron",
          "engine.json", _engine("time_error"), Timing(), MIST, unit="%"),
    Claim("mist-engine-time-worst", M, "...for every plan", "-",
          "the same plans: worst |predicted / measured step time - 1| (#12's target: 20%)",
          "mist_vs_megatron",
          "engine.json", _engine("worst_time_error"), Timing(), MIST, unit="%"),
    Claim("mist-measured-vs-megatron", M, "beats Megatron-LM, measured", "1.28× mean (up to 1.73×)",
          "measured speedup over the Megatron-LM grid's plan, arithmetic mean over the cases both fit: "
          "GPT-3 and Llama (h 256, 4 layers) on 1 and 2 gloo processes under a per-rank memory cap, "
          "every winner trained by megatron-core (this CPU, 3 launches each)", "mist_vs_megatron",
          "measured.json", _measured_speedup("megatron", "mean"), AtLeast(1.0), MIST, unit="x"),
    Claim("mist-measured-vs-megatron-max", M, "...", "up to 1.73×", "the same, the largest case",
          "mist_vs_megatron", "measured.json", _measured_speedup("megatron", "max"), AtLeast(1.0), MIST,
          unit="x"),
    Claim("mist-measured-vs-aceso", M, "beats Aceso, measured", "1.27× mean (up to 2.04×)",
          "the same over the Aceso-style search's plan (10 s budget)", "mist_vs_megatron", "measured.json",
          _measured_speedup("aceso", "mean"), AtLeast(1.0), MIST, unit="x"),
    Claim("mist-measured-vs-aceso-max", M, "...", "up to 2.04×", "the same, the largest case",
          "mist_vs_megatron", "measured.json", _measured_speedup("aceso", "max"), AtLeast(1.0), MIST,
          unit="x"),
    *(Claim(f"mist-measured-not-slower-{v}", M, "...and never loses", "-",
            f"the same cases: the worst measured speedup over {name} plus the launch-to-launch spread of the "
            "two runs (below 1.0: Mist measured slower beyond the noise)", "mist_vs_megatron",
            "measured.json", _measured_speedup(v, "worst"), AtLeast(1.0), MIST, unit="x")
      for v, name in (("megatron", "the grid"), ("aceso", "Aceso"))),
    Claim("mist-measured-time", M, "...as predicted", "-",
          "the same runs, every system's winner: worst |predicted / measured step time - 1| (CPU runtime "
          "model, 1F1B simulator; #24's target: 20%)", "mist_vs_megatron", "measured.json",
          _measured_time_error, Timing(), MIST, unit="%"),
    Claim("mist-measured-cap-binds", M, "...under a cap that binds", "-",
          "negative control: cases whose plain plan (DP over all, no accumulation, nothing saved) ran "
          "within the cap when measured (each must run out of memory)", "mist_vs_megatron",
          "measured.json", _plain_plans_that_fit, AtMost(0), MIST, unit="int"),
    Claim("mist-gpu-measured-vs-megatron", M, "beats Megatron-LM, measured on a GPU",
          "1.28× mean (up to 1.73×)",
          "as mist-measured-vs-megatron, on one H200: GPT-3 1.3B and 2.7B (seq 2048, unfused attention) "
          "under 32 and 64 GiB caps, Mist offloading only what the GPU engine can (optimizer, activations), "
          "every winner trained by megatron-core (2 launches)", "mist_vs_megatron", "gpu_measured.json",
          _measured_speedup("megatron", "mean"), AtLeast(1.0), GPU_CHECK, gpu=True, unit="x"),
    Claim("mist-gpu-measured-vs-aceso", M, "beats Aceso, measured on a GPU", "1.27× mean (up to 2.04×)",
          "the same over the Aceso-style search's plan", "mist_vs_megatron", "gpu_measured.json",
          _measured_speedup("aceso", "mean"), AtLeast(1.0), GPU_CHECK, gpu=True, unit="x"),
    Claim("mist-gpu-measured-time", M, "...as predicted", "-",
          "the same runs: worst |predicted / measured step time - 1| (runtime model fitted to the GPU's "
          "`mist profile` at the 1.3B shape; #24's target: 20%)", "mist_vs_megatron", "gpu_measured.json",
          _measured_time_error, Timing(), GPU_CHECK, gpu=True, unit="%"),
    Claim("mist-gpu-measured-cap-binds", M, "...under a cap that binds", "-",
          "negative control: cases whose plain plan ran within the GPU cap (each must run out of memory)",
          "mist_vs_megatron", "gpu_measured.json", _plain_plans_that_fit, AtMost(0), GPU_CHECK, gpu=True,
          unit="int"),
    Claim("cta-kernels", C, "CTA-pipelined GEMM kernels are correct", "-",
          "stage and ticketed kernels vs torch.matmul, max relative error (interpreter)", "cta_mlp",
          "kernels_cpu.json", _kernels, AtMost(1e-5), CTA, unit="e"),
    Claim("cta-wait", C, "...and the wait is what makes them so", "-",
          "two concurrent processes, producer 1 s late: max error with the wait", "cta_mlp",
          "kernels_cpu.json",
          _negative_control(True), AtMost(1e-5), CTA, unit="e"),
    Claim("cta-negative-control", C, "...", "-",
          "the same without the wait, producer after the consumer (negative control): max error", "cta_mlp",
          "kernels_cpu.json", _negative_control(False), AtLeast(0.1), CTA),
    *(Claim(f"cta-{hw}-vs-{vs}", C, f"cuts a 2-GEMM chain's latency vs {name}", paper,
            f"latency model, {hw.upper()}, 2 GPUs, best over M = 1k-32k, vs {name}", "cta_mlp", "sim.json",
            _cta_reduction(hw, vs), Near(abs=0.001), CTA, unit="%")
      for hw in ("h200", "b200")
      for vs, name, paper in (("microbatch", "the best micro-batching", "up to 31.8%"),
                              ("tp", "TP", "up to 29.6%"))),
    Claim("cta-single-gpu", C, "...measured (one GPU as the chain)", "-",
          "ticketed one-kernel MLP vs cuBLAS back to back, H200, best over M", "cta_mlp", "gpu_cuda.json",
          _cta_gpu, Timing(), GPU_CHECK, gpu=True, unit="%"),
)  # fmt: skip


# ---------------------------------------------------------------- verdicts and tables


KNOWN_OUTSIDE = "OUTSIDE (known)"


@dataclass(frozen=True)
class Row:
    claim: Claim
    reference: float | None
    this_run: float | None
    verdict: str  # within tolerance | OUTSIDE | OUTSIDE (known) | not run | not judged | no reference


def evaluate(claims: tuple[Claim, ...] = CLAIMS, run_source: str = "results") -> list[Row]:
    rows = []
    for c in claims:
        reference, value = c.read("reference"), c.read(run_source)
        if value is None:
            verdict = "not run"
        else:
            ok = c.check.ok(value, reference)
            verdict = {True: "within tolerance", False: "OUTSIDE", None: "not judged"}[ok]
            if ok is None and not isinstance(c.check, Timing):
                verdict = "no reference"
            if ok is False and c.known_outside:
                verdict = KNOWN_OUTSIDE
        rows.append(Row(c, reference, value, verdict))
    return rows


def print_table(rows: list[Row], file=None) -> None:
    file = file or sys.stdout
    w = max(len(r.claim.id) for r in rows) if rows else 5
    header = f"{'claim':<{w}} {'paper':<24} {'reference':>10} {'this run':>10}  {'tolerance':<24} verdict"
    print(header, file=file)
    for r in rows:
        c = r.claim
        ref, this = _format(r.reference, c.unit), _format(r.this_run, c.unit)
        print(f"{c.id:<{w}} {c.paper[:24]:<24} {ref:>10} {this:>10}  "
              f"{c.check.describe(c.unit)[:24]:<24} {r.verdict}", file=file)  # fmt: skip


def markdown(claims: tuple[Claim, ...] = CLAIMS) -> str:
    """The README's claims table: one row per claim, our number from the reference results."""
    lines = [
        "| claim | system | paper claim | paper | our measure | reference | tolerance | command | needs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in claims:
        ref = _format(c.read("reference"), c.unit)
        ref = "not yet run" if ref == "-" else f"**{ref}**"
        tolerance = c.check.describe(c.unit)
        tolerance += f"; **outside**: {c.known_outside}" if c.known_outside else ""
        cells = [f"`{c.id}`", c.system, c.claim, c.paper, c.measure, ref, tolerance,
                 f"`{c.command}`", "GPU" if c.gpu else "CPU"]  # fmt: skip
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


README = ARTIFACTS.parent / "README.md"
BEGIN, END = (
    "<!-- claims table: generated by `python -m artifacts.claims --markdown` -->",
    "<!-- end of claims table -->",
)


def readme_table(readme: Path = README) -> str:
    text = readme.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN) + 1, text.index(END)
    return text[start:stop]


def write_readme(readme: Path = README) -> None:
    text = readme.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN) + 1, text.index(END)
    readme.write_text(text[:start] + markdown() + text[stop:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    experiments = sorted({c.experiment for c in CLAIMS})
    ap.add_argument("experiments", nargs="*", metavar="EXPERIMENT",
                    help=f"only these ({', '.join(experiments)}); default: all")  # fmt: skip
    ap.add_argument("--against", choices=SOURCES, default="results",
                    help="'this run': this machine's results (default) or the reference itself")  # fmt: skip
    ap.add_argument("--markdown", action="store_true", help="print the README's claims table")
    ap.add_argument("--write-readme", action="store_true", help="rewrite the README's claims table")
    args = ap.parse_args(argv)
    if unknown := sorted(set(args.experiments) - set(experiments)):
        ap.error(f"unknown experiment {', '.join(unknown)}; accepted: {', '.join(experiments)}")
    if args.markdown:
        print(markdown(), end="")
        return 0
    if args.write_readme:
        write_readme()
        print(f"claims table written to {README}")
        return 0
    chosen = tuple(c for c in CLAIMS if not args.experiments or c.experiment in args.experiments)
    rows = evaluate(chosen, args.against)
    print_table(rows)
    outside = [r.claim.id for r in rows if r.verdict == "OUTSIDE"]
    known = [r.claim for r in rows if r.verdict == KNOWN_OUTSIDE]
    ran = sum(r.verdict != "not run" for r in rows)
    print(f"\n{len(rows)} claims: {ran} run, {len(outside)} outside their tolerance"
          + (f" ({', '.join(outside)})" if outside else "")
          + (f"; {len(known)} outside as the committed reference is (below)" if known else ""))  # fmt: skip
    for c in known:
        print(f"{c.id}: outside, as the reference is: {c.known_outside}")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
