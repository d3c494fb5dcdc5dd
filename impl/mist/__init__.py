"""Mist (EuroSys'25, arXiv 2503.19050): a memory-, overlap- and imbalance-aware training planner.

    from mist import cluster, model, search
    plan = search(model("gpt3-7b"), cluster("l4", 8), global_batch=128)
    print(plan.table())

Command line: ``python -m mist plan|predict|calibrate|list``.
"""

from .plan import Plan, StagePlan
from .planner import NoFeasiblePlan, PlannerOptions, predict, search
from .specs import GPUS, MODELS, ClusterSpec, GpuSpec, ModelSpec, cluster, model

__all__ = [
    "GPUS",
    "MODELS",
    "ClusterSpec",
    "GpuSpec",
    "ModelSpec",
    "NoFeasiblePlan",
    "Plan",
    "PlannerOptions",
    "StagePlan",
    "cluster",
    "model",
    "predict",
    "search",
]
