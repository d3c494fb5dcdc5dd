"""The same-training runs of ``tempo_bert`` (what is trained, how a run is keyed) and how their
losses are compared. No torch here: the claims check reads these without loading a model."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from measure.results import Results


@dataclass(frozen=True)
class TrainedModel:
    """How one model is trained, with and without Tempo."""

    steps: int
    batch: int
    seq: int
    causal_lm: bool  # GPT-2's objective (BPE, next token); else BERT's (WordPiece, MLM + NSP)


TRAIN = {
    "bert-mini": TrainedModel(steps=150, batch=8, seq=64, causal_lm=False),
    "gpt2-mini": TrainedModel(steps=150, batch=8, seq=64, causal_lm=True),
}
TRAIN_LR = 1e-3
# (model, configuration, dropout, dropout seed, dtype[, rows, loss]). Dropout off must give the
# same losses. The float64 pairs are what is judged, a causal LM's loss computed in float64 too
# (HF's casts the logits to float32, which made an earlier "float64" pair agree only to float32's
# rounding): if the fp32 runs part through rounding alone, these agree ~1e9 times more closely.
# The fp32 gaps are shown beside a rounding control (HF with every batch's rows reversed, the
# same sums in another order, against HF), never judged: 150 Adam steps amplify rounding
# chaotically. Dropout on: Tempo draws other masks (same distribution), so only statistics over
# dropout seeds can agree. Ten seeds each: single pairs of runs part by one-step spikes of up to
# ~0.4 (Adam at a constant learning rate on a plateau; both configurations have them), so a
# pair's max |loss difference| says nothing. The training curves cannot tell dropout 0.08 from
# 0.12 at this scale either: the distribution check at fixed weights
# (run.dropout_distribution_point) is what has that power.
DROPOUT_SEEDS = tuple(range(1, 11))
LAST_STEPS = 50  # a run's loss: the mean over its last 50 steps
REVERSED, FLOAT64_LOSS = "reversed", "fp64"

# The dropout distribution check at fixed weights (run.dropout_distribution_point): (name in its
# result, configuration, dropout p), each compared with the reference: HF again (the null),
# Tempo twice, and HF at wrong rates (the negative controls it must catch).
DROPOUT_REFERENCE = ("reference", "hf-eager", 0.1)
DROPOUT_NULL = (("hf-eager again", "hf-eager", 0.1),)
DROPOUT_TEMPO = (("tempo", "tempo", 0.1), ("tempo again", "tempo", 0.1))
DROPOUT_WRONG = (("hf-eager p=0.08 (wrong)", "hf-eager", 0.08), ("hf-eager p=0.12 (wrong)", "hf-eager", 0.12))
DROPOUT_COMPARED = (*DROPOUT_NULL, *DROPOUT_TEMPO, *DROPOUT_WRONG)


def float64_loss(model: str) -> str | None:
    """How a float64 run computes its loss: a causal LM's in float64 from the logits (HF's would
    cast them to float32); BERT's own loss stays in its logits' dtype."""
    return FLOAT64_LOSS if TRAIN[model].causal_lm else None


TRAIN_RUNS = [
    ("bert-mini", "hf-eager", 0.0, 1, "fp32"),
    ("bert-mini", "tempo", 0.0, 1, "fp32"),
    *(("bert-mini", conf, 0.1, seed, "fp32") for conf in ("hf-eager", "tempo") for seed in DROPOUT_SEEDS),
    ("bert-mini", "hf-eager", 0.0, 1, "fp64"),
    ("bert-mini", "tempo", 0.0, 1, "fp64"),
    ("gpt2-mini", "hf-eager", 0.0, 1, "fp32"),
    ("gpt2-mini", "tempo", 0.0, 1, "fp32"),
    ("gpt2-mini", "hf-eager", 0.0, 1, "fp32", REVERSED, None),
    ("gpt2-mini", "hf-eager", 0.0, 1, "fp64", None, FLOAT64_LOSS),
    ("gpt2-mini", "tempo", 0.0, 1, "fp64", None, FLOAT64_LOSS),
]


def train_key(
    model: str,
    configuration: str,
    dropout: float,
    seed: int,
    dtype: str,
    rows: str | None = None,
    loss: str | None = None,
    *,
    corpus: str,
) -> dict:
    """A training run's key. ``rows`` ("reversed": each batch's rows reversed) and ``loss`` ("fp64":
    computed in float64 from the logits) are in the key only when given: points from before they
    existed had the rows as drawn and the model's own loss."""
    trained = TRAIN[model]
    key = {
        "model": model,
        "configuration": configuration,
        "dropout": dropout,
        "dropout_seed": seed,
        "dtype": dtype,
        "corpus": corpus,
        "steps": trained.steps,
        "batch": trained.batch,
        "seq": trained.seq,
        "lr": TRAIN_LR,
    }
    if rows is not None:
        key["rows"] = rows
    if loss is not None:
        key["loss"] = loss
    return key


def _mean_gap(a: list[float], b: list[float]) -> float:
    return statistics.fmean(abs(x - y) for x, y in zip(a, b, strict=True))


def _max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# The training summary's keys (what it prints, and what the claims read): made here only.
def dropout_off_key(model: str, float64: bool = False) -> str:
    """A model's largest per-step loss difference without dropout (fp32, or the float64 pair)."""
    return f"{model} dropout off{', float64 control' if float64 else ''}: max |loss difference|"


def rounding_control_key(model: str) -> str:
    return f"{model} dropout off, rounding control: max |loss difference|"


def over_rounding_key(model: str) -> str:
    return f"{model} dropout off: max |loss difference| over the rounding control's"


DROPOUT_ON = "bert-mini dropout 0.1"
LATE = f"{DROPOUT_ON}: last-{LAST_STEPS}-step loss"
PAIRWISE_KEY = f"{DROPOUT_ON}: median pairwise mean |loss difference|, Tempo-baseline over baseline-baseline"
WELCH_T_KEY = f"{LATE}, Tempo - baseline, Welch t"
CHECK = "dropout at fixed weights: |variance ratio - 1|"
NULL_KEY, TEMPO_KEY = f"{CHECK}, HF vs HF (null)", f"{CHECK}, Tempo vs HF (worst)"
WRONG_KEY = f"{CHECK}, wrong rates vs HF (least)"


def training_summary(tr: Results, corpus: str = "stdlib") -> dict[str, float]:
    """Dropout off: the largest per-step loss difference (and its float64 control). Dropout on:
    the mean per-step |loss difference| of every Tempo-baseline pair of dropout seeds, against the
    baseline's own seed-to-seed band (every pair of baseline seeds)."""

    def curve(model, conf, dropout=0.0, seed=1, dtype="fp32", rows=None, loss=None) -> list[float] | None:
        point = tr.get(train_key(model, conf, dropout, seed, dtype, rows, loss, corpus=corpus))
        return None if point is None else point.result["losses"]

    return {
        **_dropout_off_summary(curve),
        **_dropout_on_summary(curve),
        **_dropout_check_summary([p.result for p in tr.select(check="dropout distribution", corpus=corpus)]),
    }


def _dropout_off_summary(curve: Callable[..., list[float] | None]) -> dict[str, float]:
    """Per trained model without dropout: Tempo's largest per-step loss difference from the
    baseline, in fp32 and in float64, and over the rounding control's (the baseline on reversed
    rows). ``curve``: a run's losses (None: not run)."""
    out = {}
    for model in TRAIN:
        for dtype, loss in (("fp32", None), ("fp64", float64_loss(model))):
            base, ours = (
                curve(model, "hf-eager", dtype=dtype, loss=loss),
                curve(model, "tempo", dtype=dtype, loss=loss),
            )
            if base is not None and ours is not None:
                out[dropout_off_key(model, float64=dtype == "fp64")] = _max_gap(ours, base)
        control = curve(model, "hf-eager", rows=REVERSED)
        base, ours = curve(model, "hf-eager"), curve(model, "tempo")
        if control is not None and base is not None and ours is not None:
            gap = _max_gap(control, base)
            out[rounding_control_key(model)] = gap
            out[over_rounding_key(model)] = _max_gap(ours, base) / gap
    return out


def _dropout_on_summary(curve: Callable[..., list[float] | None]) -> dict[str, float]:
    """bert-mini with dropout 0.1 over the dropout seeds: Tempo-baseline pairs' mean |loss
    difference| against the baseline's seed-to-seed band, and the last steps' loss of each with a
    Welch interval of their difference (empty with fewer than two seeds of either)."""
    runs = {
        (conf, s): c
        for conf in ("hf-eager", "tempo")
        for s in DROPOUT_SEEDS
        if (c := curve("bert-mini", conf, 0.1, s)) is not None
    }
    base = [c for (conf, _), c in runs.items() if conf == "hf-eager"]
    ours = [c for (conf, _), c in runs.items() if conf == "tempo"]
    out = {}
    if len(base) >= 2 and len(ours) >= 2:
        band = [_mean_gap(a, b) for a, b in itertools.combinations(base, 2)]
        cross = [_mean_gap(a, b) for a in ours for b in base]
        out[PAIRWISE_KEY] = statistics.median(cross) / statistics.median(band)
        late_base = [statistics.fmean(c[-LAST_STEPS:]) for c in base]
        late_ours = [statistics.fmean(c[-LAST_STEPS:]) for c in ours]
        low, high = welch_interval(late_ours, late_base, 0.90)
        out[f"{LATE}, baseline mean"] = statistics.fmean(late_base)
        out[f"{LATE}, Tempo mean"] = statistics.fmean(late_ours)
        out[f"{LATE}, baseline sd over seeds"] = statistics.stdev(late_base)
        out[f"{LATE}, Tempo - baseline, 90% interval low"] = low
        out[f"{LATE}, Tempo - baseline, 90% interval high"] = high
        out[f"{LATE}, Tempo - baseline, 90% interval bound"] = max(abs(low), abs(high))
        # the difference over its own standard error (Welch's t): how far it is from none in units
        # of what the seeds' spread makes of it, whatever that spread is in this run
        difference, error, _ = _welch(late_ours, late_base)
        out[WELCH_T_KEY] = abs(difference) / error
    return out


def _dropout_check_summary(checks: list[dict]) -> dict[str, float]:
    """The dropout distribution checks at fixed weights (``checks``: their results): how far each
    variance ratio to HF's is from 1 (empty without checks)."""
    if not checks:
        return {}

    def off(candidates) -> list[float]:
        return [abs(r[name]["variance_ratio"] - 1) for r in checks for name, _, _ in candidates]

    return {
        NULL_KEY: max(off(DROPOUT_NULL)),
        TEMPO_KEY: max(off(DROPOUT_TEMPO)),
        WRONG_KEY: min(off(DROPOUT_WRONG)),
    }


def welch_interval(a: list[float], b: list[float], level: float) -> tuple[float, float]:
    """Confidence interval of mean(a) - mean(b), unequal variances (Welch)."""
    from scipy import stats

    diff, error, dof = _welch(a, b)
    half = stats.t.ppf(0.5 + level / 2, dof) * error
    return diff - half, diff + half


def _welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) - mean(b), its standard error with unequal variances, and Welch's degrees of freedom."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return statistics.fmean(a) - statistics.fmean(b), math.sqrt(va + vb), dof
