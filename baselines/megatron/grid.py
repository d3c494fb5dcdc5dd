"""Megatron-LM practice: a grid over what its users tune, costed with Mist's own model.

dp x tp x pp = GPUs (powers of two, TP within a node), micro-batch {1, 2, 4, 8}, the
distributed optimizer (ZeRO-1) on or off, its state offloaded to the CPU by a fraction of 0, 1/4,
1/2, 3/4 or 1 (``--optimizer-cpu-offload --optimizer-offload-fraction``, with the distributed
optimizer), layers split evenly over the stages or with the first and last stage uneven by up to
two layers (``--decoder-first/last-pipeline-num-layers``, the middle ones even), interleaved
pipelines with the stages even (``--num-virtual-stages-per-pipeline-rank``: every number of
chunks that divides a stage's layers, where the micro-batches are a multiple of the stages), and
block recomputation (``--recompute-method block --recompute-num-layers k``: the first k layers of every
stage recompute; k = all is full recomputation). The search is
Mist's exhaustive search of Megatron-LM's space (``mist.tuning.megatron_lm``) over this part of
it. The same cost model prices every system, so a speedup over this baseline comes from the plan,
not the model.
"""

from __future__ import annotations

from collections.abc import Iterator

from mist.model.interference import Interference
from mist.model.runtime import RuntimeModel
from mist.model.specs import ClusterSpec, ModelSpec
from mist.plan import Plan
from mist.tuning.megatron_lm import MegatronLMSpace, search_megatron_lm, space_plans

GRID = MegatronLMSpace(micro_batches=(1, 2, 4, 8), uneven=2, pipeline_powers_of_two=True)


def grid_plans(model: ModelSpec, cluster: ClusterSpec, global_batch: int) -> Iterator[Plan]:
    """Every configuration of the grid (unpriced): each setting with every block-recompute count."""
    return space_plans(model, cluster, global_batch, GRID)


def search_grid(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    runtime: RuntimeModel | None = None,
    interference: Interference | None = None,
) -> Plan:
    """The grid's fastest plan that fits (NoFeasiblePlan if none does)."""
    return search_megatron_lm(model, cluster, global_batch, GRID, runtime, interference)
