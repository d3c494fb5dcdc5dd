"""Tempo on Llama-family decoders (beyond the paper): what a decoder layer keeps for backward, the
largest batch that fits a GPU, and the same training, HuggingFace and Tempo side by side.

    python -m artifacts.tempo_llama.run [--parts layer compile maxbatch training peers] [--jobs N]
                                        [--fresh] [--update-reference]

Parts (results in artifacts/tempo_llama/results/, git-ignored; the committed reference is in
artifacts/tempo_llama/reference/; an interrupted run resumes when rerun):
* layer: bytes one decoder layer keeps for backward inside the model, exact (measure.saved on
  fake tensors, SDPA keeping what its CUDA kernel keeps), batch 1, bf16, Llama-3.2-1B and
  Llama-3-8B shapes: HF eager and SDPA, activation checkpointing, Tempo (RMSNorm + SwiGLU, SDPA),
  each technique alone, and Tempo with the memory-lean loss (whose saving is in the head, so it
  shows per sequence). Each is compared with its closed form (CLOSED_FORMS, from what each op
  keeps); a*sbh + b*as^2b is also solved from two lengths and checked at a third, as for BERT.
* compile: one Llama-3.2-1B decoder layer, float32 on real tensors (as tempo_layer's BERT rows:
  on a CPU inductor keeps bf16 values as float32), HF SDPA and Tempo + SDPA against torch.compile
  (default, Tempo compiled, HF compiled at the activation memory budget aimed at Tempo's bytes):
  bytes kept and one step's time each, in one run (COMPILE_ROWS).
* maxbatch: the largest batch of Llama-3.2-1B and Llama-3-8B at seq 4096 and 8192 on 80 GB and
  141 GB GPUs (a whole AdamW step, bf16 model + fp32 master weights; fake-tensor estimate); and
  under torch.compile (default budget): the eager step with its saved activations counted at what
  the compiled partition keeps, as tempo_bert estimates it (checked there on compiled CPU steps).
* training: a small Llama trained 150 steps from one seed on the offline corpus, HF SDPA against
  Tempo and Tempo + loss: the losses step by step, in fp32 (shown) and in float64 (judged; HF's
  RMSNorm computed in float64 there: HF's own casts to float32).
* peers: Liger-Kernel's patch (its RMSNorm, SwiGLU and rotary kernels) on the same layer. Its
  kernels are Triton only and do not run under Triton's CPU interpreter (its RMSNorm kernel calls
  ``.to`` on a Python float there), so this part needs a CUDA GPU and ``pip install liger-kernel``;
  elsewhere it says why it did not run and writes nothing.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from measure.budget import GpuBudget
from measure.cli import quiet_broken_pipe
from measure.memory import StepMemoryEstimator
from measure.parallel import map_points
from measure.results import ResultFile, Results, Run
from tempo.maxbatch import compile_kept_scale, kept_scale_json, kept_scale_text
from tempo.models import CONFIGURATIONS, ModelSpec, build_model, make_batch, models
from tempo.ops import workspace_bytes

from ..experiment import config_from_command_line, experiment_run, option
from ..tempo_bert.run import activation_point, max_batch_per_gpu
from ..tempo_layer.run import aimed_budget, budget_context
from . import EXPERIMENT
from .summary import TRAIN, TRAIN_RUNS, run_name, training_gaps, training_key

LAYER_MODELS = ("llama-3.2-1b", "llama-3-8b")
PEER_MODELS = LAYER_MODELS[
    :1
]  # on the GPU check's 30 s: the 1B shapes (8B's 2-layer copy is 1.5B parameters)
LAYER_SEQ = 1024
CONFIGS = ["hf-eager", "hf-sdpa", "checkpointing+sdpa", "tempo+sdpa", "tempo+sdpa+loss"]
ABLATIONS = ["tempo-rmsnorm", "tempo-swiglu"]
# Bytes one bf16 decoder layer keeps per token (batch 1): coefficients of (h, f, k, a, 1, a*s) with
# h hidden, f the MLP width, k the KV width (kv heads x head size), a heads, s the sequence.
# HF SDPA: each RMSNorm keeps its float32 input and its bf16 normalised copy (6h) + rstd (4 bytes);
# the q/k/v and gate/up inputs (2h each), the down projection's input (2f); SDPA keeps q, k, v,
# its output (4h + 4k) and a float32 log-sum-exp per head (4a); SiLU its input (2f), the product
# SiLU(gate) x up both factors (4f). Eager attention keeps K and V repeated to every head (2h
# each), the float32 softmax and its bf16 copy (6 a s), no log-sum-exp. Tempo's RMSNorm keeps its
# output (shared with the next Linear) + rstd; Tempo's SwiGLU keeps gate and up (4f), nothing for
# the down projection. Checkpointing keeps each layer's input (2h).
CLOSED_FORMS = {
    "hf-eager": (24, 8, 0, 0, 8, 6),
    "hf-sdpa": (20, 8, 4, 4, 8, 0),
    "checkpointing+sdpa": (2, 0, 0, 0, 0, 0),
    "tempo+sdpa": (8, 4, 4, 4, 8, 0),
    "tempo+sdpa+loss": (8, 4, 4, 4, 8, 0),  # the loss changes the head, not the layers
    "tempo-rmsnorm": (8, 8, 4, 4, 8, 0),
    "tempo-swiglu": (20, 4, 4, 4, 8, 0),
}
MAXBATCH_MODELS = LAYER_MODELS
MAXBATCH_SEQS = (4096, 8192)
# HF SDPA and Tempo + SDPA against torch.compile, as tempo_layer does for BERT (there: why float32):
# (configuration built, compiled, the configuration whose eager bytes the partitioner's budget aims at)
COMPILE_ROWS = {
    "hf-sdpa": ("hf-sdpa", False, None),
    "tempo+sdpa": ("tempo+sdpa", False, None),
    "hf-sdpa+compile": ("hf-sdpa", True, None),
    "tempo+sdpa+compile": ("tempo+sdpa", True, None),
    "hf-sdpa+compile-at-tempo": ("hf-sdpa", True, "tempo+sdpa"),
}
# torch.compile's rows at the default budget -> the configuration compiled (their max batch)
MAXBATCH_COMPILED = {
    row: conf for row, (conf, compiled, aim) in COMPILE_ROWS.items() if compiled and aim is None
}
MAXBATCH_CONFIGS = ["hf-sdpa", "checkpointing+sdpa", "tempo+sdpa", "tempo+sdpa+loss", *MAXBATCH_COMPILED]
GPUS = {"A100-80GB": "80GB", "H200-141GB": "141GB"}
PRECISION = "bf16"  # bf16 model and gradients, fp32 master weights and AdamW state


def closed_form_bytes(spec: ModelSpec, configuration: str, seq: int) -> int:
    """The closed form's bytes for one decoder layer of ``spec`` at batch 1 (bf16)."""
    h, a = spec.hidden, spec.heads
    f, k = spec.ffn or 4 * h, (spec.kv_heads or a) * (h // a)
    ch, cf, ck, ca, c1, cas = CLOSED_FORMS[configuration]
    if configuration == "hf-eager" and (spec.kv_heads or a) == 1:
        # one KV head at batch 1: repeat_kv's expand + reshape is then a view (stride 0), so K and V
        # stay 2k each (at batch > 1 the reshape copies: the general form). The forms are batch 1's.
        ch, ck = ch - 4, ck + 4
    return seq * (ch * h + cf * f + ck * k + ca * a + c1 + cas * a * seq)


# ---------------------------------------------------------------- layer


def layer_key(model: str, configuration: str) -> dict:
    return {"model": model, "seq": LAYER_SEQ, "configuration": configuration, "batch": 1, "dtype": "bf16"}


def layer_point(model: str, configuration: str) -> dict:
    r = activation_point(model, configuration, LAYER_SEQ)
    closed = closed_form_bytes(models()[model], configuration, LAYER_SEQ)
    return {**r, "formula_bytes": closed, "formula_error": abs(r["per_layer_bytes"] - closed) / closed}


def run_layer(run: Run) -> ResultFile:
    store = run.file("layer_saved_bytes.json", config={"attention": "SDPA as on CUDA", "dropout": 0.0})
    todo = list(itertools.product(LAYER_MODELS, CONFIGS + ABLATIONS))
    for model, conf in tqdm(todo, desc="saved bytes per layer", unit="point"):
        store.compute(layer_key(model, conf), lambda m=model, c=conf: layer_point(m, c))
    return store


# ---------------------------------------------------------------- against torch.compile

COMPILE_MODEL, COMPILE_DTYPE = "llama-3.2-1b", "fp32"


def compile_key(row: str) -> dict:
    return {
        "model": COMPILE_MODEL,
        "seq": LAYER_SEQ,
        "configuration": row,
        "batch": 1,
        "dtype": COMPILE_DTYPE,
    }


def compile_point(row: str, budget: float) -> dict:
    """One decoder layer of ``COMPILE_MODEL`` (float32, real tensors, batch 1, causal SDPA): the
    bytes it keeps for backward (the saved-tensor hooks count a compiled graph's saves) and one
    training step's time, compiled at the partitioner's ``budget`` where the row compiles."""
    from measure.saved import saved_bytes
    from measure.timing import time_fn

    configuration, compiled, _ = COMPILE_ROWS[row]
    torch.manual_seed(0)
    model = build_model(COMPILE_MODEL, "pretraining", configuration, num_layers=1).float().train()
    layer = model.model.layers[0]
    x = torch.randn(1, LAYER_SEQ, models()[COMPILE_MODEL].hidden, requires_grad=True)
    rotary = model.model.rotary_emb(x, torch.arange(LAYER_SEQ)[None])
    if compiled:
        torch._dynamo.reset()  # a fresh compile: the budget is read when the graph is partitioned
        layer = torch.compile(layer)

    def step() -> None:
        out = layer(x, position_embeddings=rotary)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    with budget_context(budget):
        nbytes = saved_bytes(layer, x, position_embeddings=rotary).total_bytes
        step_s = time_fn(step, warmup=2, repeats=5).median_s
    return {"per_layer_bytes": nbytes, "step_s": step_s, "activation_memory_budget": budget}


def run_compile(run: Run) -> ResultFile:
    store = run.file("compile.json", config={"attention": "SDPA, causal", "dropout": 0.0})
    for row, (_, _, aim) in tqdm(COMPILE_ROWS.items(), desc="against torch.compile", unit="row"):
        budget = 1.0  # the default
        if aim is not None:
            default = store.get(compile_key("hf-sdpa+compile")).result["per_layer_bytes"]
            budget = aimed_budget(store.get(compile_key(aim)).result["per_layer_bytes"], default)
        store.compute(compile_key(row), lambda r=row, b=budget: compile_point(r, b))
    base = store.get(compile_key("hf-sdpa")).result
    tempo_ = store.get(compile_key("tempo+sdpa")).result
    print(
        f"\n{COMPILE_MODEL} decoder layer against torch.compile ({COMPILE_DTYPE}, seq {LAYER_SEQ}, this CPU):"
    )
    for row in COMPILE_ROWS:
        r = store.get(compile_key(row)).result
        saving, slower = 1 - r["per_layer_bytes"] / base["per_layer_bytes"], r["step_s"] / tempo_["step_s"]
        print(
            f"  {row:<26} {r['per_layer_bytes']:>12,} bytes ({saving:+.1%} vs HF SDPA)  "
            f"step {r['step_s'] * 1e3:7.1f} ms ({slower:.2f}x Tempo's)"
        )
    return store


# ---------------------------------------------------------------- maximum batch


def maxbatch_key(model: str, seq: int, configuration: str) -> dict:
    return {
        "model": model,
        "seq": seq,
        "configuration": configuration,
        "precision": PRECISION,
        "optimizer": "AdamW",
        "reserve": GpuBudget(0).reserve,  # the default reserve
    }


def llama_maxbatch_point(model: str, seq: int, configuration: str) -> dict:
    """The largest batch per GPU, each peak from the whole model (not extrapolated from shallow
    copies: with the chunked loss, the forward's peak is in the head at two layers and in the layers
    at sixteen, so it is not affine in depth). About a second a batch on fake tensors. A compile
    row (MAXBATCH_COMPILED): its model's eager step with the saved activations counted at what
    torch.compile's partition keeps (tempo.maxbatch.compile_kept_scale, checked in tempo_bert against
    compiled steps measured on a CPU)."""
    built = MAXBATCH_COMPILED.get(configuration, configuration)
    scale = None if built == configuration else compile_kept_scale(model, built, seq, PRECISION)
    est = StepMemoryEstimator(
        lambda: build_model(model, "pretraining", built),
        lambda b: make_batch(model, "pretraining", b, seq),
        PRECISION,
        op_workspace=workspace_bytes,
        kept_scale=scale,
    )
    result = max_batch_per_gpu(est.peak, GPUS)
    return result if scale is None else {**result, "kept_scale": kept_scale_json(scale)}


def run_maxbatch(run: Run, jobs: int) -> ResultFile:
    store = run.file("max_batch.json", config={"gpus": GPUS, "target": "cuda (fake tensors)"})
    todo = [
        args
        for args in itertools.product(MAXBATCH_MODELS, MAXBATCH_SEQS, MAXBATCH_CONFIGS)
        if not store.done(maxbatch_key(*args))
    ]
    for args, result, seconds in map_points(llama_maxbatch_point, todo, jobs, "max batch"):
        store.add(maxbatch_key(*args), result, seconds)  # each finished point is on disk at once
    return store


# ---------------------------------------------------------------- same training


def _rms_norm_in_its_dtype(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm without its cast to float32: that cast guards half precision, and in a
    float64 run it rounds every norm to float32 (1.8e-9 apart from Tempo's at the first step)."""
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def training_point(configuration: str, row_order: str, dtype: str) -> dict:
    """Per-step losses of the small Llama: the same data and initial weights for every run. In
    float64 the model, AdamW and the loss are float64 (HF's loss would cast the logits to float32;
    the chunked loss of ``+loss`` keeps its input's dtype)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from measure.training import Precision, causal_lm_loss, make_optimizer, train_step

    from ..tempo_bert.data import fingerprint, gpt2_batches

    batches = gpt2_batches(TRAIN["steps"], TRAIN["batch"], TRAIN["seq"], seed=0)  # BPE, vocab 8192
    torch.manual_seed(0)  # the same initial weights for every run (drawn in fp32, then cast)
    model = build_model(TRAIN["model"], "pretraining", configuration).train()
    loss_of = None
    if dtype == "fp64":
        model = model.double()  # AdamW follows the parameters' dtype
        # Tempo's lean loss computes the loss itself (its configuration says so, not its name)
        loss_of = None if CONFIGURATIONS[configuration].tempo.get("loss") else causal_lm_loss
        for module in model.modules():  # HF's norms (Tempo's are no longer LlamaRMSNorm)
            if isinstance(module, LlamaRMSNorm):
                module.forward = functools.partial(_rms_norm_in_its_dtype, module)
    precision = Precision("fp32")
    opt = make_optimizer(model, precision, lr=TRAIN["lr"])
    if row_order == "reversed":  # the rounding control: the same sequences, summed in another order
        batches = [{k: v.flip(0) for k, v in b.items()} for b in batches]
    losses = [train_step(model, b, opt, precision, loss_of=loss_of).item() for b in batches]
    return {"losses": losses, **fingerprint("bpe")}


def run_training(run: Run) -> ResultFile:
    store = run.file("training.json", config={"optimizer": "AdamW"})
    for run_args in tqdm(TRAIN_RUNS, desc="training runs", unit="run"):
        store.compute(training_key(*run_args), lambda a=run_args: training_point(*a))
    return store


# ---------------------------------------------------------------- peers


def peers_unavailable() -> str | None:
    """Why Liger-Kernel cannot be measured here (None: it can)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel, or python -m artifacts.gpu_wheels)"
    if not torch.cuda.is_available():
        return "Liger-Kernel's kernels are Triton only and need a GPU (they fail under the CPU interpreter)"
    return None


# measured in the same run on the same GPU: Liger-Kernel's patch, and what it is compared with
PEER_CONFIGS = ("liger", "tempo+sdpa", "hf-sdpa")


def peer_layer_bytes(model: str, configuration: str, layers: int, seq: int, device: str = "cuda") -> int:
    """Bytes a ``layers``-deep copy of ``model`` keeps for backward at batch 1, bf16, on ``device``
    (real tensors: Liger's kernels must run): ``configuration`` one of PEER_CONFIGS, "liger" being
    HF SDPA with Liger-Kernel's RMSNorm, SwiGLU and rotary."""
    from transformers.models.llama import modeling_llama

    from measure.memory import default_dtype
    from measure.saved import saved_bytes

    if configuration not in PEER_CONFIGS:
        raise ValueError(f"configuration {configuration!r}: one of {', '.join(PEER_CONFIGS)}")
    # Liger swaps these in transformers' module for the whole process: put them back after
    swapped = ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")
    saved = {name: getattr(modeling_llama, name) for name in swapped}
    try:
        torch.manual_seed(0)
        base = "hf-sdpa" if configuration == "liger" else configuration
        with torch.device(device), default_dtype(torch.bfloat16):  # built where it runs, in bf16
            m = build_model(model, "pretraining", base, num_layers=layers).train()
        if configuration == "liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(
                rope=True,
                rms_norm=True,
                swiglu=True,
                cross_entropy=False,
                fused_linear_cross_entropy=False,
                model=m,
            )
        return saved_bytes(m, **make_batch(model, "pretraining", 1, seq, device=device)).total_bytes
    finally:
        for name, value in saved.items():
            setattr(modeling_llama, name, value)


def run_peers(run: Run) -> ResultFile | None:
    why = peers_unavailable()
    if why is not None:
        print(f"peers: Liger-Kernel not measured: {why}")
        return None
    from importlib.metadata import version

    store = run.file("peers.json", config={"device": torch.cuda.get_device_name()})
    for model, conf in itertools.product(PEER_MODELS, PEER_CONFIGS):
        key = {**layer_key(model, conf), "liger_kernel": version("liger-kernel"), "measured_on": "cuda"}

        def point(m: str = model, c: str = conf) -> dict:  # what one more layer adds
            return {
                "per_layer_bytes": peer_layer_bytes(m, c, 2, LAYER_SEQ) - peer_layer_bytes(m, c, 1, LAYER_SEQ)
            }

        store.compute(key, point)
    return store


# ---------------------------------------------------------------- report


def print_summary(
    layer: Results | None, mb: Results | None, tr: Results | None, peers: Results | None
) -> None:
    if layer is not None:
        where = f"batch 1, bf16, seq {LAYER_SEQ}"
        print(f"\nBytes one decoder layer keeps for backward ({where}), per token x hidden:")
        print(
            f"  {'model':<14} {'configuration':<20} {'measured':>9} {'formula':>9} {'vs HF SDPA':>11} "
            f"{'per sequence (MiB)':>19}"
        )
        for p in layer:
            k, r = p.key, p.result
            sbh = LAYER_SEQ * models()[k["model"]].hidden
            base = layer.get(layer_key(k["model"], "hf-sdpa"))
            saving = (
                "" if base is None else f"{r['per_layer_bytes'] / base.result['per_layer_bytes'] - 1:+.1%}"
            )
            per_seq = r["per_model_bytes"] / 2**20
            print(
                f"  {k['model']:<14} {k['configuration']:<20} {r['per_layer_bytes'] / sbh:>9.3f} "
                f"{r['formula_bytes'] / sbh:>9.3f} {saving:>11} {per_seq:>19.1f}"
            )
    if peers is not None:
        for p in peers:
            sbh = LAYER_SEQ * models()[p.key["model"]].hidden
            print(
                f"  {p.key['model']:<14} {p.key['configuration'] + ' (GPU)':<20} "
                f"{p.result['per_layer_bytes'] / sbh:>9.3f}"
            )
    if mb is not None:
        print(f"\nMax batch per GPU (AdamW step; {PRECISION} model + fp32 master weights):")
        print(f"  {'model':<14} {'seq':>5} {'configuration':<20} " + " ".join(f"{g:>11}" for g in GPUS))
        order = [*MAXBATCH_MODELS], [*MAXBATCH_CONFIGS]
        for p in sorted(
            mb,
            key=lambda p: (
                order[0].index(p.key["model"]),
                p.key["seq"],
                order[1].index(p.key["configuration"]),
            ),
        ):
            k = p.key
            row = " ".join(f"{p.result[g]['max_batch']:>11}" for g in GPUS)
            note = ""
            if all(p.result[g]["max_batch"] == 0 for g in GPUS):
                note = f"  (batch 1 needs {max(p.result[g]['peak_gib'] for g in GPUS):.0f} GiB)"
            if "kept_scale" in p.result:
                note += f"  (eager step, kept {kept_scale_text(p.result['kept_scale'])})"
            print(f"  {k['model']:<14} {k['seq']:>5} {k['configuration']:<20} {row}{note}")
    if tr is not None:
        print(
            f"\nSame training ({TRAIN['model']}, {TRAIN['steps']} steps), max |loss difference| "
            "against HF SDPA in the same dtype:"
        )
        for run, gap in training_gaps(tr).items():
            print(f"  {run_name(*run):<32} {gap:.2e}")


PARTS = ("layer", "compile", "maxbatch", "training", "peers")


@dataclass(frozen=True)
class TempoLlamaConfig:
    """What a run of this experiment computes (its command line: ``config_from_command_line``)."""

    parts: tuple[str, ...] = option(PARTS, "the parts to run", choices=PARTS)


def main(argv: list[str] | None = None) -> None:
    config, args, _ = config_from_command_line(TempoLlamaConfig, EXPERIMENT, argv, __doc__, jobs=True)
    hf_logging.set_verbosity_error()
    layer = mb = tr = peers = None
    with experiment_run(args, EXPERIMENT) as run:
        if "layer" in config.parts:
            layer = run_layer(run).this_run()
        if "compile" in config.parts:
            run_compile(run)
        if "maxbatch" in config.parts:
            mb = run_maxbatch(run, args.jobs).this_run()
        if "training" in config.parts:
            tr = run_training(run).this_run()
        if "peers" in config.parts:
            store = run_peers(run)
            peers = store.this_run() if store is not None else None
    print_summary(layer, mb, tr, peers)
    print(f"\nresults in {args.results}")


if __name__ == "__main__":
    with quiet_broken_pipe():  # `| head`: ends quietly, status 141
        main()
