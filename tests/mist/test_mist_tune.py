"""Mist's tuner: the exact Pareto frontier, the inter-stage MILP against brute force, the 1F1B
closed form against the dependency simulator."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mist.tuning.inter_stage import (
    MIP_REL_GAP,
    Frontier,
    pareto_frontier,
    pareto_frontier_3d,
    solve_inter_stage,
)
from mist.tuning.pipeline_sim import one_f_one_b_order, pipeline_objective, simulate_1f1b


def _dominated(i, steady, extra):
    return any(
        steady[j] <= steady[i] and extra[j] <= extra[i] and (steady[j] < steady[i] or extra[j] < extra[i])
        for j in range(len(steady))
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=60))
def test_pareto_frontier_is_exactly_the_non_dominated_set(points):
    steady = np.array([p[0] for p in points], float)
    extra = np.array([p[1] for p in points], float)
    keep = pareto_frontier(steady, extra)
    kept = {(steady[i], extra[i]) for i in keep}
    expected = {(steady[i], extra[i]) for i in range(len(points)) if not _dominated(i, steady, extra)}
    assert kept == expected
    assert len(keep) == len(kept)  # one of each set of duplicates
    assert np.all(np.diff(steady[keep]) > 0) and np.all(np.diff(extra[keep]) < 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=60))
def test_3d_pareto_frontier_is_exactly_the_non_dominated_set(points):
    """Small integer coordinates: many ties and exact duplicates, which the staircase must keep apart."""
    pts = np.array(points, float)
    keep = pareto_frontier_3d(pts[:, 0], pts[:, 1], pts[:, 2])

    def dominated(p):
        return any(np.all(q <= p) and np.any(q < p) for q in pts)

    assert {tuple(pts[i]) for i in keep} == {tuple(p) for p in pts if not dominated(p)}
    assert len(keep) == len({tuple(pts[i]) for i in keep})  # one of each set of duplicates


def test_3d_frontier_keeps_what_summing_the_extras_would_drop():
    """The second point loses on (steady, sync + step) but has the least sync, which a stage whose
    sync is exposed needs: the 2-D frontier of the sum (the MILP's before the clipping barrier)
    drops it, the 3-D one keeps it."""
    steady, sync, step = np.array([1.0, 2.0]), np.array([1.0, 0.0]), np.array([1.0, 3.0])
    assert len(pareto_frontier(steady, sync + step)) == 1
    assert sorted(pareto_frontier_3d(steady, sync, step)) == [0, 1]


def test_1f1b_order_is_the_textbook_one():
    assert list(one_f_one_b_order(0, 4, 6))[:5] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    assert list(one_f_one_b_order(3, 4, 3)) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    for stage in range(4):
        order = list(one_f_one_b_order(stage, 4, 5))
        assert sorted(order) == sorted([("F", m) for m in range(5)] + [("B", m) for m in range(5)])


@pytest.mark.parametrize("stages,micro", [(1, 1), (1, 7), (4, 4), (4, 16), (8, 3)])
def test_closed_form_equals_simulation_for_balanced_stages(stages, micro, rng):
    fwd, bwd = rng.uniform(0.5, 2), rng.uniform(1, 4)
    sim = simulate_1f1b([fwd] * stages, [bwd] * stages, micro)
    assert sim == pytest.approx(pipeline_objective([fwd + bwd] * stages, [0.0] * stages, micro))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.randoms(use_true_random=False))
def test_closed_form_bounds_the_simulation(stages, micro, rnd):
    """Imbalanced stages: the closed form is the planner's objective; the simulation of the
    dependency graph is never slower than it by more than the stages' spread."""
    fwd = [rnd.uniform(0.2, 2) for _ in range(stages)]
    bwd = [2 * x * rnd.uniform(0.8, 1.2) for x in fwd]
    last = [rnd.uniform(0, 3) for _ in range(stages)]
    step = [x * rnd.uniform(0, 1) for x in last]
    barrier = rnd.uniform(0, 0.5)
    sim = simulate_1f1b(fwd, bwd, micro, last=last, step=step, barrier_s=barrier)
    closed = pipeline_objective([x + y for x, y in zip(fwd, bwd, strict=True)], last, micro, step, barrier)
    steady = [x + y for x, y in zip(fwd, bwd, strict=True)]
    assert sim <= closed + 1e-9 + max(last)
    assert sim >= max(steady) * micro - 1e-9  # the slowest stage must run every micro-batch
    # no step hides behind another stage's backward: after the barrier comes the slowest step
    assert sim >= max(steady) * micro + barrier + max(step) - 1e-9


def test_clipping_barrier_exposes_a_later_stages_step():
    """Without the barrier the last stage's step hides behind the first stage's remaining
    backwards; with it, every step waits for every stage's sync (the closed form and the
    simulation agree on balanced stages)."""
    fwd, bwd, micro = [1.0, 1.0], [2.0, 2.0], 4
    last, step = [0.5, 2.5], [0.5, 2.5]
    # the backwards end at 15 s (stage 0) and 12 s (stage 1): 3 x 3 s steady + 2 x 3 s crossing
    hidden = simulate_1f1b(fwd, bwd, micro, last=last)
    assert hidden == pytest.approx(max(15 + 0.5, 12 + 2.5))
    clipped = simulate_1f1b(fwd, bwd, micro, last=last, step=step, barrier_s=0.1)
    assert clipped == pytest.approx(15 + 0.1 + 2.5)
    closed = pipeline_objective([3.0, 3.0], last, micro, step, 0.1)
    assert closed == pytest.approx(clipped)


def _random_frontiers(rng, stages, layers, device_counts=(1,)):
    """Random frontiers keyed (layers, devices): more devices, faster (by a random factor); a
    random half of the points wait before their first forward (ZeRO-1/2 gathered in forward)."""
    out = []
    for _ in range(stages):
        per_l = {}
        for n in range(1, layers - stages + 2):
            for devices in device_counts:
                k = int(rng.integers(1, 4))
                steady = np.sort(rng.uniform(0.8, 1.2, k)) * n / devices ** rng.uniform(0.5, 1)
                extra = np.sort(rng.uniform(0, 3, k))[::-1].copy()
                step = extra * rng.uniform(0, 1, k)
                wait = rng.uniform(0, 0.5, k) * (rng.uniform(0, 1, k) < 0.5)
                per_l[n, devices] = Frontier(steady, extra, step, wait, np.arange(k), np.zeros(k))
        out.append(per_l)
    return out


@pytest.mark.parametrize("trial", range(8))
def test_milp_matches_brute_force(trial, rng):
    stages, layers, micro = int(rng.integers(1, 4)), int(rng.integers(3, 8)), int(rng.integers(1, 9))
    if layers < stages:
        layers = stages
    frontiers = _random_frontiers(rng, stages, layers)
    barrier = float(rng.uniform(0, 0.5))
    best = np.inf
    for split in itertools.product(range(1, layers + 1), repeat=stages):
        if sum(split) != layers:
            continue
        choices = [range(len(frontiers[i][n, 1])) for i, n in enumerate(split)]
        for pts in itertools.product(*choices):
            t = [frontiers[i][n, 1].steady[p] for i, (n, p) in enumerate(zip(split, pts, strict=True))]
            d = [frontiers[i][n, 1].extra[p] for i, (n, p) in enumerate(zip(split, pts, strict=True))]
            s = [frontiers[i][n, 1].step[p] for i, (n, p) in enumerate(zip(split, pts, strict=True))]
            w = [frontiers[i][n, 1].wait[p] for i, (n, p) in enumerate(zip(split, pts, strict=True))]
            best = min(best, pipeline_objective(t, d, micro, s, barrier, wait=w))
    sol = solve_inter_stage(frontiers, layers, micro, barrier_s=barrier)
    assert sol is not None and sol.optimal
    assert sum(sol.layers) == layers
    # optimal to the solver's stated gap, never below the true optimum
    assert best * (1 - 1e-12) <= sol.objective <= best * (1 + MIP_REL_GAP)


@pytest.mark.parametrize("trial", range(6))
def test_milp_with_stage_devices_matches_brute_force(trial, rng):
    """Stages choosing their own device counts: the program's optimum is the brute-force optimum
    over every layer split, device split (adding up, never growing along the pipeline) and point."""
    stages, layers, micro = int(rng.integers(2, 4)), int(rng.integers(3, 6)), int(rng.integers(1, 9))
    counts = (1, 2, 4)
    total = int(rng.choice([c for c in range(stages, 4 * stages + 1)]))
    frontiers = _random_frontiers(rng, stages, layers, counts)
    barrier = float(rng.uniform(0, 0.5))
    best = np.inf
    for split in itertools.product(range(1, layers + 1), repeat=stages):
        if sum(split) != layers:
            continue
        for devices in itertools.product(counts, repeat=stages):
            if sum(devices) != total or any(a < b for a, b in itertools.pairwise(devices)):
                continue
            keys = list(zip(split, devices, strict=True))
            for pts in itertools.product(*(range(len(frontiers[i][k])) for i, k in enumerate(keys))):
                at = [(frontiers[i][k], p) for i, (k, p) in enumerate(zip(keys, pts, strict=True))]
                t, d, s, w = (
                    [getattr(f, name)[p] for f, p in at] for name in ("steady", "extra", "step", "wait")
                )
                best = min(best, pipeline_objective(t, d, micro, s, barrier, wait=w))
    sol = solve_inter_stage(frontiers, layers, micro, barrier_s=barrier, total_devices=total)
    if not np.isfinite(best):
        assert sol is None
        return
    assert sol is not None and sol.optimal
    assert sum(sol.layers) == layers and sum(sol.devices) == total
    assert list(sol.devices) == sorted(sol.devices, reverse=True)
    assert best * (1 - 1e-12) <= sol.objective <= best * (1 + MIP_REL_GAP)


def test_milp_reports_infeasible_layer_counts():
    one = np.array([1.0]), np.array([0.0]), np.array([0.0]), np.array([0.0]), np.array([0]), np.array([0.0])
    fr = [{(1, 1): Frontier(*one)}] * 2
    assert solve_inter_stage(fr, total_layers=5, micro_batches=2) is None
    # nor device counts that cannot add up to the devices there are, or that grow along the pipeline
    fr = [{(1, 2): Frontier(*one)}] * 2
    assert solve_inter_stage(fr, total_layers=2, micro_batches=2, total_devices=5) is None
    fr = [{(1, 2): Frontier(*one)}, {(1, 4): Frontier(*one)}]
    assert solve_inter_stage(fr, total_layers=2, micro_batches=2, total_devices=6) is None
    assert solve_inter_stage(fr[::-1], total_layers=2, micro_batches=2, total_devices=6).devices == (4, 2)


def test_stages_evaluated_together_price_as_each_alone(rng):
    """``prime`` evaluates a batch of plans' stages in one array call per stage size and position
    (the exhaustive searches' batches): every plan then prices exactly, bit for bit, as it does
    alone with no memo. Plans share sizes and differ in every strategy field."""
    import dataclasses

    from mist.plan import gather_allowed
    from mist.tuning.planner import predict, predict_for, prime
    from mist.tuning.problem import Problem

    from .test_mist_plan_format import _random_plan

    def restrategised(plan):
        stages = []
        for s in plan.stages:
            zero, wo = int(rng.integers(0, 4)), float(rng.choice((0.0, 0.5, 1.0)))
            stages.append(
                dataclasses.replace(
                    s,
                    recompute=int(rng.integers(0, s.layers + 1)),
                    zero=zero,
                    offload_weights=wo,
                    offload_grads=float(rng.random()),
                    offload_optimizer=float(rng.random()),
                    offload_activations=float(rng.choice((0.0, rng.random()))),
                    selective=bool(rng.random() < 0.3),
                    gather_in_forward=bool(gather_allowed(zero, wo) and rng.random() < 0.5),
                )
            )
        return dataclasses.replace(plan, stages=stages)

    for _ in range(4):
        base = _random_plan(rng)
        plans = [restrategised(base) for _ in range(12)]
        m, c = base.model_spec(), base.cluster()
        problem, memo = Problem.of_plan(base, m, c), {}
        prime(problem, plans, memo)
        primed = len(memo)
        for plan in plans:
            together = predict_for(problem, dataclasses.replace(plan), memo=memo)
            alone = predict(dataclasses.replace(plan), m, c)
            assert together.predicted_iteration_s == alone.predicted_iteration_s
            assert together.simulated_iteration_s == alone.simulated_iteration_s
            fields = ("steady_s", "extra_s", "step_s", "wait_s", "memory_bytes", "host_memory_bytes")
            for a, b in zip(together.stages, alone.stages, strict=True):
                assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        assert len(memo) == primed  # every stage priced came from the batch
