"""Plans Megatron-LM can run, searched exhaustively and priced by Mist's cost model.

Megatron-LM (at the pinned megatron-core's release) gives every stage one TP and DP; splits the
layers evenly or with the first and last stage uneven (``--decoder-first/last-pipeline-num-layers``);
recomputes whole layers by block (the first k layers of every stage; k = all: every layer); shards
the optimizer state with its distributed optimizer (ZeRO-1) or not at all; and offloads one fraction
of the optimizer (only its distributed one). ``MegatronLMSpace`` says which of those choices a search
tries. Every plan it makes exports (``mist.export``): ``mist plan --target megatron-lm`` searches the
widest space, the Megatron-LM grid baseline (``baselines/megatron/grid.py``) the choices its users tune.

For each setting (TP, DP, micro-batch, split, ZeRO, offload fraction) the smallest block k that fits
is the fastest (recomputation only adds time), found by bisection; the fastest setting that fits wins.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..model.interference import Interference
from ..model.runtime import RuntimeModel
from ..model.specs import ClusterSpec, ModelSpec
from ..plan import Plan, StagePlan
from .planner import NoFeasiblePlan, cost_models, predict


@dataclass(frozen=True)
class MegatronLMSpace:
    """Which of Megatron-LM's choices a search tries."""

    micro_batches: tuple[int, ...] | None = None  # None: every divisor of the sequences per replica
    uneven: int | None = None  # the first/last stage within this many layers of the rest (None: any)
    zero: tuple[int, ...] = (0, 1)  # 1: the distributed optimizer
    offload_fractions: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # of the optimizer's state
    pipeline_powers_of_two: bool = False  # stages: powers of two only, or every divisor
    recompute: bool = True  # block recomputation tried (else none)

    def __post_init__(self) -> None:
        if self.micro_batches is not None and not all(
            isinstance(b, int) and b > 0 for b in self.micro_batches
        ):
            raise ValueError(f"micro_batches must be whole numbers > 0, got {self.micro_batches}")
        if not set(self.zero) <= {0, 1}:
            raise ValueError(f"Megatron-LM's ZeRO is 0 or 1 (its distributed optimizer), got {self.zero}")
        if not all(0.0 <= f <= 1.0 for f in self.offload_fractions):
            raise ValueError(f"offload fractions must be in [0, 1], got {self.offload_fractions}")


@dataclass(frozen=True)
class MegatronLMSetting:
    """One point of the space, before recomputation is chosen."""

    tp: int
    dp: int
    micro_batch: int
    split: tuple[int, ...]  # layers per stage
    zero: int
    offload_optimizer: float


def powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


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


def settings(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, space: MegatronLMSpace
) -> Iterator[MegatronLMSetting]:
    """Every setting of ``space``: TP a power of two within a node dividing the heads, stages
    dividing the rest, DP what is left; the distributed optimizer only at DP > 1, optimizer offload
    only with it (at DP 1 it shards nothing, so ZeRO-0 there is the same plan)."""
    n = cluster.gpus
    for tp in powers_of_two(cluster.gpus_per_node):
        if n % tp or model.heads % tp or model.kv % tp:
            continue
        stage_counts = powers_of_two(n // tp) if space.pipeline_powers_of_two else range(1, n // tp + 1)
        for pp in stage_counts:
            if (n // tp) % pp or pp > model.layers:
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            micro_batches = space.micro_batches or [
                b for b in range(1, per_replica + 1) if per_replica % b == 0
            ]
            for split in layer_splits(model.layers, pp, space.uneven):
                for mb, zero, offload in itertools.product(
                    micro_batches, space.zero, space.offload_fractions
                ):
                    if per_replica % mb or (zero and dp == 1) or (offload and not zero and dp > 1):
                        continue
                    yield MegatronLMSetting(tp, dp, mb, split, zero, offload)


def setting_plan(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, setting: MegatronLMSetting, recompute: int
) -> Plan:
    """``setting`` with block recomputation of the first ``recompute`` layers of every stage."""
    stages = [StagePlan(layers=n, recompute=min(recompute, n), zero=setting.zero,
                        offload_optimizer=setting.offload_optimizer) for n in setting.split]  # fmt: skip
    return Plan.of(model, cluster, global_batch=global_batch, tp=setting.tp, dp=setting.dp,
                   micro_batch=setting.micro_batch, stages=stages)  # fmt: skip


def space_plans(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, space: MegatronLMSpace
) -> Iterator[Plan]:
    """Every plan of ``space`` (unpriced): each setting with every block-recompute count."""
    for setting in settings(model, cluster, global_batch, space):
        for k in range(max(setting.split) + 1):
            yield setting_plan(model, cluster, global_batch, setting, k)


def check_model(model: ModelSpec) -> None:
    """Raises ValueError if Megatron-LM has no model of this shape (before any search)."""
    if model.parallel_block:
        raise ValueError(
            f"{model.name}: Megatron-LM has no layer with attention and MLP in parallel on one norm "
            "(Falcon); plan it with --no-parallel-block, or without --target"
        )


def search_megatron_lm(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    space: MegatronLMSpace | None = None,
    runtime: RuntimeModel | None = None,
    interference: Interference | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The fastest plan of ``space`` that fits, priced by the closed form (as Mist's search ranks);
    raises NoFeasiblePlan if none fits. The model is not checked (``check_model``): the grid baseline
    prices Falcon's parallel block as if Megatron-LM had it, so that every system is priced on the
    same model, and ``mist.export`` refuses it."""
    space = space or MegatronLMSpace()
    runtime, interference = cost_models(cluster, runtime, interference)
    what = f"no Megatron-LM configuration of {model.name} fits {cluster.gpus} x {cluster.gpu.name}"

    best = [float("inf")]  # the fastest fitting time so far, for pruning

    def leanest_fitting() -> Iterator[Plan]:
        """Per setting, the plan with the fewest recomputed layers that fits (bisection), or the
        full-recompute plan when none fits (so the no-fit message can say what is needed).
        Recomputation only adds time, so a setting whose plan without any is no faster than the
        best so far is skipped unpriced further (the space is 10^4-10^5 settings)."""
        # the most even splits first: they are usually near the best, which then prunes the rest
        spread = lambda s: max(s.split) - min(s.split)
        ordered = sorted(settings(model, cluster, global_batch, space), key=spread)
        for n, setting in enumerate(ordered):
            if progress and n % 5000 == 0:
                progress(f"[{n}/{len(ordered)} settings] best {best[0]:.3f} s")
            lo, hi = 0, max(setting.split) if space.recompute else 0

            def priced(k: int, setting: MegatronLMSetting = setting) -> Plan:
                plan = setting_plan(model, cluster, global_batch, setting, k)
                return predict(plan, model, cluster, runtime, interference, simulate=False)

            fastest = priced(lo)
            if fastest.predicted_iteration_s >= best[0]:
                continue
            plan = fastest if fastest.breakdown["fits"] else priced(hi)
            if not plan.breakdown["fits"]:
                yield plan
                continue
            while lo < hi:  # memory falls as k grows: the smallest k that fits
                mid = (lo + hi) // 2
                if priced(mid).breakdown["fits"]:
                    hi = mid
                else:
                    lo = mid + 1
            plan = priced(lo)
            best[0] = min(best[0], plan.predicted_iteration_s)
            yield plan

    return cheapest_fitting(leanest_fitting(), model, cluster, runtime, interference, what)


def cheapest_fitting(
    plans: Iterable[Plan],
    model: ModelSpec,
    cluster: ClusterSpec,
    runtime: RuntimeModel,
    interference: Interference,
    what: str,
) -> Plan:
    """Price every plan (closed form); the fastest that fits memory, timed as the search.
    Raises NoFeasiblePlan with ``what`` and the memory the leanest plan needs."""
    start = time.perf_counter()
    best, tried, lowest = None, 0, float("inf")
    for plan in plans:
        predict(plan, model, cluster, runtime, interference, simulate=False)
        tried += 1
        lowest = min(lowest, max(s.memory_bytes for s in plan.stages))
        if plan.breakdown["fits"] and (
            best is None or plan.predicted_iteration_s < best.predicted_iteration_s
        ):
            best = plan
    if best is None:
        raise NoFeasiblePlan(f"{what} ({tried} tried; the leanest needs {lowest / 2**30:.1f} GiB per GPU)")
    best.tuning_s = time.perf_counter() - start
    return best
