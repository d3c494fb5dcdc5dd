"""Aceso-style search (Liu et al., EuroSys 2024): iterative bottleneck alleviation.

From a balanced start (even layers, one TP x DP shape for all stages) the search finds the
bottleneck -- a stage out of memory, else the slowest stage -- and tries the actions that can
relieve it: move a layer to a neighbour, recompute one layer more or less, trade TP for DP
inside the stage, move devices between the stage and a neighbour, change the micro-batch size.
It takes the best improving action; when none improves, the best two-action sequence
(multi-hop). It stops when nothing improves or its budget is spent. Aceso's own space: no
ZeRO-2/3, no offloading. Every candidate is priced with Mist's model.

Aceso gives its search a time budget; this one's is counted in plans priced, so that what it finds
does not depend on the machine's speed or load (a wall-clock budget moved a committed result by
2% between two runs on one machine). ``tuning_s`` still reports the seconds it took.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass

from mist.model.interference import Interference
from mist.model.runtime import RuntimeModel
from mist.model.specs import ClusterSpec, ModelSpec
from mist.plan import Plan, StagePlan, tp_splits
from mist.tuning.planner import NoFeasiblePlan, cost_models, predict
from mist.tuning.problem import powers_of_two


def _key(plan: Plan) -> tuple:
    stages = tuple((s.layers, s.recompute, s.tp or plan.tp, s.dp or plan.dp) for s in plan.stages)
    return (plan.micro_batch, plan.dp, *stages)


def _score(plan: Plan) -> tuple:
    """Feasible plans first (memory excess in bytes), then faster; among equally fast plans the
    one whose slowest stages are faster (so relieving one of several equal bottlenecks counts
    as progress, as in Aceso)."""
    over = max(s.memory_bytes for s in plan.stages) - plan.breakdown["usable_memory_bytes"]
    stage_times = tuple(sorted((s.steady_s for s in plan.stages), reverse=True))
    return (max(over, 0), plan.predicted_iteration_s, stage_times)


class _Pricer:
    """Prices plans once each; ``priced``: how many distinct plans it has priced (the budget's unit)."""

    def __init__(self, model, cluster, runtime, interference) -> None:
        self.args = (model, cluster, runtime, interference)
        self.cache: dict[tuple, Plan | None] = {}

    @property
    def priced(self) -> int:
        return len(self.cache)

    def __call__(self, plan: Plan) -> Plan | None:
        key = _key(plan)
        if key not in self.cache:
            try:
                self.cache[key] = predict(plan, *self.args, simulate=False)
            except ValueError:  # an action produced a plan that cannot exist (e.g. uneven DP split)
                self.cache[key] = None
        return self.cache[key]


def _actions(plan: Plan, i: int, cluster: ClusterSpec) -> Iterator[Plan]:
    """Plans one action away that change the bottleneck stage i."""
    stages = plan.stages
    for j in (i - 1, i + 1):  # move a layer to a neighbour
        if 0 <= j < len(stages) and stages[i].layers > 1:
            new = copy.deepcopy(plan)
            new.stages[i].layers -= 1
            new.stages[j].layers += 1
            new.stages[i].recompute = min(new.stages[i].recompute, new.stages[i].layers)
            yield new
    if len(stages) > 2 and stages[i].layers > 1:  # multi-hop: pass a layer down the pipeline to the
        # least-loaded stage, every stage in between handing one on (their counts stay the same)
        load = (
            [s.memory_bytes for s in stages]
            if plan.breakdown.get("fits") is False
            else [s.steady_s for s in stages]
        )
        j = min((k for k in range(len(stages)) if abs(k - i) > 1), key=lambda k: load[k], default=None)
        if j is not None:
            new = copy.deepcopy(plan)
            new.stages[i].layers -= 1
            new.stages[j].layers += 1
            new.stages[i].recompute = min(new.stages[i].recompute, new.stages[i].layers)
            yield new
    for delta in (-1, 1):  # recompute one layer more or less
        r = stages[i].recompute + delta
        if 0 <= r <= stages[i].layers:
            new = copy.deepcopy(plan)
            new.stages[i].recompute = r
            yield new
    tp, dp, _ = plan.stage_parallelism(i)
    for new_tp, new_dp in ((tp * 2, dp // 2), (tp // 2, dp * 2)):  # trade TP for DP in the stage
        if new_tp >= 1 and new_dp >= 1 and new_tp * new_dp == tp * dp and new_tp <= cluster.gpus_per_node:
            new = copy.deepcopy(plan)
            new.stages[i].tp, new.stages[i].dp = new_tp, new_dp
            yield new
    for j in (i - 1, i + 1):  # take half a neighbour's replicas
        if 0 <= j < len(stages):
            tp_j, dp_j, _ = plan.stage_parallelism(j)
            if dp_j >= 2 and tp_j == tp:
                new = copy.deepcopy(plan)
                new.stages[j].tp, new.stages[j].dp = tp_j, dp_j // 2
                new.stages[i].tp, new.stages[i].dp = tp, dp + dp_j // 2
                yield new
    for mb in (plan.micro_batch * 2, plan.micro_batch // 2):  # micro-batch size
        if mb >= 1 and plan.global_batch % (plan.dp * mb) == 0:
            new = copy.deepcopy(plan)
            new.micro_batch = mb
            yield new


def _bottleneck(plan: Plan) -> int:
    usable = plan.breakdown["usable_memory_bytes"]
    over = [s.memory_bytes - usable for s in plan.stages]
    if max(over) > 0:
        return max(range(len(over)), key=over.__getitem__)
    return max(range(len(plan.stages)), key=lambda i: plan.stages[i].steady_s)


def alleviate(start: Plan, price: _Pricer, cluster: ClusterSpec, max_priced: int) -> tuple[Plan | None, bool]:
    """(the plan the bottleneck alleviation ends at, whether it ended because nothing improved)
    from ``start``, stopping once ``price`` has priced ``max_priced`` plans in all."""
    current = price(start)
    if current is None:
        return None, True
    while price.priced < max_priced:
        i = _bottleneck(current)
        one_hop = [p for p in (price(a) for a in _actions(current, i, cluster)) if p is not None]
        better = [p for p in one_hop if _score(p) < _score(current)]
        if not better:  # multi-hop: the best two-action sequence from the three best first actions
            for first in sorted(one_hop, key=_score)[:3]:
                if price.priced >= max_priced:
                    break
                j = _bottleneck(first)
                better += [p for p in (price(a) for a in _actions(first, j, cluster)) if p is not None]
            better = [p for p in better if _score(p) < _score(current)]
        if not better:
            return current, True
        current = min(better, key=_score)
    return current, False


@dataclass(frozen=True)
class AcesoSearch:
    """What the search found: the plan, the distinct plans it priced, and whether every start's
    alleviation ended because nothing improved (False: the budget stopped one)."""

    plan: Plan
    priced: int
    converged: bool


DEFAULT_MAX_PRICED = 2000  # more than any of the comparison's 60 cases prices to converge (at most 1,285)


def search_aceso(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    max_priced: int = DEFAULT_MAX_PRICED,
    runtime: RuntimeModel | None = None,
    interference: Interference | None = None,
) -> AcesoSearch:
    """The best plan found from balanced starts (one per pipeline depth), pricing at most
    ``max_priced`` distinct plans, with how much of that budget it used."""
    if isinstance(max_priced, bool) or not isinstance(max_priced, int) or max_priced < 1:
        raise ValueError(f"the Aceso-style search's budget is a positive number of plans, got {max_priced!r}")
    runtime, interference = cost_models(cluster, runtime, interference)
    price = _Pricer(model, cluster, runtime, interference)
    start_time = time.perf_counter()
    starts = []
    for pp in powers_of_two(min(cluster.gpus, model.layers)):
        if cluster.gpus % pp:
            continue
        per_stage = cluster.gpus // pp
        tp = min(per_stage, cluster.gpus_per_node)
        while tp > 1 and (not tp_splits(model, tp) or global_batch % (per_stage // tp)):
            tp //= 2
        dp = per_stage // tp
        if global_batch % dp:
            continue
        base, extra = divmod(model.layers, pp)
        stages = [StagePlan(layers=base + (k < extra), recompute=base + (k < extra)) for k in range(pp)]
        starts.append(
            # Aceso runs on Megatron-LM: the gradient reduction overlapped, as the grid's
            Plan.of(
                model,
                cluster,
                global_batch=global_batch,
                tp=tp,
                dp=dp,
                micro_batch=1,
                stages=stages,
                overlap_grad_reduce=True,
            )
        )
    if not starts:
        raise NoFeasiblePlan(
            f"no balanced start for {model.name} on {cluster.gpus} GPUs with global batch {global_batch}"
        )
    best, converged = None, True
    for k, plan in enumerate(starts):  # share the budget among the starts (what one leaves, the next may use)
        found, done = alleviate(plan, price, cluster, max_priced * (k + 1) // len(starts))
        converged = converged and done
        if found is not None and found.breakdown["fits"] and (best is None or _score(found) < _score(best)):
            best = found
    if best is None:
        raise NoFeasiblePlan(
            f"the Aceso-style search found no plan of {model.name} that fits "
            f"{cluster.gpus} x {cluster.gpu.name}"
        )
    best = copy.deepcopy(best)
    best.tuning_s = time.perf_counter() - start_time
    return AcesoSearch(best, price.priced, converged)
