"""What the experiment's result files keep of a plan, and how readers take it back."""

from __future__ import annotations

import dataclasses

from mist.plan import bytes_needed
from mist.tuning.stage_cost import STRATEGY_FIELDS

# What a result keeps of each stage of a plan: the plan itself and the predicted memory (whole
# bytes, as the plan has it; reference points from before plan_format 2 have memory_gib and
# host_memory_gib instead: readers take either, see stage_memory_bytes)
STAGE_FIELDS = ("layers", *STRATEGY_FIELDS, "tp", "dp", "memory_bytes", "host_memory_bytes")
# the predictions among them (with the older points' GiB), which a plan taken back leaves out
PREDICTED_MEMORY_FIELDS = ("memory_bytes", "host_memory_bytes", "memory_gib", "host_memory_gib")


def stage_memory_bytes(stage: dict) -> tuple[int, int]:
    """(memory, host memory) in bytes of a stage a result stores: ``memory_bytes`` and
    ``host_memory_bytes``, or a reference point's GiB from before they were bytes."""
    if "memory_bytes" in stage:
        return stage["memory_bytes"], stage["host_memory_bytes"]
    return bytes_needed(stage["memory_gib"] * 2**30), bytes_needed(stage["host_memory_gib"] * 2**30)


def plan_summary(plan) -> dict:
    """What a result keeps of a plan: its predictions, parallel sizes, stages and pre_post."""
    return {
        "iteration_s": plan.simulated_iteration_s,  # speedups are taken from the simulator
        "closed_form_s": plan.predicted_iteration_s,
        "tuning_s": plan.tuning_s,
        "tp": plan.tp,
        "dp": plan.dp,
        "micro_batch": plan.micro_batch,
        "stages": [{k: getattr(s, k) for k in STAGE_FIELDS} for s in plan.stages],
        # the embedding/head's own strategy, if the plan has one: the plan is whole, re-priceable
        "pre_post": None if plan.pre_post is None else dataclasses.asdict(plan.pre_post),
        "virtual_stages": plan.virtual_stages,  # model chunks a pipeline rank (interleaved 1F1B)
        "overlap_grad_reduce": plan.overlap_grad_reduce,  # DP reduction overlapped with backward
        "grad_bucket_params": plan.grad_bucket_params,
    }


def summary_plan(key: dict, summary: dict):
    """The plan a comparison point's ``summary`` (plan_summary) keeps, for the case ``key``
    (model, seq, flash, gpu, gpus, global_batch): whole again, unpriced."""
    from mist import Plan, StagePlan, cluster, model
    from mist.plan import PrePostPlan

    stages = [
        StagePlan(**{k: v for k, v in st.items() if k not in PREDICTED_MEMORY_FIELDS})
        for st in summary["stages"]
    ]
    edge = summary["pre_post"]
    return Plan.of(
        model(key["model"], seq=key["seq"], flash=key["flash"]),
        cluster(key["gpu"], key["gpus"]),
        global_batch=key["global_batch"],
        tp=summary["tp"],
        dp=summary["dp"],
        micro_batch=summary["micro_batch"],
        stages=stages,
        pre_post=None if edge is None else PrePostPlan(**edge),
        virtual_stages=summary.get("virtual_stages", 1),  # points from before interleaving: plain 1F1B
        # points from before the reduction overlapped: after backward
        overlap_grad_reduce=summary.get("overlap_grad_reduce", False),
        grad_bucket_params=summary.get("grad_bucket_params"),
    )


def plan_changes(before: dict, after: dict) -> list[str]:
    """What differs between two plan summaries of one case, in words (empty: the same plan): the
    parallel sizes, the micro-batch, the layers per stage, the layers recomputed, and each other
    strategy field stage by stage."""
    changes = [
        f"{what} {before.get(k, 1)} -> {after.get(k, 1)}"
        for k, what in (
            ("tp", "TP"),
            ("dp", "DP"),
            ("micro_batch", "micro-batch"),
            ("virtual_stages", "chunks"),
        )
        if before.get(k, 1) != after.get(k, 1)  # results from before interleaving have no chunks: 1
    ]
    fields = ("layers", *STRATEGY_FIELDS)
    per_stage = {k: [[s[k] for s in p["stages"]] for p in (before, after)] for k in fields}
    if per_stage["layers"][0] != per_stage["layers"][1]:
        changes.append(f"layers per stage {per_stage['layers'][0]} -> {per_stage['layers'][1]}")
    recomputed = [sum(r) for r in per_stage["recompute"]]
    if recomputed[0] != recomputed[1]:
        changes.append(f"layers recomputed {recomputed[0]} -> {recomputed[1]}")
    for k, (a, b) in per_stage.items():
        # stage by stage; where the stage count changed, the same set of values is no change
        if k not in ("layers", "recompute") and (a != b if len(a) == len(b) else set(a) != set(b)):
            changes.append(f"{k} {a} -> {b}")
    if before["pre_post"] != after["pre_post"]:
        changes.append(f"embedding/head {before['pre_post']} -> {after['pre_post']}")
    return changes
