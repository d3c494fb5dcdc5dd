"""Plans run for real: megatron-core under torchrun (mist.engine.run), measured against the prediction.

Per plan: per-rank memory (exact tensor bytes held + the allocator peak of a steady step: the
median of a few, the worst beside it) and the step time, next to what Mist predicts; the time
with a runtime model fitted to ``mist profile`` of the device the plans run on (layer ops and,
with several processes, the collectives and the mechanisms of TP and ZeRO-2/3 on a layer; made
first, held-out error reported). On the CPU every benchmark point and every plan's run is the
median of LAUNCHES launches (gloo's latency mode is set per launch). Each launch, and the fit's
profile, records what else ran on the cores meanwhile (measure.contention), and the run says so
where that was more than housekeeping: such a time is a busy machine's.

    CPU_ENGINE: a small GPT-3 (hidden 256, seq 128, 4 layers) on 2 gloo processes (TP=2, PP=2, DP=2,
                DP=2 + ZeRO-1, -2, -3); at the tiny preset's hidden 64 and seq 32 a micro-batch is
                mostly Python dispatch and gloo latency, not the layer work a cost model prices
    GPU_ENGINE: GPT-3 1.3B on one GPU with no, half and full recomputation, and with half
                recomputation plus the optimizer state, half the other layers' activations, or
                half of every layer's weights and gradients offloaded to the host (nox -s
                gpu_check); every plan's losses against the plan that neither recomputes nor
                offloads (claim mist-gpu-engine-losses)
    (Offloading is not in the CPU setup: on a CPU host and device are one memory.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from measure import fork_launch
from measure.checks import usable_cores
from measure.cli import OneLineParser
from measure.contention import Contention, OtherWork, busiest
from measure.launch import run_torchrun
from measure.results import (
    ResultFile,
    Results,
    Run,
    RunLockedError,
    device_description,
    git_state,
    key_id,
    lock_folder,
    package_versions,
    unlock_folder,
    utc_now,
    write_json_atomic,
)
from measure.strict import json_data, read_json_file

from ..experiment import add_run_arguments, experiment_run
from . import EXPERIMENT

# On this CPU a launch's speed is its own: gloo's latency has settled into a mode (~0.4 or ~1.7 ms
# an all-reduce) for a launch's life on some days, and on 2026-12-05 one plan's launches ran up to
# 30% apart with no such mode (docs/claims.md). Each collective and mechanism benchmark point, and
# each plan's measured step, is the median over this many launches; the time bounds are judged
# over their range (Bound.noise)
LAUNCHES = 3
# Passes over the layer profile's points, each point the median (write_profiles): three
# back-to-back one-pass profiles of this CPU put the 4-layer GPT-3's plans 11% apart, and one
# session's fit priced every plan ~30% slow (its ZeRO-3 plan 963 ms predicted, 628 measured)
PROFILE_ROUNDS = 3


# The machine's speed, probed beside the fit and before every launch (speed_probe): this many
# forward and backward passes of one layer, the median
PROBE_REPEATS = 10


@dataclass(frozen=True)
class EngineSetup:
    name: str  # result file stem
    model: str
    gpu: str  # the device preset predictions are made for
    processes: int
    global_batch: int
    micro_batch: int
    plans: dict  # name -> plan fields (tp, dp, stages)
    model_overrides: dict  # changes to the preset's fields (the plans' model_overrides)
    profile: dict  # `mist profile` arguments besides the model's shape: micro_batches, tps, dtype
    device: str
    steps: int = 6
    # each collective and mechanism benchmark point the median of this many launches, and each
    # plan trained in this many fresh launches, the median one reported
    launches: int = 1


CPU_ENGINE = EngineSetup(
    name="engine",
    model="gpt3-tiny",
    gpu="cpu",  # mist.model.specs.CPU_PRESET, spelled out: importing mist here costs 0.5 s
    processes=2,
    global_batch=8,
    micro_batch=2,
    # flash off: the engine runs megatron-core's local (unfused) attention, which keeps the s x s
    # scores; priced as FlashAttention, plans at micro-batch 4-8 measured 7-18% over the prediction
    model_overrides={"hidden": 256, "seq": 128, "flash": False},
    plans={
        "tp2": {"tp": 2, "dp": 1, "stages": [{"layers": 4, "recompute": 1}]},
        "pp2": {"tp": 1, "dp": 1, "stages": [{"layers": 1, "recompute": 1}, {"layers": 3}]},
        "dp2": {"tp": 1, "dp": 2, "stages": [{"layers": 4, "recompute": 2}]},
        "dp2-zero1": {"tp": 1, "dp": 2, "stages": [{"layers": 4, "recompute": 2, "zero": 1}]},
        "dp2-zero2": {"tp": 1, "dp": 2, "stages": [{"layers": 4, "recompute": 2, "zero": 2}]},
        "dp2-zero3": {"tp": 1, "dp": 2, "stages": [{"layers": 4, "recompute": 2, "zero": 3}]},
    },
    # every micro-batch the searches of the measured comparison reach (up to global batch 8 on one
    # process): a line fitted to 1-4 put a micro-batch of 8 at 18-22% under its measured time.
    # tempo: the layer with Tempo's ops too, so Mist's Tempo plans are priced with Tempo's time
    profile={"micro_batches": [1, 2, 4, 8], "tps": [1, 2], "dtype": "bf16", "tempo": True},
    device="cpu",
    launches=LAUNCHES,
)


# The CPU dry runs (the GPU check's --dry-run) test the scripts, not the engine's fidelity: at a
# quarter of CPU_ENGINE's hidden size and half its sequence. On a CPU whose bf16 GEMMs have no
# hardware path (AMD Zen 3: 0.56 GFLOP/s, measured 2026-12-02) the full shape ran past the parts'
# 150 s dry budgets (at hidden 128, seq 64 still 165 s); this one does about 1/32 of the work.
DRY_RUN_OVERRIDES = {**CPU_ENGINE.model_overrides, "hidden": 64, "seq": 64}
# Their profile, without micro-batch 8 (only the measured comparison at full shape reaches it) and
# Tempo (neither dry run plans it): one for both, so the measured dry run fits the kept profile the
# engine's made (--keep) instead of profiling again
DRY_RUN_PROFILE = {**CPU_ENGINE.profile, "micro_batches": [1, 2, 4], "tempo": False}


def speed_probe(setup: EngineSetup) -> float:
    """Seconds of one forward and backward of the engine's decoder layer at ``setup``'s shape,
    dtype and micro-batch, alone on one thread of ``setup.device`` (a rank's device): the median
    of PROBE_REPEATS. A fit prices launches made minutes after it, and on a shared VM the speed
    moves by 10-20% within half an hour (docs/claims.md, 2026-12-05); the probe taken beside the
    fit and before each launch says by how much the machine moved between them, so a time error
    can be told apart from the machine's drift. It says nothing of what the model misses (the
    same layer is in the profile); it is reported, and a time bound's noise band spans each
    launch as measured and at the fit's speed by it (claims.launch_errors), never used to correct
    a prediction. It is a coarse gauge: one layer alone for ~0.3 s, where the fit takes minutes
    and the launches run several ranks (the fit's own two probes were 10% apart on 2026-12-05)."""
    import torch

    from measure.training import DTYPES
    from mist import model
    from mist.engine.profiler import megatron_layer_seconds

    spec = model(setup.model, **setup.model_overrides)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shape = (setup.micro_batch, spec.seq, spec.hidden, spec.heads, 1)
        dtype = DTYPES[setup.profile["dtype"]]
        return sum(megatron_layer_seconds(*shape, dtype, setup.device, repeats=PROBE_REPEATS))
    finally:
        torch.set_num_threads(before)
        if setup.device == "cuda":  # the probe's layer is not the runner's to keep
            torch.cuda.empty_cache()


def speed_change(fit_probe_s: list[float], launches_probe_s: list[float]) -> float | None:
    """How much slower the machine was at the launches than at the fit, by the probe (the median
    launch's over the fit's mean; + slower): None where either was not probed."""
    if not fit_probe_s or not launches_probe_s:
        return None
    return statistics.median(launches_probe_s) / statistics.fmean(fit_probe_s) - 1


def probe_line(fit_probe_s: list[float] | None, launches_probe_s: list[float]) -> str:
    """The machine's drift between a fit and its launches, by the probe, as a line, with what the
    probe did during the fit itself (its resolution); "" where either was not probed (results
    from before the probe)."""
    change = speed_change(fit_probe_s or [], launches_probe_s)
    if change is None:
        return ""
    at_ms = statistics.median(launches_probe_s) * 1e3
    fit_ms = " and ".join(f"{t * 1e3:.1f}" for t in fit_probe_s)
    if round(abs(change), 2) == 0:
        moved = "as fast at these launches as at the fit"
    else:
        moved = f"{abs(change):.0%} {'slower' if change > 0 else 'faster'} at these launches than at the fit"
    probed = f"a layer: {fit_ms} ms just before and after the fit, {at_ms:.1f} at the launches (median)"
    return f"the machine {moved}, by its probe ({probed})"


def _one_gpu(**stage) -> dict:
    return {"tp": 1, "dp": 1, "stages": [{"layers": 24, **stage}]}


GPU_ENGINE = EngineSetup(
    name="gpu_engine",
    model="gpt3-1.3b",
    gpu="h200",
    processes=1,
    global_batch=8,
    micro_batch=2,
    model_overrides={"flash": False},  # as CPU_ENGINE's: the engine runs megatron-core's unfused attention
    # trained in this order: the plan every other's losses are checked against, then offloading,
    # which no GPU has run yet, before recomputation, so that a part its budget ends has run those
    plans={
        "recompute-0": _one_gpu(recompute=0),
        # offload.py's copy stream: half of each layer's weights up for its forward and backward,
        # the next layer's prefetched, half of the gradients drained as backward makes them
        "offload-weights-grads": _one_gpu(recompute=12, offload_weights=0.5, offload_grads=0.5),
        "offload-activations": _one_gpu(recompute=12, offload_activations=0.5),
        "offload-optimizer": _one_gpu(recompute=12, offload_optimizer=1.0),
        **{f"recompute-{r}": _one_gpu(recompute=r) for r in (12, 24)},
    },
    profile={"micro_batches": [1, 2, 4], "tps": [1], "dtype": "bf16"},
    device="cuda",
    steps=5,
)


def _launch(plan, processes: int, args: list[str]) -> subprocess.CompletedProcess:
    """One launch of ``mist.engine.run``: on a CPU its ranks are forked from one process that has
    imported megatron-core (measure.fork_launch: the same ranks, ~5 s less start-up a launch on 2
    cores); on a GPU torchrun starts them, as a user would."""
    from mist.model.specs import CPU_PRESET

    if plan.gpu != CPU_PRESET:
        # the host's cores shared by the ranks, as a GPU job has them: an offloaded optimizer
        # steps on the host (one thread a rank is the CPU engine's, whose ranks are the compute)
        threads = max(1, usable_cores() // processes)
        return run_torchrun(processes, "mist.engine.run", args, timeout=900, threads=threads)
    return fork_launch.shared("mist.engine.run:preload").run(processes, "mist.engine.run", args, timeout=900)


def _launch_once(plan, processes: int, args: list[str], out: Path, name: str) -> dict:
    """One launch of ``plan``: ``{"refused": why}`` where the engine refuses it on this device (its
    report says so: ``{"refused": [reasons]}``), ``{"out_of_memory": True, "report": ...}`` where
    its device peak went above the plan's cap, else ``{"step_s": the median of its ranks' steady
    steps, "report": ...}``. Any other failure raises, with the launch's stderr."""
    out.unlink(missing_ok=True)  # a report is this launch's
    with OtherWork() as other:  # what else ran on the cores meanwhile
        done = _launch(plan, processes, args)
    if other.result is not None and not other.result.quiet:
        print(f"  {other.result.line(f'{name} (a launch)')}", flush=True)
    # refused before any work, or over the cap: a rank writes its report and exits 2 or 3
    # (torchrun then exits 1); any other failure writes none
    report = json.loads(out.read_text()) if out.exists() else None
    if report is not None and "refused" in report:
        return {"refused": "; ".join(report["refused"])}
    out_of_memory = report is not None and report["ranks"][0]["out_of_memory"]
    if (done.returncode != 0 and not out_of_memory) or report is None:
        raise RuntimeError(f"mist.engine.run failed for {name}:\n{done.stderr[-3000:]}")
    if out_of_memory:
        return {"out_of_memory": True, "report": report}
    # all steady: warm-up and memory steps come first
    step_s = statistics.median(x for r in report["ranks"] for x in r["step_s"])
    return {"step_s": step_s, "report": report, "contention": other.result}


def train_plans(
    plans: dict,
    processes: int,
    steps: int,
    launches: int,
    work: Path,
    probe: Callable[[], float] | None = None,
    journal: Path | None = None,
) -> tuple[dict[str, dict], list[list[str]]]:
    """Each of ``plans`` (name -> plan) trained by ``mist.engine.run`` from scratch in ``launches``
    launches of ``processes`` processes, interleaved: round by round, each plan still running
    launched once, the order rotated by one a round. A change in the machine's speed during the
    run (another process, gloo's latency mode) then falls on every plan alike, not on whichever
    plan was running: a ratio of two plans' step times is taken within one run, as it should be.

    Returns, per plan, the median launch's report and step time (the median of its ranks' steady
    steps) with every launch's step time in launch order; or, where some launch's device peak went
    above the plan's cap, that launch's report with ``out_of_memory`` set and no time (a run that
    may crash is not one a user can take; it is not launched again); or, where the engine refuses
    the plan on this device, ``refused`` with its reason. And the rounds: the names launched in
    each, in order. With ``probe`` (speed_probe), the machine's speed is probed just before each
    launch (``launches_probe_s``, in launch order). With ``journal``, a folder, each finished launch
    is kept there and one kept for the same plan, round and step count is taken instead of launching
    again: a run killed at its time budget (the GPU check's) resumes launch by launch."""
    if not plans:  # every system of a case found no plan: nothing to launch
        return {}, []
    args, identities = {}, {}
    for name, plan in plans.items():
        path, out = work / f"{name}.yaml", work / f"{name}.json"
        plan.save(path)
        args[name] = (["--plan", str(path), "--steps", str(steps), "--out", str(out)], out)
        # what a kept launch must have launched: the plan as the engine runs it (not the search's
        # predictions and wall time, which the file also holds)
        if journal is not None:
            identities[name] = json_data({"plan": plan.what_runs(), "processes": processes, "steps": steps})
    timed: dict[str, list[dict]] = {name: [] for name in plans}
    ended: dict[str, dict] = {}  # refused or out of memory: not launched again
    kept_utc: dict[str, list[str | None]] = {name: [] for name in plans}  # a kept launch's, else None
    names, rounds = list(plans), []
    for r in range(launches):
        order = [n for n in names[r % len(names) :] + names[: r % len(names)] if n not in ended]
        rounds.append(order)
        for name in order:
            entry = journal / f"{name}-round{r}.json" if journal is not None else None
            one, made = _launch_or_kept(plans[name], processes, args[name], name, r, entry, identities, probe)
            kept_utc[name].append(made)
            if "step_s" in one:
                timed[name].append(one)
            else:
                ended[name] = one
    trained = {}
    for name in names:
        trained[name] = _plan_result(timed[name], ended.get(name), probed=probe is not None)
        if journal is not None:  # which launches an earlier call of this run made, and when
            trained[name]["launches_kept_utc"] = kept_utc[name]
    return trained, rounds


def _launch_or_kept(
    plan, processes: int, args: tuple, name: str, r: int, entry: Path | None, identities: dict, probe
) -> tuple[dict, str | None]:
    """Round ``r``'s launch of ``plan`` (``_launch_once``'s result, the machine's speed probed just
    before it) and None; or, where ``entry`` keeps it from an earlier call of this run, that launch
    and when it was made."""
    if kept := _kept_launch(entry, identities.get(name)):
        print(f"  {name}: launch {r + 1} kept from {kept[1]} (this run's, resumed)", flush=True)
        return kept
    probed = probe() if probe is not None else None
    one = _launch_once(plan, processes, *args, name)
    if "step_s" in one:
        one["probe_s"] = probed
    if entry is not None:
        _keep_launch(entry, identities[name], one)
    return one, None


def _plan_result(timed: list[dict], ended: dict | None, probed: bool) -> dict:
    """One plan's result in train_plans from its launches: refused, out of memory, or the median
    launch's report and step time with every launch's time, contention (and speed probe)."""
    if ended is not None and "refused" in ended:
        return {"refused": ended["refused"], "out_of_memory": False}
    if ended is not None:
        return {"out_of_memory": True, "step_s": None, "launches_step_s": [], **ended}
    # the median launch, all of it (on a CPU gloo's latency settles into a mode for a launch's life)
    median = sorted(timed, key=lambda x: x["step_s"])[(len(timed) - 1) // 2]
    result = {
        "out_of_memory": False,
        "step_s": median["step_s"],
        "launches_step_s": [x["step_s"] for x in timed],
        # what each launch shared its cores with (None: not known here)
        "launches_contention": [x["contention"] and x["contention"].as_dict() for x in timed],
        "report": median["report"],
    }
    if probed:  # the machine's speed just before each launch
        result["launches_probe_s"] = [x["probe_s"] for x in timed]
    return result


def _keep_launch(entry: Path, identity: dict, one: dict) -> None:
    """A finished launch (``_launch_once``'s result) kept at ``entry`` with what it launched."""
    kept = dict(one)
    if kept.get("contention") is not None:
        kept["contention"] = kept["contention"].as_dict()
    entry.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(entry, {"identity": identity, "made_utc": utc_now(), "launch": kept})


def _kept_launch(entry: Path | None, identity: dict | None) -> tuple[dict, str] | None:
    """The launch kept at ``entry`` for ``identity`` (the plan as it runs, processes, steps), as
    ``_launch_once`` returned it, and when it was made; None where there is none (or another
    plan's: then it is launched, and kept over it)."""
    kept = _read_kept(entry)
    whole = kept is not None and isinstance(kept.get("launch"), dict) and "made_utc" in kept
    if not whole or kept.get("identity") != identity:
        return None
    one = dict(kept["launch"])
    if one.get("contention") is not None:
        one["contention"] = Contention(**one["contention"])
    return one, kept["made_utc"]


def train_plan(
    plan,
    processes: int,
    steps: int,
    launches: int,
    work: Path,
    name: str,
    probe: Callable[[], float] | None = None,
    journal: Path | None = None,
) -> dict:
    """``plan`` alone trained as ``train_plans`` trains several (its launches back to back)."""
    return train_plans({name: plan}, processes, steps, launches, work, probe, journal)[0][name]


def rank_memory(plan, report: dict) -> list[dict]:
    """Per rank: measured memory (the median and the worst steady step) against the prediction."""
    ranks = []
    for r in report["ranks"]:
        predicted, measured = plan.stages[r["stage"]].memory_bytes, r["memory_bytes"]
        ranks.append(
            {
                "rank": r["rank"],
                "stage": r["stage"],
                "measured_bytes": measured,
                "worst_measured_bytes": r["worst_memory_bytes"],
                "predicted_bytes": predicted,
                "memory_error": predicted / measured - 1,
                # a GPU allocation over the cap: the peak before it (below what it needed)
                "lower_bound": r.get("failed_allocation", False),
            }
        )
    return ranks


def setup_plan(setup: EngineSetup, name: str):
    """The setup's plan ``name`` (its fields over the setup's model, device and batch), unpriced."""
    from mist import Plan

    base = {
        "model": setup.model,
        "gpu": setup.gpu,
        "gpus": setup.processes,
        "gpus_per_node": 8,
        "global_batch": setup.global_batch,
        "micro_batch": setup.micro_batch,
        "sequence_parallel": False,
        "model_overrides": setup.model_overrides,
    }
    return Plan.from_dict({**base, **setup.plans[name]})


def changes_nothing(fields: dict) -> bool:
    """Whether a one-stage plan's fields neither recompute nor offload nor shard anything: the
    plan every other of a setup's trains the same model as (claim mist-gpu-engine-losses)."""
    return all(not value for key, value in fields["stages"][0].items() if key != "layers")


def engine_point(setup: EngineSetup, name: str, fit: dict, fits: RuntimeFits) -> dict:
    from mist import cluster, predict

    plan = setup_plan(setup, name)
    predict(plan, plan.model_spec(), cluster(setup.gpu, setup.processes), runtime=fit["model"])
    trained = train_plan(plan, setup.processes, setup.steps, setup.launches, fits.work, name, fits.probe)
    if "refused" in trained:  # the setup's plans are ones the engine runs: a refusal is a bug here
        raise RuntimeError(f"mist.engine.run refused {name}: {trained['refused']}")
    if trained["out_of_memory"]:  # no cap: the device's own memory; the plans are priced to fit it
        worst = max(r["worst_memory_bytes"] for r in trained["report"]["ranks"])
        raise RuntimeError(
            f"{name} ran out of memory on the engine ({worst / 2**30:.2f} GiB before the allocation "
            f"that failed), priced at {max(st.memory_bytes for st in plan.stages) / 2**30:.2f} GiB"
        )
    step_s, report = trained["step_s"], trained["report"]
    ranks = rank_memory(plan, report)
    phases = measured_phases(report)
    return {
        "plan": setup.plans[name],
        "losses": next(r["losses"] for r in report["ranks"] if r["losses"] is not None),
        "ranks": ranks,
        "measured_step_s": step_s,
        "launches_step_s": trained["launches_step_s"],  # each launch's median step
        "launches_contention": trained["launches_contention"],
        "fit_contention": fit["contention"],  # what the profile and benchmarks shared the cores with
        # the machine's speed (speed_probe) beside the fit and just before each launch
        "fit_probe_s": fit["probe_s"],
        **({"fit_profile_kept": fit["profile_kept"]} if "profile_kept" in fit else {}),  # made when, where
        "launches_probe_s": trained["launches_probe_s"],
        "predicted_step_s": plan.predicted_iteration_s,
        "time_error": plan.predicted_iteration_s / step_s - 1,
        "measured_phases_s": phases,
        "predicted_stages": [{"steady_s": st.steady_s, "extra_s": st.extra_s} for st in plan.stages],
        "micro_batches": plan.grad_accum,
        "runtime_model": fit["model"].source,
        "runtime_model_held_out_error": fit["mean_abs_error"],
    }


def measured_phases(report: dict) -> dict[str, float]:
    """Where a trained plan's step time went (the median over ranks and steady steps), to set
    beside the model's parts: the pipeline is G micro-batches of a stage's ``steady_s`` (+ the
    bubble), gradient sync, clipping and optimizer its ``extra_s``."""
    return {
        k: statistics.median(ph[k] for r in report["ranks"] for ph in r["phases"])
        for k in ("pipeline_s", "grad_sync_s", "clip_s", "optimizer_s")
    }


def phases_line(result: dict, micro_batches: int) -> str:
    """A trained plan's measured phases beside the model's parts of its slowest stage, as a line."""
    ph = result["measured_phases_s"]
    st = max(result["predicted_stages"], key=lambda x: x["steady_s"])
    # results before 2026-12-07 timed the clipping (and the wait for the other stages) as sync
    sync = (
        f"gradient sync {ph['grad_sync_s'] * 1e3:.1f} ms, clipping and waiting for the other ranks "
        f"{ph['clip_s'] * 1e3:.1f} ms"
        if "clip_s" in ph
        else f"gradient sync and clipping {ph['grad_sync_s'] * 1e3:.1f} ms"
    )
    return (
        f"measured: pipeline {ph['pipeline_s'] * 1e3:.1f} ms, {sync}, optimizer "
        f"{ph['optimizer_s'] * 1e3:.1f} ms; predicted: {micro_batches} x {st['steady_s'] * 1e3:.1f} ms "
        f"a micro-batch, {st['extra_s'] * 1e3:.1f} ms sync, clipping and optimizer"
    )


def engine_key(setup: EngineSetup, name: str) -> dict:
    fields = (
        "model",
        "model_overrides",
        "gpu",
        "processes",
        "global_batch",
        "micro_batch",
        "steps",
        "launches",
    )
    return {
        "setup": setup.name,
        "plan": name,
        **{f: getattr(setup, f) for f in fields},
        "plan_fields": setup.plans[name],
    }


def fit_runtime(setup: EngineSetup, work: Path, kept: Path | None = None) -> dict:
    """``mist profile`` of ``setup.device`` at the setup's model shape, as ``setup.processes`` ranks
    run it, into ``work``, and the runtime model fitted to it (``calibrate``'s result). With several
    processes, the collectives among them too, and the mechanisms as the engine runs them: its step
    collectives, and on a layer ZeRO-2, ZeRO-3 and TP over all processes (write_rank_benchmarks,
    as `mist profile --collectives`). With it, what else ran on the cores meanwhile
    (``contention``: measure.contention) and the machine's speed just before and after
    (``probe_s``: speed_probe).

    ``kept`` (--keep's profiles/): a folder where the profile is kept, and where one made for the
    same setup, on the same machine and device, with the same code and packages, is found and
    fitted again instead of profiling (``profile_kept``: where, when it was made, whether this call
    reused it). The GPU check's two Mist parts run in two processes on one GPU: one profile serves
    both, as one serves the CPU experiment's parts in one process."""
    from mist.model.calibrate import calibrate

    made_by = kept_identity(setup.device) if kept is not None else None
    if kept is not None and made_by is None:
        print(f"  --keep: the tree is not clean at a known commit; profiling in {work}, keeping nothing")
    key = None if made_by is None else json_data({**_profile_setup(setup), **made_by})
    folder = work if key is None else kept / _digest(key)
    folder.mkdir(parents=True, exist_ok=True)
    lock = None
    if key is not None:  # another process making this profile: waited for, then reused
        try:
            lock = lock_folder(folder, f"{folder}: another process is profiling", wait_s=PROFILE_WAIT_S)
        except RunLockedError as e:
            print(f"  {e} past {PROFILE_WAIT_S:.0f} s; profiling in {work}, keeping nothing", flush=True)
            key, folder = None, work
    try:
        record = _kept_profile(folder / PROFILE_RECORD, key)
        reused = record is not None
        if record is None:
            record = _profile(setup, folder)
            if key is not None:  # written last: a folder without it holds no finished profile
                write_json_atomic(folder / PROFILE_RECORD, {"key": key, **record})
        else:
            print(
                f"  the profile for {setup.processes} process(es) made {record['made_utc']}, kept in {folder}"
            )
    finally:
        if lock is not None:
            unlock_folder(lock)
    fit = next(iter(calibrate(folder / setup.gpu).values()))
    kept_at = {"folder": str(folder), "made_utc": record["made_utc"], "reused": reused}
    return {
        **fit,
        "contention": record["contention"],
        "probe_s": record["probe_s"],
        **({"profile_kept": kept_at} if key is not None else {}),
    }


# a kept profile's key, when it was made and what ran beside it, beside the profile's folder (which
# holds the profile's own profile.json)
PROFILE_RECORD = "kept.json"
PROFILE_WAIT_S = 900.0  # for another process making the same profile (a GPU's: minutes at most)


def _profile(setup: EngineSetup, folder: Path) -> dict:
    """``fit_runtime``'s profile made into ``folder``: when, what ran beside it, the speed probes."""
    shutil.rmtree(folder / setup.gpu, ignore_errors=True)  # an interrupted profile is made again
    probed = [speed_probe(setup)]  # the machine's speed beside the fit: just before it and after
    with OtherWork() as other:  # what else ran on the cores while the fit's inputs were timed
        _write_fit_inputs(setup, folder / setup.gpu)
    probed.append(speed_probe(setup))
    if other.result is not None and not other.result.quiet:
        print(f"  {other.result.line(f'the profile for {setup.processes} process(es)')}", flush=True)
    return {"made_utc": utc_now(), "contention": other.result and other.result.as_dict(), "probe_s": probed}


def _profile_setup(setup: EngineSetup) -> dict:
    """What of ``setup`` its profile depends on (_write_fit_inputs, speed_probe)."""
    fields = ("model", "model_overrides", "gpu", "device", "processes", "micro_batch", "launches", "profile")
    return {**{f: getattr(setup, f) for f in fields}, "profile_rounds": PROFILE_ROUNDS}


def kept_identity(device: str) -> dict | None:
    """What kept work (a profile, a launch) was made with, which must match for it to be reused:
    the code (a known commit, the tree not known to differ from it: on the GPU machine, which has
    no git, the commit gpu_check's --commit names), the packages, the machine and its ``device``;
    None where the tree differs from its commit or the commit is unknown: nothing is kept."""
    git = git_state()
    if git["commit"] is None or git["dirty"]:
        return None
    return {
        "commit": git["commit"],
        "packages": package_versions(),
        "host": platform.node(),
        "machine": device_description(device),
    }


def _digest(key: dict) -> str:
    """A kept folder's name: of ``key`` serialised as a result key is (measure.results.key_id)."""
    return hashlib.sha256(key_id(key).encode()).hexdigest()[:16]


def _kept_profile(path: Path, key: dict | None) -> dict | None:
    """The record of a finished profile kept at ``path`` for ``key``; None where there is none, or
    one that is unreadable or not a whole record (profiled again, and the record rewritten)."""
    record = _read_kept(path) if key is not None else None
    whole = record is not None and {"made_utc", "contention", "probe_s"} <= record.keys()
    return record if whole and record.get("key") == key else None


def _read_kept(path: Path | None) -> dict | None:
    """A kept record (a profile's, a launch's) as a mapping; None where there is none or it cannot be
    read as one (then the work is done again, and the record rewritten)."""
    if path is None or not path.is_file():
        return None
    try:
        record = read_json_file(path)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_fit_inputs(setup: EngineSetup, profiles: Path) -> None:
    """``fit_runtime``'s profile and benchmarks, written into ``profiles``."""
    from measure.training import DTYPES
    from mist import model
    from mist.engine.profiler import write_profiles, write_rank_benchmarks
    from mist.model.profile_data import mark_profile_complete

    prof = setup.profile  # "fitted to cpu profiles"
    dtype = DTYPES[prof["dtype"]]
    spec = model(setup.model, **setup.model_overrides)  # the shapes the plans train
    shape = (spec.hidden, spec.heads, spec.seq, prof["micro_batches"], prof["tps"])
    # on a CPU, as many copies at once as the plans have ranks: they share the cores' caches; the
    # embedding and head rows at the model's vocabulary; each point the median of PROFILE_ROUNDS passes
    say = _progress(f"profile for {setup.processes} process(es)")
    write_profiles(
        profiles,
        setup.device,
        *shape,
        dtype,
        setup.gpu,
        repeats=5,
        vocab=spec.vocab,
        concurrent=setup.processes,
        progress=say,
        rounds=PROFILE_ROUNDS,
        tempo=prof.get("tempo", False),
        complete=False,  # the collectives and mechanisms below belong to it too
    )
    if setup.processes > 1:  # this machine's collectives and the engine's mechanisms, measured
        say("collectives, the engine's step collectives, ZeRO-2/3 and TP layers")
        # gloo's latency here drifts between modes (~0.3 ms or ~4 ms a call) within a launch and
        # settles into one for a launch: a point is the median of 8 interleaved windows of 10
        # calls, then of the setup's launches
        shape = (spec.hidden, spec.heads, spec.seq, prof["micro_batches"], dtype)
        n, zero_micro_batch = setup.processes, setup.micro_batch
        write_rank_benchmarks(
            profiles,
            n,
            setup.device,
            *shape,
            zero_micro_batch,
            repeats=10,
            rounds=8,
            launches=setup.launches,
            progress=say,
            every=True,  # the plans are priced by all of them
        )
    mark_profile_complete(profiles)  # every benchmark is in: calibrate fits it
    say("done")


def _progress(what: str) -> Callable[[str], None]:
    """A printer of ``what``'s steps with the seconds since it started (the profile takes minutes)."""
    start = time.monotonic()

    def say(step: str) -> None:
        print(f"  [{what}, {time.monotonic() - start:.0f} s] {step}", flush=True)

    say("started")
    return say


class RuntimeFits:
    """The runtime models fitted to ``base``'s device, one per process count, each made once (the
    engine part and the measured comparison share them): ``base`` at that many processes, TP up
    to it, with ZeRO-2/3 and TP over all processes as the engine runs them where there are several.
    ``work``: the launches' scratch folder; ``keep`` (--keep): where profiles are kept and found
    again (fit_runtime), and a run's finished launches (train_plans' journal); else nothing is kept."""

    def __init__(self, work: Path, base: EngineSetup, keep: Path | None = None) -> None:
        self.work, self.base, self.keep, self.fits = work, base, keep, {}

    def launches_folder(self, run_id: str, point: dict) -> Path | None:
        """Where run ``run_id`` keeps the finished launches of its point ``point`` (a key), made with
        this code on this machine (kept_identity): a resumed run, the same run, takes them; another
        run, or the run carried to another machine or tree, does not. None: nothing is kept."""
        made_by = None if self.keep is None else kept_identity(self.base.device)
        if made_by is None:
            return None
        return self.keep / "launches" / run_id / _digest(json_data({"point": point, **made_by}))

    def __call__(self, processes: int) -> dict:
        if processes not in self.fits:
            profile = {**self.base.profile, "tps": [t for t in (1, 2, 4, 8) if t <= processes]}
            setup = dataclasses.replace(self.base, processes=processes, profile=profile)
            kept = None if self.keep is None else self.keep / "profiles"
            self.fits[processes] = fit_runtime(setup, self.work / f"profiles-{processes}", kept)
        return self.fits[processes]

    def probe(self) -> float:
        """The machine's speed now, probed as every fit and launch of these fits is (speed_probe)."""
        return speed_probe(self.base)


def add_keep_argument(ap: OneLineParser) -> None:
    """``--keep DIR`` of the GPU check's two Mist parts (engine, measured): RuntimeFits' ``keep``."""
    ap.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="keep the device's profile and each finished launch in DIR: a later process fits a profile "
        "kept there for the same setup, machine and clean commit instead of profiling again, and a "
        "resumed run takes the launches it had finished (default: nothing kept)",
    )


def keep_folder(ap: OneLineParser, args) -> Path | None:
    """``--keep``'s folder, refused in one line before any work where it cannot be one."""
    folder = args.keep
    if folder is not None and folder.exists() and not folder.is_dir():
        ap.error(f"--keep {folder}: not a folder; give a folder (made if missing)")
    return folder


def run_engine(run: Run, setup: EngineSetup, fits: RuntimeFits) -> ResultFile:
    store = run.file(f"{setup.name}.json", setup.device, config={"profile": setup.profile})
    todo = [n for n in setup.plans if not store.done(engine_key(setup, n))]
    if todo:
        fit = fits(setup.processes)
        for k, name in enumerate(todo, 1):
            print(f"  [{k}/{len(todo)}] {name}: {setup.launches} launch(es)", flush=True)
            store.compute(engine_key(setup, name), lambda n=name: engine_point(setup, n, fit, fits))
    return store


def busy_launches(result: dict) -> str:
    """A note where some launch of a trained plan (``result``: its point's) shared its cores with
    other work (measure.contention); "" where none did or nothing is known (results from before
    contention was recorded)."""
    records = result.get("launches_contention") or []
    most = busiest(records)  # 0.0: every launch quiet, or none recorded
    if not most:
        return ""
    shared = sum(bool(c) and not Contention(**c).quiet for c in records)
    return (
        f"{shared} of {len(records)} launch(es) shared the cores with other "
        f"work (up to {most:.2f} of a core): not a quiet machine's time"
    )


def print_engine(store: Results) -> None:
    for p in store:
        r = p.result
        worst = max(r["ranks"], key=lambda x: abs(x["memory_error"]))
        measured, predicted = r["measured_step_s"] * 1e3, r["predicted_step_s"] * 1e3
        print(
            f"  {p.key['plan']}: loss {r['losses'][0]:.2f} -> {r['losses'][-1]:.2f}; memory error worst "
            f"rank {worst['memory_error']:+.1%}; step {measured:.1f} ms measured, {predicted:.1f} ms "
            f"predicted ({r['time_error']:+.0%})"
        )
        print(f"    {phases_line(r, r['micro_batches'])}")
        if note := busy_launches(r):
            print(f"    note: {note}")
        if drift := probe_line(r.get("fit_probe_s"), r.get("launches_probe_s", [])):
            print(f"    {drift}")


def main(argv: list[str] | None = None) -> None:
    """The GPU engine check (nox -s gpu_check): ``python -m artifacts.mist_vs_megatron.engine``."""

    ap = OneLineParser(description=__doc__)
    ap.add_argument("--cpu-dry-run", action="store_true", help="the CPU setup instead (tests this script)")
    add_run_arguments(ap, EXPERIMENT)
    add_keep_argument(ap)
    args = ap.parse_args(argv)
    keep = keep_folder(ap, args)
    # The dry run tests this script within its part's budget (150 s; a fresh clone's took longer
    # with all six plans): one launch each of three plans (TP, PP and ZeRO-3: every benchmark the
    # fit takes is used), a profile without micro-batch 8 (only the measured comparison reaches
    # it). The CPU engine's fidelity is measured by `nox -s mist_vs_megatron` (all six, LAUNCHES).
    plans = {name: CPU_ENGINE.plans[name] for name in ("tp2", "pp2", "dp2-zero3")}
    dry = dataclasses.replace(
        CPU_ENGINE, launches=1, profile=DRY_RUN_PROFILE, plans=plans, model_overrides=DRY_RUN_OVERRIDES
    )
    setup = dry if args.cpu_dry_run else GPU_ENGINE
    with (
        experiment_run(args, EXPERIMENT, "engine") as run,
        tempfile.TemporaryDirectory(prefix="mist_vs_megatron_") as tmp,
    ):
        store = run_engine(run, setup, RuntimeFits(Path(tmp), setup, keep))
    print_engine(store.this_run())


if __name__ == "__main__":
    main()
