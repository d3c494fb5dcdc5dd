"""The same-training runs of ``tempo_bert`` (what is trained, how a run is keyed) and how their
losses are compared. No torch here: the claims check reads these without loading a model."""

from __future__ import annotations

import itertools
import statistics

from measure.results import Results

TRAIN = {  # model -> (steps, batch, seq)
    "bert-mini": (150, 8, 64),
    "gpt2-mini": (150, 8, 64),
}
TRAIN_LR = 1e-3
# (model, configuration, dropout, dropout seed, dtype). Dropout off must give the same losses;
# the float64 pair is the control for the fp32 drift: if the fp32 runs part through rounding
# alone, the same runs in float64 must agree ~1e9 times more closely. Dropout on: Tempo draws
# other masks (same distribution), so its distance from the baseline is compared with the
# baseline's own distance from itself under other dropout seeds, over every pair of seeds.
DROPOUT_SEEDS = (1, 2, 3)
TRAIN_RUNS = [
    ("bert-mini", "hf-eager", 0.0, 1, "fp32"),
    ("bert-mini", "tempo", 0.0, 1, "fp32"),
    *(("bert-mini", conf, 0.1, seed, "fp32") for conf in ("hf-eager", "tempo") for seed in DROPOUT_SEEDS),
    ("gpt2-mini", "hf-eager", 0.0, 1, "fp32"),
    ("gpt2-mini", "tempo", 0.0, 1, "fp32"),
    ("gpt2-mini", "hf-eager", 0.0, 1, "fp64"),
    ("gpt2-mini", "tempo", 0.0, 1, "fp64"),
]


def train_key(model: str, configuration: str, dropout: float, seed: int, dtype: str, corpus: str) -> dict:
    steps, batch, seq = TRAIN[model]
    return {
        "model": model,
        "configuration": configuration,
        "dropout": dropout,
        "dropout_seed": seed,
        "dtype": dtype,
        "corpus": corpus,
        "steps": steps,
        "batch": batch,
        "seq": seq,
        "lr": TRAIN_LR,
    }


def _mean_gap(a: list[float], b: list[float]) -> float:
    return statistics.fmean(abs(x - y) for x, y in zip(a, b, strict=True))


def _max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def training_summary(tr: Results, corpus: str = "stdlib") -> dict[str, float]:
    """Dropout off: the largest per-step loss difference (and its float64 control). Dropout on:
    the mean per-step |loss difference| of every Tempo-baseline pair of dropout seeds, against the
    baseline's own seed-to-seed band (every pair of baseline seeds)."""

    def curve(model, conf, dropout=0.0, seed=1, dtype="fp32") -> list[float] | None:
        point = tr.get(train_key(model, conf, dropout, seed, dtype, corpus))
        return None if point is None else point.result["losses"]

    out = {}
    for model in TRAIN:
        for dtype, label in (("fp32", ""), ("fp64", ", float64 control")):
            base, ours = curve(model, "hf-eager", dtype=dtype), curve(model, "tempo", dtype=dtype)
            if base is not None and ours is not None:
                out[f"{model} dropout off{label}: max |loss difference|"] = _max_gap(ours, base)
    runs = {
        (conf, s): c
        for conf in ("hf-eager", "tempo")
        for s in DROPOUT_SEEDS
        if (c := curve("bert-mini", conf, 0.1, s)) is not None
    }
    base = [c for (conf, _), c in runs.items() if conf == "hf-eager"]
    ours = [c for (conf, _), c in runs.items() if conf == "tempo"]
    band = [_mean_gap(a, b) for a, b in itertools.combinations(base, 2)]
    cross = [_mean_gap(a, b) for a in ours for b in base]
    if not band or not cross:
        return out
    prefix = "bert-mini dropout 0.1"
    out[f"{prefix}: baseline seed-to-seed mean |loss difference|, lowest pair"] = min(band)
    out[f"{prefix}: baseline seed-to-seed mean |loss difference|, highest pair"] = max(band)
    out[f"{prefix}: Tempo-to-baseline mean |loss difference|, mean over pairs"] = statistics.fmean(cross)
    out[f"{prefix}: Tempo-to-baseline mean |loss difference|, highest pair"] = max(cross)
    out[f"{prefix}: Tempo-to-baseline over baseline seed-to-seed (mean over pairs)"] = statistics.fmean(
        cross
    ) / statistics.fmean(band)
    for name, curves in (("baseline", base), ("Tempo", ours)):
        out[f"{prefix}: last-50-step mean loss, {name}"] = statistics.fmean(
            statistics.fmean(c[-50:]) for c in curves
        )
    return out
