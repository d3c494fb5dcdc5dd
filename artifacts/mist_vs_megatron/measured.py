"""Mist vs Megatron-LM, measured: every system plans under a per-rank memory cap with the runtime
model fitted to the device that runs the plans, and every winner is trained by megatron-core
(``mist.engine.run``).

    MEASURED (this CPU, part ``measured`` of ``nox -s mist_vs_megatron``): the cases below.
    GPU_MEASURED (one GPU, ``python -m artifacts.mist_vs_megatron.measured``, part ``mist_measured``
        of ``nox -s gpu_check``): GPT-3 1.3B under a 32 GiB cap and 2.7B under 64 GiB (seq 2048,
        unfused attention): recomputation against offloading, as single-GPU users meet it. On the GPU
        the cap is the allocator's per-process fraction, and a plan over it raises out of memory.

Per case (a small GPT-3 or Llama, hidden 256, seq 128, 4 layers, global batch 8, on 1 or 2
gloo processes): the cap is set below what the plain plan needs (data parallelism over every
process, one micro-batch a step, nothing recomputed, offloaded or sharded), so memory binds. Mist, the
Megatron-LM grid, the Aceso-style search and ZeRO-3 each plan within 90% of it (the memory model's
stated accuracy: ``PLANNING_FRACTION``) and run under all of it; each distinct winner is
trained in ``LAUNCHES`` fresh launches, interleaved with the other winners' (round by round, the
order rotated: a change in the machine's speed falls on every system alike), the median launch's
step reported and every launch's kept; and the plain plan once, to show that the cap binds when
measured too. A plan whose device peak
goes above the cap in any launch is recorded as out of memory, never as a time.

The runtime model is fitted per process count to ``mist profile`` of the device at the base
setup's model shape, with as many profile copies at once as the plans have ranks (they share
the cores); the CPU's Llama cases and the GPU's 2.7B case are priced with the fit to GPT-3's
shape (on the GPU 1.3B's; its op classes: GEMMs, norms, element-wise), so their errors show how
the fit carries to other layers. Predicted speedups are the 1F1B
simulator's, as in the comparison part; measured ones are step-time ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from measure.checks import machine_memory_bytes
from measure.cli import OneLineParser
from measure.results import Point, ResultFile, Results, Run

from ..experiment import add_run_arguments, experiment_run
from . import EXPERIMENT
from .engine import (
    CPU_ENGINE,
    DRY_RUN_OVERRIDES,
    DRY_RUN_PROFILE,
    GPU_ENGINE,
    LAUNCHES,
    EngineSetup,
    RuntimeFits,
    add_keep_argument,
    busy_launches,
    keep_folder,
    measured_phases,
    phases_line,
    probe_line,
    rank_memory,
    train_plan,
    train_plans,
)
from .plans import plan_changes, plan_summary

# every system of the experiment, predicted (run.py's comparison) and measured here
SYSTEMS = ("mist", "megatron", "megatron_lm_target", "aceso", "zero3")
# Mist planning Tempo's layers (mist plan --tempo), where a setup asks for it: compared with Mist
TEMPO = "mist_tempo"
MiB = 2**20
ACESO_MAX_PRICED = 2000  # plans priced: the comparison part's CPU-scale budget
# Every system plans to this fraction of the cap and runs under the whole cap. The memory model is
# stated to be within 10% of what the engine measures (claim mist-engine-memory), and a steady
# step's peak varies by up to ~10% at this scale (gloo's threads free buffers at varying times).
# Planned to the whole cap, the winners sit at its edge: at 2 processes three of four ran out of
# memory when measured (41.1, 40.6 and 41.2 MiB under a 40 MiB cap).
PLANNING_FRACTION = 0.9


@dataclass(frozen=True)
class MeasuredCase:
    family: str  # gpt3 | llama: the "<family>-<size>" preset, with its setup's model overrides
    processes: int
    cap_mib: int  # each rank's device-memory cap
    global_batch: int = 8
    size: str = "tiny"
    systems: tuple[str, ...] | None = None  # the systems that plan it (None: every one of its setup's)

    @property
    def model(self) -> str:
        return f"{self.family}-{self.size}"

    @property
    def cap_bytes(self) -> int:
        return self.cap_mib * MiB

    @property
    def planning_bytes(self) -> int:
        return int(PLANNING_FRACTION * self.cap_bytes)


# Caps below each case's plain plan (74-97 MiB a rank predicted; at micro-batch 1 about 64 MiB,
# mostly weights, gradients and Adam state) and above what the leanest grid plan needs, so that
# every system has something to choose. No case has more processes than this machine (and CI's)
# has cores: 4 gloo processes time-slice 2 cores, and each collective then waits for peers that
# are descheduled, which no per-op profile prices (measured: a TP 2 x DP 2 plan took 3.3x its
# prediction, a ZeRO-3 plan 1.5x).
CASES = (
    MeasuredCase("gpt3", 1, 75),
    MeasuredCase("gpt3", 2, 40),
    MeasuredCase("llama", 2, 40),
    # Tempo's case, planned by Mist with and without Tempo: with the CPU preset's nominal model,
    # within 90% of this cap (49.5 MiB) Mist without Tempo halves the micro-batch to 4 (38.0 MiB
    # predicted, the optimizer state on the host) and with Tempo keeps 8 (43.8 MiB; 63.3 without).
    # With the CPU's fitted model (the references of 96faf07 and ca876df) both keep 8, the
    # optimizer on the host, and Mist without Tempo also keeps a quarter of its gradients there
    # and offloads a quarter of its layers' activations
    MeasuredCase("gpt3", 1, 55, systems=("mist", "mist_tempo")),
)


@dataclass(frozen=True)
class MeasuredSetup:
    name: str  # the result file's stem
    base: EngineSetup  # the device, its cost-model preset, the models' overrides, the profile fitted
    cases: tuple[MeasuredCase, ...]
    launches: int = LAUNCHES  # each winner's fresh launches, the median one reported
    tempo: bool = False  # Mist also plans with Tempo's layers (TEMPO), its winner trained as the others

    @property
    def systems(self) -> tuple[str, ...]:
        return (*SYSTEMS, TEMPO) if self.tempo else SYSTEMS

    @property
    def steps(self) -> int:  # timed steps a launch (after the warm-up and memory steps)
        return self.base.steps


MEASURED = MeasuredSetup("measured", CPU_ENGINE, CASES, tempo=True)
# One H200 (141 GB): caps far below the plain plans (one micro-batch of 8, nothing recomputed: 115
# and 254 GiB predicted) and a little above what weights, gradients and Adam state take (16 bytes
# a parameter: 21 GB at 1.3B, 43 GB at 2.7B), so that the grid's leanest plans (recomputing every
# layer: 26.5 and 51.9 GiB with the nominal H200 model) fit within the planning fraction
GPU_MEASURED = MeasuredSetup(
    "gpu_measured",
    GPU_ENGINE,
    (MeasuredCase("gpt3", 1, 32 * 1024, size="1.3b"), MeasuredCase("gpt3", 1, 64 * 1024, size="2.7b")),
    launches=2,  # a GPU's step time varies little between launches; the device time is short
)


def case_cluster(base: EngineSetup, case: MeasuredCase, gpu_memory: int):
    """The cluster a case is planned and priced on, each device capped at ``gpu_memory``: on a GPU
    this machine, its processes one node and its RAM the host's (the lent machines have 128 GiB,
    not the 2 TB host of the device preset's node: what offloading may fill); on a CPU the device
    preset's, whose host is this one."""
    from mist import cluster

    if base.device != "cuda":
        return cluster(base.gpu, case.processes, gpu_memory=gpu_memory)
    return cluster(
        base.gpu, case.processes, case.processes, host_memory=machine_memory_bytes(), gpu_memory=gpu_memory
    )


def plain_plan(case: MeasuredCase, base: EngineSetup = CPU_ENGINE):
    """What a user tries first: data parallelism over every process, one micro-batch a step (no
    gradient accumulation), nothing recomputed, offloaded or sharded."""
    from mist import Plan, StagePlan, model

    m = model(case.model, **base.model_overrides)
    c = case_cluster(base, case, case.cap_bytes)
    stages = [StagePlan(layers=m.layers)]
    micro_batch = case.global_batch // case.processes
    fields = {"global_batch": case.global_batch, "tp": 1, "dp": case.processes, "micro_batch": micro_batch}
    return Plan.of(m, c, stages=stages, **fields)


def plan_systems(
    case: MeasuredCase, runtime, aceso_budget: int = ACESO_MAX_PRICED, setup: MeasuredSetup = MEASURED
) -> dict:
    """Each system's plan within ``PLANNING_FRACTION`` of the case's cap, to run under the whole
    cap, priced by ``runtime`` (None: the device preset's nominal roofline); where a system finds
    none, the reason instead."""
    from baselines.megatron.aceso import search_aceso
    from baselines.megatron.grid import search_grid
    from baselines.megatron.zero3 import search_zero3
    from mist import NoFeasiblePlan, PlannerOptions, model, predict, search
    from mist.tuning.megatron_lm import search_megatron_lm

    m = model(case.model, **setup.base.model_overrides)
    c = case_cluster(setup.base, case, case.planning_bytes)
    gb = case.global_batch
    # Mist's whole space: the engine runs every offload on a CPU, and on one GPU (one replica)
    options = PlannerOptions()
    searches = {
        "mist": lambda: search(m, c, gb, options, runtime=runtime),
        "megatron": lambda: search_grid(m, c, gb, runtime),
        "megatron_lm_target": lambda: search_megatron_lm(m, c, gb, runtime=runtime),
        "aceso": lambda: search_aceso(m, c, gb, aceso_budget, runtime).plan,
        "zero3": lambda: search_zero3(m, c, gb, runtime),
    }
    # Tempo's layers priced by what they keep in memory and, in time, by their traced ops plus the
    # fitted Tempo excess where the setup's profile timed Tempo's layer (CPU_ENGINE's does)
    if setup.tempo:
        searches[TEMPO] = lambda: search(m.with_(tempo=True), c, gb, options, runtime=runtime)
    if case.systems is not None:
        searches = {k: v for k, v in searches.items() if k in case.systems}
    plans = {}
    for name, find in searches.items():
        try:
            plan = find()
        except NoFeasiblePlan as e:
            plans[name] = str(e)
            continue
        if plan.simulated_iteration_s is None:  # the searches that rank by the closed form
            predict(plan, plan.model_spec(), c, runtime)
        plan.gpu_memory_bytes = case.cap_bytes  # planned with headroom, run under the whole cap
        plans[name] = plan
    return plans


def _trained(plan, trained: dict) -> dict:
    if "refused" in trained:  # the engine cannot run it on this device (its reason)
        return {"refused": trained["refused"], "out_of_memory": False}
    r = {"out_of_memory": trained["out_of_memory"], "ranks": rank_memory(plan, trained["report"])}
    if trained["out_of_memory"]:
        return r | (
            {"launches_kept_utc": trained["launches_kept_utc"]} if "launches_kept_utc" in trained else {}
        )
    steps = trained["launches_step_s"]
    return r | {
        "measured_step_s": trained["step_s"],
        "launches_step_s": steps,  # each launch's median step
        "launches_contention": trained["launches_contention"],  # what each shared its cores with
        "launches_probe_s": trained.get("launches_probe_s", []),  # the machine's speed before each
        # which launches an earlier call of this run made (when), kept and taken on resuming
        **({"launches_kept_utc": trained["launches_kept_utc"]} if "launches_kept_utc" in trained else {}),
        "spread": (max(steps) - min(steps)) / trained["step_s"],  # launch to launch, of the median
        "time_error": plan.simulated_iteration_s / trained["step_s"] - 1,
        # where the time went, beside the model's parts (what a time error is to be traced by)
        "measured_phases_s": measured_phases(trained["report"]),
        "predicted_stages": [{"steady_s": st.steady_s, "extra_s": st.extra_s} for st in plan.stages],
        "micro_batches": plan.grad_accum,
        "losses": next(x["losses"] for x in trained["report"]["ranks"] if x["losses"] is not None),
    }


def measured_point(
    case: MeasuredCase, setup: MeasuredSetup, fits: RuntimeFits, launches: Path | None = None
) -> dict:
    from mist import predict

    fit = fits(case.processes)  # the base engine setup's fit (its shape, profile, launches) at this size
    runtime = fit["model"]
    plain = plain_plan(case, setup.base)
    predict(plain, plain.model_spec(), plain.cluster(), runtime)
    if max(s.memory_bytes for s in plain.stages) <= case.cap_bytes:
        raise ValueError(f"{case}: the plain plan fits the cap; it must not (memory would not bind)")
    # the plain plan once: the cap binds when measured too (its run stops before the timed steps)
    name = f"{case.model}-{case.processes}-plain"
    plain_run = train_plan(plain, case.processes, setup.steps, 1, fits.work, name, journal=launches)
    out: dict = {
        "family": case.family,
        "cap_bytes": case.cap_bytes,
        "runtime_model": runtime.source,
        "runtime_model_held_out_error": fit["mean_abs_error"],
        "runtime_fit_contention": fit["contention"],  # what the fit's profile shared its cores with
        "runtime_fit_probe_s": fit["probe_s"],  # the machine's speed just before and after the fit
        **({"runtime_fit_profile_kept": fit["profile_kept"]} if "profile_kept" in fit else {}),
        "plain": {"plan": plan_summary(plain), **_trained(plain, plain_run)},
    }
    plans = plan_systems(case, runtime, setup=setup)
    first: dict[str, str] = {}  # a plan's identity -> the first system whose plan it is
    distinct = {}  # the plans trained: the same plan as an earlier system's is trained once
    for system, plan in plans.items():
        if not isinstance(plan, str):
            distinct.setdefault(first.setdefault(json.dumps(plan.what_runs(), sort_keys=True), system), plan)
    names = {system: f"{case.model}-{case.processes}-{system}" for system in distinct}
    trained, rounds = train_plans(
        {names[system]: plan for system, plan in distinct.items()},
        case.processes,
        setup.steps,
        setup.launches,
        fits.work,
        fits.probe,
        journal=launches,
    )
    system_of = {name: system for system, name in names.items()}
    out["launch_rounds"] = [[system_of[name] for name in order] for order in rounds]  # interleaved
    for system, plan in plans.items():
        if isinstance(plan, str):
            out[system] = {"infeasible": plan}
            continue
        same = first[json.dumps(plan.what_runs(), sort_keys=True)]
        if same != system:  # the same plan as an earlier system's: one run, reported for both
            out[system] = {**out[same], "plan": plan_summary(plan), "same_plan_as": same}
        else:
            out[system] = {"plan": plan_summary(plan), **_trained(plan, trained[names[system]])}
    return out


def measured_key(case: MeasuredCase, setup: MeasuredSetup) -> dict:
    device = "this CPU" if setup.base.device == "cpu" else "this GPU"
    return {
        "setup": setup.name,
        "model": case.model,
        "model_overrides": setup.base.model_overrides,
        "processes": case.processes,
        "cap_bytes": case.cap_bytes,
        "global_batch": case.global_batch,
        "steps": setup.steps,
        "planning_fraction": PLANNING_FRACTION,
        "launches": setup.launches,
        "launch_order": "interleaved",  # round by round, every plan once a round (train_plans)
        **({} if case.systems is None else {"systems": list(case.systems)}),
        "aceso_max_priced": ACESO_MAX_PRICED,
        "cost_model": f"runtime model fitted to {device}'s profiles",
    }


def run_measured(run: Run, fits: RuntimeFits, setup: MeasuredSetup = MEASURED) -> ResultFile:
    """``setup``'s cases, each a point of ``<setup.name>.json``; ``fits`` are of its base's device."""
    config = {"systems": setup.systems, "profile": setup.base.profile}
    store = run.file(f"{setup.name}.json", setup.base.device, config=config)
    todo = [c for c in setup.cases if not store.done(measured_key(c, setup))]
    for k, case in enumerate(todo, 1):
        print(
            f"  [{k}/{len(todo)}] {case.model} on {case.processes} process(es), cap {case.cap_mib} MiB",
            flush=True,
        )
        key = measured_key(case, setup)
        launches = fits.launches_folder(run.run_id, key)  # kept: a killed case resumes launch by launch
        store.compute(key, lambda c=case, kept=launches: measured_point(c, setup, fits, kept))
        if launches is not None:  # the point holds them now
            shutil.rmtree(launches, ignore_errors=True)
    return store


def _speedups(store: Results, of: str, versus: str) -> Iterator[tuple[Point, dict]]:
    """Per case where ``versus``'s plan ran within the cap and ``of`` has a plan: ``of``'s measured
    speedup over it (its step over ``of``'s; 0 where ``of``'s plan ran out of memory: a plan that
    cannot run loses), the predicted one, the launch-to-launch spread of the two runs (the
    larger): a measured speedup within it of 1.0 is a tie; and whether the two chose the same plan
    (trained once: its speedup is 1.0 by construction)."""
    for p in store:
        a, b = p.result.get(of, {}), p.result.get(versus, {})  # a case some systems did not plan: not in it
        if "plan" not in a or "measured_step_s" not in b:
            continue
        ran = "measured_step_s" in a
        yield (
            p,
            {
                "case": f"{p.key['model']} x{p.key['processes']}",
                "measured": b["measured_step_s"] / a["measured_step_s"] if ran else 0.0,
                "predicted": b["plan"]["iteration_s"] / a["plan"]["iteration_s"],
                "spread": max(a["spread"], b["spread"]) if ran else 0.0,
                # each points at the first system whose plan it is (measured_point)
                "same_plan": a.get("same_plan_as", of) == b.get("same_plan_as", versus),
                # interleaved 1F1B: a plan outside Mist's search (results from before it: none)
                "versus_interleaved": b["plan"].get("virtual_stages", 1) > 1,
            },
        )


def measured_speedups(store: Results, versus: str) -> list[dict]:
    """Mist's speedups over ``versus`` (``_speedups``). Cases where only Mist's plan ran are not in
    it (the speedup has no value; ``only_mist_ran`` counts them)."""
    return [row for _, row in _speedups(store, "mist", versus)]


def tempo_gains(store: Results) -> list[dict]:
    """Mist with Tempo's speedups over Mist without (``_speedups``), each with what Tempo changed in
    the plan. Cases without a Tempo plan are not in it."""
    return [
        row | {"changes": plan_changes(p.result["mist"]["plan"], p.result[TEMPO]["plan"])}
        for p, row in _speedups(store, TEMPO, "mist")
    ]


def only_mist_ran(store: Results, versus: str) -> list[str]:
    """Cases where Mist's plan ran and ``versus`` found none or its plan ran out of memory."""
    ran = [
        (p, "measured_step_s" in p.result["mist"], "measured_step_s" in p.result[versus])
        for p in store
        if versus in p.result
    ]
    return [f"{p.key['model']} x{p.key['processes']}" for p, mist, other in ran if mist and not other]


def _status(r: dict) -> str:
    if "infeasible" in r:
        return "no plan fits"
    if "refused" in r:
        return f"refused by the engine here: {r['refused']}"
    if r["out_of_memory"]:
        worst = max(x["worst_measured_bytes"] for x in r["ranks"])
        at_least = "at least " if any(x.get("lower_bound") for x in r["ranks"]) else ""
        return f"out of memory (measured {at_least}{worst / MiB:.1f} MiB)"
    return (
        f"{r['measured_step_s'] * 1e3:6.1f} ms measured, {r['plan']['iteration_s'] * 1e3:6.1f} ms "
        f"predicted ({r['time_error']:+.0%}), spread {r['spread']:.0%}"
    )


def _plan_line(plan: dict) -> str:
    stages = "; ".join(
        ", ".join(
            f"{k} {v:g}"
            for k, v in st.items()
            if k in ("layers", "recompute", "zero") or (k.startswith("offload") and v)
        )
        for st in plan["stages"]
    )
    pre_post = "" if plan["pre_post"] is None else f"; embedding/head {plan['pre_post']}"
    chunks = plan.get("virtual_stages", 1)  # results from before interleaving have none
    shape = f"TP {plan['tp']} DP {plan['dp']} micro-batch {plan['micro_batch']}"
    shape += f", {chunks} chunks a rank" if chunks > 1 else ""
    return f"{shape}: [{stages}]{pre_post}"


def case_launch_probes(result: dict) -> list[float]:
    """The machine's speed just before each launch of a case (``result``: its point's), a plan
    that two systems share counted once; none in results from before the probe."""
    trained = [result[k] for k in (*SYSTEMS, TEMPO) if k in result and "same_plan_as" not in result[k]]
    return [t for system in trained for t in system.get("launches_probe_s", [])]


def print_measured(store: Results) -> None:
    for p in store:
        r = p.result
        plain = r["plain"]
        head = f"  {p.key['model']} on {p.key['processes']} process(es), cap {r['cap_bytes'] / MiB:.0f} MiB: "
        if "refused" in plain:
            print(f"{head}the plain plan was REFUSED by the engine: {plain['refused']}")
        else:
            worst = max(x["worst_measured_bytes"] for x in plain["ranks"]) / MiB
            print(
                f"{head}the plain plan {'ran out of memory' if plain['out_of_memory'] else 'FITTED'} "
                f"({worst:.1f} MiB measured, {max(x['predicted_bytes'] for x in plain['ranks']) / MiB:.1f} "
                f"predicted)"
            )
        if drift := probe_line(r.get("runtime_fit_probe_s"), case_launch_probes(r)):
            print(f"    {drift}")
        for system in (*SYSTEMS, TEMPO):
            if system not in r:  # TEMPO: where the setup plans with Tempo
                continue
            s = r[system]
            same = f" (= {s['same_plan_as']}'s)" if "same_plan_as" in s else ""
            print(f"    {system:<18} {_status(s)}{same}")
            if "same_plan_as" not in s and (note := busy_launches(s)):
                print(f"              note: {note}")
            if "plan" in s:
                print(f"              {_plan_line(s['plan'])}")
            if "measured_phases_s" in s and "same_plan_as" not in s:  # (results before 2026-12-06 lack it)
                print(f"              {phases_line(s, s['micro_batches'])}")
    for versus in SYSTEMS[1:]:
        rows, alone = measured_speedups(store, versus), only_mist_ran(store, versus)
        if alone:
            print(f"  only Mist's plan ran (not {versus}'s): {', '.join(alone)}")
        if rows:
            each = ", ".join(f"{x['case']} {x['measured']:.2f}x ({x['predicted']:.2f}x)" for x in rows)
            measured = [x["measured"] for x in rows]
            print(
                f"  Mist over {versus}: measured mean {statistics.mean(measured):.2f}x, max "
                f"{max(measured):.2f}x; per case measured (predicted): {each}"
            )
    for x in tempo_gains(store):
        what = ", ".join(x["changes"]) or "the same plan"
        print(
            f"  Mist with Tempo over Mist, {x['case']}: {x['measured']:.2f}x measured "
            f"({x['predicted']:.2f}x predicted, Tempo's time from the profile's Tempo layer; spread "
            f"{x['spread']:.0%}): {what}"
        )


def main(argv: list[str] | None = None) -> None:
    """The GPU measured comparison (``nox -s gpu_check``'s part mist_measured):
    ``python -m artifacts.mist_vs_megatron.measured [--cpu-dry-run]``."""
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="this script on the CPU (tests it): one CPU case, one launch each",
    )
    add_run_arguments(ap, EXPERIMENT)
    add_keep_argument(ap)
    args = ap.parse_args(argv)
    keep = keep_folder(ap, args)
    # The dry run: the first CPU case (one process), one launch a plan, a profile without
    # micro-batch 8, within the gpu_check part's dry budget; the CPU comparison is the
    # `measured` part of `nox -s mist_vs_megatron`
    base = dataclasses.replace(
        CPU_ENGINE, launches=1, profile=DRY_RUN_PROFILE, model_overrides=DRY_RUN_OVERRIDES
    )
    # the first case at the dry run's shape, its cap at the same share of the plain plan (11.6 MiB
    # predicted there; 75 of 101.6 MiB at the full shape)
    dry = MeasuredSetup("gpu_measured_dry_run", base, (MeasuredCase("gpt3", 1, 8),), launches=1)
    setup = dry if args.cpu_dry_run else GPU_MEASURED
    with (
        experiment_run(args, EXPERIMENT, "measured") as run,
        tempfile.TemporaryDirectory(prefix="mist_vs_megatron_") as tmp,
    ):
        store = run_measured(run, RuntimeFits(Path(tmp), setup.base, keep), setup)
    print_measured(store.this_run())


if __name__ == "__main__":
    main()
