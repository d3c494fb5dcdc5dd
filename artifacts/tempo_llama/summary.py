"""The same-training runs of ``tempo_llama`` (what is trained, how a run is keyed) and how their
losses are compared. No torch here: the claims check reads these without loading a model."""

from __future__ import annotations

from measure.results import Results

TRAIN = {"model": "llama-mini", "steps": 150, "batch": 8, "seq": 64, "lr": 1e-3}
# (configuration, row order, dtype); the first is the reference. The fp32 runs are what a user
# trains; their gaps are shown, not judged: 150 Adam steps amplify a first rounding difference
# chaotically, so how far two float32 runs of the same math part has no principled bound. The
# float64 runs are the judged pairs: weights, optimizer and loss in float64 (HF's Llama loss
# casts the logits to float32, so theirs is computed from the logits: measure.training's
# causal_lm_loss; the chunked loss keeps float64 itself). The rows-reversed run is the control
# for rounding: HF itself summing the same math in another order.
TRAIN_RUNS = [
    ("hf-sdpa", "as given", "fp32"),
    ("tempo+sdpa", "as given", "fp32"),
    ("tempo+sdpa+loss", "as given", "fp32"),
    ("hf-sdpa", "reversed", "fp32"),
    ("hf-sdpa", "as given", "fp64"),
    ("tempo+sdpa", "as given", "fp64"),
    ("tempo+sdpa+loss", "as given", "fp64"),
]
REFERENCE = {dtype: ("hf-sdpa", "as given", dtype) for dtype in ("fp32", "fp64")}  # each dtype's baseline


def training_key(configuration: str, row_order: str = "as given", dtype: str = "fp32") -> dict:
    return {
        **TRAIN,
        "configuration": configuration,
        "row_order": row_order,
        "corpus": "stdlib",
        "dtype": dtype,
    }


def run_name(configuration: str, row_order: str, dtype: str = "fp32") -> str:
    name = configuration if row_order == "as given" else f"{configuration}, rows {row_order}"
    return name if dtype == "fp32" else f"{name}, {dtype}"


ROUNDING_CONTROL = ("hf-sdpa", "reversed", "fp32")


def training_gaps(results: Results) -> dict[tuple[str, str, str], float]:
    """Largest |loss difference| over the steps against HF SDPA in the same dtype, per run (keyed
    as TRAIN_RUNS; ``run_name`` says one in words)."""
    out = {}
    for run in TRAIN_RUNS:
        reference = REFERENCE[run[2]]
        base, ours = results.get(training_key(*reference)), results.get(training_key(*run))
        if run != reference and base is not None and ours is not None:
            pairs = zip(ours.result["losses"], base.result["losses"], strict=True)
            out[run] = max(abs(x - y) for x, y in pairs)
    return out
