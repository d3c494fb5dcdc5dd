"""ZeRO-3 (DeepSpeed-style) data parallelism: every GPU a replica, weights, gradients and
optimizer state sharded over all of them; micro-batch and full recomputation tuned; costed
with Mist's model (a one-stage plan with ZeRO stage 3)."""

from __future__ import annotations

from mist.model.interference import Interference
from mist.model.runtime import RuntimeModel
from mist.model.specs import ClusterSpec, ModelSpec
from mist.plan import Plan, StagePlan
from mist.tuning.exhaustive import cheapest_fitting
from mist.tuning.problem import Problem

MICRO_BATCHES = (1, 2, 4, 8, 16)


def search_zero3(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    runtime: RuntimeModel | None = None,
    interference: Interference | None = None,
) -> Plan:
    problem = Problem.resolve(model, cluster, global_batch, runtime, interference)
    dp = cluster.gpus

    def plans():
        for mb in MICRO_BATCHES:
            if global_batch % (dp * mb) == 0:
                for recompute in (0, model.layers):
                    stage = StagePlan(layers=model.layers, recompute=recompute, zero=3)
                    # (ZeRO-3 reduce-scatters by layer in backward: the flag changes nothing)
                    fields = {
                        "global_batch": global_batch,
                        "tp": 1,
                        "dp": dp,
                        "micro_batch": mb,
                        "overlap_grad_reduce": True,
                    }
                    yield Plan.of(model, cluster, gpus=dp, stages=[stage], **fields)

    what = f"ZeRO-3 over {dp} GPUs does not fit {model.name} (global batch {global_batch})"
    return cheapest_fitting(plans(), problem, what)
