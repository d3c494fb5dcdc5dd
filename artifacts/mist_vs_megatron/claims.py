"""The claims of ``nox -s mist_vs_megatron``.

The paper's numbers are from its abstract (Mist, arXiv 2503.19050v1): "an average of 1.28 (up to
1.73) and 1.27 (up to 2.04) speedup compared to ... Megatron-LM and ... Aceso", arithmetic means
over its cases. Judged here: the speedups measured on this CPU (the ``measured`` part: every
system's winner trained by megatron-core under a memory cap that binds) and on one GPU (the GPU
check); the 60-case comparison's speedups are predictions of one cost model for every system and
are shown against the paper as predicted. Mist's paper states no accuracy figure for its own cost
model that is cited here; the time and memory targets below (20%, 10%) are this project's (issues
#12 and #24). The two sets of measured end-to-end runs ``mist validate`` reads (Mist's plans on
L4, Megatron-LM runs on A10G) guided changes to the model: they are development sets, not held
out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from measure.contention import busiest
from measure.results import Results
from mist.tuning.inter_stage import MIP_REL_GAP

from ..verdicts import AtLeast, AtMost, Bound, Missing, Near, Paper, PaperClaim, Pin, Shown, Source, one
from .engine import changes_nothing
from .measured import SYSTEMS, case_launch_probes, measured_speedups, tempo_gains
from .measured import TEMPO as TEMPO_SYSTEM  # TEMPO here is the predicted tempo part's source

EXPERIMENT = "mist_vs_megatron"
COMMAND = "nox -s mist_vs_megatron"
GPU_CHECK = "nox -s gpu_check"
ABSTRACT = "Mist, arXiv 2503.19050v1, abstract"


@dataclass(frozen=True)
class Versus:
    """A baseline Mist is judged against, and the paper's speedups over it."""

    name: str  # "the Megatron-LM grid"
    mean: float
    top: float
    detail: str = ""  # what the measures add to its name: " (2,000 plans priced)"

    @property
    def full(self) -> str:
        return self.name + self.detail


VERSUS = {
    "megatron": Versus("the Megatron-LM grid", 1.28, 1.73),
    "aceso": Versus("the Aceso-style search", 1.27, 2.04, " (2,000 plans priced)"),
}
GPUS = {"l4": ("L4", "l4"), "a100-40gb": ("A100-40GB", "a100")}  # preset -> (as written, in claim ids)
PREDICTED = dict(
    experiment=EXPERIMENT,
    file="comparison.json",
    evidence="predicted",
    basis="Mist's cost model (shipped presets) for every system, 1F1B simulator",
    command=COMMAND,
)
MEASURED = dict(
    experiment=EXPERIMENT,
    file="measured.json",
    evidence="measured",
    basis="this CPU: megatron-core on 1-2 gloo processes, 3 interleaved launches each",
    command=COMMAND,
)
GPU_MEASURED = dict(
    experiment=EXPERIMENT,
    file="gpu_measured.json",
    evidence="measured",
    basis="one GPU (the GPU check's; its model is in the results' provenance): megatron-core, 2 "
    "interleaved launches each",
    command=GPU_CHECK,
    gpu=True,
)
ENGINE = dict(MEASURED, file="engine.json", basis="this CPU: megatron-core on 2 gloo processes")
GPU_ENGINE = dict(
    GPU_MEASURED,
    file="gpu_engine.json",
    basis="one GPU (the GPU check's; its model is in the results' provenance): megatron-core, GPT-3 "
    "1.3B, one launch each",
)
# A relative loss change below one rounding of the model's dtype (bf16's unit roundoff): what moving
# tensors between device and host, or recomputing them, may leave of a GPU's run-to-run rounding
# (the embedding gradient's atomic adds, the clipping norm's reduction order on device or host).
# What a broken mechanism does, measured on this CPU (2026-12-06): gradient offloading that lost
# the last of 4 micro-batches' gradients moved the losses of GPT-3 tiny (hidden 256) by 1.3% at
# the second step and 6.6% at the fifth; done right, the losses equalled the plain plan's bit for bit
BF16_ROUNDOFF = 2.0**-8
DEVELOPMENT = dict(
    experiment=EXPERIMENT,
    file="validation.json",
    evidence="predicted",
    basis="Mist's cost model (shipped presets), against runs measured on GPUs (development sets)",
    command=COMMAND,
)
CALIBRATION = dict(
    DEVELOPMENT,
    file="calibration.json",
    basis="Mist's runtime and interference models, against held-out GPU profiles",
)
TEMPO = dict(
    PREDICTED,
    file="tempo.json",
    basis="Mist's cost model (shipped presets), Tempo's layers priced by what they keep, their "
    "extra backward work as none; 1F1B simulator",
)
TIME_TARGET = "#12's and #24's target for a step time predicted by the model fitted to the device"
# mist validate's targets (tests/mist/test_mist_validate.py): on runs that guided the model, so a
# check of its fit, tighter than a held-out prediction's
VALIDATE_TARGET = (
    "#12's targets for the development runs (time 10%, per-stage memory 5%; tested): the model was "
    "adjusted with these runs, so they check its fit, not a held-out prediction"
)
STAT = {"mean": statistics.mean, "max": max}
STAT_WORDS = {"mean": "arithmetic mean over", "max": "the largest of"}


def predicted_speedup(gpu: str, versus: str, stat: str) -> Callable[[Results], float]:
    """Mist's predicted speedup over ``versus`` on ``gpu``'s cases, arithmetic mean or max (as the
    paper states them)."""

    def value(r: Results) -> float:
        ratios = [
            p.result[versus]["iteration_s"] / p.result["mist"]["iteration_s"]
            for p in r.select(gpu=gpu)
            if "iteration_s" in p.result.get("mist", {}) and "iteration_s" in p.result.get(versus, {})
        ]
        if not ratios:
            raise Missing(gpu)
        return STAT[stat](ratios)

    return value


def closed_form_not_slower(r: Results) -> float:
    """The worst closed-form speedup of Mist over the Megatron-LM grid among the cases whose grid
    plan is in Mist's space (not interleaved); 0 where Mist found no plan and the grid did."""
    ratios = [
        p.result["megatron"]["closed_form_s"] / p.result["mist"]["closed_form_s"]
        if "closed_form_s" in p.result.get("mist", {})
        else 0.0
        for p in r
        if p.result.get("megatron", {}).get("virtual_stages") == 1
    ]
    if not ratios:
        raise Missing("megatron")
    return min(ratios)


def measured_speedup(versus: str, stat: str) -> Callable[[Results], float]:
    """Mist's measured speedup over ``versus`` (the cap-bound cases trained on one device): the
    arithmetic ``mean`` or the ``max`` over cases."""

    def value(r: Results) -> float:
        rows = measured_speedups(r, versus)
        if not rows:
            raise Missing(versus)
        return STAT[stat](x["measured"] for x in rows)

    return value


def _differing(r: Results, versus: str) -> list[dict]:
    """The measured cases where Mist and ``versus`` chose different plans and ``versus``'s is one
    Mist's search prices too (not interleaved): the same plan is a tie by construction (one run),
    an interleaved one a plan Mist cannot make."""
    rows = measured_speedups(r, versus)
    if not rows:
        raise Missing(versus)
    return [x for x in rows if not x["same_plan"] and not x["versus_interleaved"]]


def measured_losses(versus: str) -> Callable[[Results], float]:
    """How many of ``_differing``'s cases Mist's winner ran slower than ``versus``'s beyond the two
    runs' launch-to-launch spread (its speedup plus the spread below 1.0)."""
    return lambda r: sum(x["measured"] + x["spread"] < 1.0 for x in _differing(r, versus))


def measured_differing(versus: str) -> Callable[[Results], float]:
    """How many cases ``measured_losses`` counts among."""
    return lambda r: len(_differing(r, versus))


def measured_noise(versus: str, stat: str) -> Callable[[Results], float]:
    """The launch-to-launch spread behind ``measured_speedup``: the mean of the cases' (mean) or the
    largest case's (max)."""

    def value(r: Results) -> float:
        rows = measured_speedups(r, versus)
        if not rows:
            raise Missing(versus)
        if stat == "mean":
            return statistics.mean(x["spread"] for x in rows)
        return max(rows, key=lambda x: x["measured"])["spread"]

    return value


def _cases(r: Results) -> list[dict]:
    cases = [p.result for p in r]  # measured.json: this CPU's cases; gpu_measured.json: the GPU's
    if not cases:
        raise Missing("measured")
    return cases


def drift_beyond_fit(fit_probe_s: list[float], launches_probe_s: list[float]) -> float | None:
    """How much slower the machine was at some launches than at the fit that priced them, by the
    speed probe (engine.speed_probe), counting only what the probe resolves: the launches' median
    probe against the nearer end of the range the fit's own probes (just before and after it)
    spanned, 0 inside it (+ slower, - faster); None where either was not probed. The fit's two
    probes differ by the machine's drift during the fit and the probe's own noise (up to 10% here),
    and a change within them is not one the probe can tell (engine.speed_change, which the run
    prints, is against their mean)."""
    if not fit_probe_s or not launches_probe_s:
        return None
    at_launches = statistics.median(launches_probe_s)
    nearest = min(max(at_launches, min(fit_probe_s)), max(fit_probe_s))  # itself inside the range
    return at_launches / nearest - 1


def _case_drift(case: dict) -> float | None:
    """``drift_beyond_fit`` of a measured case's launches (None in results from before the probe)."""
    return drift_beyond_fit(case.get("runtime_fit_probe_s") or [], case_launch_probes(case))


def _timed_winners(r: Results, at_fit_speed: bool = True) -> list[tuple[dict, float | None]]:
    """Every plan a system chose and trained to a time (none out of memory or refused), each with
    its case's drift (``_case_drift``; None without ``at_fit_speed``)."""
    return [
        (x[s], _case_drift(x) if at_fit_speed else None)
        for x in _cases(r)
        for s in SYSTEMS
        if "time_error" in x.get(s, {})
    ]


def _quiet(r: Results, timings: Callable[[dict], list]) -> Results:
    """``r`` without the points any of whose ``timings`` (contention records) was not quiet."""
    return Results(r.path, [p for p in r if not busiest(timings(p.result))])


def quiet_cases(r: Results) -> Results:
    """Bound.quiet of the measured comparison: the cases whose profile (the fit that priced their
    plans) and every winner's launches were quiet."""
    return _quiet(
        r,
        lambda case: [
            *(c for s in SYSTEMS for c in case.get(s, {}).get("launches_contention") or []),
            case.get("runtime_fit_contention"),
        ],
    )


def quiet_plans(r: Results) -> Results:
    """Bound.quiet of the engine part: the plans whose fit's profile and launches were quiet."""
    return _quiet(r, lambda run: [*(run.get("launches_contention") or []), run.get("fit_contention")])


def measured_time_error(r: Results) -> float:
    """Worst |predicted / measured step time - 1| over every plan a system chose and trained."""
    return max(abs(x["time_error"]) for x, _ in _timed_winners(r))


def launch_errors(run: dict, drift: float | None = None) -> tuple[float, float]:
    """The (smallest, largest) |predicted / measured step time - 1| of one trained plan over its
    launches: each launch's median step against the prediction (the engine part's
    ``predicted_step_s``; the measured comparison keeps ``time_error``, its median launch's, so
    there the prediction is (1 + time_error) x that launch's time).

    With ``drift``, how much slower the machine was at the launches than at the fit that priced
    them by the speed probe (``drift_beyond_fit``), each launch also at the fit's speed: its time /
    (1 + drift). A fit prices launches made minutes later, and on this VM the probe has moved
    8-14% between them within one run (2026-12-06; docs/claims.md), where the prediction cannot
    follow: the band then spans the error as measured and as it would be at the speed the model
    was fitted at, and a bound it straddles is not judged. The median over the launches, not each
    launch's own probe: one probe is a coarse gauge, the launches' spread is already in the band."""
    launches, measured = run["launches_step_s"], run["measured_step_s"]
    if not any(math.isclose(t, measured, rel_tol=1e-12) for t in launches):
        raise ValueError(f"measured_step_s {measured} is none of its launches {launches}")
    predicted = run["predicted_step_s"] if "predicted_step_s" in run else (1 + run["time_error"]) * measured
    times = list(launches) + ([t / (1 + drift) for t in launches] if drift is not None else [])
    errors = [abs(predicted / t - 1) for t in times]
    return min(errors), max(errors)


def worst_noise(runs: list[tuple[dict, float | None]]) -> tuple[float, float]:
    """The noise band (Bound.noise) of the worst |time error| over ``runs`` (each with the
    machine's drift since its fit, ``launch_errors``): its value were every plan's most favourable
    launch its median, and were every plan's least favourable one."""
    if not runs:
        raise Missing("runs")
    bands = [launch_errors(x, drift) for x, drift in runs]
    return max(b for b, _ in bands), max(w for _, w in bands)


def measured_time_noise(at_fit_speed: bool = True) -> Callable[[Results], tuple[float, float]]:
    """``measured_time_error``'s noise band over the launches of every winner, each also at its
    fit's speed (``launch_errors``) unless not ``at_fit_speed``."""
    return lambda r: worst_noise(_timed_winners(r, at_fit_speed))


def plain_plans_that_fit(r: Results) -> float:
    """The negative control: cases whose plain plan did not run out of memory (each must): it ran
    within the cap, or the engine refused it, which shows nothing about the cap (review
    2026-12-07: a refusal counted as out of memory)."""
    return sum(not x["plain"]["out_of_memory"] for x in _cases(r))


def measured_case_count(r: Results) -> float:
    return len(_cases(r))


def _engine_runs(r: Results, setup: str = "engine") -> list[dict]:
    """The engine part's plans of ``setup`` (engine.json's CPU setup, gpu_engine.json's GPU one)."""
    runs = [p.result for p in r.select(setup=setup)]
    if not runs:
        raise Missing(setup)
    return runs


def engine(field: str, setup: str = "engine") -> Callable[[Results], float]:
    def value(r: Results) -> float:
        runs = _engine_runs(r, setup)
        if field == "memory_error":
            return max(abs(rank["memory_error"]) for x in runs for rank in x["ranks"])
        if field == "worst_time_error":
            return max(abs(x["time_error"]) for x in runs)
        return statistics.median(abs(x["time_error"]) for x in runs)

    return value


def _engine_drift(run: dict) -> float | None:
    """``drift_beyond_fit`` of an engine plan's launches (None in results from before the probe)."""
    return drift_beyond_fit(run.get("fit_probe_s") or [], run.get("launches_probe_s") or [])


def engine_noise(
    field: str, setup: str = "engine", at_fit_speed: bool = True
) -> Callable[[Results], tuple[float, float]]:
    """``engine(field)``'s noise band (Bound.noise) over each plan's launches, each also at its
    fit's speed (``launch_errors``) unless not ``at_fit_speed``: the worst or the median |time
    error| were every plan's most favourable launch its median, and its least."""

    def value(r: Results) -> tuple[float, float]:
        runs = [(x, _engine_drift(x) if at_fit_speed else None) for x in _engine_runs(r, setup)]
        if field == "worst_time_error":
            return worst_noise(runs)
        bands = [launch_errors(x, drift) for x, drift in runs]
        return statistics.median(b for b, _ in bands), statistics.median(w for _, w in bands)

    return value


def gpu_engine_loss_change(r: Results) -> float:
    """The largest relative difference, over every step, of any GPU engine plan's losses from the
    plan that neither recomputes nor offloads (the same model, seed and batches: recomputation
    and offloading move tensors, not arithmetic)."""
    runs = _engine_runs(r, "gpu_engine")
    plain = [x for x in runs if changes_nothing(x["plan"])]
    if not plain:
        raise Missing("gpu_engine: the plan that neither recomputes nor offloads")
    reference = plain[0]["losses"]
    return max(abs(loss / ref - 1) for x in runs for loss, ref in zip(x["losses"], reference, strict=True))


def development(source: str, field: str) -> Callable[[Results], float]:
    def value(r: Results) -> float:
        rows = [p.result for p in r.select(source=source)]
        if not rows:
            raise Missing(source)
        if field == "time":
            return statistics.fmean(abs(x["time_error"]) for x in rows)
        return statistics.fmean(abs(e) for x in rows for e in x["memory_errors"])

    return value


def calibration(r: Results) -> float:
    found = [p.result["mean_abs_error"] for p in r.select(model="runtime")]
    if not found:
        raise Missing("runtime")
    return max(found)


def interference(r: Results) -> float:
    found = [p.result["held_out_mean_abs_error"] for p in r.select(model="interference")]
    if not found:
        raise Missing("interference")
    return max(found)


def tempo_gain(stat: str) -> Callable[[Results], float]:
    """Mist with Tempo's predicted gain over Mist without, over the GPT-3 and Llama cases: the
    arithmetic mean, the max or the min."""

    def value(r: Results) -> float:
        gains = [p.result["gain"] for p in r if "gain" in p.result]
        if not gains:
            raise Missing("tempo")
        return {"min": min, **STAT}[stat](gains)

    return value


def measured_tempo_gain(r: Results) -> float:
    """Mist with Tempo's measured gain over Mist on this CPU's cases, the arithmetic mean."""
    rows = tempo_gains(r)
    if not rows:
        raise Missing("mist_tempo")
    return statistics.mean(x["measured"] for x in rows)


def measured_tempo_time_error(r: Results) -> float:
    """Worst |predicted / measured step time - 1| of Mist's Tempo plans trained on this CPU."""
    runs = [x[TEMPO_SYSTEM] for x in _cases(r) if "time_error" in x.get(TEMPO_SYSTEM, {})]
    if not runs:
        raise Missing(TEMPO_SYSTEM)
    return max(abs(x["time_error"]) for x in runs)


def tuning_time(r: Results) -> float:
    return one(r, gpu="a100-40gb", model="gpt3-22b", flash=True)["mist"]["tuning_s"]


# Why the measured comparisons are analogues of the paper's (their verdicts: the direction at most)
CPU_ANALOGUE = (
    "4-layer models of hidden 256 on 1-2 gloo processes of a CPU, for the paper's 1.3B-22B models on "
    "2-32 GPUs"
)
GPU_ANALOGUE = "1.3B-2.7B models on one GPU under a memory cap, for the paper's 1.3B-22B models on 2-32 GPUs"
ACESO_ANALOGUE = (
    "; the Aceso-style search re-implemented here (on Mist's cost model, 2,000 plans priced, no "
    "ZeRO or offloading), not Aceso's"
)


def _measured_claims(prefix: str, source: dict, where: str, analogue: str) -> tuple[PaperClaim, ...]:
    out = []
    for versus, v in VERSUS.items():
        for stat, paper, text in (("mean", v.mean, f"{v.mean}x mean"), ("max", v.top, f"up to {v.top}x")):
            out.append(
                PaperClaim(
                    id=f"{prefix}-vs-{versus}" + ("-max" if stat == "max" else ""),
                    system="Mist",
                    claim=f"beats {v.name}, measured" + (f" {where}" if where else ""),
                    paper=Paper(text, paper, ABSTRACT),
                    measure=f"measured speedup over {v.full}'s plan, {STAT_WORDS[stat]} the cases both fit, "
                    "every winner trained under a per-rank memory cap that binds (an analogue: "
                    f"{analogue})",
                    source=Source(**source),
                    neutral=1.0,
                    unit="x",
                    value=measured_speedup(versus, stat),
                    noise=measured_noise(versus, stat),
                    analogue=analogue + (ACESO_ANALOGUE if versus == "aceso" else ""),
                )
            )
    return tuple(out)


def _predicted_claims() -> tuple[PaperClaim, ...]:
    out = []
    for gpu, (gpu_name, in_ids) in GPUS.items():
        for versus, v in VERSUS.items():
            for stat, paper, text in (("mean", v.mean, f"{v.mean}x mean"), ("max", v.top, f"up to {v.top}x")):
                out.append(
                    PaperClaim(
                        id=f"mist-vs-{versus}-{in_ids}" + ("-max" if stat == "max" else ""),
                        system="Mist",
                        claim=f"beats {v.name}, predicted ({gpu_name} cases)",
                        paper=Paper(text, paper, ABSTRACT),
                        measure=f"predicted speedup over {v.full}, {STAT_WORDS[stat]} the paper's {gpu_name} "
                        "cases (GPT-3, Llama, Falcon 1.3B-22B on 2-32 GPUs)",
                        source=Source(**PREDICTED),
                        neutral=1.0,
                        unit="x",
                        value=predicted_speedup(gpu, versus, stat),
                    )
                )
    return tuple(out)


CLAIMS = (
    *_measured_claims("mist-measured", MEASURED, "on this CPU", CPU_ANALOGUE),
    *(
        Bound(
            id=f"mist-measured-not-slower-{v}",
            system="Mist",
            claim="...and never loses when measured",
            measure=f"the same cases where the two plans differ and the baseline's is not interleaved: "
            f"how many Mist's winner ran slower than {VERSUS[v].name}'s beyond the two runs' "
            "launch-to-launch spread",
            source=Source(**MEASURED),
            value=measured_losses(v),
            check=AtMost(0),
            unit="int",
            out_of=measured_differing(v),
            quiet=quiet_cases,
            why="the baseline's plan is one Mist's search prices too (not interleaved, which Mist's "
            "search, like its paper's, leaves out; the winners' optimizer offload, 1.0, is among Mist's "
            "fractions): Mist chose its own as faster, so measured slower beyond the noise is a wrong "
            "prediction",
        )
        for v in VERSUS
    ),
    Bound(
        id="mist-measured-time",
        system="Mist",
        claim="...and each winner runs as predicted",
        measure="the same runs, every system's winner: worst |predicted / measured step time - 1| (CPU "
        "runtime model fitted to this CPU's GPT-3 layer profile, Llama's cases too; 1F1B simulator)",
        source=Source(**MEASURED),
        value=measured_time_error,
        noise=measured_time_noise(),
        noise_as_measured=measured_time_noise(at_fit_speed=False),
        quiet=quiet_cases,
        check=AtMost(0.20),
        unit="%",
        why=TIME_TARGET,
    ),
    Bound(
        id="mist-measured-cap-binds",
        system="Mist",
        claim="...under a cap that binds",
        measure="negative control: cases whose plain plan (DP over all, no accumulation, nothing saved) "
        "did not run out of memory when measured (ran within the cap, or was refused)",
        source=Source(**MEASURED),
        value=plain_plans_that_fit,
        check=AtMost(0),
        unit="int",
        out_of=measured_case_count,
        why="a negative control: each plain plan must run out of memory",
    ),
    *_measured_claims("mist-gpu-measured", GPU_MEASURED, "on a GPU", GPU_ANALOGUE),
    Bound(
        id="mist-gpu-measured-time",
        system="Mist",
        claim="...as predicted, on a GPU",
        measure="the same runs: worst |predicted / measured step time - 1| (runtime model fitted to the "
        "GPU's `mist profile` at the 1.3B shape)",
        source=Source(**GPU_MEASURED),
        value=measured_time_error,
        noise=measured_time_noise(),
        noise_as_measured=measured_time_noise(at_fit_speed=False),
        quiet=quiet_cases,
        check=AtMost(0.20),
        unit="%",
        why=TIME_TARGET,
    ),
    Bound(
        id="mist-gpu-measured-cap-binds",
        system="Mist",
        claim="...under a cap that binds, on a GPU",
        measure="negative control: cases whose plain plan did not run out of memory under the GPU cap "
        "(ran within it, or was refused)",
        source=Source(**GPU_MEASURED),
        value=plain_plans_that_fit,
        check=AtMost(0),
        unit="int",
        out_of=measured_case_count,
        why="a negative control: each plain plan must run out of memory",
    ),
    *_predicted_claims(),
    Bound(
        id="mist-engine-memory",
        system="Mist",
        claim="plans run on megatron-core, memory as predicted",
        measure="6 plans (TP, PP, DP, ZeRO-1/2/3) on 2 gloo processes, 2 setups: worst |predicted / "
        "measured memory - 1| per rank",
        source=Source(**ENGINE),
        value=engine("memory_error"),
        check=AtMost(0.10),
        unit="%",
        why="#12's target for the memory model on the device it prices",
    ),
    Bound(
        id="mist-engine-time",
        system="Mist",
        claim="...and step time as predicted",
        measure="the same plans: median |predicted / measured step time - 1| (CPU runtime model)",
        source=Source(**ENGINE),
        value=engine("time_error"),
        noise=engine_noise("time_error"),
        noise_as_measured=engine_noise("time_error", at_fit_speed=False),
        quiet=quiet_plans,
        check=AtMost(0.20),
        unit="%",
        why=TIME_TARGET,
    ),
    Bound(
        id="mist-engine-time-worst",
        system="Mist",
        claim="...for every plan",
        measure="the same plans: worst |predicted / measured step time - 1|",
        source=Source(**ENGINE),
        value=engine("worst_time_error"),
        noise=engine_noise("worst_time_error"),
        noise_as_measured=engine_noise("worst_time_error", at_fit_speed=False),
        quiet=quiet_plans,
        check=AtMost(0.20),
        unit="%",
        why=TIME_TARGET,
    ),
    Bound(
        id="mist-gpu-engine-memory",
        system="Mist",
        claim="plans run on megatron-core, memory as predicted, on a GPU",
        measure="6 single-GPU plans (recomputation; optimizer, activation, weight and gradient "
        "offloading): worst |predicted / measured memory - 1|",
        source=Source(**GPU_ENGINE),
        value=engine("memory_error", "gpu_engine"),
        check=AtMost(0.10),
        unit="%",
        why="#12's target for the memory model on the device it prices",
    ),
    Bound(
        id="mist-gpu-engine-time",
        system="Mist",
        claim="...and step time, on a GPU",
        measure="the same plans: worst |predicted / measured step time - 1| (runtime model fitted to "
        "the GPU's `mist profile`)",
        source=Source(**GPU_ENGINE),
        value=engine("worst_time_error", "gpu_engine"),
        check=AtMost(0.20),
        unit="%",
        why=TIME_TARGET,
    ),
    Bound(
        id="mist-gpu-engine-losses",
        system="Mist",
        claim="...and offloading and recomputation train the same model, on a GPU",
        measure="the same plans: largest relative difference of any step's loss from the plan that "
        "neither recomputes nor offloads",
        source=Source(**GPU_ENGINE),
        value=gpu_engine_loss_change,
        check=AtMost(BF16_ROUNDOFF),
        unit="%",
        why="below one bf16 rounding; a lost micro-batch gradient moved the losses by 1.3-6.6% "
        "(measured on the CPU)",
    ),
    Bound(
        id="mist-validate-l4-time",
        system="Mist",
        claim="fits the runs it was developed on: Mist's plans on L4",
        measure="`mist validate` (a development set: fit quality, not held out): Mist-tuned plans "
        "measured on L4 (GPT-3 1.3B, 2 stages), mean |iteration time error|",
        source=Source(**DEVELOPMENT),
        value=development("mist-l4.json", "time"),
        check=AtMost(0.10),
        unit="%",
        why=VALIDATE_TARGET,
    ),
    Bound(
        id="mist-validate-l4-memory",
        system="Mist",
        claim="...and their memory",
        measure="the same runs: mean |per-stage peak memory error|",
        source=Source(**DEVELOPMENT),
        value=development("mist-l4.json", "memory"),
        check=AtMost(0.05),
        unit="%",
        why=VALIDATE_TARGET,
    ),
    Bound(
        id="mist-validate-a10g-time",
        system="Mist",
        claim="...and Megatron-LM runs on A10G",
        measure="`mist validate` (a development set: fit quality, not held out): Megatron-LM runs on 8 "
        "A10G (GPT-3 1.3B-6.7B, 2-8 stages), mean |iteration time error|",
        source=Source(**DEVELOPMENT),
        value=development("megatron-a10g.json", "time"),
        check=AtMost(0.10),
        unit="%",
        why=VALIDATE_TARGET,
    ),
    Shown(
        id="mist-runtime-model",
        system="Mist",
        claim="the runtime model predicts a layer",
        measure="per-layer time against the profiled per-op sums, held-out model sizes: worst mean error "
        "over the five GPU profile sets",
        source=Source(**CALIBRATION),
        value=calibration,
        unit="%",
    ),
    Shown(
        id="mist-interference",
        system="Mist",
        claim="overlap interference is modelled",
        measure="overlapped GEMM/NCCL/copy runs held out: worst mean error (L4, A100)",
        source=Source(**CALIBRATION),
        value=interference,
        unit="%",
    ),
    Bound(
        id="mist-not-slower-megatron",
        system="Mist",
        claim="its search holds the grid's plans, never slower (a check of the search's consistency)",
        measure="the worst of Mist's speedups over the Megatron-LM grid by the closed form both "
        "searches rank by, over the comparison's cases whose grid plan is not interleaved",
        source=Source(**PREDICTED),
        value=closed_form_not_slower,
        check=AtLeast(1.0 - MIP_REL_GAP),
        unit="x",
        why="every plan of the grid but the interleaved ones is in the space of Mist's MILP "
        "(uniform stages, block recomputation, ZeRO 0/1, optimizer offload in quarters), priced by "
        "the same model: Mist's plan cannot be slower beyond the MILP's relative gap, and the "
        "refinement only lowers it",
    ),
    Bound(
        id="mist-tempo-not-slower",
        system="Mist",
        claim="plans Tempo's layers, never slower (a check of the search's consistency)",
        measure="Mist with Tempo's layers over Mist without, predicted, the worst of the 40 GPT-3 and "
        "Llama cases",
        source=Source(**TEMPO),
        value=tempo_gain("min"),
        check=AtLeast(1.0 - 1e-3),
        unit="x",
        why="Tempo's layers keep less and are priced at the same time: every plan that fits "
        "without them fits with them, so the search cannot end slower (within its MILP's "
        "1e-4 gap, with room for the simulator's ranking)",
    ),
    Shown(
        id="mist-tempo-gain",
        system="Mist",
        claim="...and what Tempo buys a plan",
        measure="the same cases: Mist with Tempo over Mist without, arithmetic mean (predicted; an "
        "upper bound: Tempo's extra backward work is priced as none)",
        source=Source(**TEMPO),
        value=tempo_gain("mean"),
        unit="x",
    ),
    Shown(
        id="mist-tempo-gain-max",
        system="Mist",
        claim="...at most",
        measure="the same cases: the largest gain",
        source=Source(**TEMPO),
        value=tempo_gain("max"),
        unit="x",
    ),
    Shown(
        id="mist-measured-tempo-gain",
        system="Mist",
        claim="...and measured where memory binds",
        measure="Mist with Tempo's layers over Mist, each winner trained under the cap on this CPU, "
        "arithmetic mean over the cases (Tempo's own backward work included, as it ran)",
        source=Source(**MEASURED),
        value=measured_tempo_gain,
        unit="x",
    ),
    Shown(
        id="mist-measured-tempo-time",
        system="Mist",
        claim="...and Tempo's plans run as predicted",
        measure="the same runs: worst |predicted / measured step time - 1| of Mist's Tempo plans (CPU "
        "runtime model with the Tempo layers' excess fitted to `mist profile --tempo`; 1F1B simulator)",
        source=Source(**MEASURED),
        value=measured_tempo_time_error,
        unit="%",
    ),
    Shown(
        id="mist-tuning-time",
        system="Mist",
        claim="tunes fast",
        measure="Mist's tuning time, GPT-3 22B on 32 A100-40GB, seq 4096, batch 512, on this CPU (s)",
        source=Source(**dict(PREDICTED, evidence="measured", basis="this CPU (2 cores)")),
        value=tuning_time,
    ),
)

PINS = (
    *(
        Pin(
            id=c.id,
            experiment=EXPERIMENT,
            file="comparison.json",
            value=c.value,
            near=Near(abs=0.01),
            unit="x",
        )
        for c in CLAIMS
        if isinstance(c, PaperClaim) and c.source.file == "comparison.json"
    ),
    Pin(
        id="mist-runtime-model",
        experiment=EXPERIMENT,
        file="calibration.json",
        value=calibration,
        near=Near(abs=0.005),
        unit="%",
    ),
    Pin(
        id="mist-interference",
        experiment=EXPERIMENT,
        file="calibration.json",
        value=interference,
        near=Near(abs=0.005),
        unit="%",
    ),
    *(
        Pin(
            id=f"mist-validate-{name}",
            experiment=EXPERIMENT,
            file="validation.json",
            near=Near(abs=0.005),
            unit="%",
            value=development(source, field),
        )
        for name, source, field in (
            ("l4-time", "mist-l4.json", "time"),
            ("l4-memory", "mist-l4.json", "memory"),
            ("a10g-time", "megatron-a10g.json", "time"),
        )
    ),
)
