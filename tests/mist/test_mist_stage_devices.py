"""Stages with their own device count and (TP, DP) in Mist's search (Mist §5.3): the device
counts a stage may take, the plans the phase makes (valid, priced as the program priced them,
placed so each stage's TP groups stay in a node) and that the search keeps its best plan. The
program itself is checked against brute force in test_mist_tune.py."""

from __future__ import annotations

import pytest

from mist import cluster, model, search
from mist.engine.layout import RankLayout
from mist.engine.run import unsupported
from mist.export import megatron_lm_arguments
from mist.tuning import planner
from mist.tuning.inter_stage import solve_inter_stage
from mist.tuning.planner import (
    PlannerOptions,
    predict_for,
    stage_device_counts,
    stage_shapes,
    tune_stage_devices,
)
from mist.tuning.problem import Problem


def test_device_counts_are_aligned_blocks():
    """Powers of two dividing a node, then whole nodes; none so large that another stage gets no
    device."""
    assert stage_device_counts(cluster("l4", 16), 3) == (1, 2, 4, 8)
    assert stage_device_counts(cluster("l4", 32), 2) == (1, 2, 4, 8, 16, 24)
    assert stage_device_counts(cluster("l4", 4), 2) == (1, 2)


def test_stage_shapes_split_the_micro_batch_evenly():
    m = model("gpt3-1.3b", seq=2048)
    problem = Problem.resolve(m, cluster("l4", 8), 16)
    # 4 micro-batches of 4 sequences on 4 devices: TP 1 x DP 4, 2 x 2, 4 x 1
    assert stage_shapes(problem, 4, 4) == [(1, 4, 1), (2, 2, 2), (4, 1, 4)]
    # 8 micro-batches of 2 sequences: DP 4 cannot split them
    assert stage_shapes(problem, 4, 8) == [(2, 2, 1), (4, 1, 2)]
    assert stage_shapes(problem, 4, 4, allowed=(2,)) == [(2, 2, 2)]


@pytest.mark.parametrize(("arch", "flash"), [("gpt3", False), ("llama", True)])
def test_three_stages_on_four_gpus(arch, flash, monkeypatch):
    """A pipeline the plain search cannot make (3 stages do not divide 4 GPUs): the phase gives the
    first stage 2 devices, the others 1, in a plan that checks, that predict prices exactly as the
    program did, whose ranks keep each TP group inside an aligned block, that the engine accepts
    and that Megatron-LM export refuses by name."""
    m, c = model(f"{arch}-1.3b", seq=2048, flash=flash), cluster("l4", 4)
    problem = Problem.resolve(m, c, 16)
    G = 8
    shapes = {n: stage_shapes(problem, n, G) for n in stage_device_counts(c, 3)}
    solved = []
    monkeypatch.setattr(
        planner, "solve_inter_stage", lambda *a, **k: solved.append(solve_inter_stage(*a, **k)) or solved[-1]
    )
    plan = tune_stage_devices(problem, 3, G, shapes, PlannerOptions(milp_time_limit=30), float("inf"))
    assert plan is not None and solved[-1].optimal
    plan.check()
    shape = [plan.stage_parallelism(i) for i in range(3)]
    assert [tp * dp for tp, dp, _ in shape] == [2, 1, 1]
    assert {dp * mb for _, dp, mb in shape} == {16 // G}  # every stage splits the same micro-batch
    assert plan.grad_accum == G
    predict_for(problem, plan)
    assert plan.breakdown["fits"]
    layout = RankLayout.of(plan)
    for i, (tp, _, _) in enumerate(shape):
        assert layout.first_rank(i) % (tp * shape[i][1]) == 0  # aligned: TP groups inside a node
    assert not unsupported(plan)
    _, cannot = megatron_lm_arguments(plan, m)
    assert any("TP/DP of their own" in line for line in cannot)
    # the closed form of the plan as built is what the program minimised
    assert solved[-1].objective == pytest.approx(plan.predicted_iteration_s, rel=1e-9)


def test_the_search_keeps_its_best_plan():
    """With the phase the search returns a plan no slower than without it, and says so per
    pipeline it tries."""
    m, c = model("gpt3-1.3b", seq=2048), cluster("l4", 4)
    plain = search(m, c, 8, PlannerOptions(milp_time_limit=30))
    lines: list[str] = []
    both = search(m, c, 8, PlannerOptions(milp_time_limit=30, stage_devices=True), progress=lines.append)
    assert both.predicted_iteration_s <= plain.predicted_iteration_s * (1 + 1e-9)
    assert any("their own devices" in line for line in lines)


def test_plan_command(tmp_path, capsys):
    """`mist plan --stage-devices` writes a plan that predicts as searched; with --target it is
    refused in one line before any search."""
    from mist.__main__ import main
    from mist.plan import Plan

    out = tmp_path / "plan.yaml"
    args = ["plan", "--model", "gpt3-1.3b", "--gpus", "4", "--gpu", "l4", "--global-batch", "8", "--quiet"]
    assert main([*args, "--stage-devices", "--out", str(out)]) == 0
    plan = Plan.load(out)
    again = predict_for(Problem.resolve(model("gpt3-1.3b"), cluster("l4", 4), 8), Plan.load(out))
    assert again.predicted_iteration_s == pytest.approx(plan.predicted_iteration_s, rel=1e-9)
    capsys.readouterr()
    assert main([*args, "--stage-devices", "--target", "megatron-lm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stage-devices" in err[0] and "one TP and DP" in err[0]
