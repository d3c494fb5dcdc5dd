"""Mist planning Tempo's layers in the comparison (mist_vs_megatron's tempo part) and the words that
say what Tempo changed in a plan."""

from __future__ import annotations

import copy

from artifacts.mist_vs_megatron.plans import plan_changes
from artifacts.mist_vs_megatron.run import tempo_point


def test_tempo_part_plans_with_and_without_and_never_ends_slower():
    """Tempo's layers keep less and are priced at the plain layers' time: Mist with them cannot end
    slower; its plan is Tempo's (the plan file says so) and fits."""
    r = tempo_point("l4", "gpt3", "1.3b", False, None)
    assert r["from_comparison"] is False
    assert r["gain"] >= 1.0 - 1e-3, r
    assert r["changes"] == plan_changes(r["mist"], r["mist_tempo"])
    # the L4's 24 GB binds GPT-3 1.3B at seq 2048 unfused: Tempo frees enough to change the plan
    assert r["changes"], r
    # the comparison's Mist plan, when given, is the plan without Tempo: not searched again
    known = copy.deepcopy(r["mist"])
    again = tempo_point("l4", "gpt3", "1.3b", False, known)
    assert again["from_comparison"] is True and again["mist"] == known
    assert again["mist_tempo"]["iteration_s"] == r["mist_tempo"]["iteration_s"]


def _summary(stages: list[dict], **shape) -> dict:
    blank = {
        "recompute": 0,
        "selective": False,
        "zero": 0,
        "offload_weights": 0.0,
        "offload_grads": 0.0,
        "offload_optimizer": 0.0,
        "offload_activations": 0.0,
        "gather_in_forward": False,
    }
    return {
        "tp": 1,
        "dp": 2,
        "micro_batch": 1,
        "pre_post": None,
        **shape,
        "stages": [{**blank, **s} for s in stages],
    }


def test_plan_changes_names_each_difference_and_nothing_else():
    before = _summary([{"layers": 12, "recompute": 5}, {"layers": 12, "recompute": 3, "zero": 1}])
    assert plan_changes(before, copy.deepcopy(before)) == []
    after = _summary([{"layers": 24, "offload_optimizer": 0.5}], micro_batch=2)
    assert plan_changes(before, after) == [
        "micro-batch 1 -> 2",
        "layers per stage [12, 12] -> [24]",
        "layers recomputed 8 -> 0",
        "zero [0, 1] -> [0]",
        "offload_optimizer [0.0, 0.0] -> [0.5]",
    ]
