"""The data-parallel gradient reduction overlapped with the last micro-batch's backward
(Megatron-LM's --overlap-grad-reduce): what it hides in Mist's model, its flags, and that the
searches plan it. The engine's side is in test_mist_run.py."""

from __future__ import annotations

import dataclasses

import pytest

from baselines.megatron.grid import search_grid
from mist import Plan, StagePlan, cluster, model, predict, search
from mist.export import CannotExport, megatron_lm_arguments, torchtitan_config


def _plan(overlap: bool, bucket: int | None = None, zero: int = 0) -> Plan:
    m = model("gpt3-13b", seq=2048)
    stages = [StagePlan(layers=10, recompute=10, zero=zero) for _ in range(4)]
    return Plan.of(m, cluster("a100-40gb", 16), global_batch=32, tp=1, dp=4, micro_batch=1, stages=stages,
                   overlap_grad_reduce=overlap, grad_bucket_params=bucket)  # fmt: skip


@pytest.mark.parametrize("zero", [0, 1])
def test_overlap_hides_all_but_the_last_bucket(zero):
    """13B on 4 stages x DP 4 (a 315M-parameter layer a bucket by Megatron-LM's 40M default): with
    the reduction overlapped each stage's extras shrink, by at most the reduction of all its layers
    but one; with one bucket for the whole stage nothing is hidden; the step after the clipping
    barrier is untouched."""
    m, c = model("gpt3-13b", seq=2048), cluster("a100-40gb", 16)
    after, overlapped, one_bucket = _plan(False, zero=zero), _plan(True, zero=zero), _plan(True, 10**12, zero)
    for plan in (after, overlapped, one_bucket):
        predict(plan, m, c)
    for a, o, one in zip(after.stages, overlapped.stages, one_bucket.stages, strict=True):
        assert o.extra_s < a.extra_s and one.extra_s == pytest.approx(a.extra_s, rel=1e-12)
        assert o.step_s == pytest.approx(a.step_s, rel=1e-12)
        # at most 9 of the 10 layers' share of the reduction is hidden
        assert a.extra_s - o.extra_s <= 0.9 * (a.extra_s - a.step_s) + 1e-12
    assert overlapped.predicted_iteration_s < after.predicted_iteration_s


def test_megatron_lm_flags_and_what_torchtitan_cannot_say():
    m = model("gpt3-13b", seq=2048)
    args, cannot = megatron_lm_arguments(_plan(True, 50_000_000), m)
    assert not cannot and "--overlap-grad-reduce" in args
    assert args[args.index("--ddp-bucket-size") + 1] == "50000000"
    plain, _ = megatron_lm_arguments(_plan(False), m)
    assert "--overlap-grad-reduce" not in plain and "--ddp-bucket-size" not in plain
    llama = model("llama-7b")
    ddp = Plan.of(llama, cluster("a100-40gb", 4), global_batch=8, tp=1, dp=4, micro_batch=1,
                  stages=[StagePlan(layers=llama.layers)])  # fmt: skip
    with pytest.raises(CannotExport, match="always overlaps"):
        torchtitan_config(ddp, llama, flavor="7B")
    torchtitan_config(dataclasses.replace(ddp, overlap_grad_reduce=True), llama, flavor="7B")
    with pytest.raises(CannotExport, match="gradient buckets"):
        torchtitan_config(dataclasses.replace(ddp, overlap_grad_reduce=True, grad_bucket_params=10**6),
                          llama, flavor="7B")  # fmt: skip


def test_the_searches_plan_the_overlap_their_trainers_run():
    m, c = model("gpt3-1.3b", seq=2048), cluster("a100-40gb", 4)
    for plan in (search(m, c, 16), search_grid(m, c, 16)):
        assert plan.overlap_grad_reduce and plan.grad_bucket_params is None


@pytest.mark.parametrize("value", ["yes", 1.5, 0, -3])
def test_bad_overlap_fields_are_refused(value):
    field = "overlap_grad_reduce" if isinstance(value, str) else "grad_bucket_params"
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(_plan(True), **{field: value}).check()
