"""What the claims registry judges, and by which rule: three kinds kept apart.

* ``PaperClaim``: a number a paper states (and where it states it) against ours, which is either
  **measured** (on what) or **predicted** (by which model). Verdict against the paper, by
  ``paper_verdict``'s written rule: reproduced / direction only, smaller or larger (with the ratio
  of the effects) / not reproduced / not yet run; for an analogue of the paper's setting (a tiny
  model on CPU processes for a cluster's), the direction only, whatever the size of its effect;
  for a model's band over its assumptions, each end's, or "depends on the assumptions" when they
  differ in kind (``band_verdict``).
* ``Bound``: a principled target (exactness, an accuracy target, a negative control that must be
  caught). Verdict: holds / BROKEN / not yet run; for a measured number with a ``noise`` band (its
  value over each launch of the measurement), also "within noise" where the band straddles the
  bound: those launches cannot tell whether it holds.
* ``Shown``: a number shown for context and never judged (a timing on this machine).

Regression pins (this run against the committed reference) are not claims: ``Pin``, checked
apart (``python -m artifacts.claims --pins``, each experiment's session, tests).

The experiments' claims live beside them (``artifacts/<experiment>/claims.py``); this module
imports none of them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from measure.checks import real
from measure.results import ResultFileError, Results


class Missing(LookupError):
    """A point a claim reads is not in the result file (the claim was not run)."""


def one(results: Results, **fields) -> dict:
    """The result of the one point with these key fields; Missing if there is none."""
    point = results.one(**fields)
    if point is None:
        raise Missing(fields)
    return point.result


# ---------------------------------------------------------------- verdicts against a paper

# Ours reproduces a paper's number when its effect (its distance from "no effect": a speedup's
# 1.0x, a saving's 0%) is within a factor of 1.25 of the paper's effect either way; a smaller or
# larger effect in the same direction reproduces the direction only; an effect of the wrong sign,
# none, or one within the measurement's own noise does not reproduce it. An analogue of the paper's
# setting (other scale, other hardware, a re-implemented baseline) reproduces at most the direction:
# the size of its effect is not the paper's to compare with.
REPRODUCED_FACTOR = 1.25
RULE = (
    f"effect = distance from no effect; reproduced: ours within {REPRODUCED_FACTOR:g}x of the "
    "paper's effect either way; direction only: same sign, smaller or larger; not reproduced: "
    "no effect, the wrong sign, or within the measurement's noise; an analogue of the paper's "
    "setting: the direction at most"
)
REPRODUCED, NOT_REPRODUCED, NOT_RUN = "reproduced", "not reproduced", "not yet run"
SMALLER, LARGER = "direction only, smaller", "direction only, larger"
ANALOGUE = "direction only, an analogue"
DEPENDS = "depends on the assumptions"
DIRECTION_ONLY = "direction only"  # the summary's class of SMALLER, LARGER and ANALOGUE


@dataclass(frozen=True)
class Verdict:
    """A claim's verdict: its ``kind`` (one of the verdict names, here for paper claims and in
    artifacts.claims for bounds), which the summaries count and the exit status reads, and its
    ``text`` in full where that says more (the ratio of the effects, a band's ends, the launches'
    spread), which the tables show."""

    kind: str
    text: str = ""

    def __str__(self) -> str:
        return self.text or self.kind


def paper_verdict(
    ours: float, paper: float, neutral: float, noise: float = 0.0, analogue: bool = False
) -> Verdict:
    """The verdict of ``ours`` against ``paper`` (the module's ``RULE``): ``neutral`` is the value
    of no effect, ``noise`` the measurement's own spread (an effect within it is none);
    ``analogue``: ours is from an analogue of the paper's setting (the direction at most)."""
    if paper == neutral:
        raise ValueError(f"the paper's number {paper} is the neutral value: there is no effect to reproduce")
    effect = ours - neutral
    if abs(effect) <= noise:
        return Verdict(NOT_REPRODUCED, f"{NOT_REPRODUCED} (within noise)")
    ratio = effect / (paper - neutral)
    if ratio <= 0:
        return Verdict(NOT_REPRODUCED)
    if analogue:
        kind = ANALOGUE
    elif ratio > REPRODUCED_FACTOR:
        kind = LARGER
    elif ratio < 1 / REPRODUCED_FACTOR:
        kind = SMALLER
    else:
        return Verdict(REPRODUCED)
    return Verdict(kind, f"{kind} ({ratio:.2f}x the paper's effect)")


def band_verdict(low: float, high: float, paper: float, neutral: float) -> Verdict:
    """A band of ours (a model's result over the range of its assumptions) against ``paper``: the
    verdict of each end; when the ends' verdicts differ in class, the verdict depends on the
    assumptions (and says how)."""
    if low > high:
        raise ValueError(f"band ({low}, {high}): low above high")
    ends = paper_verdict(low, paper, neutral), paper_verdict(high, paper, neutral)
    if ends[0] == ends[1]:
        return ends[0]
    if verdict_class(ends[0]) == verdict_class(ends[1]):  # one class (a kind of its own where they differ)
        kind = ends[0].kind if ends[0].kind == ends[1].kind else verdict_class(ends[0])
        return Verdict(kind, f"{ends[0]} .. {ends[1]}")
    return Verdict(DEPENDS, f"{DEPENDS}: {ends[0]} at the low end, {ends[1]} at the high end")


def verdict_class(verdict: Verdict) -> str:
    """The summary's class of a paper claim's verdict."""
    if verdict.kind in (SMALLER, LARGER, ANALOGUE, DIRECTION_ONLY):
        return DIRECTION_ONLY
    if verdict.kind in (REPRODUCED, NOT_REPRODUCED, NOT_RUN, DEPENDS):
        return verdict.kind
    raise ValueError(f"not a paper claim's verdict: {verdict!r}")


# ---------------------------------------------------------------- the kinds

Evidence = Literal["measured", "predicted"]
Value = Callable[[Results], float]
Band = Callable[[Results], tuple[float, float]]


@dataclass(frozen=True)
class Paper:
    """A number a paper states: as it states it, the number ours is judged against, and where."""

    text: str  # "1.28x mean (up to 1.73x)"
    value: float
    where: str  # "Mist, arXiv 2503.19050v1, abstract"


@dataclass(frozen=True, kw_only=True)
class Source:
    """Where a number of ours comes from: an experiment's result file, read by ``value``; how it was
    obtained (``evidence`` on ``basis``: the machine it was measured on, or the model that predicted
    it); the command that makes it and whether it needs a GPU."""

    experiment: str
    file: str
    evidence: Evidence
    basis: str  # "this CPU (gloo processes)", "an H200", "Mist's cost model (shipped presets)"
    command: str
    gpu: bool = False

    def __post_init__(self) -> None:
        if self.evidence not in ("measured", "predicted"):
            raise ValueError(f"evidence must be 'measured' or 'predicted', got {self.evidence!r}")


@dataclass(frozen=True, kw_only=True)
class PaperClaim:
    """A paper's number and ours, judged against the paper by ``paper_verdict``'s rule (``band``
    instead of ``value``: ours is a model's range over its assumptions, judged by
    ``band_verdict``)."""

    id: str
    system: str  # Tempo | Mist | CTA-pipelining
    claim: str
    paper: Paper
    measure: str  # what our number is
    source: Source
    neutral: float  # the value of no effect (1.0 for a speedup or a ratio, 0.0 for a saving)
    unit: str = ""
    value: Value | None = None
    band: Band | None = None
    noise: Value | None = None  # the measurement's own spread (measured claims)
    # why ours is an analogue of the paper's setting, not the setting (its verdict: the direction
    # at most); "" where ours is the paper's setting
    analogue: str = ""

    def __post_init__(self) -> None:
        if (self.value is None) == (self.band is None):
            raise ValueError(f"{self.id}: give exactly one of value and band")


def _bound_value(bound: float, unit: str) -> str:
    """A bound as the table shows it: a ratio bound with more than two decimals (0.999) shown with
    three, never rounded to one it is not (1.00)."""
    if unit == "x" and round(bound, 2) != bound:
        return f"{bound:.3f}×"
    return format_value(bound, unit, signed=False)


@dataclass(frozen=True)
class AtMost:
    bound: float

    def ok(self, value: float) -> bool:
        return value <= self.bound

    def describe(self, unit: str) -> str:
        return f"≤ {_bound_value(self.bound, unit)}"


@dataclass(frozen=True)
class AtLeast:
    bound: float

    def ok(self, value: float) -> bool:
        return value >= self.bound

    def describe(self, unit: str) -> str:
        return f"≥ {_bound_value(self.bound, unit)}"


@dataclass(frozen=True, kw_only=True)
class Bound:
    """A principled target: ``check`` on our number, ``why`` the target is what it is (exactness,
    an accuracy target and whose, a negative control). ``known_broken``: why the committed
    reference breaks it and what would mend it (shown with the verdict; a bound broken without it
    fails, and one marked but holding fails the tests: the mark goes when the cause is fixed).

    ``noise``: for a number measured in several launches (``value`` from each plan's median
    launch), the (low, high) it takes were each plan's launch the one that makes it least and
    most. It holds only where both ends meet the check, is broken only where neither does, and is
    within noise between: the launches straddle the bound, not judged (the command names it and
    does not fail). n independent launches' range holds their median's true value with
    probability 1 - 2^(1-n) (each falls on either side of it with even chance): 3/4 for the CPU's
    three launches, 1/2 for the GPU check's two; a straddle is a measurement too noisy to judge
    by, not a verdict. ``noise_as_measured``: where ``noise`` also spans what the launches would
    have taken at another speed of the machine (a predicted time's band: at the fit's speed), the
    launches' band alone, shown beside it where the two differ. ``out_of``: for a count (``unit``
    "int"), how many cases it counts among, shown as "k of n": a count of none among none holds
    only vacuously, and the reader is told so. ``quiet``: for a time measured on a CPU, the
    results without the points (plans, cases) any of whose timings (a launch, or the profile its
    prediction was fitted to) shared the cores with other work (measure.contention; a timing with
    no record counts as quiet). Where the number is broken or within noise with such points and
    not broken without them, a busy machine's time decides it, and it is not judged (the command
    names it and does not fail); a break among the quiet points stands."""

    id: str
    system: str
    claim: str
    measure: str
    source: Source
    value: Value
    check: AtMost | AtLeast
    why: str
    unit: str = ""
    known_broken: str = ""
    noise: Band | None = None
    noise_as_measured: Band | None = None
    out_of: Value | None = None
    quiet: Callable[[Results], Results] | None = None

    def __post_init__(self) -> None:
        if self.out_of is not None and (self.unit != "int" or self.noise is not None):
            raise ValueError(f"{self.id}: out_of is for a count (unit 'int') without a noise band")


@dataclass(frozen=True, kw_only=True)
class Shown:
    """A number shown for context, never judged (timings are benchmarks, not checks)."""

    id: str
    system: str
    claim: str
    measure: str
    source: Source
    value: Value
    unit: str = ""
    paper: Paper | None = None


Claim = PaperClaim | Bound | Shown


@dataclass(frozen=True)
class Near:
    """Within ``abs`` (+ ``rel`` x |reference|) of the reference."""

    abs: float = 0.0
    rel: float = 0.0

    def ok(self, value: float, reference: float) -> bool:
        return abs(value - reference) <= self.abs + self.rel * abs(reference)

    def describe(self, unit: str) -> str:
        if self.abs == 0 and self.rel == 0:
            return "= reference"
        step = f"{self.abs * 100:g} pt" if unit == "%" else format_value(self.abs, unit, signed=False)
        parts = [step] if self.abs else []
        parts += [f"{self.rel:.0%} of it"] if self.rel else []
        return "reference ± " + " + ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Pin:
    """A regression pin: this run's number against the committed reference's (code that changes a
    pinned number changes the reference deliberately). Not a claim: never in a verdict."""

    id: str
    experiment: str
    file: str
    value: Value
    near: Near
    unit: str = ""


EXACT = Near(abs=0.001)  # exact byte counts: only a change of code moves them


def format_value(value: float | tuple[float, float] | None, unit: str, signed: bool = True) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return f"{format_value(value[0], unit, signed)} .. {format_value(value[1], unit, signed)}"
    if unit == "%":
        return f"{value:+.1%}" if signed else f"{value:.1%}"
    if unit == "x":
        return f"{value:.2f}×"
    if unit == "e":
        return f"{value:.1e}"
    if unit == "int":
        return f"{value:.0f}"
    return f"{value:.3g}"


def read(value: Callable[[Results], object], results: Results) -> float | tuple[float, float] | None:
    """``value`` of ``results``: None when a point it needs is missing (not run). Raises
    ResultFileError, naming the file, where a point holds a value of the wrong type or lacks a
    field (a file edited or written by other code: never a traceback), where a point holds a NaN
    or an infinity or a value out of its kind's range (``check_values``), or where the value comes
    out NaN: a computation that failed is never judged as holding, nor read as not run."""
    check_values(results)  # first: ResultFileError is a ValueError, which the wrapping below catches
    try:
        got = value(results)
        for x in got if isinstance(got, tuple) else (got,):
            if x is not None and not real(x):  # "0.0" would pass float(); True is 1
                raise TypeError(f"{x!r} is not a number")
        ours = None if got is None else tuple(float(x) for x in got) if isinstance(got, tuple) else float(got)
    except Missing:
        return None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        raise ResultFileError(
            f"{results.path}: a point holds a value of the wrong type or lacks a field "
            f"({type(e).__name__}: {e}); rerun the part that writes it, or move the file aside"
        ) from None
    if ours is not None and any(math.isnan(x) for x in (ours if isinstance(ours, tuple) else (ours,))):
        raise ResultFileError(
            f"{results.path}: a claim's value comes out NaN from its finite points (0/0, inf - inf): "
            "not judged; fix the claim's value function"
        )
    return ours


@dataclass(frozen=True)
class Range:
    """The values one kind of result field takes: at least ``least``; whole numbers if ``whole``."""

    what: str
    least: float
    whole: bool = False

    def holds(self, value: float) -> bool:
        return value >= self.least and (not self.whole or float(value).is_integer())

    def describe(self) -> str:
        return f"{self.what} ({'a whole number' if self.whole else 'a number'} >= {self.least:g})"


# Each kind of value a result holds, known by its field's name (a list's items by the list's): no
# code here writes a negative time, error or size, or a fractional batch, so such a value is a file
# edited or written wrong. A claim judged on it said something untrue (an error of -5 held a bound
# of <= 1e-5, a max batch of -5 or 1.5 was compared), and a figure drew without it (a log axis
# drops a value <= 0 without a word). Signed differences (memory_error, time_error: prediction
# against measurement) and ratios have no range here.
RANGES: tuple[tuple[str, Range], ...] = (
    (r".+_per_s(_.+)?", Range("a rate per second", 0)),  # before the times: seqs_per_s is no time
    (r".+_s|seconds", Range("a time in seconds", 0)),
    (r"error|relative_error|(.+_)?(abs|rel)_error", Range("an absolute or relative error", 0)),
    (r"(estimated_|measured_)?max_batch", Range("a max batch size", 0, whole=True)),  # 0: none fits
    (r"(micro|global)_batch(es)?", Range("a batch size", 1, whole=True)),
    (r".*bytes", Range("a size in bytes", 0)),
)


def value_range(field: str) -> Range | None:
    """The range of values the result field named ``field`` takes (``RANGES``), if it has one."""
    return next((kind for pattern, kind in RANGES if re.fullmatch(pattern, field)), None)


def check_values(results: Results) -> None:
    """Every number the points of ``results`` hold is finite, and in its kind's range where it has
    one (``RANGES``). A NaN is a computation that failed (a kernel that writes NaN gives a NaN
    error), and Python's max, min and mean drop a NaN unless it comes first, so a claim aggregating
    it would hold; read as missing, it passed as "not run". ResultFileError, naming the file, the
    point and the field, otherwise: what the claims and the figures read goes through here."""
    for p in results:
        if (found := _bad_number(p.result, "result", "")) is None:
            continue
        where, kind = found
        what = "not a finite number: a computation that failed" if kind is None else f"not {kind.describe()}"
        raise ResultFileError(
            f"{results.path}: point {json.dumps(p.key, sort_keys=True)} holds {where}, {what}, so nothing "
            "is judged or drawn from this file; fix what wrote it and rerun the part that writes the file, "
            "or move the file aside"
        )


def _bad_number(data: object, where: str, field: str) -> tuple[str, Range | None] | None:
    """Where in ``data`` (a point's result, JSON data; ``field`` its name) a number is NaN or
    infinite (with None), or outside its field's range (with the range), as "result.x.y = value";
    None where every number is sound."""
    if real(data):
        if not math.isfinite(data):
            return f"{where} = {data}", None
        kind = value_range(field)
        return None if kind is None or kind.holds(data) else (f"{where} = {data}", kind)
    if isinstance(data, dict):
        items = [(f"{where}.{k}", k, v) for k, v in data.items()]
    elif isinstance(data, list):
        items = [(f"{where}.{i}", field, v) for i, v in enumerate(data)]
    else:
        items = []
    for there, name, v in items:
        if (found := _bad_number(v, there, name)) is not None:
            return found
    return None
