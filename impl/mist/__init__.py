"""Mist (EuroSys'25, arXiv 2503.19050): a memory-, overlap- and imbalance-aware training planner.

    from mist import cluster, model, search
    plan = search(model("gpt3-7b"), cluster("l4", 8), global_batch=128)
    print(plan.table())

Command line: ``python -m mist plan|predict|calibrate|list``.
"""

from .model.specs import GPUS, MODELS, ClusterSpec, GpuSpec, ModelSpec, cluster, model
from .plan import Plan, StagePlan
from .tuning.planner import NoFeasiblePlan, PlannerOptions, predict, search

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
