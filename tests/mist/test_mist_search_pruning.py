"""The search's shortcuts change no result: strategies priced only where they fit, and the layer's
symbolic costs compiled without sympy's proof of which term of a Max is largest."""

from __future__ import annotations

import dataclasses

import numpy as np
import sympy as sp

from mist import cluster, model
from mist.model import symbolic
from mist.tuning.inter_stage import frontier_for
from mist.tuning.planner import PlannerOptions, _Fits, _stage_values, settings
from mist.tuning.problem import Problem
from mist.tuning.stage_cost import STRATEGY_FIELDS, fitting_rows, layer_numbers

GiB = 1 << 30
# (model, GPUs, global batch, device memory): small enough that a candidate's grids take
# milliseconds, tight enough that most strategies do not fit
CASES = [("gpt3-1.3b", 4, 32, 9 * GiB), ("llama-7b", 8, 64, 16 * GiB), ("falcon-7b", 8, 64, 14 * GiB)]


def _candidates(rng: np.random.Generator, how_many: int):
    name, gpus, batch, memory = CASES[rng.integers(len(CASES))]
    memory = int(memory * rng.uniform(0.7, 1.3))  # the budget at a fresh place each run
    problem = Problem.resolve(model(name), cluster("l4", gpus, gpu_memory=memory), batch, None, None)
    candidates = list(settings(problem, PlannerOptions(micro_batches=(1, 2))))
    chosen = rng.choice(len(candidates), size=min(how_many, len(candidates)), replace=False)
    return problem, [candidates[i] for i in chosen]


def _frontier_strategies(grid: dict, frontier) -> list[tuple]:
    return [tuple(float(grid[name][row]) for name in STRATEGY_FIELDS) for row in frontier.index]


def test_fitting_rows_are_the_rows_the_frontier_rule_keeps(rng):
    """fitting_rows is frontier_for's memory rule over the whole grid's evaluation, at any number
    in flight (fractions too: interleaved stages hold them)."""
    problem, candidates = _candidates(rng, 4)
    budget = float(problem.gpu_budget)
    for candidate in candidates:
        setting = candidate.setting(problem)
        layer = layer_numbers(setting)
        layers = int(rng.integers(1, problem.model.layers // candidate.stages + 1))
        first, last = bool(rng.integers(2)), bool(rng.integers(2))
        grid, values, per_flight = _stage_values(
            setting, layer, layers, first, last, PlannerOptions().space, candidate.grad_accum
        )
        flight = float(rng.choice([0.5, 1.0, 2.0, 3.0, 7.5]))
        rows = fitting_rows(
            setting,
            layer,
            layers,
            first,
            last,
            grid,
            candidate.grad_accum,
            flight,
            budget,
            problem.host_budget,
        )
        memory = values["memory"] + (flight - 1) * per_flight
        host = values["host_memory"] + (flight - 1) * values["host_per_flight"]
        expected = np.flatnonzero((memory <= budget) & (host <= problem.host_budget))
        np.testing.assert_array_equal(rows, expected)


def test_pruned_frontiers_equal_the_whole_grids(rng):
    """Each frontier a stage can ask for (as many in flight as the pruning's or more) is the same,
    point for point and strategy for strategy, from the pruned grid as from the whole one. Negative
    control: pruned for far more in flight than asked, a frontier loses its points."""
    problem, candidates = _candidates(rng, 1000)
    budget, space = float(problem.gpu_budget), PlannerOptions().space
    compared = pruned_rows = 0
    for candidate in candidates:
        setting = candidate.setting(problem)
        layer = layer_numbers(setting)
        flights = sorted({candidate.in_flight(i) for i in range(candidate.stages)})
        layers = int(rng.integers(1, problem.model.layers - candidate.stages + 2))
        first, last = bool(rng.integers(2)), bool(rng.integers(2))
        whole = _stage_values(setting, layer, layers, first, last, space, candidate.grad_accum)
        fits = _Fits(flights[0], budget, problem.host_budget)
        pruned = _stage_values(setting, layer, layers, first, last, space, candidate.grad_accum, fits)
        pruned_rows += len(whole[0]["recompute"]) - len(pruned[0]["recompute"])
        too_many = _stage_values(
            setting,
            layer,
            layers,
            first,
            last,
            space,
            candidate.grad_accum,
            dataclasses.replace(fits, in_flight=1e6),
        )
        for flight in flights:
            a = frontier_for(whole[1], flight, budget, whole[2], problem.host_budget)
            b = frontier_for(pruned[1], flight, budget, pruned[2], problem.host_budget)
            for field in ("steady", "extra", "step", "wait", "memory"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
            assert _frontier_strategies(whole[0], a) == _frontier_strategies(pruned[0], b)
            if len(a):
                compared += 1
                assert len(frontier_for(too_many[1], flight, budget, too_many[2], problem.host_budget)) < len(
                    a
                )
        if compared >= 4 and pruned_rows:
            break
    assert compared, "no candidate had a frontier to compare"
    assert pruned_rows, "every strategy of every candidate fit: the pruning was not tried"


def test_max_compiled_unevaluated_equals_sympys_own(rng):
    """A layer's costs compiled with each Max left unevaluated (numpy takes the maximum of every
    term) equal them compiled with sympy's Max, which drops the terms it proves smaller first:
    bit for bit, at random micro-batches, sequences and TP sizes. Negative control: leaving out
    the term that is largest somewhere changes the transient bytes."""
    names = ["gpt3-1.3b", "llama-7b", "falcon-7b", "gpt3-2.7b"]
    m = model(names[rng.integers(len(names))], flash=bool(rng.integers(2)))
    costs = symbolic.layer_costs(m, bool(rng.integers(2)))
    fixed = symbolic.as_integers(symbolic.numeric(m))
    b, s, t = (
        np.asarray(v, float)
        for v in (rng.integers(1, 33, 8), rng.integers(64, 8193, 8), rng.choice([1, 2, 4, 8], 8))
    )
    compiled = costs.compiled(m)(b, s, t)
    assert isinstance(costs.transient_bytes, sp.Max)
    for name in ("transient_bytes", "selective_backward_bytes"):  # the latter: a Max of several ops
        expr = getattr(costs, name)
        sympys = sp.lambdify((symbolic.b, symbolic.s, symbolic.t), expr.xreplace(fixed), "numpy")(b, s, t)
        np.testing.assert_array_equal(compiled[name], np.broadcast_to(sympys, compiled[name].shape))
    terms = [
        sp.lambdify((symbolic.b, symbolic.s, symbolic.t), term.xreplace(fixed), "numpy")
        for term in costs.transient_bytes.args
    ]
    values = np.array([np.broadcast_to(f(b, s, t), b.shape) for f in terms])
    largest = int(np.argmax(values.max(axis=1)))
    without = np.max(np.delete(values, largest, axis=0), axis=0)
    assert not np.array_equal(without, compiled["transient_bytes"])
