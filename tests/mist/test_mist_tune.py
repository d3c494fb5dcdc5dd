"""Mist's tuner: the exact Pareto frontier, the inter-stage MILP against brute force, the 1F1B
closed form against the dependency simulator."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mist.tuning.inter_stage import MIP_REL_GAP, Frontier, pareto_frontier, solve_inter_stage
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
    sim = simulate_1f1b(fwd, bwd, micro, last=last)
    closed = pipeline_objective([x + y for x, y in zip(fwd, bwd, strict=True)], last, micro)
    steady = [x + y for x, y in zip(fwd, bwd, strict=True)]
    assert sim <= closed + 1e-9 + max(last)
    assert sim >= max(steady) * micro - 1e-9  # the slowest stage must run every micro-batch


def _random_frontiers(rng, stages, layers):
    out = []
    for _ in range(stages):
        per_l = {}
        for n in range(1, layers - stages + 2):
            k = int(rng.integers(1, 4))
            steady = np.sort(rng.uniform(0.8, 1.2, k)) * n
            extra = np.sort(rng.uniform(0, 3, k))[::-1].copy()
            per_l[n] = Frontier(steady, extra, np.arange(k), np.zeros(k))
        out.append(per_l)
    return out


@pytest.mark.parametrize("trial", range(8))
def test_milp_matches_brute_force(trial, rng):
    stages, layers, micro = int(rng.integers(1, 4)), int(rng.integers(3, 8)), int(rng.integers(1, 9))
    if layers < stages:
        layers = stages
    frontiers = _random_frontiers(rng, stages, layers)
    best = np.inf
    for split in itertools.product(range(1, layers + 1), repeat=stages):
        if sum(split) != layers:
            continue
        choices = [range(len(frontiers[i][n])) for i, n in enumerate(split)]
        for pts in itertools.product(*choices):
            t = [frontiers[i][n].steady[p] for i, (n, p) in enumerate(zip(split, pts, strict=True))]
            d = [frontiers[i][n].extra[p] for i, (n, p) in enumerate(zip(split, pts, strict=True))]
            best = min(best, pipeline_objective(t, d, micro))
    sol = solve_inter_stage(frontiers, layers, micro)
    assert sol is not None and sol.optimal
    assert sum(sol.layers) == layers
    # optimal to the solver's stated gap, never below the true optimum
    assert best * (1 - 1e-12) <= sol.objective <= best * (1 + MIP_REL_GAP)


def test_milp_reports_infeasible_layer_counts():
    fr = [{1: Frontier(np.array([1.0]), np.array([0.0]), np.array([0]), np.array([0.0]))}] * 2
    assert solve_inter_stage(fr, total_layers=5, micro_batches=2) is None
