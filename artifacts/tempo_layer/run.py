"""Saved-for-backward bytes of one BERT-Large encoder layer: HF eager vs Tempo (and each
technique alone), measured exactly with measure.saved, next to the closed forms.

    python -m artifacts.tempo_layer.run [--seq 128 512] [--dtype bf16] [--batch 1] [--no-compile]
                                        [--compile-only] [--device cpu|cuda]
                                        [--fresh] [--update-reference]

torch.compile's rows (HF compiled, Tempo compiled, HF compiled at the activation memory budget that
aims at Tempo's bytes) are measured in float32 with one step's time each (COMPILED). With
``--device cuda`` (the GPU check's part ``compile``) only those rows run, in bfloat16 as a GPU
trains, into compile_cuda.json: the GPU's own bytes (inductor's CUDA partition, Tempo's GPU
kernels) and step times.

Baseline dropouts run as on CUDA (fused native_dropout, bool mask; see
measure.saved.cuda_like_dropout), so the bytes are those the layer keeps on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer
from transformers.utils import logging as hf_logging

import tempo
from measure.checks import device_name, machine_memory_bytes
from measure.cli import quiet_broken_pipe
from measure.saved import cuda_like_dropout, saved_bytes
from measure.timing import select_cuda_device, time_fn
from measure.training import DTYPES
from measure.units import format_bytes
from tempo.ops import gelu as tempo_gelu

from ..experiment import config_from_command_line, experiment_run, option
from . import EXPERIMENT

VARIANTS = {  # name -> tempo.patch switches (None: HF eager, unpatched)
    "hf-eager": None,
    "tempo": dict(layernorm=True, gelu=True, attention=True, dropout=True),
    "gelu-only": dict(layernorm=False, gelu=True, attention=False, dropout=False),
    "layernorm-only": dict(layernorm=True, gelu=False, attention=False, dropout=False),
    "attention-only": dict(layernorm=False, gelu=False, attention=True, dropout=False),
    "dropout-only": dict(layernorm=False, gelu=False, attention=False, dropout=True),
}
# Closed forms in bytes for a half-precision layer, as (coefficient of s*b*h, coefficient of a*s^2*b),
# one layer measured alone (its input counted). Baseline: Korthikanti et al. 2022, 34sbh + 5as^2b.
# Tempo: GELU keeps y (shared with the next Linear) + 1 bit/elem of 4h (0.5sbh) instead of its
# 8sbh input; LayerNorm keeps y (shared with the next Linear for LN1) instead of its 2sbh input;
# dropouts keep a seed instead of 1-byte masks (2 x sbh); attention keeps P only (2as^2b of 5).
CLOSED_FORMS = {
    "hf-eager": (34.0, 5.0),
    "tempo": (22.5, 2.0),
    "gelu-only": (26.5, 5.0),
    "layernorm-only": (32.0, 5.0),
    "attention-only": (34.0, 2.0),
    "dropout-only": (32.0, 5.0),
}


# torch.compile, what a user who wants to keep less tries first: AOTAutograd's min-cut partitioner
# recomputes cheap pointwise ops in backward instead of saving them, and its activation memory
# budget trades more recomputation for memory. Each compiled variant: the variant compiled, and the
# variant whose eager bytes its budget aims at (None: the default budget, 1.0). Measured in float32:
# on a CPU inductor computes bfloat16 pointwise ops in float32 and the partitioner then keeps
# those float32 values (a compiled bf16 layer kept 32% more than eager here), which a GPU would not.
COMPILED = {
    "hf-eager+compile": ("hf-eager", None),
    "tempo+compile": ("tempo", None),
    "hf-eager+compile-at-tempo": ("hf-eager", "tempo"),
}
COMPILE_DTYPE = "fp32"


def build_layer(
    variant: str, dtype: torch.dtype, hidden: int = 1024, heads: int = 16, device: str = "cpu"
) -> tuple:
    """(a BERT-Large-shaped encoder layer on ``device`` in training mode, dropout 0.1, as
    ``variant`` patches it (VARIANTS), the patch's report)."""
    cfg = BertConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        attn_implementation="eager",
    )
    layer = BertLayer(cfg).to(device, dtype).train()
    switches = VARIANTS[variant]
    report = str(tempo.patch(layer, **switches)) if switches is not None else "HF eager (unpatched)"
    return layer, report


def compiled_layer(variant: str, dtype: torch.dtype, hidden: int = 1024, device: str = "cpu"):
    """(``variant``'s layer under ``torch.compile``, its report): compiled on its first call, so
    the partitioner's budget is the one that call runs under (``budget_context``)."""
    eager = COMPILED[variant][0] if variant in COMPILED else variant
    layer, report = build_layer(eager, dtype, hidden, device=device)
    torch._dynamo.reset()  # a fresh compile: the budget is read when the graph is partitioned
    return torch.compile(layer), f"torch.compile of: {report}"


def budget_context(budget: float):
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)


def aimed_budget(aim_bytes: int, default_bytes: int) -> float:
    """The partitioner's budget that aims at ``aim_bytes``: their share of what the default budget
    keeps (at most 1, the default)."""
    return min(1.0, aim_bytes / default_bytes)


def measure_compiled(
    variant: str,
    seq: int,
    batch: int,
    dtype: torch.dtype,
    budget: float = 1.0,
    hidden: int = 1024,
    device: str = "cpu",
) -> dict:
    """Bytes a ``torch.compile``d layer keeps (the saved-tensor hooks see its compiled graph's
    saves) at the partitioner's ``budget``; and one training step's time (forward and backward),
    the median of 5 after 2 warm-ups."""
    compiled, report = compiled_layer(variant, dtype, hidden, device)
    x = torch.randn(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
    with cuda_like_dropout(), budget_context(budget):
        nbytes = saved_bytes(compiled, x).total_bytes
        step_s = time_fn(lambda: compiled(x)[0].sum().backward(), device).median_s
    return {
        "bytes": nbytes,
        "bytes_per_sbh": nbytes / (seq * batch * hidden),
        "closed_form_bytes": None,
        "closed_form": None,
        "activation_memory_budget": budget,
        "step_s": step_s,
        "patch_report": report,
    }


def eager_step_s(
    variant: str, seq: int, batch: int, dtype: torch.dtype, hidden: int = 1024, device: str = "cpu"
) -> float:
    """One training step's time of ``variant``'s eager layer, as ``measure_compiled`` times it."""
    layer, _ = build_layer(variant, dtype, hidden, device=device)
    x = torch.randn(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
    with cuda_like_dropout():
        return time_fn(lambda: layer(x)[0].sum().backward(), device).median_s


# Where and in which dtype the compile rows run: float32 on a CPU (see COMPILED), bfloat16 on a GPU
COMPILE_ON = {"cpu": ("layer_saved_bytes.json", COMPILE_DTYPE), "cuda": ("compile_cuda.json", "bf16")}


def measure_compile(run, seqs: list[int], batch: int, device: str = "cpu") -> None:
    """HF eager and Tempo against torch.compile (default, Tempo compiled, and HF compiled with the
    budget that aims at Tempo's bytes) on ``device``: bytes kept and a step's time, in one run."""
    file, dtype_name = COMPILE_ON[torch.device(device).type]
    store = run.file(
        file,
        device,
        config={
            "model": "bert-large layer",
            "hidden": 1024,
            "heads": 16,
            "intermediate": 4096,
            "dropout": 0.1,
        },
    )
    dtype = DTYPES[dtype_name]

    def key(seq: int, variant: str) -> dict:
        return {"layer": "bert-large", "seq": seq, "batch": batch, "dtype": dtype_name, "variant": variant}

    where = "this CPU" if device == "cpu" else f"the GPU ({device})"
    print(f"\ntorch.compile against Tempo, {dtype_name} (bytes kept, one step's time on {where}):")
    for seq in seqs:
        eager = {}
        for variant in ("hf-eager", "tempo"):
            eager[variant] = store.compute(
                key(seq, variant),
                lambda s=seq, v=variant: {
                    **measure_layer(v, s, batch, dtype, device=device),
                    "step_s": eager_step_s(v, s, batch, dtype, device=device),
                },
            )
        for variant, (_, aim) in COMPILED.items():
            budget = 1.0  # the default
            if aim is not None:
                budget = aimed_budget(
                    eager[aim]["bytes"], store.get(key(seq, "hf-eager+compile")).result["bytes"]
                )
            store.compute(
                key(seq, variant),
                lambda s=seq, v=variant, b=budget: measure_compiled(v, s, batch, dtype, b, device=device),
            )
        base, tempo_ = eager["hf-eager"], eager["tempo"]
        for variant in ("hf-eager", "tempo", *COMPILED):
            r = store.get(key(seq, variant)).result
            saving, slower = 1 - r["bytes"] / base["bytes"], r["step_s"] / tempo_["step_s"]
            print(
                f"{seq:>5} {variant:<26} {r['bytes']:>12,} bytes ({saving:+.1%} vs HF eager)  "
                f"step {r['step_s'] * 1e3:7.1f} ms ({slower:.2f}x Tempo's)"
            )


def measure_layer(
    variant: str,
    seq: int,
    batch: int,
    dtype: torch.dtype,
    hidden: int = 1024,
    heads: int = 16,
    device: str = "cpu",
) -> dict:
    layer, report = build_layer(variant, dtype, hidden, heads, device)
    x = torch.randn(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
    with cuda_like_dropout():
        r = saved_bytes(layer, x)
    c_sbh, c_as2b = CLOSED_FORMS[variant]
    closed = closed_form_bytes(variant, seq, batch, dtype, hidden, heads)
    return {
        "bytes": r.total_bytes,
        "bytes_per_sbh": r.total_bytes / (seq * batch * hidden),
        "closed_form_bytes": closed if dtype != torch.float32 else None,
        "closed_form": f"{c_sbh:g}sbh + {c_as2b:g}as^2b" if dtype != torch.float32 else None,
        "by_module_type": r.by_module_type,
        "patch_report": report,
    }


def closed_form_bytes(
    variant: str, seq: int, batch: int, dtype: torch.dtype, hidden: int = 1024, heads: int = 16
) -> float:
    """What ``variant``'s BERT-Large layer keeps for backward at this shape, by its closed form."""
    c_sbh, c_as2b = CLOSED_FORMS[variant]
    scale = torch.finfo(dtype).bits // 16  # the closed forms are for 2-byte activations
    return scale * (c_sbh * seq * batch * hidden + c_as2b * heads * seq * seq * batch)


def gelu_backward_error(dtype: torch.dtype, approximate: str, n: int, seed: int) -> dict:
    """Norm-wise error of Tempo's GELU backward (input recovered from the output) against autograd
    through torch's GELU, on ``n`` fresh normal inputs scaled by 3 (both branches, the minimum)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    grad = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    y, packed = tempo_gelu.gelu_fwd(x, approximate)
    ours = tempo_gelu.gelu_bwd(grad, y, packed, approximate).double()
    x_ref = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad(torch.nn.functional.gelu(x_ref, approximate=approximate), x_ref, grad)
    ref = ref.double()
    return {"relative_error": ((ours - ref).norm() / ref.norm()).item(), "elements": n}


def measure_layers(run, seqs: list[int], batch: int, dtype_name: str) -> None:
    model = {"hidden": 1024, "heads": 16, "intermediate": 4096, "dropout": 0.1}
    store = run.file("layer_saved_bytes.json", config={"model": "bert-large layer", **model})
    dtype = DTYPES[dtype_name]

    def key(seq: int, variant: str) -> dict:
        return {"layer": "bert-large", "seq": seq, "batch": batch, "dtype": dtype_name, "variant": variant}

    print(f"Saved-for-backward bytes of one BERT-Large encoder layer, {dtype_name}, batch {batch}")
    print(f"{'seq':>5} {'variant':<15} {'bytes':>12} {'= x sbh':>8} {'closed form':>18} {'vs HF eager':>12}")
    for seq in seqs:
        base = store.compute(key(seq, "hf-eager"), lambda s=seq: measure_layer("hf-eager", s, batch, dtype))
        for variant in VARIANTS:
            res = store.compute(key(seq, variant), lambda s=seq, v=variant: measure_layer(v, s, batch, dtype))
            saving = 1 - res["bytes"] / base["bytes"]
            match = (
                ""
                if res["closed_form_bytes"] is None
                else (
                    "  (=)"
                    if abs(res["bytes"] - res["closed_form_bytes"]) <= 0.001 * res["bytes"]
                    else "  (!=)"
                )
            )
            print(
                f"{seq:>5} {variant:<15} {res['bytes']:>12,} {res['bytes_per_sbh']:>8.2f} "
                f"{res['closed_form'] or '-':>18}{match} {saving:>+11.1%}"
            )
    print(f"results: {store.path}")
    print("(=): measured bytes equal the closed form within 0.1% (LayerNorm mean/rstd are the rest)")


GELU_CASES = [(torch.float32, "fp32"), (torch.float64, "fp64")]


def measure_gelu_backward(run) -> None:
    """Tempo's GELU backward against autograd (the paper's published kernel used a polynomial fit)."""
    store = run.file("gelu_backward.json")
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run, seed stored
    for dtype, name in GELU_CASES:
        for approximate in ("none", "tanh"):
            key = {"op": "gelu_backward", "dtype": name, "approximate": approximate, "elements": 1_000_000}
            r = store.compute(
                key,
                lambda d=dtype, a=approximate: {**gelu_backward_error(d, a, 1_000_000, seed), "seed": seed},
            )
            print(
                f"GELU backward ({approximate}, {name}): relative error vs autograd {r['relative_error']:.1e}"
            )


@dataclass(frozen=True)
class TempoLayerConfig:
    """What a run of this experiment computes (its command line: ``config_from_command_line``)."""

    seq: tuple[int, ...] = option((128, 512), "sequence lengths")
    batch: int = option(1, "sequences a batch")
    dtype: str = option("bf16", "the layers' dtype", choices=sorted(DTYPES))
    no_compile: bool = option(False, "leave out torch.compile's rows (each compiles for ~5-15 s a length)")
    compile_only: bool = option(False, "only torch.compile's rows (what --device cuda runs)")
    device: str = option(
        "cpu", "where the compile rows run: cpu, or cuda (a GPU: only those rows, bf16, compile_cuda.json)"
    )


def main(argv: list[str] | None = None) -> None:
    config, args, ap = config_from_command_line(TempoLayerConfig, EXPERIMENT, argv, __doc__)
    if min(config.seq) < 1 or config.batch < 1:
        ap.error(
            f"--seq and --batch must be positive integers, got --seq {config.seq} --batch {config.batch}"
        )
    if not device_name(config.device):
        ap.error(f"--device must be cpu or cuda[:N], got {config.device!r}")
    on_gpu = config.device.startswith("cuda")
    only_compile = config.compile_only or on_gpu
    if on_gpu and (problem := select_cuda_device(config.device)) is not None:
        ap.error(problem)
    if config.no_compile and only_compile:
        ap.error("--no-compile leaves out the only rows --compile-only and --device cuda run")
    if only_compile and config.dtype != TempoLayerConfig.dtype:
        ap.error(
            f"--dtype applies to the layer rows; the compile rows run in {COMPILE_ON['cpu'][1]} on a CPU, "
            f"{COMPILE_ON['cuda'][1]} on a GPU"
        )
    if config.dtype == COMPILE_DTYPE and not config.no_compile:
        ap.error(f"--dtype {COMPILE_DTYPE} gives the layer rows the compile rows' keys: add --no-compile")
    # the real layers would fail in the allocator, after the first rows were printed
    dtype = COMPILE_DTYPE if only_compile else config.dtype
    need = closed_form_bytes("hf-eager", max(config.seq), config.batch, DTYPES[dtype])
    have = machine_memory_bytes()
    if need > have and not on_gpu:
        ap.error(
            f"--seq {max(config.seq)} --batch {config.batch}: HF's layer keeps {format_bytes(need)} for "
            f"backward (its closed form), more than this machine's {format_bytes(have)} of memory"
        )
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    with experiment_run(args, EXPERIMENT) as run:
        if only_compile:
            measure_compile(run, config.seq, config.batch, config.device)
            return
        measure_layers(run, config.seq, config.batch, config.dtype)
        if not config.no_compile:
            measure_compile(run, config.seq, config.batch)
        measure_gelu_backward(run)


if __name__ == "__main__":
    with quiet_broken_pipe():  # `| head`: ends quietly, status 141
        main()
