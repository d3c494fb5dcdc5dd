"""Mist's host model: the measured CPU Adam step shared by a node's GPUs, host memory as a capacity."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mist.__main__ import host_memory_bytes, main
from mist.model.budget import HOST_USABLE_FRACTION
from mist.model.runtime import HOST_STREAM_FRACTION, CpuAdam, cpu_adam_params_per_s, load_cpu_adam
from mist.model.specs import GiB, cluster, model
from mist.plan import Plan, StagePlan
from mist.tuning.planner import predict


def test_shipped_cpu_adam_is_a_measurement():
    adam = load_cpu_adam()
    assert 1e6 < adam.per_core_params_per_s < 1e11
    assert adam.bytes_moved_per_param == 28 and "measured on" in adam.source


def test_profile_cpu_adam_measures_this_host():
    from mist.engine.profiler import profile_cpu_adam

    d = profile_cpu_adam(params=1 << 16, threads=(1,), repeats=2)
    assert d["threads"] == [1] and d["params_per_s"][0] > 1e5
    with pytest.raises(ValueError, match=">= 1"):
        profile_cpu_adam(params=0)


def test_cpu_adam_is_shared_by_the_node_and_bound_by_its_dram(rng):
    per_core = float(rng.uniform(1e7, 1e8))  # few cores' worth stays below the DRAM bound
    adam = CpuAdam(per_core, 28.0, "test")
    one, eight = cluster("l4", 1), cluster("l4", 8)
    assert cpu_adam_params_per_s(eight, adam) == pytest.approx(cpu_adam_params_per_s(one, adam) / 8)
    assert cpu_adam_params_per_s(one, adam) == pytest.approx(one.host.cores * per_core)
    fast = CpuAdam(1e12, 28.0, "test")  # the cores could do more than the memory moves
    bound = HOST_STREAM_FRACTION * one.host.mem_bw / 28.0
    assert cpu_adam_params_per_s(one, fast) == pytest.approx(bound)
    assert bound * 28.0 < one.host.mem_bw  # never above the data-sheet bandwidth


def _offloading_plan(host_bytes: int | None) -> Plan:
    return Plan(
        model="gpt3-22b",
        gpu="l4",
        gpus=1,
        gpus_per_node=8,
        global_batch=8,
        tp=1,
        dp=1,
        micro_batch=8,
        stages=[StagePlan(48, 48, 0, 1.0, 1.0, 1.0, 1.0)],
        host_memory_per_node_bytes=host_bytes,
    )


def test_offloaded_bytes_must_fit_the_host():
    """22B on one L4 offloads everything: it fits the usual 384 GiB host, not a 128 GiB one."""
    m = model("gpt3-22b")
    big = predict(_offloading_plan(None), m, _offloading_plan(None).cluster())
    host = big.stages[0].host_memory_bytes
    assert 300 * GiB < host < HOST_USABLE_FRACTION * 384 * GiB
    assert big.breakdown["fits"]
    small = predict(_offloading_plan(128 * GiB), m, _offloading_plan(128 * GiB).cluster())
    assert small.stages[0].host_memory_bytes == host
    assert not small.breakdown["fits"]


def test_search_respects_host_memory(capsys):
    args = ["plan", "--model", "gpt3-22b", "--gpus", "1", "--gpu", "l4", "--global-batch", "8", "--quiet"]
    assert main([*args, "--host-mem", "128"]) == 2
    err = capsys.readouterr().err
    assert "no plan" in err and "host memory" in err and err.count("\n") == 1
    assert main(args) == 0
    assert "host GiB" in capsys.readouterr().out


def test_host_memory_travels_with_the_plan(tmp_path):
    path = tmp_path / "p.yaml"
    _offloading_plan(200 * GiB).save(path)
    plan = Plan.load(path)
    assert plan.host_memory_per_node_bytes == 200 * GiB
    assert plan.cluster().host.memory == 200 * GiB
    for bad in (0, -1, 200.0 * GiB, True):  # a positive whole number of bytes, nothing else
        with pytest.raises(ValueError, match="host_memory_per_node_bytes must be a positive whole number"):
            replace(plan, host_memory_per_node_bytes=bad).check()
    with pytest.raises(ValueError, match="host memory must be a positive whole number of bytes"):
        cluster("l4", 8, host_memory=-1)


@pytest.mark.parametrize(
    "offloadable, gib", [(("optimizer", "activations"), 24), (("optimizer",), 24), ((), 32)]
)
def test_search_offloads_only_what_the_space_allows(offloadable, gib):
    """A runtime that offloads only some tensors (Megatron-LM: the optimizer; the engine on a GPU:
    optimizer and activations) gets plans that offload nothing else, the embedding/head's own
    strategy included. GPT-3 1.3B on one GPU of ``gib`` GiB: with everything allowed Mist offloads
    something the space leaves out (the negative control: at 24 GiB weights and gradients, at 32
    activations, where nothing offloaded fits too), and a plan is found either way. Without
    selective recomputation, which at this size makes offloading weights unnecessary."""
    from mist.tuning.planner import PlannerOptions, search
    from mist.tuning.stage_cost import SearchSpace

    m, c = model("gpt3-1.3b", flash=False), cluster("h200", 1, gpu_memory=gib * GiB)
    left_out = [kind for kind in ("weights", "grads", "optimizer", "activations") if kind not in offloadable]
    free = search(m, c, 8, PlannerOptions(space=SearchSpace(selective=False)))
    free_parts = [*free.stages, *([free.pre_post] if free.pre_post is not None else [])]
    assert any(getattr(p, f"offload_{kind}") for p in free_parts for kind in left_out), free
    plan = search(m, c, 8, PlannerOptions(space=SearchSpace(offloadable=offloadable, selective=False)))
    parts = [*plan.stages, *([plan.pre_post] if plan.pre_post is not None else [])]
    for kind in left_out:
        assert all(getattr(p, f"offload_{kind}", 0.0) == 0.0 for p in parts), (kind, plan)


def test_an_unknown_offloadable_kind_is_refused():
    from mist.tuning.stage_cost import SearchSpace

    with pytest.raises(ValueError, match="accepted: weights, grads, optimizer, activations"):
        SearchSpace(offloadable=("optimiser",))


def test_host_memory_takes_gib_or_a_unit():
    """A bare ``--host-mem`` is GiB, a unit is taken as ``--gpu-mem`` takes it (GB binary)."""
    assert host_memory_bytes("128") == host_memory_bytes("128GiB") == host_memory_bytes("128 gb") == 128 * GiB
    assert host_memory_bytes("0.5") == host_memory_bytes("512MiB") == GiB // 2
    assert host_memory_bytes("1.5TB") == host_memory_bytes("1536") == 1536 * GiB
    assert host_memory_bytes(None) is None
