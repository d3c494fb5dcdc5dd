"""The plan file (plan_format 2): memory in whole bytes; format 1 (GiB) still read, converted once."""

from __future__ import annotations

import json
import numbers

import numpy as np
import pytest
import yaml

from mist.__main__ import prediction_json
from mist.model.budget import gpu_budget_bytes
from mist.model.specs import GiB, models
from mist.plan import PLAN_FORMAT, Plan, PrePostPlan, StagePlan
from mist.tuning.planner import predict

# Format 1's names of the memory fields, their format-2 names and the unit each old one was in
STAGE_RENAMES = {"memory_bytes": ("memory_gib", GiB), "host_memory_bytes": ("host_memory_gib", GiB)}
PLAN_RENAMES = {"host_memory_per_node_bytes": ("host_memory_per_node_gib", GiB)}
BREAKDOWN_RENAMES = {
    "usable_memory_bytes": ("usable_memory_gib", GiB),
    "usable_host_memory_bytes_per_gpu": ("usable_host_memory_gib_per_gpu", GiB),
    "layer_saved_bytes": ("layer_saved_mib", 2**20),
}


def _as_format_1(d: dict) -> dict:
    """What the previous version would have written for the plan ``d`` (a format-2 dict): the
    memory fields under their old names, in floating GiB (MiB), and no plan_format at all (files
    from before it existed are format 1 too)."""

    def old(fields: dict, renames: dict) -> dict:
        out = {}
        for k, v in fields.items():
            if k in renames:
                name, unit = renames[k]
                out[name] = None if v is None else v / unit
            else:
                out[k] = v
        return out

    d = old({k: v for k, v in d.items() if k != "plan_format"}, PLAN_RENAMES)
    d["stages"] = [old(s, STAGE_RENAMES) for s in d["stages"]]
    d["breakdown"] = old(d["breakdown"], BREAKDOWN_RENAMES)
    return d


def _random_plan(rng: np.random.Generator) -> Plan:
    """A valid plan of random shape: a preset, TP x DP x stages on L4s or A100s, random layer
    split, recomputation, ZeRO, offloaded fractions, embedding/head strategy and host size."""
    name = str(rng.choice([n for n in models() if not n.endswith("tiny")]))
    m = models()[name]
    tp = int(rng.choice([t for t in (1, 2, 4, 8) if m.heads % t == 0 and m.kv % t == 0]))
    dp, n_stages = int(rng.choice((1, 2))), int(rng.integers(1, 5))
    cuts = np.sort(rng.choice(np.arange(1, m.layers), n_stages - 1, replace=False))
    layers = np.diff([0, *cuts, m.layers]).tolist()
    micro_batch, grad_accum = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    stages = [
        StagePlan(
            layers=int(n),
            recompute=int(rng.integers(0, n + 1)),
            zero=int(rng.integers(0, 4)),
            offload_weights=float(rng.random()),
            offload_grads=float(rng.random()),
            offload_optimizer=float(rng.random()),
            offload_activations=float(rng.random()),
        )
        for n in layers
    ]
    pre_post = None
    if rng.random() < 0.5:
        pre_post = PrePostPlan(int(rng.integers(0, 4)), *map(float, rng.random(3)))
    host = None if rng.random() < 0.3 else int(rng.integers(64 * GiB, 4096 * GiB))
    gpus = tp * dp * n_stages
    per_node = 8 if gpus <= 8 or gpus % 8 == 0 else 4  # whole nodes (12 GPUs: three of four)
    return Plan(
        model=name,
        gpu=str(rng.choice(("l4", "a100-40gb"))),
        gpus=gpus,
        gpus_per_node=per_node,
        global_batch=grad_accum * dp * micro_batch,
        tp=tp,
        dp=dp,
        micro_batch=micro_batch,
        stages=stages,
        model_overrides={"seq": int(rng.choice((1024, 2048))), "flash": bool(rng.random() < 0.5)},
        host_memory_per_node_bytes=host,
        pre_post=pre_post,
    )


def _predicted(plan: Plan) -> Plan:
    return predict(plan, plan.model_spec(), plan.cluster())


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_random_plan_round_trips(tmp_path, fresh_seed, suffix):
    rng = np.random.default_rng(fresh_seed)
    for i in range(6):
        plan = _random_plan(rng)
        if i % 2:  # half of them with predictions (whole bytes, the breakdown) filled in
            _predicted(plan)
        path = tmp_path / f"plan{i}{suffix}"
        plan.save(path)
        loaded = Plan.load(path)
        assert loaded == plan
        assert loaded.to_dict() == plan.to_dict()
        stored = json.loads(path.read_text()) if suffix == ".json" else yaml.safe_load(path.read_text())
        assert stored["plan_format"] == PLAN_FORMAT == 2  # always written as the current format
        assert not any(k.endswith("_gib") for s in stored["stages"] for k in s)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_format_1_file_loads_to_its_format_2_twin(tmp_path, fresh_seed, suffix):
    """The same plan written in GiB by the previous version and in bytes by this one: identical
    once loaded, every byte (the conversion rounds as ``predict`` does)."""
    rng = np.random.default_rng(fresh_seed)
    for i in range(4):
        plan = _predicted(_random_plan(rng))
        new, old = tmp_path / f"new{i}{suffix}", tmp_path / f"old{i}{suffix}"
        plan.save(new)
        twin = _as_format_1(plan.to_dict())
        assert "memory_gib" in twin["stages"][0] and "usable_memory_gib" in twin["breakdown"]
        old.write_text(json.dumps(twin) if suffix == ".json" else yaml.safe_dump(twin, sort_keys=False))
        from_old, from_new = Plan.load(old), Plan.load(new)
        assert from_old == from_new == plan
        assert all(isinstance(s.memory_bytes, int) for s in from_old.stages)
        # and re-pricing the old file gives the numbers it stored
        assert _predicted(from_old) == plan


def test_a_format_1_file_as_written_before():
    """A plan file as the previous version wrote it (abridged): GiB converted, exactly."""
    text = """\
plan_format: 1
model: gpt3-22b
gpu: l4
gpus: 1
gpus_per_node: 1
global_batch: 8
tp: 1
dp: 1
micro_batch: 8
stages:
- {layers: 48, recompute: 48, zero: 0, offload_weights: 1.0, offload_grads: 1.0, offload_optimizer: 1.0,
   offload_activations: 1.0, memory_gib: 22.0498046875, host_memory_gib: 342.302734375}
host_memory_per_node_gib: 383.7
breakdown: {usable_memory_gib: 22.087499999441206, usable_host_memory_gib_per_gpu: 345.33, fits: true,
            layer_saved_mib: 3268.0}
"""
    plan = Plan.from_dict(yaml.safe_load(text))
    assert plan.stages[0].memory_bytes == 23675797504 == int(22.0498046875 * GiB)
    assert plan.stages[0].host_memory_bytes == 367544762368 == int(342.302734375 * GiB)
    # a capacity: whole bytes down, as the cluster always took it (int(GiB * 2**30))
    assert plan.host_memory_per_node_bytes == int(383.7 * GiB) == plan.cluster().host.memory
    assert plan.breakdown["usable_memory_bytes"] == gpu_budget_bytes(plan.cluster())  # exact
    assert plan.breakdown["usable_host_memory_bytes_per_gpu"] == int(345.33 * GiB)
    assert plan.breakdown["layer_saved_bytes"] == 3268 * 2**20
    assert not any("gib" in k or "mib" in k for k in plan.to_dict()["breakdown"])


BASE = {
    "model": "gpt3-1.3b",
    "gpu": "l4",
    "gpus": 2,
    "gpus_per_node": 8,
    "global_batch": 8,
    "tp": 1,
    "dp": 1,
    "micro_batch": 1,
    "stages": [{"layers": 12}, {"layers": 12}],
}


@pytest.mark.parametrize("version", [None, 1, 2])
@pytest.mark.parametrize(
    ("change", "where", "old", "new"),
    [
        (
            {"host_memory_per_node_gib": 200, "host_memory_per_node_bytes": 200 * GiB},
            "",
            "host_memory_per_node_gib",
            "host_memory_per_node_bytes",
        ),
        (
            {"stages": [{"layers": 12}, {"layers": 12, "memory_gib": 9.5, "memory_bytes": 10200547328}]},
            "stage 1: ",
            "memory_gib",
            "memory_bytes",
        ),
        (
            {"stages": [{"layers": 12, "host_memory_gib": 0.0, "host_memory_bytes": 0}, {"layers": 12}]},
            "stage 0: ",
            "host_memory_gib",
            "host_memory_bytes",
        ),
        (
            {"breakdown": {"usable_memory_gib": 22.0, "usable_memory_bytes": 22 * GiB}},
            "breakdown: ",
            "usable_memory_gib",
            "usable_memory_bytes",
        ),
    ],
)
def test_a_field_named_both_ways_is_refused(tmp_path, capsys, version, change, where, old, new):
    """GiB or bytes? Neither is guessed, in either format: the file is refused in one line."""
    from mist.__main__ import main

    d = {**BASE, **change} if version is None else {**BASE, **change, "plan_format": version}
    with pytest.raises(
        ValueError, match=f"^{where}both {old} \\(GiB, plan_format 1\\) and {new} \\(bytes\\)"
    ):
        Plan.from_dict(d)
    path = tmp_path / "both.json"
    path.write_text(json.dumps(d))
    assert main(["predict", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"both {old}" in err and "Traceback" not in err


def test_format_2_has_no_gib_fields():
    with pytest.raises(ValueError, match="memory_gib is a plan_format 1 field \\(GiB\\); plan_format 2 has"):
        Plan.from_dict(
            {**BASE, "plan_format": 2, "stages": [{"layers": 12, "memory_gib": 9.5}, {"layers": 12}]}
        )
    with pytest.raises(ValueError, match="host_memory_per_node_gib must be a number"):
        Plan.from_dict({**BASE, "host_memory_per_node_gib": "lots"})
    with pytest.raises(ValueError, match="stage 0: memory_bytes must be a whole number of bytes"):
        Plan.from_dict(
            {**BASE, "plan_format": 2, "stages": [{"layers": 12, "memory_bytes": 1.5}, {"layers": 12}]}
        )
    # the caller's mapping is left as it was (the conversion works on copies)
    d = {**BASE, "stages": [{"layers": 12, "memory_gib": 1.0}, {"layers": 12}]}
    assert Plan.from_dict(d).stages[0].memory_bytes == GiB
    assert d["stages"][0] == {"layers": 12, "memory_gib": 1.0}


def test_predict_fills_in_whole_bytes(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for _ in range(4):
        plan = _predicted(_random_plan(rng))
        b = plan.breakdown
        whole = [b["usable_memory_bytes"], b["usable_host_memory_bytes_per_gpu"], b["layer_saved_bytes"]]
        whole += [x for s in plan.stages for x in (s.memory_bytes, s.host_memory_bytes)]
        assert all(type(x) is int and x >= 0 for x in whole), whole  # Python ints: no numpy, no floats
        cluster = plan.cluster()
        assert b["usable_host_memory_bytes_per_gpu"] <= 0.9 * cluster.host.memory / cluster.gpus_per_node
        gpu_fits = all(s.memory_bytes <= b["usable_memory_bytes"] for s in plan.stages)
        host_fits = all(s.host_memory_bytes <= b["usable_host_memory_bytes_per_gpu"] for s in plan.stages)
        assert b["fits"] == (gpu_fits and host_fits)
        doc = prediction_json(plan)  # `mist predict --json`: the plan's bytes as they are
        assert doc["usable_memory_bytes"] == b["usable_memory_bytes"]
        assert [s["memory_bytes"] for s in doc["stages"]] == [s.memory_bytes for s in plan.stages]
        assert all(isinstance(s["host_memory_bytes"], numbers.Integral) for s in doc["stages"])


def test_a_plan_made_for_a_capped_cluster_keeps_its_cap(tmp_path):
    """Plan.of takes a cluster's own device cap and host memory: a plan searched under a cap is
    enforced at that cap by mist.engine.run, and re-priced against the same budget; a cluster at its
    data sheet's memory leaves both unset."""
    from mist import cluster, model, search

    m = model("gpt3-tiny")
    capped = cluster("cpu", 2, host_memory=3 * GiB, gpu_memory=40 * 2**20)
    plan = search(m, capped, 8)
    assert plan.gpu_memory_bytes == 40 * 2**20 and plan.host_memory_per_node_bytes == 3 * GiB
    plan.save(tmp_path / "p.yaml")
    back = Plan.load(tmp_path / "p.yaml")
    assert back.cluster().gpu.memory == 40 * 2**20 and back.cluster().host.memory == 3 * GiB
    plain = Plan.of(
        m, cluster("cpu", 2), global_batch=8, tp=1, dp=2, micro_batch=4, stages=[StagePlan(layers=m.layers)]
    )
    assert plain.gpu_memory_bytes is None and plain.host_memory_per_node_bytes is None


def test_what_runs_leaves_out_the_predictions():
    """A plan priced and the same plan unpriced are the same run; another strategy is not."""
    from mist import cluster, model

    m, c = model("gpt3-tiny"), cluster("cpu", 2)
    fields = {"global_batch": 8, "tp": 1, "dp": 2, "micro_batch": 2}
    plain = Plan.of(m, c, stages=[StagePlan(layers=m.layers)], **fields)
    priced = predict(Plan.of(m, c, stages=[StagePlan(layers=m.layers)], **fields), m, c)
    assert priced.stages[0].memory_bytes is not None and plain.what_runs() == priced.what_runs()
    other = Plan.of(m, c, stages=[StagePlan(layers=m.layers, recompute=1)], **fields)
    assert other.what_runs() != plain.what_runs()


@pytest.mark.timeout(60)
def test_a_plan_is_never_saved_over_what_is_not_a_regular_file(tmp_path, capsys):
    """Plan.save replaced a FIFO, a character device and a link with a regular file (atomic_path's
    rename); ``mist plan --out`` at one ran the search first. Each is refused in one line, the path
    left as it was, the command's before its search."""
    import os

    from mist import cluster, model
    from mist.__main__ import main

    m = model("gpt3-tiny")
    plan = Plan.of(
        m, cluster("cpu", 2), global_batch=8, tp=1, dp=2, micro_batch=4, stages=[StagePlan(layers=m.layers)]
    )
    fifo, link = tmp_path / "p.yaml", tmp_path / "l.yaml"
    os.mkfifo(fifo)
    link.symlink_to(os.devnull)
    for path in (fifo, link):
        with pytest.raises(ValueError, match="not a regular file") as e:
            plan.save(path)
        assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)
        argv = ["plan", "--model", "gpt3-tiny", "--gpu", "cpu", "--gpus", "2", "--global-batch", "8"]
        assert main([*argv, "--quiet", "--out", str(path)]) == 2
        out, err = capsys.readouterr()
        assert "not a regular file" in err and err.count("\n") == 1 and "predicted" not in out, (out, err)
    assert os.path.islink(link) and not fifo.is_file()


def test_a_plan_names_its_own_models_overrides():
    """What a plan stores to name its model (preset_overrides) is the given spec's own fields, not
    those of an equal spec named before it: equal specs may hold values of other types (numpy's
    int64 against int; 0 against 0.0), and a plan file stores them as they are. Control: the two
    specs are equal, and their overrides differ in type."""
    from mist import model
    from mist.model.specs import preset_overrides

    numpy_typed = model("gpt3-1.3b", seq=np.int64(4096), dropout=0)
    plain = model("gpt3-1.3b", seq=4096, dropout=0.0)
    assert numpy_typed == plain
    for before, spec in ((numpy_typed, plain), (plain, numpy_typed), (plain, plain)):
        preset_overrides(before)
        named = preset_overrides(spec)
        assert named == {"seq": 4096, "dropout": 0.0}
        assert [type(v) for v in named.values()] == [type(spec.seq), type(spec.dropout)]
    assert json.dumps(preset_overrides(plain)) == '{"seq": 4096, "dropout": 0.0}'
