"""The claims of ``nox -s tempo_llama``: Tempo on Llama-family decoders, beyond the paper (which
evaluates BERT, GPT-2 and RoBERTa): no paper number to judge against, so every judged claim here
is a bound (the 35% target is issue #16's); the rest are shown."""

from __future__ import annotations

import math
from collections.abc import Callable

from measure.results import Results

from ..tempo_bert.claims import FLOAT64_WHY
from ..verdicts import EXACT, AtLeast, AtMost, Bound, Missing, Near, Pin, Shown, Source, one
from .summary import ROUNDING_CONTROL, run_name, training_gaps

EXPERIMENT = "tempo_llama"
COMMAND = "nox -s tempo_llama"
LAYER = dict(
    experiment=EXPERIMENT,
    file="layer_saved_bytes.json",
    evidence="measured",
    basis="counted exactly by the saved-tensor hooks on fake tensors, as CUDA's kernels keep them "
    "(CUDA's SDPA choice), run on this CPU",
    command=COMMAND,
)
TRAINING = dict(
    experiment=EXPERIMENT, file="training.json", evidence="measured", basis="this CPU", command=COMMAND
)
PEERS = dict(
    experiment=EXPERIMENT,
    file="peers.json",
    evidence="measured",
    basis="one GPU: Liger-Kernel and Tempo in the same run (real tensors)",
    command="nox -s gpu_check",
    gpu=True,
)


def saving(model: str, ours: str, base: str = "hf-sdpa") -> Callable[[Results], float]:
    def value(r: Results) -> float:
        mine = one(r, model=model, configuration=ours)["per_layer_bytes"]
        return 1 - mine / one(r, model=model, configuration=base)["per_layer_bytes"]

    return value


def formula_error(r: Results) -> float:
    """The largest |measured - closed form| / closed form over every layer point."""
    if not len(r):
        raise Missing("layer points")
    return max(p.result["formula_error"] for p in r)


COMPILE_MAX_BATCH = dict(
    LAYER,
    file="max_batch.json",
    evidence="predicted",
    basis="the eager step's peak bytes counted on fake tensors with its saved activations at what "
    "torch.compile's partition keeps, in the layers and elsewhere (measure.memory's kept_scale; the "
    "method checked on BERT's compiled CPU steps in tempo_bert, not on a Llama), against 141 GB",
)


def batch_ratio(
    model: str, seq: int, ours: str, gpu: str, base: str = "hf-sdpa"
) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        mine = one(r, model=model, seq=seq, configuration=ours)[gpu]["max_batch"]
        theirs = one(r, model=model, seq=seq, configuration=base)[gpu]["max_batch"]
        return mine / theirs if theirs else math.inf

    return value


def training(
    configuration: str, dtype: str = "fp32", over_control: bool = False
) -> Callable[[Results], float]:
    """A run's max |loss difference| against HF SDPA (over that of the rounding control)."""
    run = (configuration, "as given", dtype)

    def value(r: Results) -> float:
        gaps = training_gaps(r)
        if run not in gaps or (over_control and ROUNDING_CONTROL not in gaps):
            raise Missing(run_name(*run))
        return gaps[run] / gaps[ROUNDING_CONTROL] if over_control else gaps[run]

    return value


def compile_ratio(ours: str, base: str, field: str = "per_layer_bytes") -> Callable[[Results], float]:
    """``ours``'s ``field`` over ``base``'s, the compile part's rows (run.COMPILE_ROWS)."""

    def value(r: Results) -> float:
        return one(r, configuration=ours)[field] / one(r, configuration=base)[field]

    return value


def liger_vs_tempo(r: Results) -> float:
    """1 - Tempo's per-layer bytes / Liger-Kernel's, Llama-3.2-1B, both measured in the same run."""
    liger = one(r, model="llama-3.2-1b", configuration="liger")["per_layer_bytes"]
    return 1 - one(r, model="llama-3.2-1b", configuration="tempo+sdpa")["per_layer_bytes"] / liger


COMPILE = dict(
    experiment=EXPERIMENT,
    file="compile.json",
    evidence="measured",
    basis="this CPU: torch.compile (inductor), fp32 on real tensors, the compiled graph's saves "
    "counted by the saved-tensor hooks",
    command=COMMAND,
)
CLAIMS = (
    Bound(
        id="llama-vs-compile",
        system="Tempo",
        claim="...and less than torch.compile keeps",
        measure="one Llama-3.2-1B decoder layer, seq 1024, fp32: Tempo + SDPA's bytes against HF SDPA "
        "under torch.compile: saving",
        source=Source(**COMPILE),
        unit="%",
        value=lambda r: 1 - compile_ratio("tempo+sdpa", "hf-sdpa+compile")(r),
        check=AtLeast(0.30),
        why="issue #27's target for the Llama layer, stated in the issue before this bound was "
        "measured (lower than BERT's 35%: compile alone already saves ~25% on this layer)",
    ),
    Bound(
        id="llama-compile-composes",
        system="Tempo",
        claim="...and composes with it",
        measure="the same layer: Tempo + SDPA compiled over Tempo + SDPA alone (bytes)",
        source=Source(**COMPILE),
        value=compile_ratio("tempo+sdpa+compile", "tempo+sdpa"),
        check=AtMost(1.0),
        unit="x",
        why="compiling Tempo's layer must keep no more than Tempo does",
    ),
    Shown(
        id="llama-compile-saving",
        system="Tempo",
        claim="what torch.compile alone saves on a Llama layer",
        measure="the same layer: HF SDPA compiled against HF SDPA (saving)",
        source=Source(**COMPILE),
        value=lambda r: 1 - compile_ratio("hf-sdpa+compile", "hf-sdpa")(r),
        unit="%",
    ),
    Shown(
        id="llama-compile-at-tempo-time",
        system="Tempo",
        claim="torch.compile at the budget aimed at Tempo's bytes: bytes, and a step's time",
        measure="the same layer: its step time over Tempo + SDPA's (eager), on this CPU",
        source=Source(**COMPILE),
        value=compile_ratio("hf-sdpa+compile-at-tempo", "tempo+sdpa", "step_s"),
        unit="x",
    ),
    Bound(
        id="llama-layer",
        system="Tempo",
        claim="beyond the paper: a Llama decoder layer keeps less",
        measure="bytes one decoder layer keeps, Tempo (RMSNorm + SwiGLU) + SDPA vs HF SDPA, Llama-3.2-1B "
        "shapes, seq 1024 (bf16, batch 1): saving",
        source=Source(**LAYER),
        value=saving("llama-3.2-1b", "tempo+sdpa"),
        check=AtLeast(0.35),
        unit="%",
        why="issue #16's target: what RMSNorm and SwiGLU keeping their outputs must save for Tempo to "
        "matter on Llama",
    ),
    Bound(
        id="llama-layer-formula",
        system="Tempo",
        claim="...exactly as its closed form says",
        measure="every configuration, both shapes: worst |measured / closed form - 1|",
        source=Source(**LAYER),
        value=formula_error,
        check=AtMost(0.0),
        unit="e",
        why="exact byte counts: the closed form counts every tensor kept",
    ),
    Bound(
        id="llama-liger",
        system="Tempo",
        claim="...less than Liger-Kernel keeps",
        measure="the same layer, Tempo + SDPA vs Liger-Kernel's RMSNorm, SwiGLU and rotary: saving",
        source=Source(**PEERS),
        value=liger_vs_tempo,
        check=AtLeast(0.0),
        unit="%",
        why="this project's claim (issue #16): on the same layer Tempo keeps no more than "
        "Liger-Kernel, what Llama users reach for today",
    ),
    Bound(
        id="llama-same-training",
        system="Tempo",
        claim="...and trains the same model",
        measure="small Llama, 150 steps, weights, optimizer and loss in float64: max |loss difference|, "
        "Tempo + SDPA vs HF SDPA (HF's RMSNorm computed in float64: its own casts to float32)",
        source=Source(**TRAINING),
        value=training("tempo+sdpa", "fp64"),
        check=AtMost(1e-9),
        unit="e",
        why=FLOAT64_WHY,
    ),
    Bound(
        id="llama-same-training-loss",
        system="Tempo",
        claim="...also with the memory-lean loss",
        measure="the same, Tempo + SDPA + chunked linear cross-entropy",
        source=Source(**TRAINING),
        value=training("tempo+sdpa+loss", "fp64"),
        check=AtMost(1e-9),
        unit="e",
        why=FLOAT64_WHY,
    ),
    Shown(
        id="llama-same-training-fp32",
        system="Tempo",
        claim="Tempo on Llama trains as HF in float32 (shown, not judged: 150 Adam steps amplify "
        "rounding chaotically)",
        measure="the same in fp32, Tempo + SDPA + chunked loss: max |loss difference| over the rounding "
        "control's (HF with each batch's rows reversed, against HF)",
        source=Source(**TRAINING),
        value=training("tempo+sdpa+loss", over_control=True),
        unit="x",
    ),
    Shown(
        id="llama-maxbatch",
        system="Tempo",
        claim="...larger batches fit",
        measure="max batch, Tempo + SDPA / HF SDPA, Llama-3.2-1B seq 4096, bf16 + fp32 AdamW, 80 GB",
        source=Source(
            **dict(
                LAYER,
                file="max_batch.json",
                evidence="predicted",
                basis="the step's peak bytes counted on fake tensors against 80 GB",
            )
        ),
        value=batch_ratio("llama-3.2-1b", 4096, "tempo+sdpa", "A100-80GB"),
        unit="x",
    ),
    Shown(
        id="llama-maxbatch-loss",
        system="Tempo",
        claim="...more with the memory-lean loss",
        measure="the same, Tempo + SDPA + chunked linear cross-entropy / HF SDPA",
        source=Source(
            **dict(
                LAYER,
                file="max_batch.json",
                evidence="predicted",
                basis="the step's peak bytes counted on fake tensors against 80 GB",
            )
        ),
        value=batch_ratio("llama-3.2-1b", 4096, "tempo+sdpa+loss", "A100-80GB"),
        unit="x",
    ),
    Shown(
        id="llama-maxbatch-vs-compile",
        system="Tempo",
        claim="...against torch.compile",
        measure="max batch, Tempo + SDPA / HF SDPA under torch.compile, Llama-3.2-1B seq 4096, 141 GB",
        source=Source(**COMPILE_MAX_BATCH),
        value=batch_ratio("llama-3.2-1b", 4096, "tempo+sdpa", "H200-141GB", base="hf-sdpa+compile"),
        unit="x",
    ),
    Shown(
        id="llama-maxbatch-compiled-tempo",
        system="Tempo",
        claim="...and compiled itself",
        measure="the same, Tempo + SDPA under torch.compile / HF SDPA under torch.compile",
        source=Source(**COMPILE_MAX_BATCH),
        value=batch_ratio("llama-3.2-1b", 4096, "tempo+sdpa+compile", "H200-141GB", base="hf-sdpa+compile"),
        unit="x",
    ),
)

PINS = (
    Pin(
        id="llama-layer-8b",
        experiment=EXPERIMENT,
        file="layer_saved_bytes.json",
        value=saving("llama-3-8b", "tempo+sdpa"),
        near=EXACT,
        unit="%",
    ),
    Pin(
        id="llama-maxbatch",
        experiment=EXPERIMENT,
        file="max_batch.json",
        near=Near(),
        unit="x",
        value=batch_ratio("llama-3.2-1b", 4096, "tempo+sdpa", "A100-80GB"),
    ),
    Pin(
        id="llama-maxbatch-loss",
        experiment=EXPERIMENT,
        file="max_batch.json",
        near=Near(),
        unit="x",
        value=batch_ratio("llama-3.2-1b", 4096, "tempo+sdpa+loss", "A100-80GB"),
    ),
)
