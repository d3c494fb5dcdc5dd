"""Tempo's evaluation: activation memory, maximum batch size and same-training runs of BERT-Large,
RoBERTa-large and GPT-2, every configuration side by side.

    python -m artifacts.tempo_bert.run [--parts activation maxbatch training throughput]
                                       [--scale cpu|paper] [--fresh] [--update-reference]

Parts (results in artifacts/tempo_bert/results/, git-ignored; the committed reference is in
artifacts/tempo_bert/reference/; an interrupted run resumes when rerun):
* activation: bytes kept for backward, exact (measure.saved), per layer inside the model and per
  model, at batch 1 in bf16, with dropout and SDPA kept as their CUDA kernels keep them
  (measure.saved.cuda_like). The closed form a*sbh + b*as^2b of each configuration is solved
  from two sequence lengths and verified at a third. Also torch.compile's rows (HF eager
  compiled, Tempo compiled, HF eager compiled at the activation memory budget aimed at Tempo's
  bytes): the same bytes as torch.compile's partition keeps them (measure.compiled: AOTAutograd's
  min-cut partitioner on fake tensors, checked against inductor on a real layer), in bf16 as a
  GPU runs it. Below the default budget the partitioner splits each model as a whole: the
  at-Tempo row's difference of a 2- and a 1-layer model is then not a layer's bytes (its closed
  form misses, said where printed).
* maxbatch: the largest batch that fits 11/16/40/80/141 GB GPUs, from the fake-tensor estimate
  of a whole AdamW step (measure.memory; CUDA target, documented reserve).
  Also the ``python -m tempo.maxbatch`` example (BERT-Large QA head, seq 384, fp32).
  torch.compile's rows (default budget): the eager step with its saved activations counted at
  what the compiled model keeps, in the layers and elsewhere (measure.memory's ``kept_scale``;
  tempo.maxbatch.compile_kept_scale; the partitioned graphs run
  unfused on fake tensors, so their own transients would not be a compiled step's). That
  assumption is checked against real compiled steps measured on this CPU (compile_check.py).
* training: a small BERT (MLM + NSP) and a small GPT-2 (LM) trained from one seed on an offline
  corpus (artifacts/tempo_bert/data.py) with and without Tempo, dropout off (in fp32, and the
  judged float64 pairs) and on (ten dropout seeds each, against the baseline's own seed-to-seed
  band).
* throughput: sequences/s against batch size up to each configuration's maximum batch.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from measure.budget import GpuBudget
from measure.checks import device_name
from measure.cli import quiet_broken_pipe
from measure.memory import PeakReport, search_max_batch
from measure.parallel import map_points
from measure.results import ResultFile, Results, Run
from measure.timing import select_cuda_device
from measure.units import GiB
from tempo.maxbatch import (
    compile_kept_scale,
    estimator,
    kept_scale_json,
    kept_scale_text,
    saved_bytes_as_built,
)
from tempo.models import build_model, models

from ..experiment import config_from_command_line, experiment_run, option
from ..tempo_layer.run import COMPILED, aimed_budget
from . import EXPERIMENT
from .compile_check import compile_check_key, compile_check_point
from .data import CORPORA
from .summary import (
    DROPOUT_COMPARED,
    DROPOUT_REFERENCE,
    FLOAT64_LOSS,
    REVERSED,
    TRAIN,
    TRAIN_LR,
    TRAIN_RUNS,
    train_key,
    training_summary,
)
from .throughput import ThroughputSetup, headline, run_throughput

GPUS = {
    "2080Ti-11GB": "11GB",
    "V100-16GB": "16GB",
    "A100-40GB": "40GB",
    "A100-80GB": "80GB",
    "H200-141GB": "141GB",
}
MAIN_CONFIGS = ["hf-eager", "hf-sdpa", "tempo", "tempo+sdpa", "checkpointing"]
# torch.compile's rows with a max batch: those at the default budget (COMPILED's without an aim)
COMPILE_ROWS = [row for row, (_, aim) in COMPILED.items() if aim is None]
ABLATION_CONFIGS = ["tempo-gelu", "tempo-layernorm", "tempo-attention", "tempo-dropout"]
# (model, seq): the paper's settings. At --scale cpu, GPT-2 is its XL shape only (the largest).
CASES = {
    "cpu": [("bert-large", 128), ("bert-large", 512), ("roberta-large", 512), ("gpt2-xl", 1024)],
    "paper": [
        ("bert-large", 128),
        ("bert-large", 512),
        ("roberta-large", 512),
        ("gpt2-medium", 1024),
        ("gpt2-large", 1024),
        ("gpt2-xl", 1024),
    ],
}
ABLATION_CASE = ("bert-large", 512)
# Throughput: at --scale cpu a 4-layer BERT whose encoder (not its vocabulary head) holds most
# of the activation memory, under a stated budget, fp32 (the CPU's fast dtype); at paper scale
# the paper's models in half precision with fp32 Adam on an emulated 16 GB GPU (V100).
THROUGHPUT = {
    "cpu": ThroughputSetup(
        cases=(("bert-l4h256", 256),),
        configs=tuple(MAIN_CONFIGS),
        precision="fp32",
        gpu="512MiB",
        reserve=False,
        warmup=1,
        repeats=2,
    ),
    "paper": ThroughputSetup(
        cases=tuple(CASES["paper"]),
        configs=tuple(MAIN_CONFIGS + ABLATION_CONFIGS),
        precision="fp16",
        gpu="16GB",
        reserve=True,
        warmup=2,
        repeats=5,
    ),
}
PRECISIONS = {"cpu": ["fp16"], "paper": ["fp16", "fp32", "amp-fp16"]}
# docs/tempo.md's `python -m tempo.maxbatch` example: (model, head, seq, precision), HF eager and Tempo.
MAXBATCH_EXAMPLE = ("bert-large", "qa", 384, "fp32")


# ---------------------------------------------------------------- activation memory


def model_saved_bytes(
    model: str, configuration: str, seq: int, layers: int, budget: float | None = None
) -> tuple[int, dict[str, int]]:
    """Exact bytes a ``layers``-deep copy of ``model`` keeps for backward at batch 1 (bf16), by
    module type (tempo.maxbatch.saved_bytes_as_built). A configuration of COMPILED: its model as
    ``torch.compile`` partitions it at the activation memory ``budget``."""
    built, _ = COMPILED.get(configuration, (configuration, None))
    compiled_at = budget if configuration in COMPILED else None
    r = saved_bytes_as_built(model, built, seq, layers, compiled_at, "bf16")
    return r.total_bytes, r.by_module_type


def activation_point(model: str, configuration: str, seq: int, budget: float | None = None) -> dict:
    spec = models()[model]
    h, a = spec.hidden, spec.heads

    def per_layer(s: int) -> tuple[int, dict[str, int]]:
        one, by1 = model_saved_bytes(model, configuration, s, 1, budget)
        two, by2 = model_saved_bytes(model, configuration, s, 2, budget)
        return two - one, {k: by2.get(k, 0) - by1.get(k, 0) for k in by2 if by2.get(k, 0) != by1.get(k, 0)}

    layer, by_type = per_layer(seq)
    # Solve bytes = x*s*h + y*a*s^2 (b = 1) from two lengths; check the third.
    s2, s3 = seq // 2, seq // 4
    l2, _ = per_layer(s2)
    det = seq * h * a * s2 * s2 - s2 * h * a * seq * seq
    x = (layer * a * s2 * s2 - l2 * a * seq * seq) / det
    y = (seq * h * l2 - s2 * h * layer) / det
    l3, _ = per_layer(s3)
    predicted = x * s3 * h + y * a * s3 * s3
    first, _ = model_saved_bytes(model, configuration, seq, 1, budget)
    return {
        "per_layer_bytes": layer,
        "per_layer_by_module_type": by_type,
        "closed_form_bytes": {"sbh": round(x, 3), "as2b": round(y, 3)},
        "closed_form_checked_at_seq": s3,
        "closed_form_error": abs(predicted - l3) / l3,
        "per_model_bytes": first + (spec.layers - 1) * layer,  # every layer keeps the same bytes
        **({} if configuration not in COMPILED else {"activation_memory_budget": budget}),
    }


def activation_key(model: str, seq: int, configuration: str) -> dict:
    return {"model": model, "seq": seq, "configuration": configuration, "batch": 1, "dtype": "bf16"}


def run_activation(run: Run, cases, configs) -> ResultFile:
    """Every configuration's bytes per layer, then torch.compile's (COMPILED): HF eager compiled at
    the default budget, Tempo compiled, and HF eager compiled at the budget aimed at Tempo's bytes
    (aimed_budget: their share of what the default keeps, at the case's length)."""
    store = run.file("activation_memory.json", config={"dropout": "as on CUDA (bool mask)"})
    todo = list(itertools.product(cases, [*configs, *COMPILED]))
    for (model, seq), conf in tqdm(todo, desc="activation memory", unit="point"):
        budget = None
        if conf in COMPILED:
            aim = COMPILED[conf][1]
            default = store.get(activation_key(model, seq, "hf-eager+compile"))
            budget = (
                1.0
                if aim is None
                else aimed_budget(
                    store.get(activation_key(model, seq, aim)).result["per_layer_bytes"],
                    default.result["per_layer_bytes"],
                )
            )
        store.compute(
            activation_key(model, seq, conf),
            lambda m=model, s=seq, c=conf, b=budget: activation_point(m, c, s, b),
        )
    return store


# ---------------------------------------------------------------- maximum batch


def max_batch_per_gpu(peak: Callable[[int], PeakReport], gpus: dict[str, str]) -> dict:
    """The largest batch under each GPU's usable memory (name -> size, e.g. "16GB"), the peaks
    memoised so that the budgets share their probes."""
    peak = functools.cache(peak)
    out = {}
    for gpu, mem in gpus.items():
        budget = GpuBudget.parse(mem)
        b, report = search_max_batch(peak, budget.usable_bytes)
        out[gpu] = {
            "max_batch": b,
            "peak_gib": round(report.peak_gib, 3),
            "phase": report.peak_phase,
            "usable_gib": round(budget.usable_bytes / GiB, 3),
        }
    return out


def maxbatch_point(model: str, head: str, seq: int, precision: str, configuration: str) -> dict:
    """The largest batch per GPU; a configuration of COMPILED (default budget): its eager
    model's step with the saved activations counted at what the compiled model keeps
    (compile_kept_scale; measure.memory's ``kept_scale``)."""
    if configuration not in COMPILED:
        return max_batch_per_gpu(estimator(model, head, seq, precision, configuration).peak, GPUS)
    built, aim = COMPILED[configuration]
    if aim is not None:
        raise ValueError(f"{configuration}: a max-batch estimate needs the default budget")
    scale = compile_kept_scale(model, built, seq, precision)
    peak = estimator(model, head, seq, precision, built, kept_scale=scale).peak
    return {**max_batch_per_gpu(peak, GPUS), "kept_scale": kept_scale_json(scale)}


MAXBATCH_FIELDS = ("model", "head", "seq", "precision", "configuration")


def maxbatch_key(model: str, head: str, seq: int, precision: str, configuration: str) -> dict:
    fields = dict(zip(MAXBATCH_FIELDS, (model, head, seq, precision, configuration), strict=True))
    return {**fields, "optimizer": "AdamW", "reserve": GpuBudget(0).reserve}  # the default reserve


def run_maxbatch(run: Run, cases, configs, precisions, jobs: int, scale: str) -> ResultFile:
    store = run.file("max_batch.json", config={"gpus": GPUS, "target": "cuda (fake tensors)"})
    todo = [(m, "pretraining", s, p, c) for (m, s), p, c in itertools.product(cases, precisions, configs)]
    if scale == "cpu":  # reduced: checkpointing and the ablations on the headline case only
        todo = [
            t
            for t in todo
            if t[4] in MAIN_CONFIGS[:4] or ((t[0], t[2]) == ABLATION_CASE and t[4] in MAIN_CONFIGS)
        ]
    todo += [(*MAXBATCH_EXAMPLE, c) for c in ("hf-eager", "tempo")]
    # torch.compile's rows at the default budget (the at-Tempo budget partitions a model as a
    # whole: its bytes per model are not a layer's times the depth)
    todo += [
        (m, "pretraining", s, p, c) for (m, s), p, c in itertools.product(cases, precisions, COMPILE_ROWS)
    ]
    todo = [t for t in todo if not store.done(maxbatch_key(*t))]
    for args, result, seconds in map_points(maxbatch_point, todo, jobs, "max batch"):
        store.add(maxbatch_key(*args), result, seconds)  # each finished point is on disk at once
    check = run.file("compile_check.json", config={"measured": "this CPU (allocator events)"})
    print("\ntorch.compile's max-batch estimate against a compiled step's peak measured on this CPU:")
    for conf in ("hf-eager", "tempo"):  # the compile rows' estimate against a compiled step
        r = check.compute(compile_check_key(conf), lambda c=conf: compile_check_point(c))
        measured, estimated = r["compiled"]["measured_bytes"], r["compiled"]["estimated_bytes"]
        print(
            f"  {conf:<9} compiled: measured {measured / 2**20:8.1f} MiB, estimated {estimated / 2**20:8.1f} "
            f"MiB ({r['compiled_error']:+.2%}; kept {kept_scale_text(r['kept_scale'])}); "
            f"eager control {r['eager_error']:+.2%}"
        )
    return store


# ---------------------------------------------------------------- same training


def training_run(
    model: str,
    configuration: str,
    dropout: float,
    dropout_seed: int,
    dtype: str,
    rows: str | None = None,
    loss: str | None = None,
    *,
    corpus: str,
) -> dict:
    from .data import fingerprint

    _, losses = _train(model, configuration, dropout, dropout_seed, dtype, corpus, rows, loss)
    kind = "bpe" if TRAIN[model].causal_lm else "wordpiece"
    return {"losses": losses, **fingerprint(kind, source=corpus)}


def _train(
    model: str,
    configuration: str,
    dropout: float,
    dropout_seed: int,
    dtype: str,
    corpus: str,
    rows: str | None = None,
    loss: str | None = None,
):
    """(the trained model, its per-step losses): the same data and initial weights for every run;
    ``rows`` "reversed": each batch's rows reversed; ``loss`` "fp64": computed in float64 from the
    logits (a causal LM's)."""
    from measure.training import Precision, causal_lm_loss, make_optimizer, train_step

    from .data import bert_batches, gpt2_batches

    trained = TRAIN[model]
    make = gpt2_batches if trained.causal_lm else bert_batches
    # the same data for every run
    batches = make(trained.steps, trained.batch, trained.seq, seed=0, source=corpus)
    if rows == REVERSED:  # the rounding control: the same sequences, summed in another order
        batches = [{k: v.flip(0) for k, v in b.items()} for b in batches]
    torch.manual_seed(0)  # the same initial weights for every run (drawn in fp32, then cast)
    m = build_model(model, "pretraining", configuration, dropout=dropout).train()
    if dtype == "fp64":
        m = m.double()  # AdamW follows the parameters' dtype
    loss_of = None
    if loss == FLOAT64_LOSS:
        if dtype != "fp64" or not trained.causal_lm:
            raise ValueError(f"a float64 loss is for float64 causal LMs, not {model} in {dtype}")
        loss_of = causal_lm_loss
    precision = Precision("fp32")
    opt = make_optimizer(m, precision, lr=TRAIN_LR)
    torch.manual_seed(dropout_seed)  # only dropout draws from here on
    return m, [train_step(m, b, opt, precision, loss_of=loss_of).item() for b in batches]


def dropout_distribution_point(weights: str, draws: int, corpus: str) -> dict:
    """Same weights, same batch, many dropout draws: the BERT encoder's output distribution under
    Tempo's dropout against HF's (dropout 0.1). Tempo draws other masks, so its outputs can only
    agree in distribution; the total variance over draws is what a wrong drop rate moves (about
    ±2% per 0.01 of p here), and HF at p = 0.08 and 0.12 are the negative controls that must be
    caught. ``weights``: "init" (the training runs' initial weights) or "trained" (after the
    dropout-off baseline's 150 steps)."""
    from .data import bert_batches

    trained = TRAIN["bert-mini"]
    if weights == "trained":
        state = _train("bert-mini", "hf-eager", 0.0, 1, "fp32", corpus)[0].state_dict()
    else:
        torch.manual_seed(0)
        state = build_model("bert-mini", "pretraining", "hf-eager", dropout=0.0).state_dict()
    inputs = {
        k: v
        for k, v in bert_batches(1, trained.batch, trained.seq, seed=0, source=corpus)[0].items()
        if k not in ("labels", "next_sentence_label")
    }
    seeds = [int.from_bytes(os.urandom(4), "little") for _ in (DROPOUT_REFERENCE, *DROPOUT_COMPARED)]

    def moments(configuration: str, p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = build_model("bert-mini", "pretraining", configuration, dropout=p).train()
        m.load_state_dict(state)
        torch.manual_seed(seed)
        with torch.no_grad():
            outs = torch.stack([m.bert(**inputs).last_hidden_state.double().flatten() for _ in range(draws)])
        return outs.mean(0), outs.var(0)

    _, configuration, p = DROPOUT_REFERENCE
    ref_mean, ref_var = moments(configuration, p, seeds[0])
    out = {"draws": draws, "seeds": seeds}
    for (name, configuration, p), seed in zip(DROPOUT_COMPARED, seeds[1:], strict=True):
        mean, var = moments(configuration, p, seed)
        out[name] = {
            "variance_ratio": (var.sum() / ref_var.sum()).item(),
            # squared distance of the means over what sampling alone gives: ~1 when the same
            "mean_distance_ratio": (((mean - ref_mean) ** 2).sum() / ((var + ref_var) / draws).sum()).item(),
        }
    return out


DISTRIBUTION_DRAWS = 400  # the HF-vs-HF null then stays within ~0.3% of 1: the 1% bound is ~4 sd


def run_training(run: Run, corpus: str) -> ResultFile:
    store = run.file("training.json", config={"precision": "fp32", "optimizer": "AdamW"})
    for args in tqdm(TRAIN_RUNS, desc="training runs", unit="run"):
        store.compute(train_key(*args, corpus=corpus), lambda a=args: training_run(*a, corpus=corpus))
    for weights in tqdm(("init", "trained"), desc="dropout distribution at fixed weights", unit="point"):
        key = {
            "check": "dropout distribution",
            "weights": weights,
            "draws": DISTRIBUTION_DRAWS,
            "corpus": corpus,
            "dropout": 0.1,
        }
        store.compute(key, lambda w=weights: dropout_distribution_point(w, DISTRIBUTION_DRAWS, corpus))
    return store


# ---------------------------------------------------------------- report


def _off_form(r: dict) -> str:
    """A note where a row's closed form misses its third length: its bytes are not affine in the
    length, nor (so far seen) in depth, and the 2-minus-1-layer difference is not a layer's bytes.
    So far: torch.compile below its default budget, which partitions each model as a whole."""
    error = r["closed_form_error"]
    return "" if error <= 0.01 else f"  (not a layer's bytes: the closed form misses by {error:.0%})"


def print_summary(
    act: Results | None, mb: Results | None, tr: Results | None, tp: Results | None, corpus: str
) -> None:
    if tp is not None and len(tp):
        print("\nThroughput at each configuration's own maximum batch:")
        print("\n".join(headline(tp)))
    if act is not None:
        print("\nActivation memory per layer (batch 1, bf16): bytes = a*sbh + b*as^2b")
        for p in act:
            k, r = p.key, p.result
            base = act.get(activation_key(k["model"], k["seq"], "hf-eager"))
            saving = (
                "" if base is None else f"{1 - r['per_layer_bytes'] / base.result['per_layer_bytes']:+.1%}"
            )
            cf = {name: (0.0 if abs(v) < 5e-3 else v) for name, v in r["closed_form_bytes"].items()}
            print(
                f"  {k['model']:<14} {k['seq']:<5} {k['configuration']:<26} "
                f"{r['per_layer_bytes'] / 2**20:9.2f} MiB  = {cf['sbh']:6.2f}sbh + {cf['as2b']:5.2f}as^2b  "
                f"{saving:>7}" + _off_form(r)
            )
    if tr is not None:
        print("\nSame training (one seed for weights and data; fp32 unless it says float64):")
        for name, value in training_summary(tr, corpus).items():
            print(f"  {name}: {value:.3g}")
    if mb is not None:
        print("\nMax batch per GPU (AdamW step; fp16 = half model + fp32 master weights)")
        print(f"  {'case':<36} {'config':<16} " + " ".join(f"{g:>11}" for g in GPUS))
        order = MAIN_CONFIGS + ABLATION_CONFIGS + COMPILE_ROWS
        for p in sorted(
            mb,
            key=lambda p: (
                *(str(p.key[f]) for f in MAXBATCH_FIELDS[:4]),
                order.index(p.key["configuration"]),
            ),
        ):
            k = p.key
            case = f"{k['model']} {k['head']} {k['seq']} {k['precision']}"
            scale = p.result.get("kept_scale")
            print(
                f"  {case:<36} {k['configuration']:<16} "
                + " ".join(f"{p.result[g]['max_batch']:>11}" for g in GPUS)
                + ("" if scale is None else f"  (eager step, kept {kept_scale_text(scale)})")
            )
        base = mb.get(maxbatch_key("bert-large", "pretraining", 512, "fp16", "hf-eager"))
        ours = mb.get(maxbatch_key("bert-large", "pretraining", 512, "fp16", "tempo"))
        if base and ours and base.result["V100-16GB"]["max_batch"]:
            ours_b, base_b = ours.result["V100-16GB"]["max_batch"], base.result["V100-16GB"]["max_batch"]
            print(
                f"\nBERT-Large seq 512, fp16 + fp32 Adam, 16 GB: Tempo fits {ours_b / base_b:.2f}x the batch "
                f"of HF eager ({ours_b} vs {base_b}; paper: up to 2x)"
            )


def _case(text: str) -> tuple[str, int]:
    """MODEL/SEQ, checked here in full: a bad case found in a worker process would surface there
    as a traceback, after other work."""
    model, _, seq = text.partition("/")
    presets = models()
    if model not in presets or not seq.isdigit() or not 1 <= int(seq) <= presets[model].max_positions:
        known = ", ".join(f"{name} (SEQ 1-{spec.max_positions})" for name, spec in presets.items())
        raise argparse.ArgumentTypeError(f"a case is MODEL/SEQ, one of {known}; got {text!r}")
    return model, int(seq)


PARTS = ("activation", "maxbatch", "training", "throughput")


@dataclass(frozen=True)
class TempoBertConfig:
    """What a run of this experiment computes (its command line: ``config_from_command_line``)."""

    parts: tuple[str, ...] = option(PARTS, "the parts to run", choices=PARTS)
    scale: str = option("cpu", "cpu: small cases; paper: the paper's", choices=("cpu", "paper"))
    device: str = option("cpu", "where the throughput part trains (cpu, cuda, cuda:1)")
    corpus: str = option(
        "stdlib",
        "training text: stdlib docstrings (offline, default) or a HF datasets corpus (network once)",
        choices=CORPORA,
    )
    cases: tuple[tuple[str, int], ...] | None = option(
        None, "throughput: only these MODEL/SEQ cases", parse=_case, many=True
    )
    configs: tuple[str, ...] | None = option(
        None, "throughput: these only", many=True, choices=MAIN_CONFIGS + ABLATION_CONFIGS
    )
    gpu_mem: str | None = option(None, "throughput: the memory budget (default: 16GB at paper scale)")


def main(argv: list[str] | None = None) -> None:
    config, args, ap = config_from_command_line(TempoBertConfig, EXPERIMENT, argv, __doc__, jobs=True)
    if "training" not in config.parts and config.corpus != "stdlib":  # ignored without a word
        ap.error("--corpus applies to the training part only; add training to --parts")
    if "throughput" not in config.parts:  # they would be ignored without a word
        given = [
            flag
            for flag, value in (
                ("--cases", config.cases),
                ("--configs", config.configs),
                ("--gpu-mem", config.gpu_mem),
            )
            if value
        ]
        if given:
            ap.error(f"{', '.join(given)} apply to the throughput part only; add throughput to --parts")
    if not device_name(config.device):
        ap.error(f"--device must be cpu or cuda[:N], got {config.device!r}")
    if config.device.startswith("cuda") and (problem := select_cuda_device(config.device)) is not None:
        ap.error(problem)
    setup = THROUGHPUT[config.scale]
    setup = replace(
        setup,
        cases=tuple(config.cases or setup.cases),
        configs=tuple(config.configs or setup.configs),
        gpu=config.gpu_mem or setup.gpu,
    )
    if "throughput" in config.parts:
        try:
            usable = setup.budget.usable_bytes  # validates --gpu-mem before any work
        except ValueError as e:
            ap.error(f"--gpu-mem: {e}")
        if usable <= 0:
            ap.error(f"--gpu-mem {setup.gpu}: nothing is left for the model after the CUDA context's reserve")
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cases = CASES[config.scale]
    act = mb = tr = tp = None
    with experiment_run(args, EXPERIMENT) as run:
        if "activation" in config.parts:
            act = run_activation(run, cases, MAIN_CONFIGS + ABLATION_CONFIGS).this_run()
        if "maxbatch" in config.parts:
            configs, precisions = MAIN_CONFIGS + ABLATION_CONFIGS, PRECISIONS[config.scale]
            mb = run_maxbatch(run, cases, configs, precisions, args.jobs, config.scale).this_run()
        if "training" in config.parts:
            tr = run_training(run, config.corpus).this_run()
        if "throughput" in config.parts:
            tp = run_throughput(run, setup, config.device, args.jobs).this_run()
    print_summary(act, mb, tr, tp, config.corpus)
    print(f"\nresults in {args.results}; figures: nox -s figures")


if __name__ == "__main__":
    with quiet_broken_pipe():  # `| head`: ends quietly, status 141
        main()
