"""The data-parallel gradient reduction overlapped with the last micro-batch's backward
(Megatron-LM's --overlap-grad-reduce), and ZeRO-1/2's weight gather with the next forward
(--overlap-param-gather, StagePlan.gather_in_forward): what they hide in Mist's model, their
flags, and that the searches plan them. The engine's side is in test_mist_run.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from baselines.megatron.grid import search_grid
from mist import Plan, StagePlan, cluster, model, predict, search
from mist.export import CannotExport, megatron_lm_arguments, torchtitan_config
from mist.tuning.megatron_lm import MegatronLMSpace, search_megatron_lm, space_plans
from mist.tuning.pipeline_sim import pipeline_objective, simulate_1f1b
from mist.tuning.problem import Problem
from mist.tuning.stage_cost import SearchSpace, layer_numbers, strategy_grid


def _plan(overlap: bool, bucket: int | None = None, zero: int = 0, gather: bool = False, **stage) -> Plan:
    m = model("gpt3-13b", seq=2048)
    stages = [
        StagePlan(layers=10, recompute=10, zero=zero, gather_in_forward=gather, **stage) for _ in range(4)
    ]
    return Plan.of(
        m,
        cluster("a100-40gb", 16),
        global_batch=32,
        tp=1,
        dp=4,
        micro_batch=1,
        stages=stages,
        overlap_grad_reduce=overlap,
        grad_bucket_params=bucket,
    )


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


def _layers_gather_s(plan: Plan, i: int) -> float:
    """Seconds of stage i's layers' weight all-gather, as the cost model prices it after the step."""
    st = Problem.of_plan(plan, plan.model_spec(), plan.cluster()).plan_setting(plan, i)
    stage_bytes = 2.0 * layer_numbers(st).params * plan.stages[i].layers
    return float(st.runtime.collective("all_gather", stage_bytes, st.dp, st.cluster, False))


@pytest.mark.parametrize("zero", [1, 2])
def test_gather_in_forward_leaves_the_step_and_waits_on_the_fill_path(zero):
    """The same 13B plans with ZeRO-1/2: gathering the weights bucket by bucket in the next forward
    takes the layers' whole all-gather off the step after the clipping barrier, leaves what comes
    before the barrier as it was, and makes each stage's first forward wait for at least the first
    bucket's gather and at most the whole. One bucket a stage: the first forward waits for all of
    it. The iteration pays the waits one stage after another on the fill path (simulated), so on
    these 4 stages, whose forward hides little of the gather, gathering after the step is faster."""
    after, gathered = _plan(True, zero=zero), _plan(True, zero=zero, gather=True)
    one_bucket = _plan(True, 10**12, zero=zero, gather=True)
    for plan in (after, gathered, one_bucket):
        predict(plan, plan.model_spec(), plan.cluster())
    for i, (a, g, one) in enumerate(zip(after.stages, gathered.stages, one_bucket.stages, strict=True)):
        whole = _layers_gather_s(after, i)
        assert g.step_s == pytest.approx(a.step_s - whole, rel=1e-9)
        assert g.extra_s - g.step_s == pytest.approx(a.extra_s - a.step_s, rel=1e-12)
        assert whole / 10 * (1 - 1e-9) <= g.wait_s <= whole * (1 + 1e-9)  # a bucket a layer here
        assert one.wait_s == pytest.approx(whole, rel=1e-9) and one.step_s == pytest.approx(g.step_s)
        assert a.wait_s == 0.0
    waits = sum(s.wait_s for s in gathered.stages)
    moved = max(a.step_s for a in after.stages) - max(g.step_s for g in gathered.stages)
    assert gathered.simulated_iteration_s == pytest.approx(
        after.simulated_iteration_s + waits - moved, rel=1e-9
    )
    assert gathered.simulated_iteration_s > after.simulated_iteration_s


def test_only_zero12_weights_on_the_device_are_gathered_in_forward():
    """ZeRO-0 has nothing to gather, ZeRO-3 gathers per layer in forward already, offloaded weights
    are gathered after the step: plans saying otherwise are refused, and the searches' strategy
    grid holds no such stage; a single GPU (DP 1) gathers nothing."""
    for zero, offloaded in ((0, 0.0), (3, 0.0), (1, 0.5), (2, 1.0)):
        with pytest.raises(ValueError, match="gather_in_forward is for ZeRO-1/2 weights kept on the device"):
            _plan(True, zero=zero, gather=True, offload_weights=offloaded).check()
    grid = strategy_grid(3, SearchSpace())
    gathered = grid["gather_in_forward"] > 0
    assert gathered.any() and (~gathered).any()
    assert np.all(np.isin(grid["zero"][gathered], (1, 2))) and np.all(grid["offload_weights"][gathered] == 0)
    for bad in ((), (1,), ("yes",)):
        with pytest.raises(ValueError, match="gather_in_forward: one or both"):
            SearchSpace(gather_in_forward=bad)
    only = strategy_grid(3, SearchSpace(gather_in_forward=(True,)))  # where a stage may: ZeRO-0/3 stay
    assert set(only["zero"]) == {0, 1, 2, 3} and len(only["zero"]) == (~gathered).sum()
    m = model("gpt3-1.3b", seq=2048)
    one = Plan.of(
        m,
        cluster("a100-40gb", 1),
        global_batch=4,
        tp=1,
        dp=1,
        micro_batch=1,
        stages=[StagePlan(layers=m.layers, zero=1, gather_in_forward=True)],
    )
    assert predict(one, m, one.cluster()).stages[0].wait_s == 0.0


def test_the_simulated_pipeline_pays_each_stages_first_forward_wait():
    """Each stage's first forward is on the fill path of the first micro-batch: on balanced stages
    the simulated makespan grows by exactly the sum of the waits, as the closed form adds it; on
    unbalanced ones by at most that (a stage with slack absorbs some), never less than nothing."""
    rng = np.random.default_rng()
    for _ in range(40):
        stages, micro = int(rng.integers(1, 7)), int(rng.integers(1, 33))
        wait = list(rng.uniform(0, 2, stages))
        f = float(rng.uniform(0.1, 3))
        fwd, bwd = [f] * stages, [f * float(rng.uniform(1, 3))] * stages
        grown = simulate_1f1b(fwd, bwd, micro, wait=wait) - simulate_1f1b(fwd, bwd, micro)
        assert grown == pytest.approx(sum(wait), rel=1e-9)
        steady = [a + b for a, b in zip(fwd, bwd, strict=True)]
        closed = pipeline_objective(steady, [0.0] * stages, micro, wait=wait)
        assert closed == pytest.approx(simulate_1f1b(fwd, bwd, micro, wait=wait), rel=1e-9)
        fwd = list(rng.uniform(0.1, 3, stages))
        bwd = [a * float(rng.uniform(1, 3)) for a in fwd]
        grown = simulate_1f1b(fwd, bwd, micro, wait=wait) - simulate_1f1b(fwd, bwd, micro)
        assert -1e-9 <= grown <= sum(wait) * (1 + 1e-9) + 1e-9


def test_megatron_lm_flags_and_what_torchtitan_cannot_say():
    m = model("gpt3-13b", seq=2048)
    args, cannot = megatron_lm_arguments(_plan(True, 50_000_000), m)
    assert not cannot and "--overlap-grad-reduce" in args
    assert args[args.index("--ddp-bucket-size") + 1] == "50000000"
    plain, _ = megatron_lm_arguments(_plan(False), m)
    assert "--overlap-grad-reduce" not in plain and "--ddp-bucket-size" not in plain
    llama = model("llama-7b")
    ddp = Plan.of(
        llama,
        cluster("a100-40gb", 4),
        global_batch=8,
        tp=1,
        dp=4,
        micro_batch=2,  # no accumulation: torchtitan's DDP would sum every micro-batch
        stages=[StagePlan(layers=llama.layers)],
    )
    with pytest.raises(CannotExport, match="always overlaps"):
        torchtitan_config(ddp, llama, flavor="7B")
    torchtitan_config(dataclasses.replace(ddp, overlap_grad_reduce=True), llama, flavor="7B")
    with pytest.raises(CannotExport, match="gradient buckets"):
        torchtitan_config(
            dataclasses.replace(ddp, overlap_grad_reduce=True, grad_bucket_params=10**6), llama, flavor="7B"
        )


def test_gather_flag_for_all_distributed_optimizer_stages_and_fsdp2_always_gathers_ahead():
    m = model("gpt3-13b", seq=2048)
    args, cannot = megatron_lm_arguments(_plan(True, zero=1, gather=True), m)
    assert not cannot and {"--use-distributed-optimizer", "--overlap-param-gather"} <= set(args)
    plain, _ = megatron_lm_arguments(_plan(True, zero=1), m)
    assert "--overlap-param-gather" not in plain
    some = _plan(True, zero=1, gather=True)
    some.stages[0].gather_in_forward = False
    assert "some stages only" in " ".join(megatron_lm_arguments(some, m)[1])
    _, cannot = megatron_lm_arguments(_plan(False, zero=1, gather=True), m)
    assert any("needs --overlap-grad-reduce" in c for c in cannot)
    interleaved = _plan(True, zero=1, gather=True)
    interleaved.virtual_stages = 2  # Megatron-LM would begin every rank's gather at the schedule's start
    args, cannot = megatron_lm_arguments(interleaved, m)
    assert not cannot and {"--overlap-param-gather", "--no-align-param-gather"} <= set(args)
    assert "--no-align-param-gather" not in megatron_lm_arguments(_plan(True, zero=1, gather=True), m)[0]
    llama = model("llama-7b")
    fsdp = Plan.of(
        llama,
        cluster("a100-40gb", 4),
        global_batch=8,
        tp=1,
        dp=4,
        micro_batch=1,
        stages=[StagePlan(layers=llama.layers, zero=2)],
        overlap_grad_reduce=True,
    )
    with pytest.raises(CannotExport, match="gathers ahead"):
        torchtitan_config(fsdp, llama, flavor="7B")
    fsdp.stages[0].gather_in_forward = True
    torchtitan_config(fsdp, llama, flavor="7B")


def test_the_searches_plan_the_overlap_their_trainers_run():
    m, c = model("gpt3-1.3b", seq=2048), cluster("a100-40gb", 4)
    for plan in (search(m, c, 16), search_grid(m, c, 16)):
        assert plan.overlap_grad_reduce and plan.grad_bucket_params is None
    # Mist chooses it per stage: here its ZeRO-2 stage gathers in forward (one stage: no fill path);
    # the same plan gathering after the step is slower
    mist = search(m, c, 16)
    assert [s.gather_in_forward for s in mist.stages] == [True]
    after = dataclasses.replace(
        mist, stages=[dataclasses.replace(s, gather_in_forward=False) for s in mist.stages]
    )
    assert predict(after, m, c).predicted_iteration_s > mist.predicted_iteration_s
    # with the distributed optimizer, the grid tries the weights gathered after the step and in
    # forward: its winner is the faster, and its space holds both
    space = MegatronLMSpace(zero=(1,))
    best = search_megatron_lm(m, c, 16, space=space)
    stages = [dataclasses.replace(s, gather_in_forward=not s.gather_in_forward) for s in best.stages]
    flipped = dataclasses.replace(best, stages=stages)
    assert best.predicted_iteration_s <= predict(flipped, m, c).predicted_iteration_s
    assert {s.stages[0].gather_in_forward for s in space_plans(m, c, 16, space)} == {False, True}


@pytest.mark.parametrize("value", ["yes", 1.5, 0, -3])
def test_bad_overlap_fields_are_refused(value):
    field = "overlap_grad_reduce" if isinstance(value, str) else "grad_bucket_params"
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(_plan(True), **{field: value}).check()
    if isinstance(value, str):
        with pytest.raises(ValueError, match="gather_in_forward must be true or false"):
            _plan(True, zero=1, gather=value).check()
