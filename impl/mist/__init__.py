"""Mist (EuroSys'25, arXiv 2503.19050): a memory-, overlap- and imbalance-aware training planner.

    from mist import cluster, model, search
    plan = search(model("gpt3-7b"), cluster("l4", 8), global_batch=128)
    print(plan.table())

Command line: ``python -m mist plan|predict|calibrate|list``.
"""

from .model.specs import ClusterSpec, GpuSpec, ModelSpec, cluster, gpus, model, models
from .plan import Plan, StagePlan
from .tuning.planner import NoFeasiblePlan, PlannerOptions, predict, search

__all__ = [
    "ClusterSpec",
    "GpuSpec",
    "ModelSpec",
    "NoFeasiblePlan",
    "Plan",
    "PlannerOptions",
    "StagePlan",
    "cluster",
    "gpus",
    "model",
    "models",
    "predict",
    "search",
]
