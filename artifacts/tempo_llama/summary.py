"""The same-training runs of ``tempo_llama`` (what is trained, how a run is keyed) and how their
losses are compared. No torch here: the claims check reads these without loading a model."""

from __future__ import annotations

from measure.results import Results

TRAIN = {"model": "llama-mini", "steps": 150, "batch": 8, "seq": 64, "lr": 1e-3, "dtype": "fp32"}
# (configuration, row order); the first is the reference. The last is the control for rounding:
# HF itself with each batch's rows reversed computes the same math, summed in another order, and
# how far its losses drift from HF's over 150 steps is the band that rounding alone opens.
TRAIN_RUNS = [
    ("hf-sdpa", "as given"),
    ("tempo+sdpa", "as given"),
    ("tempo+sdpa+loss", "as given"),
    ("hf-sdpa", "reversed"),
]


def training_key(configuration: str, row_order: str = "as given") -> dict:
    return {**TRAIN, "configuration": configuration, "row_order": row_order, "corpus": "stdlib"}


def run_name(configuration: str, row_order: str) -> str:
    return configuration if row_order == "as given" else f"{configuration}, rows {row_order}"


ROUNDING_CONTROL = run_name(*TRAIN_RUNS[-1])


def training_gaps(results: Results) -> dict[str, float]:
    """Largest |loss difference| over the steps against HF SDPA, per run (name: ``run_name``)."""
    base = results.get(training_key(*TRAIN_RUNS[0]))
    out = {}
    for run in TRAIN_RUNS[1:]:
        ours = results.get(training_key(*run))
        if base is not None and ours is not None:
            pairs = zip(ours.result["losses"], base.result["losses"], strict=True)
            out[run_name(*run)] = max(abs(x - y) for x, y in pairs)
    return out
