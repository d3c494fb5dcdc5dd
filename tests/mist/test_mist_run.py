"""Planner-made and hand-written plans trained by megatron-core on 2 gloo processes (torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from measure.launch import run_torchrun
from mist import Plan, StagePlan, cluster, model, predict
from mist.engine.run import unsupported

# Predicted vs measured per-rank memory: the stated target (README: "target 10%"), not loosened.
# Measured: held tensor bytes + the allocator peak of the typical steady step (the median of a
# few: on a CPU the peaks vary by up to ~10% of the total at this tiny scale, as gloo's threads and
# FSDP2's asynchronous collectives free buffers at varying times; the worst is reported too).
TOLERANCE = 0.10


def _torchrun(plan: Plan, tmp_path: Path, steps: int = 5) -> dict:
    path, out = tmp_path / "plan.yaml", tmp_path / "report.json"
    plan.save(path)
    args = ["--plan", str(path), "--steps", str(steps), "--out", str(out)]
    done = run_torchrun(plan.gpus, "mist.engine.run", args, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


_REPORTS: dict[tuple, dict] = {}  # one torchrun per plan per test session


def _report(plan_args: tuple, tmp_path_factory) -> tuple[Plan, dict]:
    tp, layers, recompute, dp, zero = plan_args
    plan = _plan(tp, list(layers), list(recompute), dp, zero)
    if plan_args not in _REPORTS:
        _REPORTS[plan_args] = _torchrun(plan, tmp_path_factory.mktemp("run"))
    return plan, _REPORTS[plan_args]


def _tiny_plan(stages: list[StagePlan], tp: int = 1, dp: int = 1) -> Plan:
    """A gpt3-tiny plan for 2 CPU processes, global batch 8 in micro-batches of 2, no SP."""
    return Plan(model="gpt3-tiny", gpu="cpu", gpus=2, gpus_per_node=8, global_batch=8, tp=tp, dp=dp,
                micro_batch=2, stages=stages, sequence_parallel=False)  # fmt: skip


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
    assert losses[-1] < losses[0] - 0.5  # the same few sequences every step: it must learn them
    predict(plan, model("gpt3-tiny"), cluster("cpu", 2))
    for r in report["ranks"]:
        predicted = plan.stages[r["stage"]].memory_bytes
        assert abs(predicted / r["memory_bytes"] - 1) < TOLERANCE, (r, predicted)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_sharding_trains_like_plain_data_parallelism(tmp_path_factory, zero):
    """Same data, same initial weights: sharding the optimizer (and gradients, and weights) over
    the replicas must not change the training, only where the bytes live (bf16 gradient sums may
    round in a different order)."""
    _, plain = _report((1, (4,), (2,), 2, 0), tmp_path_factory)
    _, sharded = _report((1, (4,), (2,), 2, zero), tmp_path_factory)
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
    activations there: same training as without (on a CPU 'host' and 'device' are one memory,
    so this checks the mechanics; the memory saved is measured on a GPU), and the host holds the
    12 B a parameter the model counts."""
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
def test_planner_plan_runs(tmp_path):
    """What `mist plan` makes for 2 CPU processes, with the parts mist.engine.run cannot do yet removed."""
    from mist import search
    from mist.tuning.planner import PlannerOptions
    from mist.tuning.stage_cost import SearchSpace

    plan = search(
        model("gpt3-tiny"), cluster("cpu", 2), 8, PlannerOptions(SearchSpace(zero_stages=(0,), offload=False))
    )
    plan.sequence_parallel = False  # megatron-core's torch LayerNorm cannot do SP (see unsupported())
    assert not unsupported(plan), unsupported(plan)
    report = _torchrun(plan, tmp_path, steps=4)
    losses = next(r["losses"] for r in report["ranks"] if r["losses"] is not None)
    assert losses[-1] < losses[0]


def test_unsupported_parts_are_named():
    stages = [StagePlan(layers=2, zero=3), StagePlan(layers=2, offload_grads=0.5)]
    plan = Plan.of(
        model("gpt3-tiny"), cluster("cpu", 8), global_batch=8, tp=2, dp=2, micro_batch=2, stages=stages
    )
    reasons = " | ".join(unsupported(plan))
    assert "ZeRO-3 with TP > 1" in reasons and "offloading of weights or gradients" in reasons
    assert "sequence parallelism" in reasons


def test_the_engine_refuses_a_layer_it_would_build_differently():
    """Falcon is priced with attention and MLP in parallel; megatron-core builds them in sequence,
    so mist.engine.run refuses it by name, and runs the sequential variant it does build."""
    falcon = Plan.of(model("falcon-tiny"), cluster("cpu", 1, 1), global_batch=2, tp=1, dp=1, micro_batch=1,
                     stages=[StagePlan(layers=4)])  # fmt: skip
    assert any("in parallel on one norm (Falcon)" in r for r in unsupported(falcon))
    falcon.model_overrides = {"parallel_block": False}
    assert not unsupported(falcon)


def test_megatron_arguments_follow_the_model_fields():
    from baselines.megatron.grid import megatron_args

    plan = Plan.of(model("llama-7b"), cluster("l4", 8), global_batch=64, tp=2, dp=1, micro_batch=1,
                   stages=[StagePlan(layers=16), StagePlan(layers=16)])  # fmt: skip
    args, cannot = megatron_args(plan, model("llama-7b", kv_heads=8))
    assert {"--normalization RMSNorm", "--swiglu", "--position-embedding-type rope", "--sequence-parallel",
            "--num-query-groups 8", "--hidden-dropout 0.0"} <= set(args) and not cannot  # fmt: skip
    args, cannot = megatron_args(plan, model("falcon-7b"))
    assert "--swiglu" not in args and any("Falcon" in c for c in cannot)
    plan.sequence_parallel = False
    assert "--sequence-parallel" not in megatron_args(plan, model("gpt3-7b"))[0]
