"""A search's Problem is resolved once; its Candidates count micro-batches as the plans do."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from mist import Plan, StagePlan, cluster, model, predict, search
from mist.tuning import planner, problem
from mist.tuning.pipeline_sim import in_flight
from mist.tuning.planner import NoFeasiblePlan, PlannerOptions, settings
from mist.tuning.problem import Candidate, Problem

QUICK = PlannerOptions(micro_batches=(1, 2))


@pytest.fixture
def resolutions(monkeypatch) -> Counter:
    """Counts of every per-search resolution: cost models (and their presets) and both budgets."""
    calls: Counter = Counter()
    names = ("cost_models", "load_runtime_model", "load_interference")
    names += ("gpu_budget_bytes", "host_budget_bytes")
    for name in names:
        real = getattr(problem, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(problem, name, counted)
    return calls


def test_a_search_resolves_its_problem_once(resolutions):
    plan = search(model("gpt3-1.3b"), cluster("l4", 4), 16, QUICK)
    assert plan.predicted_iteration_s is not None
    # one resolution although the search prices many candidates, predicts and refines its plans
    assert resolutions == Counter(
        cost_models=1, load_runtime_model=1, load_interference=1, gpu_budget_bytes=1, host_budget_bytes=1
    )


def test_a_failed_search_resolves_its_problem_once(resolutions):
    """The no-feasible-plan message prices every candidate again, on the same problem."""
    with pytest.raises(NoFeasiblePlan):
        search(model("gpt3-13b"), cluster("l4", 1, host_memory=2**30), 8, QUICK)
    assert resolutions["cost_models"] == 1
    assert resolutions["gpu_budget_bytes"] == resolutions["host_budget_bytes"] == 1


def test_given_cost_models_are_used_not_the_presets(resolutions):
    c = cluster("l4", 2)
    runtime, interference = problem.cost_models(c)
    resolutions.clear()
    p = Problem.resolve(model("gpt3-1.3b"), c, 8, runtime, interference)
    assert p.runtime is runtime and p.interference is interference
    assert resolutions["load_runtime_model"] == resolutions["load_interference"] == 0


def test_the_planner_reads_budgets_only_from_the_problem():
    """Nothing in the planner computes a budget or loads a preset itself any more."""
    for name in ("gpu_budget_bytes", "host_budget_bytes", "load_runtime_model"):
        assert not hasattr(planner, name)


def test_predict_resolves_once_and_equals_the_searchs_pricing(resolutions):
    m, c = model("gpt3-1.3b"), cluster("l4", 4)
    plan = search(m, c, 16, QUICK)
    resolutions.clear()
    again = predict(dataclasses.replace(plan, stages=[dataclasses.replace(s) for s in plan.stages]), m, c)
    assert resolutions["cost_models"] == 1
    assert again.predicted_iteration_s == plan.predicted_iteration_s
    assert again.stages == plan.stages and again.breakdown == plan.breakdown


def test_candidates_count_micro_batches_and_in_flight_as_the_plan_does():
    m, c = model("gpt3-1.3b"), cluster("l4", 8)
    p = Problem.resolve(m, c, 64)
    candidates = list(settings(p, PlannerOptions()))
    assert candidates and len(set(candidates)) == len(candidates)
    for cand in candidates:
        # the searches' candidates overlap the gradient reduction
        plan = Plan.of(
            m,
            c,
            global_batch=64,
            tp=cand.tp,
            dp=cand.dp,
            micro_batch=cand.micro_batch,
            stages=[StagePlan(layers=1) for _ in range(cand.stages)],
            overlap_grad_reduce=True,
        )
        assert cand.tp * cand.dp * cand.stages == c.gpus
        assert cand.grad_accum == plan.grad_accum == 64 // (cand.dp * cand.micro_batch)
        assert cand.grad_accum * cand.dp * cand.micro_batch == 64
        assert Candidate.of_plan(plan) == cand
        for i in range(cand.stages):
            assert (
                cand.in_flight(i)
                == in_flight(i, cand.stages, plan.grad_accum)
                == min(cand.stages - i, plan.grad_accum)
            )


def test_a_candidates_setting_is_the_problems():
    m, c = model("gpt3-1.3b"), cluster("l4", 8)
    p = Problem.resolve(m, c, 32)
    st = Candidate(2, 2, 2, 1, 32).setting(p)
    assert (st.tp, st.stages, st.dp, st.micro_batch) == (2, 2, 2, 1)
    assert st.runtime is p.runtime and st.interference is p.interference
    assert st.sp is p.sequence_parallel and st.grad_accumulation is p.grad_accumulation
