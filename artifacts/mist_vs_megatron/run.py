"""Mist's main comparison: the best plan of Mist, Megatron-LM (grid), Mist's search of only what
Megatron-LM runs (``mist plan --target megatron-lm``), an Aceso-style search and ZeRO-3 for GPT-3,
Llama and Falcon at 1.3B-22B on 2-32 GPUs, all priced by one model.

    python -m artifacts.mist_vs_megatron.run [--parts ...] [--scale cpu|paper] [--jobs N]
                                             [--fresh] [--update-reference]

Parts (results in artifacts/mist_vs_megatron/results/, git-ignored; the committed reference is in
reference/; an interrupted run resumes when rerun):
* calibration: the runtime model's held-out per-layer error on the Mist artifact's per-op
  profiles (data/mist-artifact), and the interference model's on its overlap benchmarks.
* validation: ``mist validate``: the measured end-to-end runs (data/mist-artifact/measured-runs)
  predicted exactly as they ran; iteration time and per-stage memory errors.
* comparison: per case (cluster, model, FlashAttention) each system's plan, predicted
  iteration time, memory per stage and tuning time; Mist's plan also as Megatron-LM arguments
  with what Megatron-LM cannot express.
* ablation (GPT-3): from the Megatron-LM grid, Mist's search with checkpoint tuning only, then
  + offloading (and ZeRO), then + imbalance awareness (the full planner).
* tempo (GPT-3, Llama): Mist with Tempo's layers (``mist plan --tempo``: norms keep their output,
  GELU its output and a bit, attention its probabilities, dropout a seed) against Mist without
  them, per case: the predicted gain and what Tempo changed in the plan. Tempo's extra backward
  work is priced as none by the shipped GPU presets (no GPU has timed Tempo's layer): a predicted
  gain is an upper bound of what the memory saved buys. The measured part trains both where
  memory binds, planned with a CPU fit that prices that work (``mist profile --tempo``).
* engine: plans (TP=2, PP=2, DP=2, ZeRO-1/2/3) trained by megatron-core on 2 gloo processes; measured
  per-rank memory and step time against the prediction (time from a runtime model fitted to
  `mist profile` of this CPU).
* measured: Mist, the grid, the Aceso-style search and ZeRO-3 each plan a small GPT-3 or Llama
  on 1 or 2 gloo processes under a per-rank memory cap that the plain plan exceeds; every winner
  trained (3 launches), measured step times and speedups beside the predicted ones (measured.py).
FlashAttention on and off; --scale paper gives the Aceso-style search a larger budget.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from measure.cli import quiet_broken_pipe
from measure.parallel import map_points
from measure.results import Results, Run

from ..experiment import config_from_command_line, experiment_run, option
from . import EXPERIMENT
from .engine import CPU_ENGINE, RuntimeFits, print_engine, run_engine
from .measured import SYSTEMS, print_measured, run_measured
from .plans import plan_changes, plan_summary

PARTS = ("calibration", "validation", "comparison", "ablation", "tempo", "engine", "measured")
SIZES = [("1.3b", 2, 32), ("2.7b", 4, 64), ("7b", 8, 128), ("13b", 16, 256), ("22b", 32, 512)]  # GPUs, batch
CLUSTERS = {"l4": 2048, "a100-40gb": 4096}  # GPU -> sequence length (the paper's settings)
ARCHS = ("gpt3", "llama", "falcon")  # the model families of mist.model.specs.families()
TEMPO_ARCHS = ("gpt3", "llama")  # Tempo's layers are built sequential: not Falcon's parallel block
FLASH = {"cpu": (True, False), "paper": (True, False)}
# the Aceso-style search's budget in distinct plans priced (not seconds: results independent of load)
ACESO_MAX_PRICED = {"cpu": 2000, "paper": 12000}
# What each step adds, in order: Mist's search over recomputed layers per stage, the layer split
# (MILP) and the micro-batch, without offloading or ZeRO-2/3 and blind to the first/last
# micro-batch's extra work; then offloading (the MILP's halves, the optimizer's quarters, refined to
# eighths with the embedding/head's own strategy) and ZeRO-2/3; then imbalance awareness (the full
# planner).
ABLATION = (
    "megatron",
    "+recompute, layer split, micro-batch",
    "+offloading (1/8 steps, embedding/head's own), ZeRO-2/3",
    "+imbalance awareness",
)


def _simulated(plan, m, c):
    """The plan's iteration time by the 1F1B simulator (the closed form the searches rank by
    under-estimates unbalanced pipelines); re-predicted where a search skipped the simulation."""
    from mist import predict

    if plan.simulated_iteration_s is None:
        predict(plan, m, c)
    return plan


def _setup(gpu: str, arch: str, size: str, flash: bool):
    from mist import cluster, model

    gpus, batch = next((g, b) for s, g, b in SIZES if s == size)
    return model(f"{arch}-{size}", seq=CLUSTERS[gpu], flash=flash), cluster(gpu, gpus), batch


def comparison_point(gpu: str, arch: str, size: str, flash: bool, aceso_budget: int) -> dict:
    from baselines.megatron.aceso import search_aceso
    from baselines.megatron.grid import search_grid
    from baselines.megatron.zero3 import search_zero3
    from mist import NoFeasiblePlan, search
    from mist.export import megatron_lm_arguments
    from mist.tuning.megatron_lm import check_model, search_megatron_lm

    m, c, batch = _setup(gpu, arch, size, flash)
    runs = {
        "mist": lambda: search(m, c, batch),
        "megatron": lambda: search_grid(m, c, batch),
        "megatron_lm_target": lambda: check_model(m) or search_megatron_lm(m, c, batch),
        "aceso": lambda: search_aceso(m, c, batch, aceso_budget),
        "zero3": lambda: search_zero3(m, c, batch),
    }
    # the model's family and size as fields next to the preset's name (the key's "model"), so
    # readers never take the name apart; not in the key, whose identity older points share
    out: dict = {"family": arch, "size": size, "gpus": c.gpus, "global_batch": batch, "seq": m.seq}
    for name, run in runs.items():
        try:
            found = run()
        except NoFeasiblePlan as e:
            out[name] = {"infeasible": str(e)}
            continue
        except ValueError as e:  # a model the system cannot build (Falcon on Megatron-LM)
            out[name] = {"not_runnable": str(e)}
            continue
        plan = getattr(found, "plan", found)  # the Aceso-style search also says how much budget it used
        out[name] = plan_summary(_simulated(plan, m, c))
        if plan is not found:
            out[name] |= {"priced_plans": found.priced, "converged": found.converged}
        if name == "mist":
            args, cannot = megatron_lm_arguments(plan, m)
            out[name]["megatron_args"] = args
            out[name]["megatron_cannot_express"] = cannot
    return out


def ablation_point(gpu: str, arch: str, size: str, known: dict[str, float | None]) -> dict:
    """The ablation's iteration times; ``known``: variants already found by the comparison part
    (the grid and the full planner are the same searches of the same case), taken from it."""
    from baselines.megatron.grid import search_grid
    from mist import NoFeasiblePlan, PlannerOptions, search
    from mist.tuning.stage_cost import SearchSpace

    m, c, batch = _setup(gpu, arch, size, True)
    options = (
        PlannerOptions(SearchSpace(zero_stages=(0, 1), offload=False), imbalance_aware=False),
        PlannerOptions(SearchSpace(), imbalance_aware=False),
        PlannerOptions(SearchSpace(), imbalance_aware=True),
    )
    searches = [lambda: search_grid(m, c, batch), *(lambda o=o: search(m, c, batch, o) for o in options)]
    # as in comparison_point: the name is not parsed back
    out: dict = {"family": arch, "size": size, "from_comparison": sorted(known)}
    for name, run in zip(ABLATION, searches, strict=True):
        if name in known:
            out[name] = known[name]
            continue
        try:
            out[name] = _simulated(run(), m, c).simulated_iteration_s
        except NoFeasiblePlan:
            out[name] = None
    return out


def tempo_point(gpu: str, arch: str, size: str, flash: bool, known: dict | None) -> dict:
    """Mist's plan with and without Tempo's layers; ``known``: the comparison part's Mist result
    for the same case (this run's), taken as the plan without, not searched again."""
    from mist import NoFeasiblePlan, search

    m, c, batch = _setup(gpu, arch, size, flash)
    out: dict = {"family": arch, "size": size, "from_comparison": known is not None}
    for name, spec in (("mist", m), ("mist_tempo", m.with_(tempo=True))):
        if name == "mist" and known is not None:
            out[name] = known
            continue
        try:
            out[name] = plan_summary(_simulated(search(spec, c, batch), spec, c))
        except NoFeasiblePlan as e:
            out[name] = {"infeasible": str(e)}
    if "iteration_s" in out["mist"] and "iteration_s" in out["mist_tempo"]:
        out["gain"] = out["mist"]["iteration_s"] / out["mist_tempo"]["iteration_s"]
        out["changes"] = plan_changes(out["mist"], out["mist_tempo"])
    return out


def _known_from_comparison(comparison: Results | None, key: dict) -> dict[str, float | None]:
    """The ablation's first and last variants (the grid, the full planner) as the comparison part
    of this run found them for the same case (FlashAttention on), where it has it."""
    point = (
        None
        if comparison is None
        else next((p for p in comparison if {k: p.key.get(k) for k in key} == key), None)
    )
    if point is None:
        return {}
    found = {}
    for variant, system in ((ABLATION[0], "megatron"), (ABLATION[-1], "mist")):
        r = point.result[system]
        if "iteration_s" in r or "infeasible" in r:
            found[variant] = r.get("iteration_s")
    return found


def _largest_first(todo: list[tuple], flash=lambda args: args[3]) -> list[tuple]:
    """Cases (gpu, arch, size, ...; ``flash``: whether a case's FlashAttention is on) in the order
    of their searches' length, the longest first: the workers then end together instead of one
    waiting out the last large case (the 22B cases take 20-45 s, the 1.3B ones 1-3). Larger
    models on more GPUs search more; a longer sequence and unfused attention leave more
    strategies that fit."""
    sizes = [size for size, _, _ in SIZES]
    return sorted(
        todo, key=lambda args: (sizes.index(args[2]), CLUSTERS[args[0]], not flash(args)), reverse=True
    )


def comparison_key(gpu: str, arch: str, size: str, flash: bool, aceso_budget: int) -> dict:
    gpus, batch = next((g, b) for s, g, b in SIZES if s == size)
    return {
        "gpu": gpu,
        "model": f"{arch}-{size}",
        "flash": flash,
        "gpus": gpus,
        "global_batch": batch,
        "seq": CLUSTERS[gpu],
        "aceso_max_priced": aceso_budget,
        "cost_model": "shipped presets",
    }


def tempo_key(gpu: str, arch: str, size: str, flash: bool) -> dict:
    return {k: v for k, v in comparison_key(gpu, arch, size, flash, 0).items() if k != "aceso_max_priced"}


def ablation_key(gpu: str, arch: str, size: str) -> dict:
    return {k: v for k, v in comparison_key(gpu, arch, size, True, 0).items() if k != "aceso_max_priced"}


def run_comparison(run: Run, flash: tuple[bool, ...], budget: int, jobs: int) -> Results:
    store = run.file("comparison.json", config={"systems": SYSTEMS})
    todo = [
        (gpu, arch, size, f, budget)
        for gpu in CLUSTERS
        for arch in ARCHS
        for size, _, _ in SIZES
        for f in flash
        if not store.done(comparison_key(gpu, arch, size, f, budget))
    ]
    for args, result, seconds in map_points(comparison_point, _largest_first(todo), jobs, "cases"):
        store.add(comparison_key(*args), result, seconds)
    return store.this_run()


def run_tempo(run: Run, flash: tuple[bool, ...], jobs: int, comparison: Results | None = None) -> Results:
    """Mist with and without Tempo per GPT-3 and Llama case; where ``comparison`` (this run's) has
    the case, its Mist plan is the one without."""
    store = run.file("tempo.json", config={"archs": TEMPO_ARCHS})
    todo = []
    for gpu, arch, (size, _, _), f in itertools.product(CLUSTERS, TEMPO_ARCHS, SIZES, flash):
        key = tempo_key(gpu, arch, size, f)
        if store.done(key):
            continue
        found = (
            None
            if comparison is None
            else next((p for p in comparison if {k: p.key.get(k) for k in key} == key), None)
        )
        todo.append((gpu, arch, size, f, None if found is None else found.result["mist"]))
    for args, result, seconds in map_points(tempo_point, _largest_first(todo), jobs, "tempo"):
        store.add(tempo_key(*args[:4]), result, seconds)
    return store.this_run()


def print_tempo(store: Results) -> None:
    """Per case, Tempo's predicted gain for Mist and what it changed in the plan."""
    for p in store:
        r = p.result
        case = f"{p.key['model']:<11} {p.key['gpu']:<9} flash {'on ' if p.key['flash'] else 'off'}"
        if "gain" not in r:
            print(
                f"  {case}: "
                + "; ".join(
                    f"{n}: {r[n]['infeasible']}" for n in ("mist", "mist_tempo") if "infeasible" in r[n]
                )
            )
            continue
        what = ", ".join(r["changes"]) or "the same plan"
        print(f"  {case}: {r['gain']:.3f}x ({what})")
    gains = [p.result["gain"] for p in store if "gain" in p.result]
    if gains:
        changed = sum(bool(p.result["changes"]) for p in store if "gain" in p.result)
        print(
            f"  Tempo's predicted gain for Mist: mean {statistics.mean(gains):.3f}x, "
            f"max {max(gains):.3f}x, min {min(gains):.3f}x; the plan changed in {changed} of "
            f"{len(gains)} cases"
        )


def run_ablation(run: Run, jobs: int, comparison: Results | None = None) -> Results:
    """The ablation's cases; where ``comparison`` (this run's) has a case, its grid and Mist plans
    are the ablation's first and last variants, not searched again."""
    store = run.file("ablation.json", config={"arch": "gpt3", "variants": ABLATION})
    todo = [
        (gpu, "gpt3", size, _known_from_comparison(comparison, ablation_key(gpu, "gpt3", size)))
        for gpu in CLUSTERS
        for size, _, _ in SIZES
        if not store.done(ablation_key(gpu, "gpt3", size))
    ]
    for args, result, seconds in map_points(
        ablation_point, _largest_first(todo, lambda _: True), jobs, "ablation"
    ):
        store.add(ablation_key(*args[:3]), result, seconds)
    return store.this_run()


def calibration_point(profiles: str) -> dict:
    from mist.model.calibrate import calibrate
    from mist.model.profile_data import ARTIFACT_DATA

    r = calibrate(ARTIFACT_DATA / "gpu-op-profiles" / profiles)[profiles]
    keep = (
        "gpu",
        "held_out_cases",
        "mean_abs_error",
        "median_abs_error",
        "max_abs_error",
        "head_mean_abs_error",
        "head_max_abs_error",
    )
    return {k: r[k] for k in keep}


def interference_point(benchmarks: str) -> dict:
    from mist.model.interference import fit_interference
    from mist.model.profile_data import ARTIFACT_DATA

    _, report = fit_interference(ARTIFACT_DATA / "gpu-bandwidth" / benchmarks)
    return report


def run_calibration(run: Run) -> Results:
    from mist.model.profile_data import ARTIFACT_DATA

    store = run.file("calibration.json", config={"data": "data/mist-artifact"})
    for d in sorted(p.name for p in (ARTIFACT_DATA / "gpu-op-profiles").iterdir() if p.is_dir()):
        r = store.compute({"model": "runtime", "profiles": d}, lambda d=d: calibration_point(d))
        print(
            f"  runtime model, {d}: held-out per-layer error mean {r['mean_abs_error']:.1%}, median "
            f"{r['median_abs_error']:.1%}, max {r['max_abs_error']:.1%} ({r['held_out_cases']} cases)"
        )
    for f in sorted(p.name for p in (ARTIFACT_DATA / "gpu-bandwidth").glob("*.json")):
        r = store.compute({"model": "interference", "benchmarks": f}, lambda f=f: interference_point(f))
        before, after = r["no_interference_mean_abs_error"], r["held_out_mean_abs_error"]
        print(f"  interference, {f}: held-out error {before:.1%} without the model, {after:.1%} with it")
    return store.this_run()


def run_validation(run: Run) -> Results:
    from mist.tuning.validate import load_measured_runs, report, validate

    store = run.file("validation.json", config={"runs": "data/mist-artifact/measured-runs"})
    for row in report(validate(load_measured_runs()))["runs"]:
        store.compute({"run": row["run"], "source": row["source"]}, lambda row=row: row)
        memory = ", ".join(f"{e:+.1%}" for e in row["memory_errors"]) or "not measured"
        print(f"  {row['run']}: time {row['time_error']:+.1%}, memory per stage {memory}")
    return store.this_run()


def speedups(store: Results, versus: str, of: str = "mist") -> dict[str, list[float]]:
    """Per GPU: the speedup of ``of`` over ``versus`` on every case both could plan."""
    out: dict[str, list[float]] = {}
    for p in store:
        a, b = p.result.get(of, {}), p.result.get(versus, {})
        if "iteration_s" in a and "iteration_s" in b:
            out.setdefault(p.key["gpu"], []).append(b["iteration_s"] / a["iteration_s"])
    return out


@dataclass(frozen=True)
class MistVsMegatronConfig:
    """What a run of this experiment computes (its command line: ``config_from_command_line``)."""

    parts: tuple[str, ...] = option(PARTS, "the parts to run, in this order", choices=PARTS)
    scale: str = option("cpu", "paper: the Aceso-style search's larger budget", choices=("cpu", "paper"))


def main(argv: list[str] | None = None) -> None:
    config, args, ap = config_from_command_line(MistVsMegatronConfig, EXPERIMENT, argv, __doc__, jobs=True)
    if config.scale != "cpu" and not {"comparison", "tempo"} & set(config.parts):  # else ignored
        ap.error("--scale applies to the comparison and tempo parts only; add one to --parts")
    budget = ACESO_MAX_PRICED[config.scale]
    cmp = abl = tempo = engine = measured = None
    # the CPU's runtime models (a profile per process count): made once, for the engine and measured parts
    with (
        experiment_run(args, EXPERIMENT) as run,
        tempfile.TemporaryDirectory(prefix="mist_vs_megatron_") as tmp,
    ):
        fits = RuntimeFits(Path(tmp), CPU_ENGINE)
        if "calibration" in config.parts:
            print("Runtime and interference models, held out:")
            run_calibration(run)
        if "validation" in config.parts:
            print("Measured end-to-end runs, predicted as they ran:")
            run_validation(run)
        if "comparison" in config.parts:
            cmp = run_comparison(run, FLASH[config.scale], budget, args.jobs)
        if "ablation" in config.parts:
            abl = run_ablation(run, args.jobs, cmp)
        if "tempo" in config.parts:
            tempo = run_tempo(run, FLASH[config.scale], args.jobs, cmp)
        if "engine" in config.parts:
            engine = run_engine(run, CPU_ENGINE, fits).this_run()
        if "measured" in config.parts:
            print("Mist vs the baselines under a memory cap, every winner trained (gloo processes):")
            measured = run_measured(run, fits).this_run()
    if engine is not None:
        print("\nPlans trained by megatron-core (2 gloo processes), measured vs predicted:")
        print_engine(engine)
    if measured is not None:
        print("\nMist vs the baselines under a per-rank memory cap, trained by megatron-core on this CPU:")
        print_measured(measured)
    if cmp is not None:
        print("\nMist's speedup (predicted iteration time, same cost model for every system):")
        pairs = (
            ("mist", "megatron", "1.28x mean, up to 1.73x"),
            ("mist", "aceso", "1.27x mean, up to 2.04x"),
            ("mist", "megatron_lm_target", "-"),
            ("megatron_lm_target", "megatron", "-"),
        )
        for of, versus, paper in pairs:
            for gpu, values in speedups(cmp, versus, of).items():
                mean = statistics.mean(values)
                print(
                    f"  {of} over {versus:<18} on {gpu:<10}: mean {mean:.2f}x, max {max(values):.2f}x, "
                    f"min {min(values):.2f}x over {len(values)} cases (paper: {paper})"
                )
        times = [p.result["mist"]["tuning_s"] for p in cmp if "tuning_s" in p.result.get("mist", {})]
        if times:
            print(f"  Mist tuning time: median {statistics.median(times):.1f} s, max {max(times):.1f} s")
    if abl is not None:
        print(f"\nablation: {len(abl)} GPT-3 cases")
    if tempo is not None:
        print("\nMist with Tempo's layers over Mist without (predicted; Tempo's extra backward unpriced):")
        print_tempo(tempo)
    print(f"\nresults in {args.results}; figures: nox -s figures")


if __name__ == "__main__":
    with quiet_broken_pipe():  # `| head`: ends quietly, status 141
        main()
