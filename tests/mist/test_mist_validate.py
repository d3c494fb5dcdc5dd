"""`mist validate`: the measured end-to-end runs read as the plans that ran, predicted, compared."""

from __future__ import annotations

import json
import random

import pytest

from mist.__main__ import main
from mist.tuning.validate import MEASURED_RUNS, load_measured_runs, report, validate


def test_measured_runs_are_read_as_the_plans_that_ran():
    runs = load_measured_runs()
    assert {r.source for r in runs} == {"mist-l4.json", "megatron-a10g.json"} and len(runs) == 5
    for r in runs:
        r.plan.check()
        assert sum(s.layers for s in r.plan.stages) == r.model.layers
        assert r.plan.gpus == r.cluster.gpus and r.iteration_s > 0
    l4 = [r for r in runs if r.source == "mist-l4.json"]
    assert all(r.model.dropout == 0.0 and r.model.heads == 16 and len(r.stage_memory_bytes) == 2 for r in l4)
    assert [s.layers for s in l4[0].plan.stages] == [13, 11] and l4[0].plan.grad_accum == 32
    a10g = next(r for r in runs if r.name.startswith("gpt_2_6B"))  # 105/104/104/106 operators: 8 layers each
    assert [(s.layers, s.recompute) for s in a10g.plan.stages] == [(8, 8)] * 4


def test_every_run_is_predicted_and_the_errors_are_what_they_say():
    rows = validate(load_measured_runs())
    for r in rows:
        assert r.simulated_s > 0 and r.time_error == pytest.approx(r.simulated_s / r.run.iteration_s - 1)
        if r.run.stage_memory_bytes:
            for e, p, m in zip(
                r.memory_errors, r.predicted_memory_bytes, r.run.stage_memory_bytes, strict=True
            ):
                assert e == pytest.approx(p / m - 1)
    out = report(rows)
    assert set(out["summary"]) == {"mist-l4.json", "megatron-a10g.json"}
    assert "mean_abs_memory_error" in out["summary"]["mist-l4.json"]
    assert "mean_abs_memory_error" not in out["summary"]["megatron-a10g.json"]  # not measured there


def test_validate_command(capsys):
    assert main(["validate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["runs"]) == 5 and {"measured_s", "predicted_s", "time_error"} <= set(data["runs"][0])
    assert main(["validate"]) == 0
    assert "time mean |error|" in capsys.readouterr().out


def _copy(tmp_path, name="megatron-a10g.json"):
    data = json.loads((MEASURED_RUNS / name).read_text())
    return data, tmp_path / name


@pytest.mark.parametrize(
    "fault",
    [
        "not json",
        "neither format",
        "missing field",
        "partial layer",
        "grad accum",
        "zero time",
        "negative time",
        "nan memory",
    ],
)
def test_broken_measured_runs_are_refused_clearly(tmp_path, fault, capsys):
    if fault == "not json":
        (tmp_path / "runs.json").write_text("{" + "x" * random.randint(0, 20))
        match = "not readable as JSON"
    elif fault == "neither format":
        (tmp_path / "runs.json").write_text(json.dumps({"points": []}))
        match = "neither measured-run format"
    elif fault == "missing field":
        data, path = _copy(tmp_path)
        del data["runs"][random.randrange(3)]["ops_per_stage"]
        path.write_text(json.dumps(data))
        match = "lacks 'ops_per_stage'"
    elif fault == "partial layer":
        data, path = _copy(tmp_path)
        data["runs"][0]["ops_per_stage"][0] += random.randint(1, 12)
        path.write_text(json.dumps(data))
        match = "not whole layers"
    elif fault == "grad accum":
        data, path = _copy(tmp_path, "mist-l4.json")
        data["cases"][0]["plan"]["grad_accum_steps"] += 1
        path.write_text(json.dumps(data))
        match = "gradient accumulation"
    elif fault in ("zero time", "negative time"):
        data, path = _copy(tmp_path, "mist-l4.json")
        data["cases"][0]["measured"]["iteration_s"] = 0 if fault == "zero time" else -random.uniform(0.1, 9)
        path.write_text(json.dumps(data))
        match = "measured iteration time must be a positive number"
    else:
        data, path = _copy(tmp_path, "mist-l4.json")
        data["cases"][0]["measured"]["stage_peak_allocated_MB"][0] = float("nan")
        path.write_text(json.dumps(data))
        match = "stage 0 peak memory must be a positive number"
    with pytest.raises(ValueError, match=match):
        load_measured_runs(tmp_path)
    assert main(["validate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(tmp_path) in err and err.count("\n") == 1


def test_the_model_predicts_the_measured_runs_within_the_targets():
    """The issue's targets on the shipped measured runs (the model is not fitted to them): Mist's
    L4 plans within 10% in time and 5% in per-stage memory on average, the Megatron-LM A10G runs
    within 10% in time."""
    summary = report(validate(load_measured_runs()))["summary"]
    assert summary["mist-l4.json"]["mean_abs_time_error"] <= 0.10
    assert summary["mist-l4.json"]["mean_abs_memory_error"] <= 0.05
    assert summary["megatron-a10g.json"]["mean_abs_time_error"] <= 0.10


def test_each_run_is_priced_for_the_engine_that_ran_it():
    from mist.model.specs import GRAD_ACCUMULATION

    engines = {r.source: r.grad_accumulation for r in load_measured_runs()}
    assert engines == {
        "mist-l4.json": GRAD_ACCUMULATION["mist"],
        "megatron-a10g.json": GRAD_ACCUMULATION["megatron-lm"],
    }


def _case_edit(data, fault):
    case = data["cases"][0]
    stages = len(case["plan"]["layers_per_stage"])
    if fault == "memory a string":
        case["measured"]["stage_peak_allocated_MB"] = "big"
        return "stage_peak_allocated_MB must be a list of one number per stage"
    if fault == "memory entry a string":
        case["measured"]["stage_peak_allocated_MB"][0] = "big"
        return "stage_peak_allocated_MB[0] must be a number of MiB, got a str"
    if fault == "memory short":
        case["measured"]["stage_peak_allocated_MB"] = case["measured"]["stage_peak_allocated_MB"][:-1]
        return f"stage_peak_allocated_MB must be a list of one number per stage ({stages}), got {stages - 1}"
    if fault == "nodes true":
        case["nodes"] = True
        return "nodes must be a whole number >= 1, got True"
    if fault == "gpus_per_node true":
        case["gpus_per_node"] = True
        return "gpus_per_node must be a whole number >= 1, got True"
    if fault == "case a list":  # was a TypeError traceback (unhashable), before it was named
        case["case"] = ["x"]
        return "cases[0]: case must be a non-empty string, got ['x']"
    if fault == "case twice":
        data["cases"].append(dict(case))
        return f"case {case['case']!r} is listed twice"
    if fault == "no cases":
        data["cases"] = []
        return "cases must be a non-empty list of measured records"
    case["plan"]["stage_strategies"][0][6] = 2.0  # offload_w
    return "stage 0: offload_weights is a fraction in [0, 1], got 2.0"


@pytest.mark.parametrize(
    "fault",
    [
        "memory a string",
        "memory entry a string",
        "memory short",
        "nodes true",
        "gpus_per_node true",
        "case a list",
        "case twice",
        "no cases",
        "offload",
    ],
)
def test_a_mist_case_of_the_wrong_kind_is_one_line_naming_file_and_case(tmp_path, fault, capsys):
    """The probe round: `"big" * 2**20` printed as a one-megabyte line; `nodes: true` read as 1 node;
    a case listed twice counted twice in the means; `cases: []` an empty table and exit 0; a short
    memory list "zip() argument 2 is shorter than argument 1" and offload 2.0 with no file named."""
    data, path = _copy(tmp_path, "mist-l4.json")
    expected = _case_edit(data, fault)
    path.write_text(json.dumps(data))
    assert main(["validate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and err.count("\n") == 1 and len(err) < 500, err
    assert expected in err, err
    if fault not in ("case twice", "no cases", "case a list"):
        assert data["cases"][0]["case"] in err, err


def test_megatron_runs_listed_twice_or_none_are_refused(tmp_path, capsys):
    data, path = _copy(tmp_path)
    data["runs"].append(data["runs"][0])
    path.write_text(json.dumps(data))
    assert main(["validate", str(tmp_path)]) == 2
    assert f"config {data['runs'][0]['config']!r} is listed twice" in capsys.readouterr().err
    data["runs"] = []
    path.write_text(json.dumps(data))
    assert main(["validate", str(tmp_path)]) == 2
    assert "runs must be a non-empty list" in capsys.readouterr().err
    data, path = _copy(tmp_path)  # control: the shipped file as it is
    path.write_text(json.dumps(data))
    assert main(["validate", str(tmp_path)]) == 0


# fault -> (the first Megatron-LM run's field, its value, what the error must say)
_MEGATRON_EDITS = {
    "times empty": ("measured_iteration_ms", [], "measured_iteration_ms must be a non-empty list of times"),
    "time true": ("measured_iteration_ms", [True], "measured_iteration_ms must be a non-empty list"),
    "times a string": ("measured_iteration_ms", "fast", "measured_iteration_ms must be a non-empty list"),
    "checkpoint short": ("checkpoint_activations", [True], "checkpoint_activations must be a list of one"),
    "checkpoint yes": ("checkpoint_activations", ["yes", "no"], "checkpoint_activations must be a list"),
    "checkpoint 2": ("checkpoint_activations", [2, 0], "checkpoint_activations must be a list"),
    "tp strings": ("tp_first_op_per_stage", ["1", "1"], "tp_first_op_per_stage must be a list of one"),
    "tp short": ("tp_first_op_per_stage", [0, 1], "tp_first_op_per_stage must be a list of one whole"),
    "gpus negative": ("num_gpus", [-1, 1], "num_gpus must be a list of one whole number >= 1"),
}
_MIST_FAULTS = (
    "layers long",
    "strategy empty",
    "micro-batch 0",
    "pre_post short",
    "devices",
    "relu",
    "activation a list",
    "mlp a list",
    "bias",
)


def _mist_plan_edit(case: dict, fault: str) -> str:
    plan = case["plan"]
    if fault == "layers long":
        plan["layers_per_stage"] = [24]
        return "layers_per_stage must be a list of one whole number per stage (2)"
    if fault == "strategy empty":
        plan["stage_strategies"][0] = [1, 1, 1]
        return "stage_strategies must be a list of (micro_batch, dp, tp) >= 1"
    if fault == "micro-batch 0":
        plan["stage_strategies"][1][0] = 0
        return "stage_strategies must be a list of (micro_batch, dp, tp) >= 1"
    if fault == "pre_post short":
        plan["pre_post"] = [1]
        return "pre_post must be a list of (micro_batch, dp, tp) >= 1"
    if fault == "devices":
        plan["devices_per_stage_nodes_x_gpus"] = [[1, 2], [1, 1]]
        return "devices_per_stage_nodes_x_gpus [[1, 2], [1, 1]] is not DP x TP = 1 a stage"
    if fault == "activation a list":
        case["model"]["activation"] = ["gelu"]
        return "activation must be one of gelu, gelu_fast for mlp mlp, got ['gelu']"
    if fault == "mlp a list":
        case["model"]["mlp"] = ["mlp"]
        return "mlp must be one of mlp, swiglu, got ['mlp']"
    if fault == "bias":
        case["model"]["bias"] = True
        return "bias true is not modelled (bias-free layers only)"
    case["model"]["activation"] = "relu"
    return "activation must be one of gelu, gelu_fast for mlp mlp, got 'relu'"


@pytest.mark.parametrize("fault", [*_MEGATRON_EDITS, *_MIST_FAULTS])
def test_a_record_field_of_the_wrong_kind_is_one_line_naming_what_it_accepts(tmp_path, fault, capsys):
    """The probe round of 2026-12-07: "fmean requires at least one data point", "zip() argument 2
    is shorter than argument 1", "not enough values to unpack", "TP/DP > 1 is not read yet" for
    strings, `[true]` read as 1 ms (a 1,205,844% error), "yes" as a recomputed stage, ReLU priced as
    GELU, and a device layout that contradicted the strategies ignored."""
    megatron = fault in _MEGATRON_EDITS
    data, path = _copy(tmp_path) if megatron else _copy(tmp_path, "mist-l4.json")
    record = data["runs"][0] if megatron else data["cases"][0]
    if megatron:
        key, value, expected = _MEGATRON_EDITS[fault]
        record[key] = value
    else:
        expected = _mist_plan_edit(record, fault)
    path.write_text(json.dumps(data))
    assert main(["validate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and err.count("\n") == 1 and len(err) < 500, err
    assert expected in err and (record["config"] if megatron else record["case"]) in err, err
