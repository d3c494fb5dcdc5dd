"""Tempo's evaluation: activation memory, maximum batch size and same-training runs of BERT-Large,
RoBERTa-large and GPT-2, every configuration side by side.

    python -m artifacts.tempo_bert.run [--parts activation maxbatch training] [--scale cpu|paper] [--force]

Parts (each resumable; results in artifacts/tempo_bert/results/):
* activation: bytes kept for backward, exact (measure.saved), per layer inside the model and per
  model, at batch 1 in bf16, with dropout and SDPA kept as their CUDA kernels keep them
  (measure.saved.cuda_like). The closed form a*sbh + b*as^2b of each configuration is solved
  from two sequence lengths and verified at a third.
* maxbatch: the largest batch that fits 11/16/40/80/141 GB GPUs, from the fake-tensor estimate
  of a whole AdamW step (measure.memory; CUDA target, documented reserve).
* training: a small BERT (MLM + NSP) and a small GPT-2 (LM) trained from one seed on an offline
  corpus (artifacts/tempo_bert/data.py) with and without Tempo, dropout off and on.
The throughput part is tracked in issue #3 (not yet implemented).
"""

from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from measure.memory import GiB, GpuBudget, PeakReport, default_dtype, search_max_batch
from measure.parallel import map_points
from measure.results import ResultFile, provenance
from measure.saved import cuda_like, saved_bytes
from tempo.maxbatch import estimator
from tempo.models import MODELS, build_model, make_batch

from .data import CORPORA
from .throughput import ThroughputSetup, headline, run_throughput

RESULTS = Path(__file__).parent / "results"
GPUS = {
    "2080Ti-11GB": "11GB",
    "V100-16GB": "16GB",
    "A100-40GB": "40GB",
    "A100-80GB": "80GB",
    "H200-141GB": "141GB",
}
MAIN_CONFIGS = ["hf-eager", "hf-sdpa", "tempo", "tempo+sdpa", "checkpointing"]
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


# ---------------------------------------------------------------- activation memory


def model_saved_bytes(model: str, configuration: str, seq: int, layers: int) -> tuple[int, dict[str, int]]:
    """Exact bytes a ``layers``-deep copy of ``model`` keeps for backward at batch 1 (bf16)."""
    with FakeTensorMode(), default_dtype(torch.bfloat16):
        m = build_model(model, "pretraining", configuration, num_layers=layers).train()
        batch = make_batch(model, "pretraining", 1, seq)
        with cuda_like():
            r = saved_bytes(m, **batch)
    return r.total_bytes, r.by_module_type


def activation_point(model: str, configuration: str, seq: int) -> dict:
    spec = MODELS[model]
    h, a = spec.hidden, spec.heads

    def per_layer(s: int) -> tuple[int, dict[str, int]]:
        one, by1 = model_saved_bytes(model, configuration, s, 1)
        two, by2 = model_saved_bytes(model, configuration, s, 2)
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
    first, _ = model_saved_bytes(model, configuration, seq, 1)
    return {
        "per_layer_bytes": layer,
        "per_layer_by_module_type": by_type,
        "closed_form_bytes": {"sbh": round(x, 3), "as2b": round(y, 3)},
        "closed_form_checked_at_seq": s3,
        "closed_form_error": abs(predicted - l3) / l3,
        "per_model_bytes": first + (spec.layers - 1) * layer,  # every layer keeps the same bytes
    }


def run_activation(cases, configs, results: Path, force: bool) -> ResultFile:
    store = ResultFile(
        results / "activation_memory.json",
        provenance({"part": "activation", "cases": cases, "configs": configs, "batch": 1, "dtype": "bf16"}),
        force,
    )
    todo = list(itertools.product(cases, configs))
    for (model, seq), conf in tqdm(todo, desc="activation memory", unit="point"):
        store.compute(f"{model}/s{seq}/{conf}", lambda m=model, s=seq, c=conf: activation_point(m, c, s))
    return store


# ---------------------------------------------------------------- maximum batch


def maxbatch_point(model: str, seq: int, precision: str, configuration: str) -> dict:
    est = estimator(model, "pretraining", seq, precision, configuration)
    memo: dict[int, PeakReport] = {}

    def peak(b: int) -> PeakReport:
        if b not in memo:
            memo[b] = est.peak(b)
        return memo[b]

    out = {}
    for gpu, mem in GPUS.items():
        budget = GpuBudget.parse(mem)
        b, report = search_max_batch(peak, budget.usable_bytes)
        out[gpu] = {
            "max_batch": b,
            "peak_gib": round(report.peak_gib, 3),
            "phase": report.peak_phase,
            "usable_gib": round(budget.usable_bytes / GiB, 3),
        }
    return out


def run_maxbatch(cases, configs, precisions, results: Path, force: bool, jobs: int, scale: str) -> ResultFile:
    store = ResultFile(
        results / "max_batch.json",
        provenance(
            {
                "part": "maxbatch",
                "scale": scale,
                "cases": cases,
                "configs": configs,
                "precisions": precisions,
                "gpus": GPUS,
                "reserve": "0.75 GiB context + 5% fragmentation",
                "optimizer": "AdamW",
            }
        ),
        force,
    )
    todo = [(m, s, p, c) for (m, s), p, c in itertools.product(cases, precisions, configs)]
    if scale == "cpu":  # reduced: checkpointing and the ablations on the headline case only
        todo = [
            t
            for t in todo
            if t[3] in MAIN_CONFIGS[:4] or ((t[0], t[1]) == ABLATION_CASE and t[3] in MAIN_CONFIGS)
        ]
    todo = [t for t in todo if not store.done("{}/s{}/{}/{}".format(*t))]
    for args, result in map_points(maxbatch_point, todo, jobs, "max batch"):
        store.add("{}/s{}/{}/{}".format(*args), result)  # each finished point is on disk at once
    return store


# ---------------------------------------------------------------- same training


TRAIN = {  # model -> (steps, batch, seq)
    "bert-mini": (150, 8, 64),
    "gpt2-mini": (150, 8, 64),
}
# (model, configuration, dropout, dropout seed, dtype): dropout off must give the same losses;
# with dropout on, Tempo draws other masks, so compare its distance from the baseline with the
# distance between two baseline runs that differ only in their dropout seed. The float64 pair
# is the control for the fp32 drift: if the fp32 runs part through rounding alone, the same
# runs in float64 must agree ~1e9 times more closely.
TRAIN_RUNS = [
    ("bert-mini", "hf-eager", 0.0, 1, "fp32"),
    ("bert-mini", "tempo", 0.0, 1, "fp32"),
    ("bert-mini", "hf-eager", 0.1, 1, "fp32"),
    ("bert-mini", "hf-eager", 0.1, 2, "fp32"),
    ("bert-mini", "tempo", 0.1, 1, "fp32"),
    ("gpt2-mini", "hf-eager", 0.0, 1, "fp32"),
    ("gpt2-mini", "tempo", 0.0, 1, "fp32"),
    ("gpt2-mini", "hf-eager", 0.0, 1, "fp64"),
    ("gpt2-mini", "tempo", 0.0, 1, "fp64"),
]


def train_key(model: str, configuration: str, dropout: float, seed: int, dtype: str) -> str:
    return f"{model}/{configuration}/p{dropout}/seed{seed}" + ("" if dtype == "fp32" else f"/{dtype}")


def training_run(
    model: str, configuration: str, dropout: float, dropout_seed: int, dtype: str, corpus: str
) -> dict:
    from measure.training import Precision, make_optimizer, train_step

    from .data import bert_batches, gpt2_batches

    steps, batch, seq = TRAIN[model]
    make = bert_batches if model.startswith("bert") else gpt2_batches
    batches = make(steps, batch, seq, seed=0, source=corpus)  # the same data for every run
    torch.manual_seed(0)  # the same initial weights for every run (drawn in fp32, then cast)
    m = build_model(model, "pretraining", configuration, dropout=dropout).train()
    if dtype == "fp64":
        m = m.double()  # AdamW follows the parameters' dtype
    precision = Precision("fp32")
    opt = make_optimizer(m, precision, lr=1e-3)
    torch.manual_seed(dropout_seed)  # only dropout draws from here on
    losses = [train_step(m, b, opt, precision).item() for b in batches]
    return {"losses": losses, "steps": steps, "batch": batch, "seq": seq}


def run_training(results: Path, force: bool, corpus: str = "stdlib") -> ResultFile:
    store = ResultFile(
        results / "training.json",
        provenance(
            {
                "part": "training",
                "runs": TRAIN_RUNS,
                "shapes": TRAIN,
                "precision": "fp32",
                "lr": 1e-3,
                "corpus": corpus,
            }
        ),
        force,
    )
    for run in tqdm(TRAIN_RUNS, desc="training runs", unit="run"):
        store.compute(train_key(*run), lambda a=run: training_run(*a, corpus))
    return store


def training_summary(tr: ResultFile) -> dict:
    def curve(key):
        return torch.tensor(tr.points[key]["losses"])

    out = {}
    for model in TRAIN:
        off = (curve(f"{model}/tempo/p0.0/seed1") - curve(f"{model}/hf-eager/p0.0/seed1")).abs()
        out[f"{model} dropout off: max |loss difference|"] = off.max().item()
        if f"{model}/tempo/p0.0/seed1/fp64" in tr.points:
            off64 = (
                curve(f"{model}/tempo/p0.0/seed1/fp64") - curve(f"{model}/hf-eager/p0.0/seed1/fp64")
            ).abs()
            out[f"{model} dropout off, float64 control: max |loss difference|"] = off64.max().item()
    base, other, ours = (
        curve(f"bert-mini/{c}/p0.1/seed{s}") for c, s in (("hf-eager", 1), ("hf-eager", 2), ("tempo", 1))
    )
    out["bert-mini dropout 0.1: mean |tempo - baseline|"] = (ours - base).abs().mean().item()
    out["bert-mini dropout 0.1: mean |baseline seed 2 - baseline seed 1|"] = (
        (other - base).abs().mean().item()
    )
    out["bert-mini dropout 0.1: last-50 mean loss baseline / tempo"] = (
        base[-50:].mean().item(),
        ours[-50:].mean().item(),
    )
    return out


# ---------------------------------------------------------------- report


def print_summary(
    act: ResultFile | None, mb: ResultFile | None, tr: ResultFile | None, tp: ResultFile | None
) -> None:
    if tp is not None:
        setup = tp.provenance["config"]
        print(
            f"\nThroughput at each configuration's own maximum batch ({setup['precision']}, budget "
            f"{setup['gpu']}{' less the reserve' if setup['reserve'] else ''}; "
            f"on {tp.provenance['device']['device']}):"
        )
        print("\n".join(headline(tp)))
    if act is not None:
        print("\nActivation memory per layer (batch 1, bf16): bytes = a*sbh + b*as^2b")
        for key, r in act.points.items():
            model, seq, conf = key.split("/")
            base = act.points.get(f"{model}/{seq}/hf-eager")
            saving = "" if base is None else f"{1 - r['per_layer_bytes'] / base['per_layer_bytes']:+.1%}"
            cf = {k: (0.0 if abs(v) < 5e-3 else v) for k, v in r["closed_form_bytes"].items()}
            print(
                f"  {model:<14} {seq:<5} {conf:<16} {r['per_layer_bytes'] / 2**20:9.2f} MiB  "
                f"= {cf['sbh']:6.2f}sbh + {cf['as2b']:5.2f}as^2b  {saving:>7}"
            )
    if tr is not None:
        print("\nSame training (fp32, one seed for weights and data):")
        for name, value in training_summary(tr).items():
            print(f"  {name}: {value}")
    if mb is not None:
        print("\nMax batch per GPU (AdamW step; fp16 = half model + fp32 master weights)")
        print(f"  {'case':<32} {'config':<16} " + " ".join(f"{g:>11}" for g in GPUS))
        order = MAIN_CONFIGS + ABLATION_CONFIGS
        keys = sorted(mb.points, key=lambda k: (*k.split("/")[:3], order.index(k.split("/")[3])))
        for key in keys:
            r = mb.points[key]
            model, seq, prec, conf = key.split("/")
            print(
                f"  {model + ' ' + seq + ' ' + prec:<32} {conf:<16} "
                + " ".join(f"{r[g]['max_batch']:>11}" for g in GPUS)
            )
        base = mb.points.get("bert-large/s512/fp16/hf-eager")
        ours = mb.points.get("bert-large/s512/fp16/tempo")
        if base and ours and base["V100-16GB"]["max_batch"]:
            ratio = ours["V100-16GB"]["max_batch"] / base["V100-16GB"]["max_batch"]
            ours_b, base_b = ours["V100-16GB"]["max_batch"], base["V100-16GB"]["max_batch"]
            print(
                f"\nBERT-Large seq 512, fp16 + fp32 Adam, 16 GB: Tempo fits {ratio:.2f}x the batch of "
                f"HF eager ({ours_b} vs {base_b}; paper: up to 2x)"
            )


def _case(text: str) -> tuple[str, int]:
    model, _, seq = text.partition("/")
    if model not in MODELS or not seq.isdigit():
        models = ", ".join(MODELS)
        raise argparse.ArgumentTypeError(f"a case is MODEL/SEQ with MODEL one of {models}; got {text!r}")
    return model, int(seq)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ["activation", "maxbatch", "training", "throughput"]
    ap.add_argument("--parts", nargs="+", default=parts, choices=parts)
    ap.add_argument("--scale", choices=["cpu", "paper"], default="cpu")
    ap.add_argument("--device", default="cpu", help="where the throughput part trains (cpu, cuda, cuda:1)")
    ap.add_argument("--force", action="store_true", help="recompute points already in the result files")
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"result directory (default: {RESULTS})")
    ap.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)"
    )
    ap.add_argument(
        "--corpus",
        choices=CORPORA,
        default="stdlib",
        help="training text: stdlib docstrings (offline, default) or a HF datasets corpus (network once)",
    )
    ap.add_argument("--cases", nargs="+", type=_case, help="throughput: only these MODEL/SEQ cases")
    every_config = MAIN_CONFIGS + ABLATION_CONFIGS
    ap.add_argument("--configs", nargs="+", choices=every_config, help="throughput: these only")
    ap.add_argument("--gpu-mem", help="throughput: the memory budget (default: 16GB at paper scale)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here (use --device cpu)")
    if not args.device.startswith(("cpu", "cuda")):
        ap.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cases = CASES[args.scale]
    act = mb = tp = None
    if "activation" in args.parts:
        act = run_activation(cases, MAIN_CONFIGS + ABLATION_CONFIGS, args.results, args.force)
    if "maxbatch" in args.parts:
        mb = run_maxbatch(
            cases,
            MAIN_CONFIGS + ABLATION_CONFIGS,
            PRECISIONS[args.scale],
            args.results,
            args.force,
            args.jobs,
            args.scale,
        )
    tr = run_training(args.results, args.force, args.corpus) if "training" in args.parts else None
    if "throughput" in args.parts:
        setup = THROUGHPUT[args.scale]
        setup = replace(
            setup,
            cases=tuple(args.cases or setup.cases),
            configs=tuple(args.configs or setup.configs),
            gpu=args.gpu_mem or setup.gpu,
        )
        tp = run_throughput(setup, args.scale, args.device, args.results, args.force, args.jobs)
    print_summary(act, mb, tr, tp)
    print(f"\nresults in {args.results}; figures: nox -s figures")


if __name__ == "__main__":
    main()
