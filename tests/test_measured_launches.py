"""mist_vs_megatron's measured comparison launches its plans interleaved (engine.train_plans):
round by round, each plan still running once, the order rotated; a plan that ran out of memory or
was refused is not launched again; the median launch is the one reported."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from artifacts.mist_vs_megatron import engine
from measure.contention import Contention


class _Plan:
    def save(self, path) -> None:
        path.write_text("a plan\n")


def _fake_launches(monkeypatch, outcomes: dict[str, list[dict]]) -> list[str]:
    """Replace each launch by the next of its plan's ``outcomes``; returns the launch order."""
    order: list[str] = []

    def launch_once(plan, processes, args, out, name):
        order.append(name)
        return outcomes[name].pop(0)

    monkeypatch.setattr(engine, "_launch_once", launch_once)
    return order


def test_rounds_rotate_and_every_plan_is_launched_once_a_round(monkeypatch, tmp_path):
    rng = random.Random()
    names = [f"plan{i}" for i in range(rng.randint(2, 5))]
    launches = rng.randint(2, 5)
    steps = {n: [rng.uniform(0.1, 1.0) for _ in range(launches)] for n in names}
    busy = {
        n: [rng.choice([None, Contention(10.0, 2, 1.9, rng.uniform(0, 1), 0.0)]) for _ in steps[n]]
        for n in names
    }
    outcomes = {
        n: [{"step_s": s, "report": {"launch": k}, "contention": busy[n][k]} for k, s in enumerate(steps[n])]
        for n in names
    }
    order = _fake_launches(monkeypatch, outcomes)
    trained, rounds = engine.train_plans({n: _Plan() for n in names}, 2, 3, launches, tmp_path)
    k = len(names)
    assert rounds == [names[r % k :] + names[: r % k] for r in range(launches)]
    assert order == [n for r in rounds for n in r]
    for n in names:
        ranked = sorted(range(launches), key=lambda i: steps[n][i])
        median = ranked[(launches - 1) // 2]
        assert trained[n]["launches_step_s"] == steps[n]  # in launch order
        assert trained[n]["launches_contention"] == [c and c.as_dict() for c in busy[n]]
        assert trained[n]["step_s"] == steps[n][median]
        assert trained[n]["report"] == {"launch": median}  # the median launch's own report
        assert trained[n]["out_of_memory"] is False


def test_a_plan_out_of_memory_or_refused_is_not_launched_again(monkeypatch, tmp_path):
    ok = [{"step_s": 0.2, "report": {}, "contention": None} for _ in range(3)]
    outcomes = {
        "fits": ok,
        "over": [{"out_of_memory": True, "report": {"worst": 1}}],
        "refused": [{"refused": "no such mechanism here"}],
    }
    order = _fake_launches(monkeypatch, outcomes)
    trained, rounds = engine.train_plans({n: _Plan() for n in outcomes}, 2, 3, 3, tmp_path)
    assert order == ["fits", "over", "refused", "fits", "fits"]
    assert rounds == [["fits", "over", "refused"], ["fits"], ["fits"]]
    assert trained["over"] == {
        "out_of_memory": True,
        "step_s": None,
        "launches_step_s": [],
        "report": {"worst": 1},
    }
    assert trained["refused"] == {"refused": "no such mechanism here", "out_of_memory": False}
    assert trained["fits"]["launches_step_s"] == [0.2, 0.2, 0.2]


def test_no_plans_no_launches(monkeypatch, tmp_path):
    """A case where no system found a plan (its cap too tight): was a ZeroDivisionError."""
    order = _fake_launches(monkeypatch, {})
    assert engine.train_plans({}, 2, 3, 3, tmp_path) == ({}, []) and order == []


def test_a_launch_beside_other_work_is_said_and_a_quiet_one_is_not():
    quiet, busy = Contention(9.0, 2, 1.9, 0.02, 0.0), Contention(9.0, 2, 1.9, 0.9, 0.05)
    result = {"launches_contention": [quiet.as_dict(), busy.as_dict(), None]}
    assert engine.busy_launches(result) == (
        "1 of 3 launch(es) shared the cores with other work (up to 0.95 of a core): "
        "not a quiet machine's time"
    )
    # control: all quiet, nothing known, or a result from before contention was recorded
    assert engine.busy_launches({"launches_contention": [quiet.as_dict(), None]}) == ""
    assert engine.busy_launches({}) == ""


def test_each_launch_is_probed_just_before_it(monkeypatch, tmp_path):
    """With a probe (engine.speed_probe), the machine's speed is taken just before each launch and
    kept, in launch order, beside the launch's step; a plan that ends (out of memory, refused) has
    no time and so no probe to compare it with. Without one, nothing is probed (the tests above)."""
    rng = random.Random()
    outcomes = {
        "a": [{"step_s": rng.uniform(0.1, 1), "report": {}, "contention": None} for _ in range(3)],
        "b": [{"step_s": rng.uniform(0.1, 1), "report": {}, "contention": None} for _ in range(3)],
        "over": [{"out_of_memory": True, "report": {}}],
    }
    order = _fake_launches(monkeypatch, outcomes)
    probes = [rng.uniform(0.01, 0.05) for _ in range(7)]
    taken = iter(probes)

    def probe() -> float:
        order.append("probe")
        return next(taken)

    trained, rounds = engine.train_plans({n: _Plan() for n in outcomes}, 2, 3, 3, tmp_path, probe)
    launched = [n for r in rounds for n in r]
    assert order == [x for n in launched for x in ("probe", n)]  # a probe just before every launch
    for name in ("a", "b"):
        mine = [probes[i] for i, n in enumerate(launched) if n == name]
        assert trained[name]["launches_probe_s"] == mine
    assert "launches_probe_s" not in trained["over"]


def test_the_machines_drift_between_fit_and_launches_is_said():
    rng = random.Random()
    fit = [rng.uniform(0.02, 0.03) for _ in range(2)]
    launches = [rng.uniform(0.02, 0.04) for _ in range(rng.randint(1, 9))]
    change = engine.speed_change(fit, launches)
    assert change == statistics.median(launches) / statistics.fmean(fit) - 1
    line = engine.probe_line(fit, launches)
    assert f"{abs(change):.0%}" in line or "as fast" in line
    assert ("slower" in line) == (round(abs(change), 2) > 0 and change > 0)
    assert ("faster" in line) == (round(abs(change), 2) > 0 and change < 0)
    assert "as fast" in engine.probe_line([0.02, 0.02], [0.02])
    assert "10% slower" in engine.probe_line([0.02], [0.022])
    assert "20.0 and 18.0 ms just before and after the fit" in engine.probe_line([0.02, 0.018], [0.019])
    # not probed (results from before the probe): nothing said
    assert engine.speed_change([], launches) is None and engine.probe_line(None, launches) == ""
    assert engine.probe_line(fit, []) == ""


def test_the_speed_probe_times_the_setups_layer_on_one_thread(monkeypatch):
    """One thread while it times (a rank's device), the caller's count restored after; the layer
    at the setup's shape and micro-batch, really timed (a positive time)."""
    import dataclasses

    import torch

    from mist.engine import profiler

    setup = dataclasses.replace(engine.CPU_ENGINE, model_overrides=engine.DRY_RUN_OVERRIDES, micro_batch=1)
    seen, timed = [], profiler.megatron_layer_seconds

    def spy(b, s, h, heads, tp, *args, **kwargs):
        seen.append((torch.get_num_threads(), b, s, h, heads, tp))
        return timed(b, s, h, heads, tp, *args, **kwargs)

    monkeypatch.setattr(profiler, "megatron_layer_seconds", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not the probe's one: that it is restored can be seen
    try:
        seconds = engine.speed_probe(setup)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [(1, 1, 64, 64, 4, 1)] and 0 < seconds < 10


def test_a_cases_launch_probes_count_a_shared_plan_once():
    from artifacts.mist_vs_megatron.measured import case_launch_probes

    rng = random.Random()
    own = {s: [rng.uniform(0.01, 0.03) for _ in range(3)] for s in ("mist", "aceso")}
    result = {
        "mist": {"launches_probe_s": own["mist"]},
        "megatron": {"launches_probe_s": own["mist"], "same_plan_as": "mist"},  # mist's launches
        "aceso": {"launches_probe_s": own["aceso"]},
        "zero3": {"infeasible": "no plan within the cap"},
        "plain": {"launches_probe_s": [9.9]},  # not a system's winner
    }
    assert case_launch_probes(result) == own["mist"] + own["aceso"]
    old = {"mist": {"measured_step_s": 0.2}, "aceso": {"measured_step_s": 0.3}}  # before the probe
    assert case_launch_probes(old) == [] and engine.probe_line(None, []) == ""


def _one_launch(monkeypatch, tmp_path, returncode: int, stderr: str, report: dict | None) -> dict:
    """engine._launch_once over a launch that exits ``returncode`` with ``stderr``, having
    written ``report`` (None: none)."""
    import subprocess

    out = tmp_path / "report.json"

    def launch(plan, processes, args):
        if report is not None:
            out.write_text(json.dumps(report))
        return subprocess.CompletedProcess(args, returncode, "", stderr)

    monkeypatch.setattr(engine, "_launch", launch)
    return engine._launch_once(_Plan(), 2, [], out, "a plan")


def test_a_refusal_is_read_from_the_report_and_any_other_failure_raises(monkeypatch, tmp_path):
    """A plan the engine refuses is known by its report (``{"refused": [reasons]}``, exit 2), not by
    a line of stderr: a launch that failed mid-run with an ``error:`` line (a ValueError in a
    step) was recorded as "refused by the engine here" (the negative control)."""
    refused = {"refused": ["interleaved pipelines with ZeRO-2/3", "another part"]}
    assert _one_launch(monkeypatch, tmp_path, 1, "error: mist.engine.run cannot ...\n", refused) == {
        "refused": "interleaved pipelines with ZeRO-2/3; another part"
    }
    with pytest.raises(RuntimeError, match=r"mist\.engine\.run failed for a plan:\nerror: a bug mid-step"):
        _one_launch(monkeypatch, tmp_path, 1, "error: a bug mid-step\n", None)
    with pytest.raises(RuntimeError, match="failed for a plan"):  # no report, no line
        _one_launch(monkeypatch, tmp_path, 1, "Traceback ...\n", None)


def test_a_gpu_case_is_planned_for_the_machine_it_runs_on(monkeypatch):
    """On a GPU the measured cases were planned for the device preset's node (8 GPUs sharing a 2 TB
    host), while the lent machine has one GPU and 128 GiB: what offloading may fill is this
    machine's RAM, its processes one node. The CPU setup keeps the device preset's cluster."""
    from artifacts.mist_vs_megatron import measured
    from mist import cluster

    ram = random.choice([64, 128, 256]) * 2**30
    monkeypatch.setattr(measured, "machine_memory_bytes", lambda: ram)
    case = random.choice(measured.GPU_MEASURED.cases)
    c = measured.case_cluster(measured.GPU_MEASURED.base, case, case.planning_bytes)
    assert (c.gpus, c.gpus_per_node, c.host.memory, c.gpu.memory) == (
        case.processes,
        case.processes,
        ram,
        case.planning_bytes,
    )
    cpu_case = random.choice(measured.CASES)
    on_cpu = measured.case_cluster(measured.CPU_ENGINE, cpu_case, cpu_case.cap_bytes)
    assert on_cpu == cluster("cpu", cpu_case.processes, gpu_memory=cpu_case.cap_bytes)


def test_phases_name_the_clipping_apart_and_older_results_as_they_were_timed():
    """Review 2026-12-07: "gradient sync" held the clipping all-reduce, where a pipeline stage waits
    for the others (1.5-8 ms at PP 2 with nothing to sync). Results since time it apart; those
    before are said as what they timed."""
    stage = {"steady_s": 0.01, "extra_s": 0.002}
    phases = {"pipeline_s": 0.04, "grad_sync_s": 0.0002, "optimizer_s": 0.0006}
    new = engine.phases_line(
        {"measured_phases_s": {**phases, "clip_s": 0.004}, "predicted_stages": [stage]}, 4
    )
    old = engine.phases_line({"measured_phases_s": phases, "predicted_stages": [stage]}, 4)
    assert "gradient sync 0.2 ms, clipping and waiting for the other ranks 4.0 ms" in new
    assert "gradient sync and clipping 0.2 ms" in old and "4 x 10.0 ms" in old
    ranks = [{"phases": [{**phases, "clip_s": c}]} for c in (0.001, 0.003, 0.004)]
    assert engine.measured_phases({"ranks": ranks})["clip_s"] == 0.003  # the median over ranks
