"""`python -m mist`: plan, predict, errors."""

from __future__ import annotations

import json

import pytest

from mist.__main__ import main
from mist.model.specs import GRAD_ACCUMULATION, cluster, model
from mist.plan import Plan
from mist.tuning.planner import predict


def test_plan_then_predict_round_trip(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert (
        main(
            [
                "plan",
                "--model",
                "gpt3-1.3b",
                "--gpus",
                "4",
                "--gpu",
                "l4",
                "--global-batch",
                "16",
                "--quiet",
                "--explain",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "predicted iteration" in text and "why this plan" in text
    plan = Plan.load(out)
    assert sum(s.layers for s in plan.stages) == 24 and plan.tp * plan.dp * len(plan.stages) == 4
    assert main(["predict", str(out)]) == 0
    again = predict(Plan.load(out), model("gpt3-1.3b"), cluster("l4", 4))
    assert again.predicted_iteration_s == pytest.approx(plan.predicted_iteration_s)
    assert again.breakdown["fits"]


def test_predict_a_hand_written_plan(tmp_path, capsys):
    path = tmp_path / "mine.json"
    Plan.from_dict(
        {
            "model": "llama-7b",
            "gpu": "a100-40gb",
            "gpus": 8,
            "gpus_per_node": 8,
            "global_batch": 64,
            "tp": 2,
            "dp": 2,
            "micro_batch": 2,
            "stages": [
                {"layers": 15, "recompute": 15},
                {"layers": 17, "recompute": 4, "zero": 1, "offload_optimizer": 0.5},
            ],
        }
    ).save(path)
    assert main(["predict", str(path)]) == 0
    out = capsys.readouterr().out
    assert "TP 2 x DP 2 x PP 2" in out and "predicted iteration" in out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tp": 16, "dp": 1, "gpus": 32}, "larger than GPUs per node"),
        ({"global_batch": 30}, "not a multiple"),
        ({"stages": [{"layers": 24, "recompute": 30}, {"layers": 0}]}, "recompute must be in"),
        ({"stages": [{"layers": 12, "zero": 4}, {"layers": 12}]}, "zero must be"),
    ],
)
def test_bad_plans_are_refused_clearly(change, message):
    base = {
        "model": "gpt3-1.3b",
        "gpu": "l4",
        "gpus": 4,
        "gpus_per_node": 8,
        "global_batch": 32,
        "tp": 1,
        "dp": 2,
        "micro_batch": 2,
        "stages": [{"layers": 12}, {"layers": 12}],
    }
    with pytest.raises(ValueError, match=message):
        Plan.from_dict({**base, **change})


def test_bad_commands_say_what_is_accepted(capsys):
    assert main(["plan", "--model", "gpt3-99b", "--gpus", "8", "--gpu", "l4", "--global-batch", "8"]) == 2
    assert "presets: gpt3-1.3b" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "12", "--gpu", "l4", "--global-batch", "8"]) == 2
    assert "do not fill nodes" in capsys.readouterr().err
    # 256 GPUs, TP <= 8 (16 heads, 8 per node), at most 24 stages: DP >= 2 cannot divide 7
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "256", "--gpu", "l4", "--global-batch", "7"]) == 2
    assert "divides global batch 7" in capsys.readouterr().err


def test_no_feasible_plan_says_how_much_memory(capsys):
    args = ["plan", "--model", "gpt3-22b", "--gpus", "1", "--gpu", "l4", "--global-batch", "8"]
    assert main([*args, "--quiet", "--no-offload"]) == 2
    err = capsys.readouterr().err
    assert "needs" in err and "GiB per GPU" in err and "usable" in err


def test_stages_with_their_own_tp_and_dp():
    """An Aceso-style plan: stage 0 on TP 2 x DP 2, stage 1 on TP 1 x DP 4 (each of the 16
    micro-batches split over the stage's own replicas)."""
    d = {
        "model": "gpt3-1.3b",
        "gpu": "a100-40gb",
        "gpus": 8,
        "gpus_per_node": 8,
        "global_batch": 64,
        "tp": 2,
        "dp": 2,
        "micro_batch": 2,
        "stages": [{"layers": 10}, {"layers": 14, "tp": 1, "dp": 4}],
    }
    plan = predict(Plan.from_dict(d), model("gpt3-1.3b"), cluster("a100-40gb", 8))
    assert plan.stage_parallelism(1) == (1, 4, 1) and plan.grad_accum == 16
    uniform = predict(
        Plan.from_dict({**d, "stages": [{"layers": 10}, {"layers": 14}]}),
        model("gpt3-1.3b"),
        cluster("a100-40gb", 8),
    )
    assert plan.stages[1].steady_s != pytest.approx(uniform.stages[1].steady_s)
    assert "1x4" in plan.table()
    with pytest.raises(ValueError, match="use 2x2 \\+ 1x2 = 6 GPUs"):
        Plan.from_dict({**d, "stages": [{"layers": 10}, {"layers": 14, "tp": 1, "dp": 2}]})


def test_model_fields_on_the_command_line_and_predict_json(tmp_path, capsys):
    import json
    import random

    heads, seq = random.choice((16, 32)), random.choice((512, 1024))
    out = tmp_path / "plan.json"
    args = ["--heads", str(heads), "--seq", str(seq), "--dropout", "0", "--out", str(out), "--quiet"]
    assert (
        main(["plan", "--model", "gpt3-1.3b", "--gpus", "2", "--gpu", "l4", "--global-batch", "8", *args])
        == 0
    )
    capsys.readouterr()
    saved = json.loads(out.read_text())
    # the plan names its model exactly: the fields that differ from the preset
    asked = model("gpt3-1.3b", heads=heads, seq=seq, dropout=0.0)
    preset = model("gpt3-1.3b")
    wanted = {"heads": heads, "seq": seq, "dropout": 0.0}
    differ = {k: v for k, v in wanted.items() if getattr(preset, k) != v}
    assert saved["plan_format"] == 2 and saved["model_overrides"] == differ
    assert Plan.load(out).model_spec() == asked
    assert main(["predict", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prediction_format"] == 2 and doc["fits"] is True
    assert {"iteration_s", "closed_form_s", "usable_memory_bytes", "stages", "breakdown", "plan"} <= set(doc)
    assert [s["layers"] for s in doc["stages"]] == [s["layers"] for s in saved["stages"]]
    assert all(0 < s["memory_bytes"] <= doc["usable_memory_bytes"] for s in doc["stages"])
    # 0 is a value, not "unset": refused in one line, as is a plan of an unknown format
    bad_seq = ["--gpus", "2", "--gpu", "l4", "--global-batch", "8", "--seq", "0"]
    assert main(["plan", "--model", "gpt3-1.3b", *bad_seq]) == 2
    assert "seq must be a positive integer" in capsys.readouterr().err
    saved["plan_format"] = 3
    out.write_text(json.dumps(saved))
    assert main(["predict", str(out)]) == 2
    assert "plan_format 3 is not supported" in capsys.readouterr().err


def test_plan_under_a_device_memory_cap(tmp_path, capsys):
    """`--gpu-mem` caps every device (the CPU "device" included: no CUDA reserve there): the plan
    file carries the cap, the plan fits under it, and a tighter cap changes the plan (negative
    control: the cap is used). A bad size: one line saying what is accepted."""
    plans = {}
    for cap in ("16GiB", "2MiB"):
        out = tmp_path / f"{cap}.yaml"
        assert (
            main(
                [
                    "plan",
                    "--model",
                    "gpt3-tiny",
                    "--gpus",
                    "2",
                    "--gpu",
                    "cpu",
                    "--global-batch",
                    "8",
                    "--gpu-mem",
                    cap,
                    "--quiet",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        plans[cap] = Plan.load(out)
    tight = plans["2MiB"]
    assert tight.gpu_memory_bytes == 2 * 2**20 and tight.breakdown["usable_memory_bytes"] == 2 * 2**20
    assert all(s.memory_bytes <= 2 * 2**20 for s in tight.stages)
    assert max(s.memory_bytes for s in plans["16GiB"].stages) > 2 * 2**20  # unconstrained, it uses more
    capsys.readouterr()
    base = ["plan", "--model", "gpt3-tiny", "--gpus", "2", "--gpu", "cpu", "--global-batch", "8"]
    for bad in ("lots", "infGiB", "1e400GiB"):  # the last two once ended in an OverflowError
        assert main([*base, "--gpu-mem", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'16GB', '80GiB', '512MiB'" in err[0], err


def test_a_plan_keeps_the_engine_it_was_priced_for(tmp_path, capsys):
    """A plan made with --engine megatron-lm (fp32 main grads) was re-priced by `mist predict` for
    16-bit gradients unless --engine was said again, and exported with --grad-reduce-in-bf16, so
    Megatron-LM ran other gradients than the plan priced (review 2026-12-07)."""

    from mist.engine.run import priced_otherwise
    from mist.export import megatron_lm_arguments

    # 2 L4s: a pipeline of two unsharded stages, whose whole gradient buffers the engines price at
    # 2 and 4 bytes a parameter (on 4, the plan is ZeRO-2 over 4 replicas with one micro-batch,
    # where the 16-bit engine's fp32 copy at the step levels the peaks since the all-gathers were
    # read right, 411de49)
    gpus = 2
    plans = {}
    for engine in ("megatron-core", "megatron-lm"):
        out = tmp_path / f"{engine}.yaml"
        argv = ["plan", "--model", "gpt3-1.3b", "--gpus", str(gpus), "--gpu", "l4", "--global-batch", "16"]
        assert main([*argv, "--engine", engine, "--quiet", "--out", str(out)]) == 0
        plans[engine] = Plan.load(out)
        assert plans[engine].breakdown["engine"] == engine
    capsys.readouterr()
    fp32 = plans["megatron-lm"]
    again = predict(Plan.load(tmp_path / "megatron-lm.yaml"), model("gpt3-1.3b"), cluster("l4", gpus))
    assert [s.memory_bytes for s in again.stages] == [s.memory_bytes for s in fp32.stages]
    assert again.predicted_iteration_s == pytest.approx(fp32.predicted_iteration_s, rel=1e-12)
    # the same plan priced for 16-bit gradients: 2 bytes a parameter less on every stage
    as_16_bit = predict(
        Plan.load(tmp_path / "megatron-lm.yaml"),
        model("gpt3-1.3b"),
        cluster("l4", gpus),
        grad_accumulation=GRAD_ACCUMULATION["megatron-core"],
    )
    assert all(
        a < b
        for a, b in zip(
            (s.memory_bytes for s in as_16_bit.stages), (s.memory_bytes for s in fp32.stages), strict=True
        )
    )
    assert as_16_bit.breakdown["engine"] == "megatron-core"
    # the CLI re-prices for the plan's engine unless told another
    for given, engine in (([], "megatron-lm"), (["--engine", "megatron-core"], "megatron-core")):
        assert main(["predict", str(tmp_path / "megatron-lm.yaml"), "--json", *given]) == 0
        stages = json.loads(capsys.readouterr().out)["stages"]
        want = fp32 if engine == "megatron-lm" else as_16_bit
        assert [s["memory_bytes"] for s in stages] == [s.memory_bytes for s in want.stages]
    # exported with the gradients priced; the engine says it runs 16-bit ones
    for engine, plan in plans.items():
        args, _ = megatron_lm_arguments(plan, model("gpt3-1.3b"))
        assert ("--grad-reduce-in-bf16" in args) == (engine == "megatron-core")
        notes = priced_otherwise(plan)
        assert any("priced for how megatron-lm accumulates" in n for n in notes) == (engine == "megatron-lm")
    unpriced = Plan.from_dict({**plans["megatron-lm"].what_runs(), "plan_format": 2})
    assert unpriced.priced_engine is None
    assert "--grad-reduce-in-bf16" in megatron_lm_arguments(unpriced, model("gpt3-1.3b"))[0]
    with pytest.raises(ValueError, match="breakdown: engine must be one of megatron-core, mist, megatron-lm"):
        Plan.from_dict({**fp32.to_dict(), "breakdown": {**fp32.breakdown, "engine": "megatron_lm"}})


def test_the_megatron_lm_target_plans_for_the_gradients_it_exports(tmp_path, capsys):
    """`--target megatron-lm` searched for 16-bit gradients only; a Megatron-LM user keeping its
    bf16 default (fp32 main grads) can plan for them, and the export then keeps that default."""
    from mist.export import megatron_lm_arguments

    base = ["plan", "--model", "gpt3-1.3b", "--gpus", "4", "--gpu", "l4", "--global-batch", "16", "--quiet"]
    out = tmp_path / "plan.yaml"
    assert main([*base, "--target", "megatron-lm", "--engine", "megatron-lm", "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.priced_engine == GRAD_ACCUMULATION["megatron-lm"]
    assert "--grad-reduce-in-bf16" not in megatron_lm_arguments(plan, model("gpt3-1.3b"))[0]
    as_16_bit = predict(
        Plan.load(out),
        model("gpt3-1.3b"),
        cluster("l4", 4),
        grad_accumulation=GRAD_ACCUMULATION["megatron-core"],
    )
    assert all(a.memory_bytes < b.memory_bytes for a, b in zip(as_16_bit.stages, plan.stages, strict=True))
    capsys.readouterr()
    for target, engine in (("megatron-lm", "mist"), ("torchtitan", "megatron-lm")):
        assert main([*base, "--target", target, "--engine", engine]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--target {target}: it accumulates gradients as --engine" in err[0], err


def test_an_engine_other_than_the_priced_one_is_said_or_refused(tmp_path, capsys):
    """Review 2026-12-07: a plan priced for torchtitan exported to Megatron-LM (16-bit reductions),
    or one priced for megatron-core exported to torchtitan (fp32), ran other gradients than priced
    without a word; predict took any GradAccumulation and wrote a name no plan file reads back;
    refine ranked for its options' engine and kept the plan's."""
    import dataclasses

    from mist.export import priced_otherwise_note
    from mist.model.specs import TARGET_ENGINES, GradAccumulation
    from mist.tuning.planner import PlannerOptions, refine

    m, c = model("gpt3-1.3b"), cluster("l4", 4)
    out = tmp_path / "plan.yaml"
    argv = ["plan", "--model", "gpt3-1.3b", "--gpus", "4", "--gpu", "l4", "--global-batch", "16"]
    # a plan Megatron-LM runs, whatever Mist's own search prefers (its export is what is checked)
    assert main([*argv, "--target", "megatron-lm", "--quiet", "--out", str(out)]) == 0
    for engine, accumulation in GRAD_ACCUMULATION.items():
        plan = predict(Plan.load(out), m, c, grad_accumulation=accumulation)
        for target, runs in TARGET_ENGINES.items():
            note = priced_otherwise_note(plan, target)
            as_priced = engine in runs and (
                target == "torchtitan" or (accumulation.grad_bytes == 4) == (engine == "megatron-lm")
            )
            assert (note is None) == as_priced, (engine, target, note)
        plan.save(out.with_name(f"{engine}.yaml"))
        capsys.readouterr()
        assert main(["export", str(out.with_name(f"{engine}.yaml")), "--to", "megatron-lm"]) == 0
        said = [line for line in capsys.readouterr().err.splitlines() if "priced for" in line]
        assert bool(said) == (engine not in ("megatron-core", "megatron-lm")), (engine, said)
    # a priced plan that records no engine (older files, another tool's) was priced as megatron-core;
    # not priced at all, it was priced for nothing (review 2026-12-07)
    unrecorded = Plan.load(out)
    unrecorded.breakdown = {}
    assert "priced for megatron-core's" in priced_otherwise_note(unrecorded, "torchtitan")
    assert priced_otherwise_note(unrecorded, "megatron-lm") is None
    unrecorded.predicted_iteration_s = None
    assert priced_otherwise_note(unrecorded, "torchtitan") is None
    unrecorded.breakdown = {"engine": "bogus"}  # changed after loading (loading refuses it)
    with pytest.raises(ValueError, match="breakdown engine 'bogus' is none of"):
        unrecorded.priced_engine  # noqa: B018
    custom = GradAccumulation("mine", 6.0, True)
    lookalike = dataclasses.replace(GRAD_ACCUMULATION["megatron-lm"], engine="megatron-core")
    for bad in (custom, lookalike, "megatron-lm"):
        with pytest.raises(
            ValueError, match=r"must be one of mist\.model\.specs\.GRAD_ACCUMULATION's engines"
        ) as e:
            predict(Plan.load(out), m, c, grad_accumulation=bad)
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="GRAD_ACCUMULATION's engines"):
            PlannerOptions(grad_accumulation=bad)
    fp32 = Plan.load(out.with_name("megatron-lm.yaml"))
    with pytest.raises(ValueError, match="this plan was priced for megatron-lm: pass PlannerOptions"):
        refine(fp32, m, c, PlannerOptions(), None, None)
    refined = refine(
        fp32, m, c, PlannerOptions(grad_accumulation=GRAD_ACCUMULATION["megatron-lm"]), None, None
    )
    assert refined.priced_engine == GRAD_ACCUMULATION["megatron-lm"]
