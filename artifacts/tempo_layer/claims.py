"""The claims of ``nox -s tempo_layer``: bytes one BERT-Large encoder layer keeps for backward,
against their closed forms, and Tempo's GELU backward against autograd.

Tempo's paper states no per-layer closed form that is cited here; the baseline's 34sbh + 5as²b is
Korthikanti et al. 2022 (arXiv 2205.05198, §4.1, eq. 1), and Tempo's 22.5sbh + 2as²b is this
repo's own count of what Tempo keeps (run.CLOSED_FORMS), measured to within 0.03% at seq 512:
48.0% of the baseline's bytes saved. The paper's own memory claim (up to 2× the batch) is judged
in tempo_bert's claims.
"""

from __future__ import annotations

from collections.abc import Callable

from measure.results import Results

from ..verdicts import EXACT, AtLeast, AtMost, Bound, Missing, Pin, Shown, Source, one

EXPERIMENT = "tempo_layer"
SOURCE = dict(
    experiment=EXPERIMENT,
    file="layer_saved_bytes.json",
    evidence="measured",
    basis="this CPU (saved-tensor hooks: exact bytes, the same on any device)",
    command="nox -s tempo_layer",
)
VARIANTS = ("tempo", "attention-only", "gelu-only", "layernorm-only", "dropout-only")


def layer_saving(seq: int, variant: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        ours = one(r, seq=seq, variant=variant, dtype="bf16", batch=1)["bytes"]
        return 1 - ours / one(r, seq=seq, variant="hf-eager", dtype="bf16", batch=1)["bytes"]

    return value


def closed_form_error(r: Results) -> float:
    """Worst |measured / closed form - 1| over every half-precision layer point."""
    errors = [
        abs(p.result["bytes"] / p.result["closed_form_bytes"] - 1)
        for p in r
        if p.result.get("closed_form_bytes")
    ]
    if not errors:
        raise Missing("layer points")
    return max(errors)


def gelu_error(dtype: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        found = [p.result["relative_error"] for p in r.select(op="gelu_backward", dtype=dtype)]
        if not found:
            raise Missing(dtype)
        return max(found)

    return value


def compiled_ratio(
    seq: int, ours: str, base: str, field: str = "bytes", dtype: str = "fp32"
) -> Callable[[Results], float]:
    """``ours``'s ``field`` (bytes, step_s) over ``base``'s, torch.compile's rows (run.COMPILED):
    float32 on this CPU, bfloat16 on the GPU."""

    def value(r: Results) -> float:
        mine = one(r, seq=seq, variant=ours, dtype=dtype, batch=1)[field]
        return mine / one(r, seq=seq, variant=base, dtype=dtype, batch=1)[field]

    return value


def compiled_saving(seq: int, ours: str, base: str, dtype: str = "fp32") -> Callable[[Results], float]:
    ratio = compiled_ratio(seq, ours, base, dtype=dtype)
    return lambda r: 1 - ratio(r)


GELU = dict(SOURCE, file="gelu_backward.json", basis="this CPU (10^6 fresh inputs a dtype)")
COMPILED = dict(
    SOURCE,
    basis="this CPU: torch.compile (inductor), fp32, the compiled graph's saves counted "
    "by the saved-tensor hooks",
)
COMPILED_GPU = dict(
    SOURCE,
    file="compile_cuda.json",
    basis="one GPU (the GPU check's): torch.compile (inductor), bf16, the compiled graph's saves "
    "counted by the saved-tensor hooks",
    command="nox -s gpu_check (part compile)",
    gpu=True,
)
CLAIMS = (
    Bound(
        id="tempo-vs-compile",
        system="Tempo",
        claim="beyond the paper: Tempo keeps less than torch.compile, what users try first",
        measure="BERT-Large layer, seq 512, fp32, dropout 0.1: Tempo's bytes against HF eager under "
        "torch.compile (AOTAutograd's min-cut partitioner recomputes cheap pointwise ops): saving",
        source=Source(**COMPILED),
        value=compiled_saving(512, "tempo", "hf-eager+compile"),
        check=AtLeast(0.35),
        unit="%",
        why="issue #27's target (a reviewer's first question: does compile already do it?)",
    ),
    Bound(
        id="tempo-compile-composes",
        system="Tempo",
        claim="...and composes with it",
        measure="the same layer: Tempo under torch.compile over Tempo alone (bytes)",
        source=Source(**COMPILED),
        value=compiled_ratio(512, "tempo+compile", "tempo"),
        check=AtMost(1.0),
        unit="x",
        why="compiling Tempo's layer must keep no more than Tempo does alone",
    ),
    Shown(
        id="compile-saving",
        system="Tempo",
        claim="what torch.compile alone saves",
        measure="the same layer: HF eager under torch.compile against HF eager (saving)",
        source=Source(**COMPILED),
        value=compiled_saving(512, "hf-eager+compile", "hf-eager"),
        unit="%",
    ),
    Shown(
        id="compile-at-tempo-bytes",
        system="Tempo",
        claim="torch.compile told to keep what Tempo keeps (its activation memory budget)",
        measure="the same layer: HF eager compiled at the budget aimed at Tempo's bytes, over Tempo's",
        source=Source(**COMPILED),
        value=compiled_ratio(512, "hf-eager+compile-at-tempo", "tempo"),
        unit="x",
    ),
    Shown(
        id="compile-at-tempo-time",
        system="Tempo",
        claim="...and what that costs in time",
        measure="the same: its training step's time over Tempo's (eager), on this CPU (a GPU's ratio "
        "differs: compile-at-tempo-time-gpu)",
        source=Source(**COMPILED),
        unit="x",
        value=compiled_ratio(512, "hf-eager+compile-at-tempo", "tempo", "step_s"),
    ),
    Shown(
        id="tempo-vs-compile-gpu",
        system="Tempo",
        claim="Tempo keeps less than torch.compile, on a GPU",
        measure="BERT-Large layer, seq 512, bf16: Tempo's bytes against HF eager compiled (saving)",
        source=Source(**COMPILED_GPU),
        value=compiled_saving(512, "tempo", "hf-eager+compile", dtype="bf16"),
        unit="%",
    ),
    Shown(
        id="compile-at-tempo-time-gpu",
        system="Tempo",
        claim="...and at Tempo's bytes, what compile's recomputation costs against Tempo, on a GPU",
        measure="the same: HF eager compiled at the budget aimed at Tempo's bytes, its training step's "
        "time over Tempo's (eager)",
        source=Source(**COMPILED_GPU),
        value=compiled_ratio(512, "hf-eager+compile-at-tempo", "tempo", "step_s", dtype="bf16"),
        unit="x",
    ),
    Bound(
        id="tempo-layer-closed-form",
        system="Tempo",
        claim="one BERT-Large layer keeps what its closed form says: 22.5sbh + 2as²b with Tempo, "
        "34sbh + 5as²b without (and each technique alone)",
        measure="every variant, seq 128 and 512, bf16: worst |measured / closed form - 1|",
        source=Source(**SOURCE),
        value=closed_form_error,
        check=AtMost(0.001),
        unit="e",
        why="exact byte counts; the closed forms leave out a few KiB a layer (seeds, bit-mask padding)",
    ),
    Bound(
        id="gelu-backward-fp32",
        system="Tempo",
        claim="in-place GELU: the backward from its output equals autograd's from its input",
        measure="relative error against autograd through torch's GELU, fp32, both approximations",
        source=Source(**GELU),
        value=gelu_error("fp32"),
        check=AtMost(1e-5),
        unit="e",
        why="float32's unit roundoff (6.0e-8) times the conditioning of recovering the input from "
        "the output: the bound allows about 170 units of roundoff",
    ),
    Bound(
        id="gelu-backward-fp64",
        system="Tempo",
        claim="...and in float64",
        measure="the same in float64",
        source=Source(**GELU),
        value=gelu_error("fp64"),
        check=AtMost(1e-10),
        unit="e",
        why="the same in float64's unit roundoff (1.1e-16): the bound allows about 10^6 units, so "
        "it catches any formula error (fp32's 1e-6 would fail it)",
    ),
)

PINS = tuple(
    Pin(
        id=f"tempo-layer-{variant}-{seq}",
        experiment=EXPERIMENT,
        file="layer_saved_bytes.json",
        value=layer_saving(seq, variant),
        near=EXACT,
        unit="%",
    )
    for variant in VARIANTS
    for seq in (128, 512)
)
