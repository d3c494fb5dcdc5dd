"""Planner-made and hand-written plans trained by megatron-core on 2 gloo processes.

The ranks are forked from one process that imported megatron-core once (measure.fork_launch:
~1.5 s a run instead of torchrun's ~6.5 s on 2 cores); the out-of-memory test launches with
torchrun itself, the path every experiment takes."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from artifacts.mist_vs_megatron.plans import summary_plan
from measure import fork_launch
from measure.launch import run_torchrun
from mist import Plan, StagePlan, cluster, model, predict
from mist.engine.run import unsupported
from mist.plan import PrePostPlan
from mist.tuning.problem import Problem
from mist.tuning.stage_cost import layer_numbers, offloaded_layers

# Predicted vs measured per-rank memory: the stated target (docs/mist.md: "target 10%"), not loosened.
# Measured: held tensor bytes + the allocator peak of the typical steady step (the median of a
# few: on a CPU the peaks vary by up to ~10% of the total at this tiny scale, as gloo's threads and
# FSDP2's asynchronous collectives free buffers at varying times; the worst is reported too).
TOLERANCE = 0.10


def _torchrun(plan: Plan, tmp_path: Path, steps: int = 1, extra: tuple[str, ...] = ()) -> dict:
    """The engine's report for ``plan`` (``extra``: more arguments of mist.engine.run); each
    distinct plan is launched once per test session (several tests compare against the same
    plain plan). One timed step after the warm-up and the memory steps: the tests judge losses
    and memory; step times are the experiments'."""
    key = (json.dumps(plan.what_runs(), sort_keys=True), steps, extra)
    if key in _REPORTS:
        return _REPORTS[key]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path, out = tmp_path / "plan.yaml", tmp_path / "report.json"
    plan.save(path)
    args = ["--plan", str(path), "--steps", str(steps), "--out", str(out), *extra]
    done = fork_launch.shared("mist.engine.run:preload").run(plan.gpus, "mist.engine.run", args, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    _REPORTS[key] = json.loads(out.read_text())
    return _REPORTS[key]


_REPORTS: dict[tuple, dict] = {}  # one torchrun per distinct plan per test session


def _tp_groups_agree(report: dict) -> None:
    """Under sequence parallelism each TP rank's norm gradients are partial sums over its sequence
    shard; summed over the TP group they are equal, and so are the weights they step. Unsummed,
    the ranks' norms drift apart (the losses barely move: 1.6% over 8 steps), so the weights'
    sums must agree within each TP group (one stage, one DP rank), and there must be some."""
    groups: dict[tuple, set] = {}
    for r in report["ranks"]:
        assert r["sequence_parallel_params"] > 0, r
        groups.setdefault((r["stage"], r["dp_rank"]), set()).add(r["sequence_parallel_checksum"])
    assert all(len(sums) == 1 for sums in groups.values()), groups


def _report(plan_args: tuple, tmp_path_factory) -> tuple[Plan, dict]:
    tp, layers, recompute, dp, zero = plan_args
    plan = _plan(tp, list(layers), list(recompute), dp, zero)
    return plan, _torchrun(plan, tmp_path_factory.mktemp("run"))


def _tiny_plan(stages: list[StagePlan], tp: int = 1, dp: int = 1) -> Plan:
    """A gpt3-tiny plan for tp x dp x stages CPU processes, global batch 8 in micro-batches of 2,
    no SP, priced without FlashAttention (the engine runs megatron-core's unfused attention)."""
    return Plan(
        model="gpt3-tiny",
        gpu="cpu",
        gpus=tp * dp * len(stages),
        gpus_per_node=8,
        global_batch=8,
        tp=tp,
        dp=dp,
        micro_batch=2,
        stages=stages,
        sequence_parallel=False,
        model_overrides={"flash": False},
    )


# bf16's unit roundoff: a value rounded to bf16 is within BF16_U of itself, relatively
BF16_U = 2.0**-8


def _same_first_step(a: dict, b: dict) -> None:
    """Two reports of plans that train the same model on the same data (same weights, dropout
    off or drawn alike), whose arithmetic differs only in where and in which order bf16 sums are
    rounded (a gradient reduced in another bucket, a sequence-parallel reduce-scatter for an
    all-reduce): their first step, before any update, must agree within that rounding. Where the
    paths differ only in a sum's rounding, each summed value differs by at most 2u (u = BF16_U:
    rounded once in each), and so does a norm over them: | |x| - |y| | <= |x - y| <= 2u |x|.
    Where they differ earlier (SP's forward sums in another collective) later layers carry the
    difference on, and 2u is a target, not a bound: the first loss and the first global gradient
    norm (the whole model's, before clipping) must meet it. Measured: ZeRO-1 bit-equal to plain
    DP, ZeRO-2/3 1e-5 apart in the first norm. The later losses, compared at 2e-2, only check
    that both train alike: Adam at lr 1e-2 amplifies the rounding step by step (ZeRO-2: 3e-4 in
    the third loss)."""
    first = [next(r for r in rep["ranks"] if r["losses"] is not None) for rep in (a, b)]
    assert first[1]["losses"][0] == pytest.approx(first[0]["losses"][0], rel=2 * BF16_U, abs=0)
    norms = [rep["ranks"][0]["global_grad_norms"][0] for rep in (a, b)]
    assert norms[1] == pytest.approx(norms[0], rel=2 * BF16_U, abs=0), norms


def _offload_pair(field: str, dp: int, zero: int, tmp_path: Path) -> tuple[Plan, dict, Plan, dict]:
    """(plain plan, its report, plan with ``field`` = 1.0, its report): four recomputed layers,
    micro-batches of 1, the optimizer offloaded in both. The plain run is shared by the tests
    that offload weights and gradients (one launch per DP/ZeRO setting per session)."""
    runs = []
    for fraction in (0.0, 1.0):
        stage = StagePlan(layers=4, recompute=4, zero=zero, offload_optimizer=1.0, **{field: fraction})
        plan = _tiny_plan([stage], dp=dp)
        plan.micro_batch = 1
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", dp))
        runs.append((plan, _torchrun(plan, tmp_path / f"{field}{fraction}")))
    (plain_plan, plain), (plan, report) = runs
    return plain_plan, plain, plan, report


def _plan(tp: int, layers: list[int], recompute: list[int], dp: int = 1, zero: int = 0) -> Plan:
    stages = [StagePlan(layers=n, recompute=r, zero=zero) for n, r in zip(layers, recompute, strict=True)]
    return _tiny_plan(stages, tp, dp)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("tp", "layers", "recompute", "dp", "zero"),
    [
        (2, [4], [1], 1, 0),
        (1, [1, 3], [1, 0], 1, 0),
        (1, [4], [2], 2, 1),
        (1, [4], [2], 2, 2),
        (1, [4], [2], 2, 3),
    ],
    ids=["tp2", "pp2", "dp2-zero1", "dp2-zero2", "dp2-zero3"],
)
def test_plan_trains_on_megatron_core_and_memory_matches(tmp_path_factory, tp, layers, recompute, dp, zero):
    plan, report = _report((tp, tuple(layers), tuple(recompute), dp, zero), tmp_path_factory)
    losses = next(r["losses"] for r in report["ranks"] if r["losses"] is not None)
    # the same few sequences every step: it must learn them. Judged by the lowest loss after the
    # first, not the last: Adam at lr 1e-2 bounces (pp2 since its recomputation redraws the
    # forward's dropout masks, as the plain plan trains: 5.57 -> 4.84, then 5.33 at the last step)
    assert min(losses[1:]) < losses[0] - 0.5, losses
    predict(plan, model("gpt3-tiny"), cluster("cpu", 2))
    for r in report["ranks"]:
        predicted = plan.stages[r["stage"]].memory_bytes
        assert abs(predicted / r["memory_bytes"] - 1) < TOLERANCE, (r, predicted)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gradient_clipping_norm_is_the_whole_models_in_every_layout(tmp_path):
    """The engine clips gradients to a global norm of 1.0 (Megatron-LM's default): every layout of
    the same model, data and initial weights (no dropout) must find the same first-step norm, each
    gradient counted once over the DP, TP and pipeline ranks, and that norm must be above 1 (else
    clipping is never exercised). Within 0.1%: bf16 gradients summed in another order (measured:
    2e-5). A pipeline's stages initialise their layers from their own random streams, so pipelines
    are compared with a pipeline of the same split. Negative control: the ranks' own norms added
    up (each replica's and TP-duplicated gradients counted again) are outside that tolerance. And
    the gradients are scaled: on one process their norm after clipping is 1 (unscaled: 1.18).
    Under ZeRO each DP rank steps by its own share, so there the ranks' norms add up to the whole,
    before clipping and after (review 2026-12-07: ZeRO-2's read 0 before clipping, its sums not yet
    where the step reads them; ZeRO-1's after clipping mixed scaled and unscaled gradients)."""
    layouts = {  # name: (tp, dp, stages' layers, zero)
        "one": (1, 1, [4], 0),
        "tp2": (2, 1, [4], 0),
        "dp2": (1, 2, [4], 0),
        "dp2-zero1": (1, 2, [4], 1),
        "dp2-zero2": (1, 2, [4], 2),
        "dp2-zero3": (1, 2, [4], 3),
        "pp2": (1, 1, [2, 2], 0),
        "tp2-pp2": (2, 1, [2, 2], 0),
    }
    norms, naive, shares_clipped = {}, {}, {}
    for name, (tp, dp, layers, zero) in layouts.items():
        plan = _tiny_plan([StagePlan(layers=n, zero=zero) for n in layers], tp=tp, dp=dp)
        plan.model_overrides["dropout"] = 0.0
        report = _torchrun(plan, tmp_path / name, steps=1)
        firsts = {r["global_grad_norms"][0] for r in report["ranks"]}
        assert len(firsts) == 1, (name, firsts)  # every rank clips by the same norm
        norms[name] = firsts.pop()
        naive[name] = sum(r["first_grad_norm"] ** 2 for r in report["ranks"]) ** 0.5
        shares_clipped[name] = sum(r["first_clipped_grad_norm"] ** 2 for r in report["ranks"]) ** 0.5
        if name == "one":
            clipped = report["ranks"][0]["first_clipped_grad_norm"]
    assert norms["one"] > 1.0 and norms["pp2"] > 1.0, norms
    # one process: its gradients are all of them; each scaled in bf16, so rounded by up to 2^-9
    assert clipped == pytest.approx(1.0, rel=2**-8)
    same = {name: "pp2" if name.endswith("pp2") else "one" for name in layouts}
    for name, norm in norms.items():
        assert norm == pytest.approx(norms[same[name]], rel=1e-3), (name, norms)
    for name in ("tp2", "dp2", "tp2-pp2"):
        assert naive[name] != pytest.approx(norms[same[name]], rel=1e-3), (name, naive)
    for name in ("dp2-zero1", "dp2-zero2", "dp2-zero3"):  # disjoint shares: their norms add up
        assert naive[name] == pytest.approx(norms[name], rel=1e-3), (name, naive, norms)
        assert shares_clipped[name] == pytest.approx(1.0, rel=2**-8), (name, shares_clipped)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_selective_recomputation_trains_the_same_and_keeps_less(tmp_path):
    """Selective recomputation (the core attention recomputed in backward, megatron-core's own),
    alone and after one fully recomputed layer, on one process at sequence 128 (where the scores
    are most of what a layer keeps): the same losses as the same plan without it (recomputation
    repeats the same ops, dropout's random state restored), memory within the tolerance of the
    prediction. Negative control: the prediction without it is outside."""
    runs = {}
    for recompute, selective in itertools.product((0, 1), (False, True)):
        plan = _tiny_plan([StagePlan(layers=4, recompute=recompute, selective=selective)])
        plan.model_overrides["seq"] = 128
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 1))
        runs[recompute, selective] = plan, _torchrun(plan, tmp_path / f"r{recompute}-{selective}")
    for recompute in (0, 1):
        (plain_plan, plain), (plan, report) = runs[recompute, False], runs[recompute, True]
        losses, measured = report["ranks"][0]["losses"], report["ranks"][0]["memory_bytes"]
        assert losses == pytest.approx(plain["ranks"][0]["losses"], rel=1e-6), recompute
        assert abs(plan.stages[0].memory_bytes / measured - 1) < TOLERANCE, (recompute, measured)
        assert abs(plain_plan.stages[0].memory_bytes / measured - 1) > TOLERANCE, (recompute, measured)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_stage_recomputation_trains_the_same_and_each_stage_keeps_less(tmp_path):
    """Two stages of two layers recomputing 2 and 1 of them (each stage its own count), at sequence
    128 (activations most of what a stage holds), against the same plan recomputing none: the
    same losses (recomputation repeats the same ops and redraws the same dropout masks, with
    micro-batches in flight in the 1F1B schedule: 1e-6), each run's memory
    within the tolerance of its own prediction (measured: -2.4%, +4.6% recomputing; -1.6%, +3.9%
    not). Negative control: each recomputing stage's memory is outside the tolerance of what
    the plan without recomputation predicts for it (+61%, +28%), so a stage whose count the
    engine ignored would fail the memory check."""
    runs = {}
    for recompute in ((2, 1), (0, 0)):
        plan = _plan(1, [2, 2], list(recompute))
        plan.model_overrides["seq"] = 128  # with dropout: 2 micro-batches in flight on stage 0
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 2))
        runs[recompute] = plan, _torchrun(plan, tmp_path / f"recompute{recompute}")
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for _, rep in runs.values())
    assert a == pytest.approx(b, rel=1e-6), (a, b)
    (plan, report), (plain_plan, _) = runs[2, 1], runs[0, 0]
    for run_plan, run in runs.values():
        for r in run["ranks"]:
            predicted = run_plan.stages[r["stage"]].memory_bytes
            assert abs(predicted / r["memory_bytes"] - 1) < TOLERANCE, (r, predicted)
    for r in report["ranks"]:
        assert abs(plain_plan.stages[r["stage"]].memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, r


def test_a_recomputation_replays_the_tracked_streams_and_leaves_them_where_they_were():
    """In process, on megatron-core's tracker: what a recomputation draws from a tracked stream is
    what its forward drew (twice: the context is entered once per recomputation), and the draws
    after it are those of a tracker that never recomputed. Control: outside the context the
    stream has moved on."""
    import torch

    from mist.engine import cpu_shim
    from mist.engine.run import _replay_tracked_streams

    cpu_shim.install()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved = tracker.get_states(), tracker.seeds_.copy()

    def draw() -> torch.Tensor:
        with tracker.fork():
            return torch.rand(8)

    try:
        tracker.reset()
        tracker.add("model-parallel-rng", 1234)
        expected = [draw() for _ in range(3)]  # a tracker that never recomputes
        tracker.reset()
        tracker.add("model-parallel-rng", 1234)
        _, recomputation = _replay_tracked_streams()
        forward = draw()
        later = draw()
        for _ in range(2):
            with recomputation:
                assert torch.equal(draw(), forward)
        assert torch.equal(forward, expected[0]) and torch.equal(later, expected[1])
        assert torch.equal(draw(), expected[2])
        assert not torch.equal(draw(), forward)  # control
    finally:
        tracker.reset()
        tracker.set_states(saved[0])
        tracker.seeds_ = saved[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_full_recomputation_recomputes_the_forwards_dropout_masks(tmp_path):
    """With dropout, a recomputed layer must redraw in backward the masks its forward drew, or its
    gradient is not that of the loss computed. Four micro-batches a step on one process, all or
    half of the layers recomputed: the first gradient norm and every step's loss equal the plain
    plan's (1e-6; measured: to the bit). Until 4263911 they did not (the first norm 2.36685
    against 2.36144 at one micro-batch): torch.utils.checkpoint restores the default generator
    but not megatron-core's RNG tracker, from whose stream the core attention draws its dropout.
    Control: the same plan without dropout trains apart, so the masks are drawn and matter."""
    reports = {}
    for recompute, dropout in ((0, None), (4, None), (2, None), (0, 0.0)):
        plan = _tiny_plan([StagePlan(layers=4, recompute=recompute)])
        if dropout is not None:
            plan.model_overrides["dropout"] = dropout
        assert not unsupported(plan), unsupported(plan)
        reports[recompute, dropout] = _torchrun(plan, tmp_path / f"r{recompute}-{dropout}", steps=4)["ranks"][
            0
        ]
    plain = reports[0, None]
    for recompute in (4, 2):
        recomputed = reports[recompute, None]
        assert recomputed["first_grad_norm"] == pytest.approx(plain["first_grad_norm"], rel=1e-6), recompute
        assert recomputed["losses"] == pytest.approx(plain["losses"], rel=1e-6), recompute
    assert reports[0, 0.0]["losses"] != pytest.approx(plain["losses"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_sharding_trains_like_plain_data_parallelism(tmp_path_factory, zero):
    """Same data, same initial weights: sharding the optimizer (and gradients, and weights) over
    the replicas must not change the training, only where the bytes live (bf16 gradient sums may
    round in a different order)."""
    _, plain = _report((1, (4,), (2,), 2, 0), tmp_path_factory)
    _, sharded = _report((1, (4,), (2,), 2, zero), tmp_path_factory)
    _same_first_step(plain, sharded)
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (plain, sharded))
    assert a == pytest.approx(b, rel=2e-2, abs=0)
    held = {
        rep_name: max(r["held_bytes"] for r in rep["ranks"])
        for rep_name, rep in (("plain", plain), ("zero", sharded))
    }
    assert held["zero"] < 0.75 * held["plain"]  # master weights and Adam state are split in two


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offloading_optimizer_and_activations_trains_the_same(tmp_path, tmp_path_factory):
    """The second stage keeps its optimizer state on the host and moves its layers' saved
    activations there: same training as without, and the host holds the 12 B a parameter the
    model counts (what the activations' offload saves: test_offloaded_activations_leave_the_device_peak)."""
    _, plain = _report((1, (1, 3), (1, 0), 1, 0), tmp_path_factory)
    stages = [
        StagePlan(layers=1, recompute=1),
        StagePlan(layers=3, offload_optimizer=1.0, offload_activations=1.0),
    ]
    plan = _tiny_plan(stages)
    assert not unsupported(plan)
    offloaded = _torchrun(plan, tmp_path)
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (plain, offloaded))
    assert a == pytest.approx(b, rel=1e-6)
    last = next(r for r in offloaded["ranks"] if r["stage"] == 1)
    assert last["activation_offloaded_layers"] == 3
    # held on the device: bf16 weights + bf16 gradients (4 B a parameter); on the host the fp32
    # master weight and two Adam moments (12 B a parameter)
    assert last["host_optimizer_bytes"] == pytest.approx(3 * last["held_bytes"], rel=0.01)
    before = next(r for r in plain["ranks"] if r["stage"] == 1)
    assert before["held_bytes"] - last["held_bytes"] == pytest.approx(last["host_optimizer_bytes"], rel=0.02)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_optimizer_offload_trains_as_zero_alone(tmp_path, zero):
    """ZeRO-Offload: each rank's share of the optimizer (ZeRO-3: of its weight shards) steps on the
    host. The same losses as ZeRO alone (the same AdamW on the same share), its fp32 master weights
    and two moments on the host (12 B a parameter, as predicted), and the device memory within the
    tolerance of the prediction. Negative control: the memory the plan without offloading predicts
    is outside it (the check would catch an offload that left the state on the device). One
    micro-batch a step: with several, how many layers' gradients wait on gloo's asynchronous
    reduce-scatter varies from step to step (ZeRO-3: 0 to 4 layers, +-7% of this total)."""
    runs = {}
    for fraction in (0.0, 1.0):
        plan = _tiny_plan([StagePlan(layers=4, zero=zero, offload_optimizer=fraction)], dp=2)
        plan.micro_batch = 4
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 2))
        runs[fraction] = plan, _torchrun(plan, tmp_path / f"offload{fraction}")
    (plain_plan, plain), (plan, offloaded) = runs[0.0], runs[1.0]
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (plain, offloaded))
    assert a == pytest.approx(b, rel=1e-6)
    for r in offloaded["ranks"]:
        stage, without = plan.stages[r["stage"]], plain_plan.stages[r["stage"]]
        assert r["host_optimizer_bytes"] == pytest.approx(stage.host_memory_bytes, rel=0.02), r
        assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)
        assert abs(without.memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, (r, without.memory_bytes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sequence_parallelism_trains_as_tensor_parallelism_alone(tmp_path):
    """TP 2 with sequence parallelism on a CPU (the engine's norms allow it; megatron-core's torch
    norm does not): the same losses as TP 2 without it (no dropout, whose streams differ between
    the two; bf16 sums over the TP group in another order), and each run's memory within the
    tolerance of its prediction. At this size SP saves ~1% (weights dominate), so the negative
    control is the mechanism itself: a layer's input holds half the sequence with it, all without."""
    runs = {}
    for sequence_parallel in (False, True):
        plan = _tiny_plan([StagePlan(layers=4, recompute=4)], tp=2)
        plan.model_overrides["dropout"], plan.sequence_parallel = 0.0, sequence_parallel
        plan.micro_batch = 4  # two micro-batches: with four, SP's peaks varied by +-25% (gloo threads)
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 2))
        runs[sequence_parallel] = plan, _torchrun(plan, tmp_path / f"sp{sequence_parallel}")
    _same_first_step(*(rep for _, rep in runs.values()))
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for _, rep in runs.values())
    assert a == pytest.approx(b, rel=2e-2, abs=0)
    seq = model("gpt3-tiny").seq
    for sequence_parallel, (plan, report) in runs.items():
        for r in report["ranks"]:
            predicted = plan.stages[r["stage"]].memory_bytes
            assert abs(predicted / r["memory_bytes"] - 1) < TOLERANCE, (r, predicted)
            assert r["layer_input_shape"][0] == (seq // 2 if sequence_parallel else seq), r
    _tp_groups_agree(runs[True][1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero2_with_sequence_parallelism_trains_as_without_zero(tmp_path):
    """4 processes, TP 2 with sequence parallelism x DP 2: ZeRO-2 (gradients reduced to their
    owner as backward makes them; the norms' partial sums over the sequence shards summed over the
    TP group first) trains as plain data parallelism does (no dropout; bf16 sums in another
    order), and its memory is within the tolerance of the prediction. Negative control: the
    memory the same plan at ZeRO-0 predicts is outside it (measured: +55% to +59%; a ZeRO-2 that
    sharded nothing would match that one)."""
    runs = {}
    for zero in (0, 2):
        plan = _tiny_plan([StagePlan(layers=4, zero=zero)], tp=2, dp=2)
        plan.model_overrides["dropout"], plan.sequence_parallel = 0.0, True
        plan.micro_batch = 4  # one micro-batch a step: the reductions in backward hooks vary less
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 4))
        runs[zero] = plan, _torchrun(plan, tmp_path / f"zero{zero}")
    _same_first_step(*(rep for _, rep in runs.values()))
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for _, rep in runs.values())
    assert a == pytest.approx(b, rel=2e-2, abs=0)
    (plain_plan, _), (plan, report) = runs[0], runs[2]
    _tp_groups_agree(report)
    for r in report["ranks"]:
        predicted = plan.stages[r["stage"]].memory_bytes
        assert abs(predicted / r["memory_bytes"] - 1) < TOLERANCE, (r, predicted)
        assert abs(plain_plan.stages[r["stage"]].memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, r


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("stage_zero", "pre_post"),
    [
        (2, PrePostPlan(zero=0)),
        (0, PrePostPlan(zero=1, offload_optimizer=1.0)),
        (3, PrePostPlan(zero=0)),
        (0, PrePostPlan(zero=3)),
    ],
    ids=[
        "layers-zero2-edges-zero0",
        "layers-zero0-edges-zero1-offloaded",
        "layers-zero3-edges-zero0",
        "layers-zero0-edges-zero3",
    ],
)
def test_embedding_and_head_strategy_of_their_own(tmp_path, stage_zero, pre_post):
    """``pre_post``: the embedding and head (a vocabulary of 4096: most of this model's
    parameters) with their own ZeRO stage and optimizer offload, the layers with the stage's;
    ZeRO-3 for part of the stage (FSDP2 groups of the layers only, or of the embedding and head
    only, the rest left whole). The same losses as the stage's strategy for everything (bf16 sums
    in another order), memory and host bytes within the tolerance of the prediction. Negative
    control: the memory predicted for the stage's strategy alone is outside it (an engine
    ignoring pre_post would match that)."""
    runs = {}
    for edge in (None, pre_post):
        plan = _tiny_plan([StagePlan(layers=4, zero=stage_zero)], dp=2)
        plan.micro_batch, plan.pre_post, plan.model_overrides["vocab"] = 4, edge, 4096
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 2))
        runs[edge is not None] = plan, _torchrun(plan, tmp_path / f"pre_post{edge is not None}")
    _same_first_step(*(rep for _, rep in runs.values()))
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for _, rep in runs.values())
    assert a == pytest.approx(b, rel=2e-2, abs=0)
    (alone, _), (plan, report) = runs[False], runs[True]
    for r in report["ranks"]:
        stage = plan.stages[r["stage"]]
        assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)
        assert r["host_optimizer_bytes"] == pytest.approx(stage.host_memory_bytes, rel=0.02), r
        assert abs(alone.stages[r["stage"]].memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_with_tensor_and_sequence_parallelism_trains_as_without_zero(tmp_path):
    """4 processes, TP 2 with sequence parallelism x DP 2, ZeRO-3 (FSDP2 shards each TP rank's
    part over its DP group): the same losses as without ZeRO (no dropout; bf16 sums in another
    order), memory within the tolerance of the prediction, the ZeRO-0 prediction outside it, and
    the norms still marked for the TP-group gradient sum after FSDP2 replaced them and summed
    (a lost mark moved the losses by only 1.6% over 8 steps: inside the loss tolerance)."""
    runs = {}
    for zero in (0, 3):
        plan = _tiny_plan([StagePlan(layers=4, zero=zero)], tp=2, dp=2)
        plan.micro_batch, plan.sequence_parallel, plan.model_overrides["dropout"] = 4, True, 0.0
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 4))
        runs[zero] = plan, _torchrun(plan, tmp_path / f"zero{zero}")
    _same_first_step(*(rep for _, rep in runs.values()))
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for _, rep in runs.values())
    assert a == pytest.approx(b, rel=2e-2, abs=0)
    (plain_plan, plain), (plan, report) = runs[0], runs[3]
    marked = plain["ranks"][0]["sequence_parallel_params"]
    _tp_groups_agree(report)
    for r in report["ranks"]:
        stage = plan.stages[r["stage"]]
        assert r["sequence_parallel_params"] == marked, r
        assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)
        assert abs(plain_plan.stages[r["stage"]].memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, r


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dp", "zero"), [(1, 0), (2, 1), (2, 2)], ids=["dp1", "dp2-zero1", "dp2-zero2"])
def test_weight_offload_trains_the_same_and_frees_the_device(tmp_path, dp, zero):
    """Every weight (the embedding and head too: they follow the stage) at rest on the host, up for
    its layer's forward and backward with the next layer's prefetched, the optimizer offloaded
    too (so weights are a large share of what the device holds; micro-batches of 1, every layer
    recomputed). The same losses as without (the same arithmetic: 1e-6), the host holds the
    weights' bytes the model counts, no weight is left on the device after the step, and the
    device memory is within the tolerance of the prediction. Negative control: the memory
    predicted without weight offloading is outside it (a weight that never left the device would
    match that one). ZeRO-2 without the memory checks: at this size its memory comes out 20-33%
    under the prediction with or without weight offloading (the model holds the gradient shards
    all step; the engine frees them once reduced), a gap of the model's, not of this mechanism;
    its updated weights, at rest on the host, are broadcast through the device
    (zero.broadcast_through) and its sums stepped through ``step_grad``."""
    plain_plan, plain, plan, report = _offload_pair("offload_weights", dp, zero, tmp_path)
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (plain, report))
    assert a == pytest.approx(b, rel=1e-6)
    for r, r0 in zip(report["ranks"], plain["ranks"], strict=True):
        stage, without = plan.stages[r["stage"]], plain_plan.stages[r["stage"]]
        assert r["weights_left_on_device"] == 0, r
        moved = stage.host_memory_bytes - without.host_memory_bytes  # the weights' bf16 bytes
        assert r["host_weight_bytes"] == pytest.approx(moved, rel=0.02), (r, moved)
        assert r0["held_bytes"] - r["held_bytes"] == r["host_weight_bytes"], (r0, r)
        if zero < 2:
            assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)
            assert abs(without.memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, (r, without.memory_bytes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_part_with_fewer_buckets_than_replicas_trains(tmp_path):
    """Two stages x DP 2 at ZeRO-1, the embedding/head a part of their own: the last stage's head is one
    bucket for two replicas, so one rank steps none of that part (it must hold no optimizer for
    it, not fail). The model learns, and each stage's largest rank is within the tolerance of the
    prediction (what a plan must fit). The engine shards ZeRO by whole buckets where the model
    splits evenly, so the other last-stage rank comes out 17% under it: the head's optimizer
    state is all on one rank (Megatron's distributed optimizer splits elements, not buckets)."""
    plan = _plan(1, [2, 2], [1, 1], dp=2, zero=1)
    plan.pre_post = PrePostPlan(zero=1)
    assert not unsupported(plan), unsupported(plan)
    report = _torchrun(plan, tmp_path, steps=5)  # six layers learn slower: 0.26 in seven steps
    losses = next(r["losses"] for r in report["ranks"] if r["losses"] is not None)
    assert min(losses[1:]) < losses[0] - 0.5, losses  # the lowest after the first: Adam bounces
    predict(plan, plan.model_spec(), cluster("cpu", 4))
    for i, stage in enumerate(plan.stages):
        largest = max(r["memory_bytes"] for r in report["ranks"] if r["stage"] == i)
        assert abs(stage.memory_bytes / largest - 1) < TOLERANCE, (i, largest, stage.memory_bytes)
    last = [r["held_bytes"] for r in report["ranks"] if r["stage"] == 1]
    assert max(last) - min(last) > 0.15 * max(last)  # the head's state on one replica only


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("dp", "zero"), [(1, 0), (2, 0), (2, 1), (2, 2)], ids=["dp1", "dp2", "dp2-zero1", "dp2-zero2"]
)
def test_gradient_offload_accumulates_on_the_host(tmp_path, dp, zero):
    """Every gradient accumulates on the host (ZeRO-2: this rank's reduced share), the optimizer
    offloaded too (micro-batches of 1, every layer recomputed): the same losses as without (the
    same sums: 1e-6), the host buffers hold the bytes the model counts, and without ZeRO and
    with ZeRO-1 the device memory is within the tolerance of the prediction (-5.2% on the Intel
    Xeon VM on 2026-12-06 at both, the peak op a linear's weight-gradient GEMM; +1.8% on the AMD
    one before the model priced that gradient, the same in every launch), the one without
    gradient offload outside it (negative control). At ZeRO-1 the peak was the broadcast of the
    updated weights while it made a flat copy of each owner's share (rank 0 at -32%, 0.93 MB
    against 0.63 predicted); it runs in place now (test_mist_offload_mechanisms.py:
    test_zero1_broadcasts_updated_weights_in_place). With ZeRO-2 only the losses and host bytes
    are checked: its reductions in backward hooks vary by up to 50% (its model is 12-33% off
    besides; docs/mist.md). So up to ZeRO-1 the device's held bytes are checked too (deterministic):
    what the offload takes off them is the host's gradient bytes, within the tolerance of the
    memory the prediction saves (-0.8%; a gradient left on the device would save nothing)."""
    plain_plan, plain, plan, report = _offload_pair("offload_grads", dp, zero, tmp_path)
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (plain, report))
    assert a == pytest.approx(b, rel=1e-6)
    for r, r0 in zip(report["ranks"], plain["ranks"], strict=True):
        stage, without = plan.stages[r["stage"]], plain_plan.stages[r["stage"]]
        moved = stage.host_memory_bytes - without.host_memory_bytes  # the gradients' bf16 bytes
        assert r["host_gradient_bytes"] == pytest.approx(moved, rel=0.03), (r, moved)
        if zero < 2:  # ZeRO-2 frees its gradient shards once reduced: none held, offloaded or not
            saved, predicted = r0["held_bytes"] - r["held_bytes"], without.memory_bytes - stage.memory_bytes
            assert saved == r["host_gradient_bytes"], (r0, r)
            assert saved == pytest.approx(predicted, rel=TOLERANCE), (r0, r, predicted)
            assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)
            assert abs(without.memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, (r, without.memory_bytes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero1_offloads_a_fraction_of_each_owners_gradients(tmp_path):
    """ZeRO-1 over 2 replicas with half the gradients summed on the host (GradientOffload: half
    of each owner's share, ShardedMasterAdamW.shares), half the weights at rest there and a
    quarter of each share's optimizer stepped there (part of the weights at rest stepped on the
    host, part on the device and sent from their masters: zero.broadcast_through): the same
    losses as the plan that offloads nothing (the same sums: 1e-6), and every rank holds the
    same host gradient buffer (all of them sum every gradient, into one layout)."""
    runs = []
    for offloaded in (False, True):
        fractions = {"offload_grads": 0.5, "offload_weights": 0.5, "offload_optimizer": 0.25}
        stage = StagePlan(layers=4, recompute=2, zero=1, **(fractions if offloaded else {}))
        plan = _tiny_plan([stage], dp=2)
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 2))
        runs.append(_torchrun(plan, tmp_path / f"offloaded{offloaded}"))
    plain, report = runs
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (plain, report))
    assert a == pytest.approx(b, rel=1e-6)
    held = {r["host_gradient_bytes"] for r in report["ranks"]}
    assert len(held) == 1 and held != {0}, report["ranks"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("timing", ["latest", "run-ahead"])
@pytest.mark.parametrize(
    ("stages", "dp", "zero", "edges"),
    [([4], 2, 0, False), ([4], 2, 1, False), ([4], 2, 2, False), ([4], 2, 3, False), ([2, 2], 1, 0, True)],
    ids=["dp2", "dp2-zero1", "dp2-zero2", "dp2-zero3", "pp2-edges"],
)
def test_offloading_waits_for_every_copy_it_reads(tmp_path, stages, dp, zero, edges, timing):
    """``--copy-timing latest`` (offload.CopyTiming) makes each of offloading's copies only when it
    is waited for, ``run-ahead`` every copy queued at the first wait after it: the latest and the
    earliest a GPU's copy stream may make them, their destinations poisoned until then. A plan
    offloading half of each layer's weights, every gradient, the activations of the layers not
    recomputed (one of each stage's is) and half the optimizer state then trains to the same
    losses, gradient norms and final weights, exactly, as with copies in line: every value the
    engine reads through a copy was waited for, as a GPU needs (over DP: ZeRO-0/1's host sums,
    ZeRO-2's and ZeRO-3's, a CPU-only path; in a pipeline, 1F1B's micro-batches in flight, and
    the embedding and head offloading as their own part, ``pre_post``). Negative controls, a wait
    dropped: test_mist_offload_mechanisms.py (what neither timing can see: offload.CopyTiming)."""
    offloads = {"offload_weights": 0.5, "offload_grads": 1.0, "offload_activations": 1.0}
    plan = _tiny_plan(
        [StagePlan(n, recompute=1, zero=zero, offload_optimizer=0.5, **offloads) for n in stages], dp=dp
    )
    if edges:
        plan.pre_post = PrePostPlan(offload_weights=1.0, offload_grads=0.5)
    assert not unsupported(plan), unsupported(plan)
    assert bool(unsupported(plan, "cuda")) == (zero == 3), unsupported(plan, "cuda")  # ZeRO-3: CPU only
    in_line = _torchrun(plan, tmp_path / "in-line", steps=2)
    deferred = _torchrun(plan, tmp_path / timing, steps=2, extra=("--copy-timing", timing))
    assert (deferred["copy_timing"], in_line["copy_timing"]) == (timing, "in-line")
    for a, b in zip(in_line["ranks"], deferred["ranks"], strict=True):
        fields = ("losses", "global_grad_norms", "weight_sum")
        assert [a[f] for f in fields] == [b[f] for f in fields], (a, b)
        assert a["host_weight_bytes"] > 0 and a["host_gradient_bytes"] > 0, a
        assert a["activation_offloaded_layers"] == stages[a["stage"]] - 1, a
    assert all(math.isfinite(x) for r in deferred["ranks"] if r["losses"] for x in r["losses"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_offloads_weight_and_gradient_shards(tmp_path):
    """ZeRO-3 (FSDP2) with every weight shard at rest on the host and half the gradient shards
    added into host buffers as the reduce-scatters make them (hidden 256, so weights dominate;
    every layer recomputed, the optimizer offloaded in both runs, one micro-batch a step). The
    same losses as ZeRO-3 alone (the same arithmetic: 1e-6); the host holds the bytes the model
    counts; the device holds the weight shards' bytes fewer, and the gradient shards it keeps
    plus those on the host are the plain run's (negative control: a kept shard left as a view
    pins its group's whole reduce-scatter output, and the sum comes out larger). Memory: on a
    CPU, ZeRO-3's step peak moves by a layer's full weights from step to step (gloo; at this
    size 8.4-11.5 MiB above 3.1 MiB held), so the prediction is checked against the range of the
    profiled steps, widened by the tolerance, its low end by one layer's full weights more: the
    steps' peaks fall in modes a layer's weights apart (here 8.11 and 9.69 MB of the offloaded
    run), and a CI run whose 5 profiled steps all fell in the upper one failed the plain range."""
    runs = {}
    for offloaded in (False, True):
        stage = StagePlan(
            layers=4,
            recompute=4,
            zero=3,
            offload_optimizer=1.0,
            offload_weights=1.0 * offloaded,
            offload_grads=0.5 * offloaded,
        )
        plan = _tiny_plan([stage], dp=2)
        plan.micro_batch, plan.model_overrides["hidden"] = 4, 256
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 2))
        runs[offloaded] = plan, _torchrun(plan, tmp_path / f"offloaded{offloaded}")
    (plain_plan, plain), (plan, report) = runs[False], runs[True]
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (plain, report))
    assert a == pytest.approx(b, rel=1e-6)
    problem = Problem.of_plan(plan, plan.model_spec(), cluster("cpu", 2))
    layer_weights = 2 * layer_numbers(problem.setting(*plan.stage_parallelism(0), 1)).params  # bf16, whole
    for r, r0 in zip(report["ranks"], plain["ranks"], strict=True):
        stage, without = plan.stages[r["stage"]], plain_plan.stages[r["stage"]]
        moved = stage.host_memory_bytes - without.host_memory_bytes  # weight and gradient shards
        assert r["host_weight_bytes"] + r["host_gradient_bytes"] == pytest.approx(moved, rel=0.02), (r, moved)
        assert r["host_gradient_bytes"] == pytest.approx(r["host_weight_bytes"] / 2, rel=0.05), r
        assert r0["held_bytes"] - r["held_bytes"] == r["host_weight_bytes"] > 0, (r0, r)
        kept = r["device_grad_bytes"] + r["host_gradient_bytes"]
        assert kept == pytest.approx(r0["device_grad_bytes"], rel=1e-3), (r, r0)
        for rep, st in ((r, stage), (r0, without)):
            lo = rep["held_bytes"] + min(rep["step_peaks_bytes"]) - layer_weights
            hi = rep["worst_memory_bytes"]
            assert lo * (1 - TOLERANCE) < st.memory_bytes < hi * (1 + TOLERANCE), (rep, st.memory_bytes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_embedding_and_head_offload_their_own_weights_and_gradients(tmp_path):
    """pre_post with the embedding's and head's weights, gradients and optimizer on the host (a
    vocabulary of 1024: 40% of the parameters), the layers keeping theirs: the same losses as
    without, host weight and gradient bytes as the model counts, memory within the tolerance
    (measured -1%), and the prediction without pre_post outside it (31% away: negative control).
    The two are not prefetched together: they run at opposite ends, one at a time, as the model
    prices them. At a vocabulary of 4096 the measured peak is 12% under the prediction, with or
    without pre_post: the model over-prices the head's step peak by ~0.3 MB there."""
    runs = {}
    edges = PrePostPlan(zero=0, offload_weights=1.0, offload_grads=1.0, offload_optimizer=1.0)
    for pre_post in (None, edges):
        plan = _tiny_plan([StagePlan(layers=4, recompute=4, offload_optimizer=1.0)])
        plan.micro_batch, plan.pre_post, plan.model_overrides["vocab"] = 1, pre_post, 1024
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 1))
        runs[pre_post is not None] = plan, _torchrun(plan, tmp_path / f"pre_post{pre_post is not None}")
    (alone, plain), (plan, report) = runs[False], runs[True]
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (plain, report))
    assert a == pytest.approx(b, rel=1e-6)
    (r,) = report["ranks"]
    stage = plan.stages[0]
    moved = stage.host_memory_bytes - alone.stages[0].host_memory_bytes
    assert r["host_weight_bytes"] + r["host_gradient_bytes"] == pytest.approx(moved, rel=0.02), (r, moved)
    assert r["weights_left_on_device"] == 0
    assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)
    assert abs(alone.stages[0].memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_uneven_stages_anywhere_train_and_memory_matches(tmp_path):
    """Four stages of 1, 2, 1 and 2 layers (uneven in the middle, which Megatron's first/last-stage
    settings cannot say; megatron-core's pipeline layout can): each stage builds the plan's count,
    the model learns, and each rank's memory is within the tolerance of the prediction (measured
    on the Intel Xeon VM, 2026-12-06: -5.6%, -0.0%, -4.0%, +1.7% on stages 0-3; +9.8%, +1.5%,
    +8.5%, -1.6% on the AMD one on 2026-12-01, before the CPU stand-ins for bf16 GEMMs and dropout
    masks; deterministic on a machine: the step peaks repeat to the byte; without recomputation
    the first stages' four micro-batches in flight come out 13-19% above
    the prediction, a gap of the memory model's at this size). Negative control: the counts
    swapped (2, 1, 2, 1) predict memory outside the tolerance for every stage (measured: +63%,
    -46%, +80%, -41%), so a stage built with its neighbour's count would fail the memory check.
    No loss comparison with an even split: each stage draws its layers' initial weights from its
    own stream (test_gradient_clipping_norm_is_the_whole_models_in_every_layout), so another
    split trains another model."""
    plan = _plan(1, [1, 2, 1, 2], [1, 2, 1, 2])
    swapped = _plan(1, [2, 1, 2, 1], [2, 1, 2, 1])
    for p in (plan, swapped):
        p.model_overrides["layers"] = 6
        assert not unsupported(p), unsupported(p)
        predict(p, p.model_spec(), cluster("cpu", 4))
    report = _torchrun(plan, tmp_path, steps=5)  # six layers learn slower: 0.26 in seven steps
    losses = next(r["losses"] for r in report["ranks"] if r["losses"] is not None)
    assert min(losses[1:]) < losses[0] - 0.5, losses  # the lowest after the first: Adam bounces
    for r in report["ranks"]:
        stage = plan.stages[r["stage"]]
        assert r["layers"] == stage.layers, r
        assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)
        assert abs(swapped.stages[r["stage"]].memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_device_peak_above_the_plans_cap_ends_the_run_as_out_of_memory(tmp_path):
    """The plan's per-device cap on a CPU: at half the predicted memory every rank stops before
    the timed steps, the report says out of memory and has no time, the ranks exit with status 3
    (torchrun's own: 1); at 1.5 times
    the prediction (negative control: the cap is what stops it) the run is timed."""
    outcomes = {}
    for share in (0.5, 1.5):
        plan = _plan(1, [4], [2], dp=2, zero=1)
        predict(plan, plan.model_spec(), cluster("cpu", 2))
        plan.gpu_memory_bytes = int(share * plan.stages[0].memory_bytes)
        path, out = tmp_path / f"cap{share}.yaml", tmp_path / f"cap{share}.json"
        plan.save(path)
        args = ["--plan", str(path), "--steps", "2", "--out", str(out)]
        # the failing run as a user meets it (torchrun); the control forked, as the other tests
        launch = run_torchrun if share < 1 else fork_launch.shared("mist.engine.run:preload").run
        done = launch(plan.gpus, "mist.engine.run", args, timeout=240)
        outcomes[share] = done, json.loads(out.read_text())
    done, report = outcomes[0.5]
    assert done.returncode != 0 and "error: out of memory" in done.stderr, done.stderr[-2000:]
    assert all(r["out_of_memory"] and r["step_s"] == [] for r in report["ranks"]), report
    done, report = outcomes[1.5]
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(not r["out_of_memory"] and len(r["step_s"]) == 2 for r in report["ranks"]), report


@pytest.mark.slow
def test_planner_plan_runs(tmp_path):
    """What `mist plan` makes for 2 CPU processes (sequence parallelism as planned), searched
    without ZeRO and offloading: the planner's plain space runs as planned (the mechanisms have
    tests of their own)."""
    from mist import search
    from mist.tuning.planner import PlannerOptions
    from mist.tuning.stage_cost import SearchSpace

    plan = search(
        model("gpt3-tiny"), cluster("cpu", 2), 8, PlannerOptions(SearchSpace(zero_stages=(0,), offload=False))
    )
    assert not unsupported(plan), unsupported(plan)
    report = _torchrun(plan, tmp_path, steps=4)
    losses = next(r["losses"] for r in report["ranks"] if r["losses"] is not None)
    assert losses[-1] < losses[0]


COMPARISON = Path(__file__).parents[2] / "artifacts/mist_vs_megatron/reference/comparison.json"


def test_every_plan_of_the_committed_comparison_is_accepted():
    """Every plan of every system in the committed mist_vs_megatron comparison, rebuilt from its
    summary, is one the engine accepts (the counts are printed; the history: at 8f1b34b, 7 of 60
    Mist plans were accepted; 57 of the reference of
    2026-12-01; 53 of the reference of 2026-12-02, whose memory model is the engine's and picks
    offloading under ZeRO-3 more often; all 60 once the engine offloaded under ZeRO-3 and ran it
    for part of a stage. Aceso's: 44 until plans whose stages all share a TP/DP of their own were
    lifted to that TP/DP, 57 then, all 60 once stages whose TP/DP differ ran). The Megatron-LM
    target's too, where it has one (Falcon: Megatron-LM cannot build it, said so instead).

    On a GPU the engine refuses exactly the plans that offload weights or gradients of a ZeRO-3
    part with DP replicas (offload.py's GPU path does not offload FSDP2's shards): counted here,
    so the gap is a number, not a footnote (30 of the 60 Mist plans of the reference of c0f2e50
    until ZeRO-1/2 offloaded weights and ZeRO-0/1/2 gradients over DP on a GPU too; none now)."""
    from artifacts.mist_vs_megatron.run import SYSTEMS

    points = json.loads(COMPARISON.read_text())["points"]
    accepted, on_gpu, made = (dict.fromkeys(SYSTEMS, 0) for _ in range(3))
    for point in points:
        for system in SYSTEMS:
            summary = point["result"].get(system, {})
            if "stages" not in summary:
                assert system == "megatron_lm_target" and "not_runnable" in summary, (point["key"], system)
                continue
            made[system] += 1
            plan = summary_plan(point["key"], summary)
            accepted[system] += not unsupported(plan)
            gpu_reasons = unsupported(plan, "cuda")
            on_gpu[system] += not gpu_reasons
            held = plan.strategies_with_dp()
            offloads = any(d > 1 and s.zero >= 3 and (s.offload_grads or s.offload_weights) for s, d in held)
            assert bool(gpu_reasons) == offloads, (point["key"], system, gpu_reasons)
    print(f"accepted of {len(points)} cases on the CPU engine:", accepted, "on a GPU:", on_gpu)
    assert accepted == made and made["mist"] == len(points), (accepted, made)
    # the baselines never offload weights or gradients: a GPU runs all of theirs
    assert all(on_gpu[s] == made[s] for s in SYSTEMS if s != "mist"), (on_gpu, made)


@pytest.mark.parametrize(
    ("offload", "zero", "dp", "on_gpu"),
    [
        ({"offload_weights": 0.5}, 0, 1, True),
        ({"offload_weights": 0.5}, 0, 2, True),  # ZeRO-0: the DP sum reads the gradients only
        ({"offload_weights": 0.5}, 1, 2, True),  # ZeRO-1's broadcasts copy them through the device
        ({"offload_weights": 0.5}, 2, 2, True),
        ({"offload_weights": 0.5}, 3, 1, True),  # one replica: no FSDP2
        ({"offload_weights": 0.5}, 3, 2, False),  # FSDP2's gathers would read host shards
        ({"offload_grads": 1.0}, 0, 2, True),  # the DP sum through the device, a gradient at a time
        ({"offload_grads": 1.0}, 2, 2, True),  # reduced on the device, summed on the host
        ({"offload_grads": 1.0}, 3, 1, True),
        ({"offload_grads": 1.0}, 3, 2, False),  # FSDP2's reduce-scatters would write host shards
    ],
)
@pytest.mark.parametrize("on_pre_post", [False, True], ids=["stage", "pre_post"])
def test_the_engine_refuses_what_offload_py_runs_on_a_cpu_only(offload, zero, dp, on_gpu, on_pre_post):
    """offload.py's GPU path offloads weights and gradients under ZeRO-0/1/2 at any DP and under
    ZeRO-3 with one replica; a GPU refuses ZeRO-3's over DP replicas (its host shards), in the
    layers' stages and in the embedding/head's own strategy, and a CPU runs them all; an unknown
    device is one line. Control: a plain plan runs on both."""
    plain = _tiny_plan([StagePlan(4)])
    assert unsupported(plain, "cuda") == [] == unsupported(plain)
    plan = _tiny_plan([StagePlan(4, zero=zero, **({} if on_pre_post else offload))], dp=dp)
    if on_pre_post:
        plan.pre_post = PrePostPlan(zero=zero, **offload)
    assert unsupported(plan) == [], (offload, on_pre_post)
    reasons = " ".join(unsupported(plan, "cuda"))
    assert (reasons == "") == on_gpu, reasons
    assert on_gpu or "on a GPU" in reasons, reasons
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        unsupported(plain, "gpu")


def test_every_plan_of_the_gpu_checks_engine_part_runs_on_a_gpu():
    """The GPU check's engine plans (artifacts.mist_vs_megatron.engine.GPU_ENGINE), weight and
    gradient offloading among them, are ones the engine accepts on a GPU, and one of them neither
    recomputes nor offloads (claim mist-gpu-engine-losses compares every plan's losses with it)."""
    from artifacts.mist_vs_megatron.engine import GPU_ENGINE, changes_nothing, setup_plan

    offloads = set()
    for name in GPU_ENGINE.plans:
        plan = setup_plan(GPU_ENGINE, name)
        assert unsupported(plan, "cuda") == [], (name, unsupported(plan, "cuda"))
        offloads |= {f for f in ("offload_weights", "offload_grads") if getattr(plan.stages[0], f)}
    assert offloads == {"offload_weights", "offload_grads"}, offloads
    assert any(changes_nothing(fields) for fields in GPU_ENGINE.plans.values())


@pytest.mark.parametrize("setup", ["MEASURED", "GPU_MEASURED"])
def test_measured_comparison_cases_bind_and_every_plan_in_them_runs(setup):
    """The cases of mist_vs_megatron's measured part (this CPU) and of the GPU check's: the plain
    plan needs more than the cap (the run also measures that it runs out of memory) and every
    system's plan under the cap is one the engine accepts, carrying the cap it enforces (priced
    here by the device preset's nominal roofline; the experiment prices with the fitted model and
    may pick others)."""
    from artifacts.mist_vs_megatron import measured
    from mist import predict

    setup = getattr(measured, setup)
    for case in setup.cases:
        plain = measured.plain_plan(case, setup.base)
        predict(plain, plain.model_spec(), plain.cluster())
        assert plain.stages[0].memory_bytes > case.cap_bytes, case
        plans = measured.plan_systems(case, None, aceso_budget=200, setup=setup)
        assert not isinstance(plans["mist"], str), (case, plans["mist"])
        for system, plan in plans.items():
            if isinstance(plan, str):
                continue
            assert plan.gpu_memory_bytes == case.cap_bytes, (case, system)
            assert unsupported(plan, setup.base.device) == [], (case, system)  # a GPU's refusals too
            assert max(s.memory_bytes for s in plan.stages) <= case.planning_bytes, (case, system)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plan_whose_stages_share_a_tp_dp_of_their_own_runs_as_that_plan(tmp_path_factory):
    """Aceso's form (plan TP 2 x DP 1, micro-batches of 4; every stage TP 1 x DP 2) trains exactly
    as the plan it is, TP 1 x DP 2 with micro-batches of 2: the engine lifts it (the same losses,
    bit for bit, and the same per-rank memory held)."""
    plain_plan, plain = _report((1, (4,), (2,), 2, 0), tmp_path_factory)
    aceso = _tiny_plan([StagePlan(layers=4, recompute=2, tp=1, dp=2)], tp=2, dp=1)
    aceso.micro_batch = 4
    assert aceso.grad_accum == plain_plan.grad_accum and not unsupported(aceso)
    report = _torchrun(aceso, tmp_path_factory.mktemp("aceso"))
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (plain, report))
    assert a == b
    assert [r["held_bytes"] for r in report["ranks"]] == [r["held_bytes"] for r in plain["ranks"]]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("second", "sequence_parallel"),
    [((2, 1), False), ((2, 1), True), ((1, 1), False)],
    ids=["tp2", "tp2-sp", "one-device"],
)
def test_stages_whose_tp_dp_differ_train_as_the_same_pipeline_on_one_process_a_stage(
    tmp_path_factory, second, sequence_parallel
):
    """Stage 0 on TP 1 x DP 2, stage 1 on TP 2 x DP 1 (4 processes; each micro-batch's 4 sequences
    split 2 + 2 in stage 0, whole on each TP rank of stage 1, and with sequence parallelism each of
    those holds half the positions) or, with a device count of its own, on one process (3 processes:
    Mist's §5.3 stages, as the planner makes them for 3 stages on 4 GPUs) against the same two
    stages on one process each (no dropout). Before any update the two compute the same thing: the
    same first loss (1e-4), and stage 0's gradient norm after its DP average equal to the one
    process's (1e-3; each replica's loss is the mean of its own sequences, so the input gradient
    stage 0 receives is scaled by its DP over the next stage's: without that, half), stage 1's over
    its two TP ranks too (1e-2: its final norm's weights are on both). After that, Adam at lr 1e-2
    amplifies the TP split's different bf16 rounding (0.2% after two steps, 10% after eight), so
    only the first three losses are compared (2%). Each rank's layer input holds its replica's
    sequences (2 in stage 0, 4 in stage 1: a per-stage DP ignored would give equal ones), and memory
    is within the tolerance of each stage's prediction."""
    runs = {}
    for shape in ("one-process", "own"):
        if shape == "own":
            stages = [StagePlan(layers=2), StagePlan(layers=2, tp=second[0], dp=second[1])]
            plan = _tiny_plan(stages, tp=1, dp=2)
            plan.gpus = 2 + second[0] * second[1]
            plan.sequence_parallel = sequence_parallel
        else:
            plan = _tiny_plan([StagePlan(layers=2), StagePlan(layers=2)])
            plan.micro_batch = 4
        plan.model_overrides["dropout"] = 0.0
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", plan.gpus))
        runs[shape] = plan, _torchrun(plan, tmp_path_factory.mktemp(shape))
    (_, ref), (plan, report) = runs["one-process"], runs["own"]
    a, b = (next(r["losses"] for r in rep["ranks"] if r["losses"] is not None) for rep in (ref, report))
    assert b[0] == pytest.approx(a[0], rel=1e-4) and b[:3] == pytest.approx(a[:3], rel=2e-2), (a, b)
    ref_norms = {r["stage"]: r["first_grad_norm"] for r in ref["ranks"]}
    stage1 = sum(r["first_grad_norm"] ** 2 for r in report["ranks"] if r["stage"] == 1) ** 0.5
    assert stage1 == pytest.approx(ref_norms[1], rel=1e-2)
    for r in report["ranks"]:
        if r["stage"] == 0:
            assert r["first_grad_norm"] == pytest.approx(ref_norms[0], rel=1e-3), (r, ref_norms)
        assert r["layer_input_shape"][1] == plan.stage_parallelism(r["stage"])[2] == 2 * (1 + r["stage"])
        halved = sequence_parallel and r["stage"] == 1  # stage 1's TP ranks hold half the positions
        assert r["layer_input_shape"][0] == plan.model_spec().seq // (2 if halved else 1), r
        stage = plan.stages[r["stage"]]
        assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)


def test_every_part_a_plan_holds_is_built():
    """What Megatron-LM cannot build (megatron_limits names it) the engine builds around: stages
    whose TP/DP differ, with sequence parallelism, offloading under ZeRO-3 and ZeRO-3 for part of
    a stage, pre_post, uneven middle stages and the parallel block, here in one plan."""
    from mist.engine.megatron import megatron_limits

    stages = [
        StagePlan(layers=2, zero=3, offload_grads=0.5),
        StagePlan(layers=3, tp=1, dp=4),
        StagePlan(layers=2, tp=1, dp=4),
        StagePlan(layers=2, offload_weights=1.0),
    ]
    plan = Plan.of(
        model("falcon-tiny"),
        cluster("cpu", 16),
        global_batch=8,
        tp=2,
        dp=2,
        micro_batch=2,
        stages=stages,
        pre_post=PrePostPlan(zero=1),
        sequence_parallel=True,
    )
    limits = megatron_limits(plan, plan.model_spec())
    assert set(limits) == {
        "parallel_block",
        "stage_parallelism",
        "pre_post",
        "uneven_middle_stages",
        "offload_weights_grads",
    }, limits
    assert unsupported(plan) == []


@pytest.mark.slow
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_parallel_block_layer_is_attention_plus_mlp_on_one_norm(tmp_path, normalization):
    """The engine's parallel block (Falcon, GPT-J): y = x + attention(norm(x)) + mlp(norm(x)) in
    float64, its gradient too, with no second norm. Negative control: megatron-core's sequential
    layer with the same weights is far from that formula."""
    out = tmp_path / "check.json"
    done = run_torchrun(
        1,
        "tests.mist.parallel_block_check",
        ["--out", str(out), "--normalization", normalization],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["second_norm"] == "IdentityOp"
    assert result["output_error"] <= 1e-12 and result["gradient_error"] <= 1e-12, result
    assert result["sequential_differs_by"] > 1e-2, result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_falcon_plan_trains_with_tp_and_memory_matches(tmp_path):
    """A Falcon plan (the parallel block, priced with one norm and one all-reduce a layer) trains on
    2 processes with TP 2, and each rank's memory is within the tolerance of the prediction."""
    plan = _tiny_plan([StagePlan(layers=4, recompute=1)], tp=2)
    plan.model = "falcon-tiny"
    assert not unsupported(plan), unsupported(plan)
    report = _torchrun(plan, tmp_path)
    losses = next(r["losses"] for r in report["ranks"] if r["losses"] is not None)
    assert min(losses[1:]) < losses[0] - 0.5, losses  # the lowest after the first: Adam bounces
    predict(plan, model("falcon-tiny"), cluster("cpu", 2))
    for r in report["ranks"]:
        predicted = plan.stages[r["stage"]].memory_bytes
        assert abs(predicted / r["memory_bytes"] - 1) < TOLERANCE, (r, predicted)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_interleaved_pipeline_trains_as_its_virtual_stages_on_a_process_each(tmp_path_factory):
    """Interleaved 1F1B: 2 ranks of 2 chunks of one layer (rank 0 holds the model's layers 1 and 3,
    rank 1 layers 2 and 4; each chunk's layer recomputed) against the plain pipeline of those 4
    virtual stages on a process each. Chunk c of rank i is built from the seed as stage 2c + i
    alone, so both train one model on the same micro-batches (no dropout): the same losses (1e-6)
    and the same per-stage gradient norms. Negative control: the same 2 ranks not interleaved (2
    layers a stage) train another model, whose losses differ. Each rank builds its stage's layers
    and its memory is within the tolerance of the prediction (2.5 micro-batches' activations in
    flight on rank 0, against 2 for the plain 2-stage pipeline)."""
    plans = {
        "interleaved": _tiny_plan([StagePlan(layers=2, recompute=2), StagePlan(layers=2, recompute=2)]),
        "virtual": _tiny_plan([StagePlan(layers=1, recompute=1) for _ in range(4)]),
        "plain": _tiny_plan([StagePlan(layers=2, recompute=2), StagePlan(layers=2, recompute=2)]),
    }
    plans["interleaved"].virtual_stages = 2
    reports = {}
    for name, plan in plans.items():
        plan.model_overrides["dropout"] = 0.0
        plan.check()
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", plan.gpus))
        reports[name] = _torchrun(plan, tmp_path_factory.mktemp(name), steps=3)
    losses = {
        name: next(r["losses"] for r in rep["ranks"] if r["losses"] is not None)
        for name, rep in reports.items()
    }
    assert losses["interleaved"] == pytest.approx(losses["virtual"], rel=1e-6), losses
    assert losses["plain"] != pytest.approx(losses["virtual"], rel=1e-3), losses
    # rank i's first gradient norm covers virtual stages i and i + 2 of the 4-stage pipeline
    virtual_norms = {r["stage"]: r["first_grad_norm"] for r in reports["virtual"]["ranks"]}
    for r in reports["interleaved"]["ranks"]:
        i = r["stage"]
        expected = (virtual_norms[i] ** 2 + virtual_norms[i + 2] ** 2) ** 0.5
        assert r["first_grad_norm"] == pytest.approx(expected, rel=1e-5), (r, virtual_norms)
        assert r["layers"] == 2
        stage = plans["interleaved"].stages[i]
        assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_interleaved_pipeline_with_the_distributed_optimizer_trains_as_without(tmp_path_factory):
    """Interleaved 1F1B (2 ranks x 2 chunks of 2 layers, every layer recomputed) at DP 2 with ZeRO-1
    and half of each rank's optimizer share offloaded (Megatron-LM's distributed optimizer with
    --optimizer-offload-fraction 0.5) against the same pipeline at ZeRO-0 (4 processes each): the
    same training (bf16 sums in another order: 2e-2, as ZeRO-1 without interleaving), the state
    sharded over both chunks' layers (a rank holds less), and each rank's memory within the
    tolerance of the prediction (measured: -4.2% to +2.8%). The engine's ZeRO-1 shares are whole
    buckets (a layer, the embedding, the head) where the model prices an even share: with one
    layer a chunk, DP rank 0's share came out 12% above it and its memory 10.7% above."""
    reports, plans = {}, {}
    for zero, fraction in ((0, 0.0), (1, 0.5)):
        stages = [StagePlan(layers=4, recompute=4, zero=zero, offload_optimizer=fraction) for _ in range(2)]
        plan = _tiny_plan(stages, dp=2)
        plan.model_overrides["layers"] = 8
        plan.virtual_stages = 2
        plan.micro_batch = 1  # 4 micro-batches a step: a multiple of the 2 stages
        plan.model_overrides["dropout"] = 0.0
        plan.check()
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", plan.gpus))
        plans[zero], reports[zero] = plan, _torchrun(plan, tmp_path_factory.mktemp(f"zero{zero}"))
    _same_first_step(reports[0], reports[1])
    a, b = (next(r["losses"] for r in reports[z]["ranks"] if r["losses"] is not None) for z in (0, 1))
    assert a == pytest.approx(b, rel=2e-2, abs=0)
    for r in reports[1]["ranks"]:
        plain = next(p for p in reports[0]["ranks"] if p["rank"] == r["rank"])
        assert r["held_bytes"] < 0.75 * plain["held_bytes"], (r["held_bytes"], plain["held_bytes"])
        assert r["host_optimizer_bytes"] > 0, r
        stage = plans[1].stages[r["stage"]]
        assert abs(stage.memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, stage.memory_bytes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_interleaved_ranks_hold_the_activations_in_flight_the_model_prices(tmp_path):
    """2 ranks x 2 chunks of one layer, nothing recomputed, 4 micro-batches of 8 sequences: rank 0
    holds 5 chunk-ops' activations at its peak (2.5 micro-batches' worth, 1F1B's 2), rank 1 3 (1.5,
    against 1). Each rank's memory is within the tolerance of the prediction (measured: -2.9% and
    +3.7%); negative control: priced with 1F1B's in-flight counts it is outside (-14.1%, -14.0%),
    so the check would catch chunks that held what 1F1B holds. (With 8 micro-batches the ranks
    measured 7.4% and 9.2% more than with 4, where neither count changes: messages waiting for
    their receiver, which the model does not price; hence 4.)"""
    plan = _tiny_plan([StagePlan(layers=2), StagePlan(layers=2)])
    plan.virtual_stages, plan.micro_batch, plan.global_batch = 2, 8, 32
    plan.model_overrides["dropout"] = 0.0
    plan.check()
    plain = dataclasses.replace(plan, virtual_stages=1, stages=[dataclasses.replace(s) for s in plan.stages])
    for p in (plan, plain):
        predict(p, p.model_spec(), cluster("cpu", 2))
    report = _torchrun(plan, tmp_path)
    for r in report["ranks"]:
        i = r["stage"]
        assert abs(plan.stages[i].memory_bytes / r["memory_bytes"] - 1) < TOLERANCE, (r, plan.stages[i])
        assert abs(plain.stages[i].memory_bytes / r["memory_bytes"] - 1) > TOLERANCE, (r, plain.stages[i])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [0, 1])
def test_overlapped_gradient_reduction_trains_as_after_backward(tmp_path_factory, zero):
    """Megatron-LM's --overlap-grad-reduce at DP 2 (4 micro-batches a step, buckets of at least
    40k parameters: about a layer of this model's 49k): each bucket's
    all-reduce starts in the last micro-batch's backward, once its gradients are whole. The same
    losses as the sum after backward (1e-6: the same sums), and every bucket was begun in backward;
    negative control: the run without it began none. A bucket launched a micro-batch early would
    sum partial gradients, and the losses would differ."""
    reports = {}
    for overlap in (False, True):
        plan = _tiny_plan([StagePlan(layers=4, zero=zero)], dp=2)
        plan.micro_batch = 1
        plan.overlap_grad_reduce, plan.grad_bucket_params = overlap, 40_000 if overlap else None
        plan.model_overrides["dropout"] = 0.0
        plan.check()
        assert not unsupported(plan), unsupported(plan)
        reports[overlap] = _torchrun(plan, tmp_path_factory.mktemp(f"overlap{overlap}"), steps=2)
    a, b = (next(r["losses"] for r in reports[o]["ranks"] if r["losses"] is not None) for o in (False, True))
    assert a == pytest.approx(b, rel=1e-6), (a, b)
    for r in reports[True]["ranks"]:
        assert r["gradient_buckets"] >= 4 and r["buckets_reduced_in_backward"] == r["gradient_buckets"], r
    assert all(r["buckets_reduced_in_backward"] == 0 for r in reports[False]["ranks"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("zero", "stages", "virtual"),
    [(1, 1, 1), (2, 1, 1), (1, 2, 2)],
    ids=["zero1", "zero2", "zero1-interleaved"],
)
def test_weight_gather_in_forward_trains_as_after_the_step(tmp_path_factory, zero, stages, virtual):
    """Megatron-LM's --overlap-param-gather at DP 2 (buckets of at least 40k parameters: about a
    layer of this model's 49k), on one stage and on 2 ranks x 2 chunks of 2 layers, every layer
    recomputed: each group's updated weights are broadcast as the next forward reaches it. The same
    losses as broadcasting after the step (1e-6: the same weights), the DP replicas' weights equal
    after the run, and every group was waited for in forward; without it none was. A group never
    gathered would leave the replicas' weights apart (each steps only its share), and the losses
    would differ (checked by hand: with the forward's wait switched off, 8 of 9 losses differ)."""
    reports = {}
    for overlap in (False, True):
        layers = 8 // stages
        plan = _tiny_plan(
            [
                StagePlan(layers=layers, recompute=layers, zero=zero, gather_in_forward=overlap)
                for _ in range(stages)
            ],
            dp=2,
        )
        plan.model_overrides["layers"] = 8
        plan.micro_batch, plan.virtual_stages = 1, virtual
        plan.overlap_grad_reduce, plan.grad_bucket_params = True, 40_000
        plan.model_overrides["dropout"] = 0.0
        plan.check()
        assert not unsupported(plan), unsupported(plan)
        reports[overlap] = _torchrun(plan, tmp_path_factory.mktemp(f"gather{overlap}"), steps=3)
    a, b = (next(r["losses"] for r in reports[o]["ranks"] if r["losses"] is not None) for o in (False, True))
    assert a == pytest.approx(b, rel=1e-6), (a, b)
    assert len(set(a)) == len(a)  # the weights changed every step: a stale replica would show
    for r in reports[True]["ranks"]:
        assert r["weight_gather_groups"] >= 8 // stages, r
        assert r["weight_gathers_in_forward"] == r["weight_gather_groups"], r
        twin = next(t for t in reports[True]["ranks"] if t["stage"] == r["stage"] and t["rank"] != r["rank"])
        assert r["weight_sum"] == twin["weight_sum"], (r["weight_sum"], twin["weight_sum"])
    for r in reports[False]["ranks"]:
        assert r["weight_gather_groups"] == r["weight_gathers_in_forward"] == 0, r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tempo_plan_trains_as_the_plain_plan_within_predicted_memory(tmp_path):
    """``tempo: true`` in a plan's model_overrides (``mist plan --tempo``): the engine builds
    tempo.megatron's layers (a Llama: RMSNorm, SwiGLU, no dropout; TP 2 with sequence parallelism).
    The same weights and data train as megatron-core's layers do, up to bf16 rounding, and each
    rank's memory is within the tolerance of Mist's prediction, which prices what Tempo's layers
    keep. At this tiny shape both plans are priced alike; the control is one process at sequence
    128 and one micro-batch of 8 a step, where activations make the peak: there the Tempo plan's
    peak is below the plain plan's by at least half the saving the model predicts (megatron-core's
    layers would show none). (With TP 2 and sequence parallelism at that shape the Tempo plan's
    peak is in its attention's backward, whose CPU path works a chunk of heads at a time: the
    model prices that chunk, tempo.ops' statement, and predicts a saving of 3% where 15% was
    measured on 2026-12-05; docs/tempo.md.)"""
    runs = []
    for tempo in (False, True):
        plan = _tiny_plan([StagePlan(layers=4)], tp=2)
        plan.model, plan.sequence_parallel = "llama-tiny", True
        plan.model_overrides = {"flash": False, "tempo": tempo}
        assert not unsupported(plan), unsupported(plan)
        predict(plan, plan.model_spec(), cluster("cpu", 2))
        report = _torchrun(plan, tmp_path / f"tempo{tempo}")
        for r in report["ranks"]:
            predicted = plan.stages[r["stage"]].memory_bytes
            assert abs(predicted / r["memory_bytes"] - 1) < TOLERANCE, (tempo, r["memory_bytes"], predicted)
        runs.append(next(r["losses"] for r in report["ranks"] if r["losses"] is not None))
    plain, tempo = runs
    # the first step's loss: the same weights and data through the same math, rounded differently
    # where Tempo's ops round otherwise: within bf16's epsilon; later steps drift apart as any two
    # roundings of training do
    assert abs(tempo[0] / plain[0] - 1) < 2**-8, (plain[0], tempo[0])
    measured, predicted = {}, {}  # the control, by whether the plan has Tempo's layers
    for lean in (False, True):
        plan = _tiny_plan([StagePlan(layers=4)])
        plan.model, plan.micro_batch = "llama-tiny", 8
        plan.model_overrides = {"flash": False, "tempo": lean, "seq": 128}
        predict(plan, plan.model_spec(), cluster("cpu", 1))
        (rank,) = _torchrun(plan, tmp_path / f"control{lean}")["ranks"]
        measured[lean], predicted[lean] = rank["memory_bytes"], plan.stages[0].memory_bytes
        assert abs(predicted[lean] / measured[lean] - 1) < TOLERANCE, (measured, predicted)
    saving = predicted[False] - predicted[True]
    assert saving > 0.1 * predicted[False], predicted  # a shape where Tempo's layers keep less
    assert measured[True] < measured[False] - saving / 2, (measured, predicted)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offloaded_activations_leave_the_device_peak(tmp_path):
    """On a CPU host and device are one memory: the host copies of offloaded activations are host
    work, out of the device peak, as on a GPU. One stage of 4 layers: the same losses to the bit
    (the copies are exact), whole layers offloaded as the model counts them, and the measured peak
    within 10% of the prediction, for every layer offloaded (two layers' swap buffers: the layer
    whose backward runs and the next one's, prefetched), half of them (the swap buffers in place
    of the kept layers, freed by then: not on top of them), and with a recomputed layer (its input
    stays on the device) at 4 micro-batches a step. Negative controls: the run that offloads
    nothing (activations that never left the device) is outside that tolerance of the offloaded
    prediction. Measured before the fixes, 2026-12-04: the model summed the swap buffers and the
    kept layers (half offloaded: 63.3 MiB predicted, 43.2 measured) and the engine swapped the
    layers' weights with their activations (4 micro-batches of 2: 22.9 MiB against 19.9)."""
    base = dict(
        model="gpt3-tiny",
        gpu="cpu",
        gpus=1,
        gpus_per_node=8,
        global_batch=8,
        tp=1,
        dp=1,
        sequence_parallel=False,
        model_overrides={"hidden": 256, "seq": 128, "flash": False},
    )
    runs = {}  # (micro-batch, recompute, fraction) -> (peak, predicted, losses)
    for micro_batch, recompute, fraction in ((8, 0, 0.0), (8, 0, 1.0), (8, 0, 0.5), (2, 1, 0.5)):
        stage = StagePlan(layers=4, recompute=recompute, offload_optimizer=1.0, offload_activations=fraction)
        plan = Plan(**base, micro_batch=micro_batch, stages=[stage])
        predict(plan, plan.model_spec(), plan.cluster())
        report = _torchrun(plan, tmp_path / f"act{micro_batch}-{recompute}-{fraction}")
        rank = report["ranks"][0]
        assert rank["activation_offloaded_layers"] == offloaded_layers(
            {"offload_activations": fraction, "recompute": recompute}, 4
        )
        runs[micro_batch, recompute, fraction] = (
            rank["memory_bytes"],
            plan.stages[0].memory_bytes,
            rank["losses"],
        )
    assert runs[8, 0, 0.0][2] == runs[8, 0, 1.0][2] == runs[8, 0, 0.5][2]
    for peak, prediction, _ in runs.values():
        assert abs(peak / prediction - 1) < 0.10, runs
    assert abs(runs[8, 0, 0.0][0] / runs[8, 0, 1.0][1] - 1) > 0.10, runs  # the control: nothing offloaded


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: dataclasses.replace(p, micro_batch=3), "not a multiple of dp x micro_batch"),
        (lambda p: dataclasses.replace(p, micro_batch=16), "not a multiple of dp x micro_batch"),
        (lambda p: dataclasses.replace(p, stages=[StagePlan(layers=4, zero=7)]), "zero must be 0, 1, 2 or 3"),
        (lambda p: dataclasses.replace(p, stages=[StagePlan(layers=4, recompute=9)]), "recompute must be in"),
        (lambda p: dataclasses.replace(p, stages=[StagePlan(layers=5)]), "the stages hold 5 layers"),
        (lambda p: dataclasses.replace(p, tp=3, gpus=3), "TP 3 must divide the heads"),
        # review 2026-12-07: both passed every check and died in megatron-core's asserts, a traceback
        (
            lambda p: dataclasses.replace(p, tp=2, gpus=2, model_overrides={"flash": False, "vocab": 255}),
            "a vocabulary of 255 over TP 2",
        ),
        (
            lambda p: dataclasses.replace(
                p, tp=2, gpus=2, sequence_parallel=True, model_overrides={"flash": False, "seq": 33}
            ),
            "sequence parallelism needs TP 2 to divide the sequence",
        ),
    ],
)
def test_engine_refuses_a_plan_built_in_code_as_a_loaded_one_is(change, message, monkeypatch):
    """``run()`` took a Plan made in code on trust: micro-batch 3 of 8 dropped sequences, ZeRO 7,
    recompute 9 of 4 layers and a 5-layer stage for a 4-layer model all trained. Refused before
    anything is built (no process group here: building would fail differently)."""
    from mist.engine import run as engine

    monkeypatch.setattr(engine, "_build", lambda *a: pytest.fail("built"))
    plan = change(_tiny_plan([StagePlan(layers=4)]))
    with pytest.raises(ValueError, match=message):
        engine.run(plan)


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({"RANK": "abc"}, [], "RANK='abc' must be a whole number"),
        ({"MASTER_PORT": "x1"}, [], "MASTER_PORT='x1' must be a whole number"),
        ({}, ["--out", "{tmp}"], "a folder; give the file's name"),
        ({}, ["--out", "{tmp}/no/such/report.json"], "does not exist"),
        ({}, ["--plan", "{tmp}/missing.yaml"], "No such file or directory"),
        ({"MEASURE_LAUNCHER_PID": "abc"}, [], "MEASURE_LAUNCHER_PID='abc' must be a process id"),
        # run as a plain script: torch's error named RANK but not how to launch it
        ({"RANK": None}, [], "no RANK in the environment: launch it with torchrun"),
    ],
)
def test_engine_command_refuses_bad_launches_in_one_line(tmp_path, env, argv, message):
    """`python -m mist.engine.run` with a missing plan file, an --out it cannot write (found after
    the training, before), or launcher variables that are not numbers: one line, exit 2."""
    plan = tmp_path / "plan.yaml"
    _tiny_plan([StagePlan(layers=4)]).save(plan)
    args = ["--plan", str(plan), *(a.format(tmp=tmp_path) for a in argv)]
    done = subprocess.run(
        [sys.executable, "-m", "mist.engine.run", *args],
        env={
            k: v
            for k, v in {
                **os.environ,
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_PORT": "1",
                **env,
            }.items()
            if v is not None
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = [line for line in done.stderr.splitlines() if "warn" not in line.lower()]
    assert done.returncode in (1, 2) and len(err) == 1 and message in err[0], done.stderr[-2000:]


def _engine_command(
    plan_file: Path, out: Path, world_size: int, rank: int = 0
) -> subprocess.CompletedProcess:
    """`python -m mist.engine.run` as ``rank`` of ``world_size``, writing its report to ``out``."""
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "MASTER_PORT": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "mist.engine.run", "--plan", str(plan_file), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_refused_plan_is_said_in_one_line_and_in_its_report(tmp_path):
    """A plan the engine cannot execute here (interleaved stages with ZeRO-2) is refused before any
    process group, in one line and in rank 0's report (``{"refused": [reasons]}``), which is how
    the experiments tell a refusal from a failure. A plan for other than the launch's processes is
    refused in one line too, with no report: it is no refusal of the plan (the control)."""
    plan = dataclasses.replace(
        _tiny_plan([StagePlan(layers=2, zero=2), StagePlan(layers=2, zero=2)]), virtual_stages=2
    )
    plan.check()
    reasons = unsupported(plan)
    assert reasons, "the control plan must be one the engine refuses"
    plan_file, out = tmp_path / "plan.yaml", tmp_path / "report.json"
    plan.save(plan_file)
    # any rank: the first to refuse may be any (torchrun then stops the others)
    done = _engine_command(plan_file, out, world_size=plan.gpus, rank=random.randrange(plan.gpus))
    err = [line for line in done.stderr.splitlines() if "warn" not in line.lower()]
    assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
    assert "cannot execute this plan" in err[0]
    assert json.loads(out.read_text()) == {"refused": reasons}
    out.unlink()
    done = _engine_command(plan_file, out, world_size=plan.gpus + 1)
    err = [line for line in done.stderr.splitlines() if "warn" not in line.lower()]
    assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
    assert f"the plan is for {plan.gpus} processes, this run has {plan.gpus + 1}" in err[0]
    assert not out.exists()


def test_a_gpu_cap_the_gpu_cannot_give_is_refused_not_clamped(monkeypatch):
    """The plan's per-device cap becomes the allocator's fraction of the GPU less the CUDA
    context's reserve; a cap above the GPU's memory, or within the reserve, was clamped to "no
    cap" or to 0 without a word, and the run held to another cap than the plan's."""
    from measure.budget import GpuBudget
    from mist.engine import run as engine

    total = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=total))
    plan = _tiny_plan([StagePlan(layers=4)])
    assert engine._allocator_fraction(plan) is None  # no cap
    cap = random.randint(GpuBudget(1).context_bytes + 1, total)
    fraction = engine._allocator_fraction(dataclasses.replace(plan, gpu_memory_bytes=cap))
    assert fraction == (cap - GpuBudget(cap).context_bytes) / total and 0 < fraction < 1
    with pytest.raises(ValueError, match=r"more than this GPU's 80\.00 GiB"):
        engine._allocator_fraction(dataclasses.replace(plan, gpu_memory_bytes=total + 1))
    with pytest.raises(ValueError, match="no more than the CUDA context's reserve"):
        engine._allocator_fraction(dataclasses.replace(plan, gpu_memory_bytes=GpuBudget(1).context_bytes))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tempo_plan_from_the_command_line_runs_on_the_engine(tmp_path):
    """`mist plan --tempo` writes a plan file that states Tempo's layers, and the engine trains
    that file with them: its first loss is not megatron-core's layers' to the bit (the same plan
    with Tempo off: the control), yet equal within bf16's epsilon (the same weights and data)."""
    from mist.__main__ import main

    out = tmp_path / "plan.yaml"
    argv = ["plan", "--model", "gpt3-tiny", "--gpu", "cpu", "--gpus", "1", "--global-batch", "8"]
    assert main([*argv, "--tempo", "--no-flash", "--quiet", "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.model_overrides.get("tempo") is True and not unsupported(plan), (plan.model_overrides,)
    losses = {}
    for tempo in (True, False):
        run = dataclasses.replace(plan, model_overrides={**plan.model_overrides, "tempo": tempo})
        report = _torchrun(run, tmp_path / f"tempo{tempo}")
        losses[tempo] = next(r["losses"] for r in report["ranks"] if r["losses"] is not None)[0]
    assert losses[True] != losses[False] and abs(losses[True] / losses[False] - 1) < 2**-8, losses
