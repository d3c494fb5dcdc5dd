"""Exhaustive searches of a trainer's space of plans (``megatron_lm``, ``torchtitan``): the sizes
they enumerate, and the one pruned search over settings that each choose a recompute count.

Each setting (parallel sizes, micro-batch, split, ZeRO, offloading) is priced with an ascending
list of recompute counts; time grows along it and memory falls from its second count on, so the
smallest count that fits is the setting's fastest plan (the first count, else bisection), and a
setting whose plan without recomputation is no faster than the best so far is skipped, as is one
whose TP, DP, micro-batch and stage count cannot beat it by the planner's own lower bound (the
spaces hold 10^4-10^5 settings). Every plan is priced
by Mist's closed form, as Mist's own search ranks.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from measure.units import format_bytes

from ..model.interference import Interference
from ..model.runtime import RuntimeModel
from ..model.specs import GRAD_ACCUMULATION, ClusterSpec, GradAccumulation, ModelSpec
from ..plan import Plan, grad_accum
from .planner import NoFeasiblePlan, StageMemo, layer_s, lower_bound_s, predict_for, prime
from .problem import Candidate, Problem

S = TypeVar("S", bound="Sizes")
# settings whose stages are evaluated together (``prime``): consecutive settings of a space share
# their stages' sizes, so a batch needs a few array calls; larger batches prune less (the best
# plan so far is older), smaller ones call more
BATCH = 256


def layer_splits(layers: int, pp: int, uneven: int | None = None) -> list[tuple[int, ...]]:
    """Layers per stage as Megatron-LM can split them: even, or the first and last stage uneven
    (within ``uneven`` layers of the even share; None: any) with the middle stages even."""
    if pp == 1:
        return [(layers,)]
    per = layers // pp
    reach = per if uneven is None else uneven
    out = set()
    for first, last in itertools.product(range(max(1, per - reach), per + reach + 1), repeat=2):
        middle = layers - first - last
        if pp == 2 and middle == 0:
            out.add((first, last))
        elif pp > 2 and middle > 0 and middle % (pp - 2) == 0:
            out.add((first, *[middle // (pp - 2)] * (pp - 2), last))
    return sorted(out, key=lambda split: (len(set(split)) > 1, split))


class Sizes(Protocol):
    """What a setting has that bounds its time: its TP, DP, micro-batch and layers per stage (and,
    where it has them, its ``virtual`` chunks a rank)."""

    tp: int
    dp: int
    micro_batch: int
    split: tuple[int, ...]


def lower_bound(problem: Problem) -> Callable[[Sizes], float]:
    """A lower bound on a setting's iteration: the planner's (``planner.lower_bound_s``, a
    balanced split), once per TP, DP, micro-batch and stage count, and where the split is uneven
    G m p + (L - m) p / V, m its largest stage's layers. A stage of l layers takes at least l p a
    micro-batch (p: a layer's forward and backward), and ``pipeline_objective`` is at least
    G max T + (sum T - max T) / V >= (G - 1/V) max T + L p / V >= G m p + (L - m) p / V: the
    Megatron-LM space's uneven splits, most of its settings, are priced only where they could
    win."""

    @functools.cache
    def of(tp: int, dp: int, micro_batch: int, stages: int, virtual: int) -> float:
        return lower_bound_s(problem, Candidate(tp, stages, dp, micro_batch, problem.global_batch, virtual))

    per_layer = functools.cache(functools.partial(layer_s, problem))

    def bound(sizes: Sizes) -> float:
        virtual = getattr(sizes, "virtual", 1)
        balanced = of(sizes.tp, sizes.dp, sizes.micro_batch, len(sizes.split), virtual)
        if len(set(sizes.split)) == 1:
            return balanced
        largest, p = max(sizes.split), per_layer(sizes.tp, sizes.dp, sizes.micro_batch)
        micro_batches = grad_accum(problem.global_batch, sizes.dp, sizes.micro_batch)
        layers = problem.model.layers
        return max(balanced, micro_batches * largest * p + (layers - largest) * p / virtual)

    return bound


def fastest_fitting(
    global_batch: int,
    settings: list[S],
    plan_of: Callable[[S, int], Plan],
    counts: Callable[[S], list[int]],
    model: ModelSpec,
    cluster: ClusterSpec,
    runtime: RuntimeModel | None,
    interference: Interference | None,
    progress: Callable[[str], None] | None,
    what: str,
    variants: Callable[[S], list[S]] = lambda setting: [],
    grad_accumulation: GradAccumulation = GRAD_ACCUMULATION["megatron-core"],
) -> Plan:
    """The fastest plan that fits over ``settings`` (searched in that order: put likely winners
    first), each with ``plan_of(setting, k)`` for k in ``counts(setting)`` (ascending recompute).
    A setting is skipped unpriced when the planner's lower bound for its TP, DP, micro-batch and
    stage count is no faster than the best so far. ``variants(setting)``: settings that differ
    from it only in time, never in memory (e.g. where the weights are gathered): each is priced
    at the count the setting needs, not searched again. Raises NoFeasiblePlan with ``what`` and
    the memory the leanest plan needs. ``grad_accumulation``: how the trainer that runs the plans
    accumulates gradients (as ``predict``'s)."""
    problem = Problem.resolve(model, cluster, global_batch, runtime, interference, grad_accumulation)
    search = _FittingSearch(problem, settings, plan_of, counts, variants, progress)
    return cheapest_fitting(search.leanest_fitting(), problem, what, search.memo)


@dataclass
class _FittingSearch(Generic[S]):
    """``fastest_fitting``'s pruned search: the stages priced so far (the same stage recurs in many
    plans of a space) and the best fitting time so far, which the pruning reads and every fitting
    plan lowers."""

    problem: Problem
    settings: list[S]
    plan_of: Callable[[S, int], Plan]
    counts: Callable[[S], list[int]]
    variants: Callable[[S], list[S]]
    progress: Callable[[str], None] | None
    memo: StageMemo = field(default_factory=dict)
    best: float = float("inf")

    def __post_init__(self) -> None:
        self.bound = lower_bound(self.problem)

    def priced(self, setting: S, count: int) -> Plan:
        return predict_for(self.problem, self.plan_of(setting, count), simulate=False, memo=self.memo)

    def with_variants(self, setting: S, count: int) -> list[Plan]:
        """The setting's plan at ``count`` and its variants' (the same memory)."""
        return [self.priced(same_memory, count) for same_memory in (setting, *self.variants(setting))]

    def fitting(self, plans: list[Plan]) -> Iterator[Plan]:
        for plan in plans:
            if plan.breakdown["fits"]:
                self.best = min(self.best, plan.predicted_iteration_s)
                yield plan

    def prime_counts(self, batch: list[S], counts_of: Callable[[S], list[int]]) -> None:
        """Evaluate together the stages of every setting of ``batch`` (and its variants) at each
        count of ``counts_of(setting)``."""
        plans = [
            self.plan_of(same, count)
            for setting in batch
            for count in counts_of(setting)
            for same in (setting, *self.variants(setting))
        ]
        prime(self.problem, plans, self.memo)

    def leanest_fitting(self) -> Iterator[Plan]:
        """Per setting, the plan with the fewest recomputed layers that fits (and its variants'),
        or the leanest plan when none fits (so the no-fit message can say what is needed). The
        settings go in batches, each batch's stages evaluated together (``prime``): first every
        setting's first count, then every count of those that need a bisection."""
        settings, counts = self.settings, self.counts
        for start in range(0, len(settings), BATCH):
            if self.progress and start % (20 * BATCH) == 0:
                self.progress(f"[{start}/{len(settings)} settings] best {self.best:.3f} s")
            batch = [
                setting for setting in settings[start : start + BATCH] if self.bound(setting) < self.best
            ]
            self.prime_counts(batch, lambda setting: counts(setting)[:1])
            bisect = []
            for setting in batch:
                if self.bound(setting) >= self.best:
                    continue
                fastest = self.with_variants(setting, counts(setting)[0])
                if min(plan.predicted_iteration_s for plan in fastest) >= self.best:
                    continue
                if fastest[0].breakdown["fits"]:  # time grows along the counts: nothing faster
                    yield from self.fitting(fastest)
                else:
                    bisect.append(setting)
            self.prime_counts(bisect, lambda setting: counts(setting)[1:])
            for setting in bisect:
                yield from self.fitting_count(setting, counts(setting))

    def fitting_count(self, setting: S, its_counts: list[int]) -> Iterator[Plan]:
        """The setting's plan (and variants') at the smallest count after the first that fits, by
        bisection; its leanest plan if none does."""
        plan = self.priced(setting, its_counts[-1])
        if not plan.breakdown["fits"]:
            yield plan
            return
        count = first_fitting(its_counts, lambda count: self.priced(setting, count).breakdown["fits"])
        yield from self.fitting(self.with_variants(setting, count))


def first_fitting(counts: list[int], fits: Callable[[int], bool]) -> int:
    """The smallest count of ``counts`` after the first for which ``fits``, by bisection, given that
    the last one fits. Memory falls along counts from the second count on; the first recomputed layer
    may add more to backward's peak (its recomputed activations) than it saves, so the first count
    is checked on its own (by the caller) and the bisection starts after it."""
    lo, hi = 1, len(counts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(counts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return counts[lo]


def cheapest_fitting(
    plans: Iterable[Plan], problem: Problem, what: str, memo: StageMemo | None = None
) -> Plan:
    """Price every plan (closed form) against ``problem``; the fastest that fits memory, timed as
    the search. Raises NoFeasiblePlan with ``what`` and the memory the leanest plan needs."""
    start = time.perf_counter()
    best, tried, lowest = None, 0, float("inf")
    for plan in plans:
        predict_for(problem, plan, simulate=False, memo=memo)
        tried += 1
        lowest = min(lowest, max(stage.memory_bytes for stage in plan.stages))
        if plan.breakdown["fits"] and (
            best is None or plan.predicted_iteration_s < best.predicted_iteration_s
        ):
            best = plan
    if best is None:
        raise NoFeasiblePlan(f"{what} ({tried} tried; the leanest needs {format_bytes(lowest)} per GPU)")
    best.tuning_s = time.perf_counter() - start
    return best
