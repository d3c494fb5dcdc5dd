"""Megatron-LM practice: a grid over what its users tune, costed with Mist's own model.

dp x tp x pp = GPUs (powers of two, TP within a node), micro-batch {1, 2, 4, 8}, the
distributed optimizer (ZeRO-1) on or off, layers split evenly over the stages or with the first
and last stage uneven (``--decoder-first/last-pipeline-num-layers``, the middle ones even), and
block recomputation (``--recompute-method block --recompute-num-layers k``: the first k layers
of every stage recompute; k = all is full recomputation). For each setting the smallest k that
fits memory is the fastest (recomputation only adds time), found by bisection. The fastest plan
that fits wins. The same cost model prices every system, so a speedup over this baseline comes
from the plan, not the model.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from mist.engine.megatron import megatron_limits, model_settings
from mist.model.interference import Interference
from mist.model.runtime import RuntimeModel
from mist.model.specs import ClusterSpec, ModelSpec
from mist.plan import Plan, StagePlan
from mist.tuning.planner import NoFeasiblePlan, cost_models, predict

MICRO_BATCHES = (1, 2, 4, 8)
UNEVEN = 2  # the first and last stage may hold up to this many layers fewer or more than the rest


def powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def layer_splits(layers: int, pp: int) -> list[tuple[int, ...]]:
    """Layers per stage as Megatron-LM can split them: even, or the first and last stage uneven
    with the middle stages even."""
    if pp == 1:
        return [(layers,)]
    out = []
    per = layers // pp
    for first, last in itertools.product(range(max(1, per - UNEVEN), per + UNEVEN + 1), repeat=2):
        middle = layers - first - last
        if pp == 2:
            if middle == 0:
                out.append((first, last))
        elif middle > 0 and middle % (pp - 2) == 0:
            out.append((first, *[middle // (pp - 2)] * (pp - 2), last))
    return sorted(set(out), key=lambda split: (len(set(split)) > 1, split))


def grid_settings(model: ModelSpec, cluster: ClusterSpec, global_batch: int) -> Iterator[tuple]:
    """Every (tp, dp, micro-batch, layers per stage, zero) the grid considers."""
    n = cluster.gpus
    for tp, pp in itertools.product(powers_of_two(cluster.gpus_per_node), powers_of_two(n)):
        if n % (tp * pp) or model.heads % tp or model.kv % tp or pp > model.layers:
            continue
        dp = n // (tp * pp)
        for split in layer_splits(model.layers, pp):
            for mb, zero in itertools.product(MICRO_BATCHES, (0, 1)):
                if global_batch % (dp * mb) or (zero and dp == 1):
                    continue
                yield tp, dp, mb, split, zero


def grid_plan(model, cluster, global_batch, setting: tuple, recompute: int) -> Plan:
    """A grid setting with block recomputation of the first ``recompute`` layers of every stage."""
    tp, dp, mb, split, zero = setting
    stages = [StagePlan(layers=n, recompute=min(recompute, n), zero=zero) for n in split]
    return Plan.of(model, cluster, global_batch=global_batch, tp=tp, dp=dp, micro_batch=mb, stages=stages)


def grid_plans(model: ModelSpec, cluster: ClusterSpec, global_batch: int) -> Iterator[Plan]:
    """Every configuration of the grid (unpriced): each setting with every block-recompute count."""
    for setting in grid_settings(model, cluster, global_batch):
        for k in range(max(setting[3]) + 1):
            yield grid_plan(model, cluster, global_batch, setting, k)


def search_grid(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    runtime: RuntimeModel | None = None,
    interference: Interference | None = None,
) -> Plan:
    runtime, interference = cost_models(cluster, runtime, interference)
    what = f"no Megatron-LM grid configuration of {model.name} fits {cluster.gpus} x {cluster.gpu.name}"

    def leanest_fitting() -> Iterator[Plan]:
        """Per setting, the plan with the fewest recomputed layers that fits (bisection), or the
        full-recompute plan when none fits (so the no-fit message can say what is needed)."""
        for setting in grid_settings(model, cluster, global_batch):
            lo, hi = 0, max(setting[3])

            def priced(k: int, setting: tuple = setting) -> Plan:
                plan = grid_plan(model, cluster, global_batch, setting, k)
                return predict(plan, model, cluster, runtime, interference, simulate=False)

            plan = priced(hi)
            if not plan.breakdown["fits"]:
                yield plan
                continue
            while lo < hi:  # memory falls as k grows: the smallest k that fits
                mid = (lo + hi) // 2
                if priced(mid).breakdown["fits"]:
                    hi = mid
                else:
                    lo = mid + 1
            yield priced(lo)

    return cheapest_fitting(leanest_fitting(), model, cluster, runtime, interference, what)


def cheapest_fitting(plans, model, cluster, runtime, interference, what: str) -> Plan:
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


# Megatron-LM's flags for megatron-core's settings (mist.megatron.model_settings) that take a value
MEGATRON_LM_FLAGS = (
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("max_sequence_length", "--seq-length"),
    ("max_sequence_length", "--max-position-embeddings"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("hidden_dropout", "--hidden-dropout"),
    ("attention_dropout", "--attention-dropout"),
)


def megatron_args(plan: Plan, model: ModelSpec) -> tuple[list[str], list[str]]:
    """Megatron-LM command-line arguments for ``plan``, and the plan's choices it cannot express
    (stages that all share a TP and DP other than the plan's: written at the plan's level)."""
    plan = plan.with_stage_parallelism_lifted()
    settings = model_settings(plan, model)
    args = [
        f"--micro-batch-size {plan.micro_batch}",
        f"--global-batch-size {plan.global_batch}",
        "--bf16",
        *(f"{flag} {settings[field]}" for field, flag in MEGATRON_LM_FLAGS),
    ]
    if not settings["add_bias_linear"]:
        args.append("--disable-bias-linear")
    if settings["sequence_parallel"]:
        args.append("--sequence-parallel")
    if model.flash:
        args.append("--use-flash-attn")
    if settings["normalization"] != "LayerNorm":
        args.append(f"--normalization {settings['normalization']}")
    if settings["gated_linear_unit"]:
        args.append("--swiglu")  # gated, SiLU: what --swiglu sets
    if settings["position_embedding_type"] != "learned_absolute":
        args.append(f"--position-embedding-type {settings['position_embedding_type']}")
    if settings["num_query_groups"] != settings["num_attention_heads"]:
        args += ["--group-query-attention", f"--num-query-groups {settings['num_query_groups']}"]
    cannot = list(megatron_limits(plan, model).values())
    stages = plan.stages
    even_middle = len({s.layers for s in stages[1:-1]}) <= 1  # else refused in megatron_limits
    if settings["num_layers_in_first_pipeline_stage"] is not None and even_middle:
        args += [
            f"--decoder-first-pipeline-num-layers {settings['num_layers_in_first_pipeline_stage']}",
            f"--decoder-last-pipeline-num-layers {settings['num_layers_in_last_pipeline_stage']}",
        ]
    block = max(s.recompute for s in stages)  # block recomputation: the first k layers of each stage
    if block == 0:
        pass
    elif all(s.recompute == s.layers for s in stages):
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif all(s.recompute == min(block, s.layers) for s in stages):
        args += [
            "--recompute-granularity full",
            "--recompute-method block",
            f"--recompute-num-layers {block}",
        ]
    else:
        cannot.append(f"a different number of recomputed layers per stage {[s.recompute for s in stages]}")
    zero = {s.zero for s in stages}
    if zero - {0, 1}:
        cannot.append("ZeRO stage 2/3 (Megatron-LM's distributed optimizer shards optimizer state only)")
    elif zero == {1}:
        args.append("--use-distributed-optimizer")
    elif len(zero) > 1:
        cannot.append("the distributed optimizer on some stages only")
    offload = {s.offload_optimizer for s in stages}
    if len(offload) == 1 and offload != {0.0}:
        args += ["--optimizer-cpu-offload", f"--optimizer-offload-fraction {offload.pop()}"]
    elif len(offload) > 1:
        cannot.append("a different optimizer offload fraction per stage")
    if any(s.offload_activations for s in stages):
        cannot.append("offloading activations to the CPU")
    return args, cannot
