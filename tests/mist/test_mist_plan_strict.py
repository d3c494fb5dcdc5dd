"""Plan files read and written strictly (the fourth probe round): no file read without end, the
predictions a file carries checked like its plan, a plan saved only where it reads back as the
same plan, and the planner's options checked where they are made."""

from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest

from mist import Plan, PlannerOptions, StagePlan, cluster, model, predict, search
from mist.__main__ import main
from mist.model.specs import ModelSpec

from .cli_inputs import PLAN, one_error_line


def _one_error_line(capsys, *expected: str) -> None:
    one_error_line(capsys.readouterr().err, *expected)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_or_a_device_as_plan_file_is_refused_not_read(tmp_path, capsys):
    """A FIFO blocked `mist predict` until killed and /dev/zero read until MemoryError."""
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)  # no writer: a read would block (the test's timeout ends it)
    assert main(["predict", str(fifo)]) == 2
    _one_error_line(capsys, "plan.yaml: not a regular file")
    if os.path.exists("/dev/zero"):
        assert main(["predict", "/dev/zero"]) == 2
        _one_error_line(capsys, "/dev/zero: not a regular file")
    control = tmp_path / "control.yaml"
    control.write_text(PLAN)
    assert main(["predict", str(control)]) == 0


@pytest.mark.parametrize(
    ("added", "expected"),
    [
        ("predicted_iteration_s: fast", "predicted_iteration_s must be a finite number of seconds >= 0"),
        ("predicted_iteration_s: -1", "predicted_iteration_s must be a finite number of seconds >= 0"),
        ("tuning_s: .nan", "tuning_s must be a finite number of seconds >= 0"),
        ("simulated_iteration_s: true", "simulated_iteration_s must be a finite number"),
        ("breakdown: {fast: 1}", "breakdown: unknown field(s) fast"),
        ("breakdown: {fits: 1}", "breakdown: fits must be true or false"),
        ("breakdown: {layer_fwd_ms: .inf}", "breakdown: layer_fwd_ms must be a finite number >= 0"),
        # nested aliases (a "billion laughs"): a list where a number goes, refused before any use
        ("a: &a [1, 1]\nb: &b [*a, *a]\nbreakdown: {layer_saved_bytes: [*b, *b]}", "unknown field(s) a, b"),
        ("breakdown: {layer_saved_bytes: [1, 2]}", "breakdown: layer_saved_bytes must be a whole number"),
    ],
)
def test_the_predictions_a_plan_file_carries_are_checked(tmp_path, capsys, added, expected):
    path = tmp_path / "plan.yaml"
    path.write_text(PLAN + added + "\n")
    assert main(["predict", str(path)]) == 2
    _one_error_line(capsys, "plan.yaml", expected)


def test_stage_predictions_are_checked(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(PLAN.replace("{layers: 12}, {layers: 12}", "{layers: 12, steady_s: '1'}, {layers: 12}"))
    assert main(["predict", str(path)]) == 2
    _one_error_line(capsys, "stage 0: steady_s must be a finite number of seconds >= 0")


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_predicted_plan_saves_and_reads_back_the_same(tmp_path, suffix):
    """Control for the checks above: what predict() writes into a plan passes them."""
    layers = random.choice([4, 8, 12])
    m = model("gpt3-1.3b", layers=np.int64(layers))  # a numpy number: YAML refused it at save
    c = cluster("l4", 2)
    mb = random.choice([1, 2, 4])
    plan = Plan.of(m, c, global_batch=8, tp=1, dp=2, micro_batch=mb, stages=[StagePlan(layers=layers)])
    predict(plan, m, c)
    assert plan.breakdown and plan.predicted_iteration_s > 0
    path = tmp_path / f"plan{suffix}"
    plan.save(path)
    again = Plan.load(path)
    assert again.to_dict() == Plan.from_dict(plan.to_dict()).to_dict()
    assert again.model_spec() == m and isinstance(again.model_overrides["layers"], int)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left beside it


def test_a_plan_of_a_model_that_is_no_preset_is_not_saved(tmp_path):
    """Saved as `model: mymodel` with no overrides, its shape was lost without a word."""
    import dataclasses

    mine = dataclasses.replace(model("gpt3-tiny"), name="mymodel")
    assert isinstance(mine, ModelSpec)
    plan = search(mine, cluster("cpu", 1), 8, PlannerOptions(micro_batches=(8,)))
    with pytest.raises(ValueError, match="a plan of model 'mymodel' cannot be saved") as e:
        plan.save(tmp_path / "plan.yaml")
    assert "\n" not in str(e.value) and not (tmp_path / "plan.yaml").exists()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (dict(micro_batches=[0]), "micro_batches must be None or a non-empty list of whole numbers >= 1"),
        (dict(micro_batches=[-2]), "micro_batches must be"),
        (dict(micro_batches=[1.5]), "micro_batches must be"),
        (dict(micro_batches=[]), "micro_batches must be"),
        (dict(milp_time_limit=0), "milp_time_limit must be a finite number of seconds > 0"),
        (dict(refine_offload_step=0), r"refine_offload_step must be None or a whole number in \[1, 32\]"),
        (dict(refine_offload_step=10**6), r"refine_offload_step must be None or a whole number in \[1, 32\]"),
        (dict(refine_offload_step=33), r"got 33"),
        (dict(imbalance_aware="no"), "imbalance_aware must be True or False"),
        (dict(space="all"), "space must be a SearchSpace"),
    ],
)
def test_planner_options_are_checked_where_they_are_made(options, expected):
    """A micro-batch of 0 divided by zero inside the search; [-2] and [1.5] gave messages that
    did not say what was wrong."""
    with pytest.raises(ValueError, match=expected) as e:
        PlannerOptions(**options)
    assert "\n" not in str(e.value)
    PlannerOptions(micro_batches=[1, 2])  # control: a list of whole numbers is taken
    PlannerOptions(refine_offload_step=32)  # control: the finest step taken


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(zero_stages=()), "zero_stages: one or more of the ZeRO stages 0, 1, 2, 3; got ()"),
        (dict(zero_stages=(7,)), "zero_stages: one or more of the ZeRO stages"),
        (dict(zero_stages=(True,)), "zero_stages: one or more of the ZeRO stages"),
        (dict(zero_stages=0), "zero_stages: one or more of the ZeRO stages"),
        (dict(offload="no"), "offload must be True or False, got 'no'"),
        (dict(recompute=2), "recompute must be True or False, got 2"),
        (dict(selective=1), "selective must be True or False, got 1"),
        (
            dict(offload_ratios=(float("nan"),)),
            r"offload_ratios: one or more fractions in \[0, 1\]; got \(nan,\)",
        ),
        (dict(offload_ratios=(-0.5,)), r"offload_ratios: one or more fractions in \[0, 1\]"),
        (dict(offload_ratios=(1.5,)), r"offload_ratios: one or more fractions"),
        (dict(offload_ratios=()), r"offload_ratios: one or more fractions"),
    ],
)
def test_a_search_space_is_checked_where_it_is_made(fields, expected):
    """The probe round: () an IndexError inside the search, "no" and 2 taken as true, a NaN ratio
    "the leanest candidate needs inf GiB", -0.5 NoFeasiblePlan, 1.5 and ZeRO 7 refused only later
    as some stage's error."""
    from mist.tuning.stage_cost import SearchSpace

    with pytest.raises(ValueError, match=expected) as e:
        SearchSpace(**fields)
    assert "\n" not in str(e.value)
    SearchSpace(zero_stages=[0, 3], offload_ratios=(0, 0.25, 1), offload=False)  # control: taken


@pytest.mark.parametrize("options", [{}, {"micro_batches": [1]}, 0])
def test_search_takes_planner_options_only(options):
    """A mapping was an AttributeError inside the search, and {} or 0 silently the defaults."""
    with pytest.raises(ValueError, match="options must be a PlannerOptions or None"):
        search(model("gpt3-tiny"), cluster("cpu", 1), 8, options)


def test_a_bad_model_override_in_a_plan_file_names_the_file_and_field(tmp_path, capsys):
    """model_overrides: {dropout: .nan} said 'dropout must be a number in [0, 1)' with no file."""
    path = tmp_path / "plan.yaml"
    path.write_text(PLAN + "model_overrides: {dropout: .nan}\n")
    assert main(["predict", str(path)]) == 2
    _one_error_line(capsys, "plan.yaml: model_overrides: dropout must be")


_DEEP = "[" * 100_000 + "]" * 100_000
_HUGE = "1" + "0" * 400  # beyond a float: float() of it overflows


@pytest.mark.parametrize(
    ("suffix", "text", "expected"),
    [
        (".json", _DEEP, "nested deeper than Python's parser follows"),
        (".yaml", _DEEP, "nested deeper than Python's parser follows"),
        (
            ".yaml",
            PLAN.replace("{layers: 12}, {layers: 12}", f"{{layers: 12, wait_s: {_HUGE}}}, {{layers: 12}}"),
            "whole number 100000000000... (401 characters): beyond any number read here",
        ),
        (".yaml", PLAN + f"gpu_memory_bytes: {_HUGE}\n", "beyond any number read here"),
        (".yaml", PLAN + f"host_memory_per_node_bytes: -{_HUGE}\n", "(402 characters): beyond any number"),
        (".yaml", PLAN + f"global_batch_x: {'9' * 5000}\n", "(5000 characters): beyond any number"),
    ],
    ids=["deep json", "deep yaml", "huge wait_s", "huge gpu memory", "huge host memory", "5000 digits"],
)
def test_a_plan_file_too_deep_or_with_a_huge_number_is_one_line(tmp_path, capsys, suffix, text, expected):
    """The probe round: a RecursionError traceback (28 lines from JSON, 2,989 from YAML), an
    OverflowError one from a 400-digit wait_s or memory cap, "Exceeds the limit (4300 digits)" with
    no file named from 5000 digits. Now the file and what is wrong, in one line."""
    path = tmp_path / f"plan{suffix}"
    path.write_text(text)
    assert main(["predict", str(path)]) == 2
    _one_error_line(capsys, str(path), expected)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("global_batch: 1:20", "global_batch must be a whole number >= 1, got '1:20'"),  # read as 80
        ("global_batch: 0x8", "got '0x8'"),
        ("global_batch: 010", "got '010'"),  # octal 8
        ("global_batch: 1_0", "got '1_0'"),
        ("sequence_parallel: yes", "sequence_parallel must be true or false, got 'yes'"),
        ("sequence_parallel: on", "got 'on'"),
    ],
)
def test_yaml_1_1_numbers_and_booleans_are_refused_not_read(tmp_path, capsys, given, expected):
    """PyYAML reads YAML 1.1: `1:20` was base 60 (predicted for global batch 80, exit 0), `0x8` and
    `010` 8, `yes` and `on` true. Plans read YAML 1.2's numbers and booleans: these stay strings,
    refused in one line; written the plain way they read (the control)."""
    field = given.split(":")[0]
    path = tmp_path / "plan.yaml"
    path.write_text(
        "\n".join(line for line in PLAN.splitlines() if not line.startswith(field)) + f"\n{given}\n"
    )
    assert main(["predict", str(path)]) == 2
    _one_error_line(capsys, "plan.yaml", expected)
    plain = {"global_batch": "global_batch: 8", "sequence_parallel": "sequence_parallel: true"}[field]
    path.write_text(path.read_text().replace(given, plain))
    assert main(["predict", str(path)]) == 0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ("{name: gpt3-2.7b}", "model_overrides: unknown model field(s) name; known: "),
        ("{1: 2, seq: 1024}", "model_overrides must be a mapping of model fields by name, got {1: 2, "),
        ("{null: 2}", "model_overrides must be a mapping of model fields by name"),
    ],
)
def test_a_model_override_named_name_or_not_by_a_string_is_one_line(tmp_path, capsys, overrides, expected):
    """The probe round: "model() got multiple values for argument 'name'" and "keywords must be
    strings", each an 18-line TypeError traceback."""
    path = tmp_path / "plan.yaml"
    path.write_text(PLAN + f"model_overrides: {overrides}\n")
    assert main(["predict", str(path)]) == 2
    _one_error_line(capsys, "plan.yaml", expected)


def test_a_model_spec_is_named_by_a_string():
    with pytest.raises(ValueError, match="name must be a non-empty string, got 123"):
        ModelSpec(123, 64, 2, 4)


@pytest.mark.parametrize(
    ("given", "said", "not_said"),
    [
        ([], ["synthetic data", "a null tokenizer"], []),
        (["--data-path", "/data/x"], ["a null tokenizer"], ["synthetic data"]),
        (["--data-path", "/data/x", "--tokenizer-type", "GPT2BPETokenizer"], [], ["placeholders"]),
    ],
)
def test_the_export_footer_names_only_the_placeholders(tmp_path, capsys, given, said, not_said):
    """With --data-path given, the footer still said the data was synthetic (--mock-data)."""
    path = tmp_path / "plan.yaml"
    path.write_text(PLAN)
    assert main(["export", str(path), "--to", "megatron-lm", *given]) == 0
    err = capsys.readouterr().err
    assert all(s in err for s in said) and not any(s in err for s in not_said), err


def test_a_plan_that_would_not_read_back_is_not_saved(tmp_path):
    """A negative predicted wait was saved without a word, and Plan.load then refused the file."""
    source = tmp_path / "source.yaml"
    source.write_text(PLAN)
    plan = Plan.load(source)
    plan.stages[0].wait_s = -1e-9
    with pytest.raises(ValueError, match="would not read back, so it is not saved: stage 0: wait_s") as e:
        plan.save(tmp_path / "plan.yaml")
    assert "\n" not in str(e.value) and not (tmp_path / "plan.yaml").exists()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t + "pre_post: x\n", "plan.yaml: pre_post must be a mapping of the embedding's"),
        (lambda t: t + "pre_post: [1]\n", "pre_post must be a mapping"),
        (
            lambda t: t.replace("model: gpt3-1.3b", "model: 'gpt3-1.3b '"),
            "plan.yaml: model 'gpt3-1.3b ' is no preset (presets: ",
        ),
        (
            lambda t: t.replace("{layers: 12}, {layers: 12}", "{layers: 12, null: 1}, {layers: 12}"),
            "plan.yaml: stage 0: unknown field(s) None; a StagePlan has: layers",
        ),
        (
            lambda t: t.replace("{layers: 12}, {layers: 12}", "{layers: 12}, {layers: 12, 7: 1, z: 2}"),
            "plan.yaml: stage 1: unknown field(s) 7, z; a StagePlan has: layers",
        ),
        (lambda t: t + "7: 1\n", "plan.yaml: unknown field(s) 7; a Plan has: model"),
        (lambda t: t + "pre_post: {null: 1}\n", "plan.yaml: pre_post: unknown field(s) None"),
        # the probe round of 2026-12-07: "'<=' not supported between instances of 'float' and
        # 'str'", true taken as 1.0, a dataclass's "missing 1 required keyword-only argument"
        (
            lambda t: t.replace(
                "{layers: 12}, {layers: 12}", "{layers: 12, offload_weights: half}, {layers: 12}"
            ),
            "plan.yaml: stage 0: offload_weights is a fraction in [0, 1], got 'half'",
        ),
        (
            lambda t: t.replace(
                "{layers: 12}, {layers: 12}", "{layers: 12}, {layers: 12, offload_grads: [1]}"
            ),
            "plan.yaml: stage 1: offload_grads is a fraction in [0, 1], got [1]",
        ),
        (
            lambda t: t.replace(
                "{layers: 12}, {layers: 12}", "{layers: 12, offload_grads: true}, {layers: 12}"
            ),
            "stage 0: offload_grads is a fraction in [0, 1], got True",
        ),
        (lambda t: t + "pre_post: {offload_optimizer: null}\n", "pre_post: offload_optimizer is a fraction"),
        (lambda t: t + "pre_post: {zero: '1'}\n", "pre_post: zero must be 0, 1, 2 or 3, got '1'"),
        (lambda t: t + "pre_post: {zero: true}\n", "pre_post: zero must be 0, 1, 2 or 3, got True"),
        (lambda t: t.replace("tp: 1\n", ""), "plan.yaml: missing field(s) tp; a Plan needs: model, gpu"),
        (
            lambda t: t.replace("{layers: 12}, {layers: 12}", "{layers: 12}, {recompute: 0}"),
            "plan.yaml: stage 1: missing field(s) layers; a StagePlan needs: layers",
        ),
    ],
    ids=[
        "pre_post string",
        "pre_post list",
        "model with a space",
        "null key",
        "7 key",
        "top 7",
        "pre_post null",
        "fraction string",
        "fraction list",
        "fraction true",
        "pre_post fraction null",
        "pre_post zero string",
        "pre_post zero true",
        "missing tp",
        "missing layers",
    ],
)
def test_a_plan_file_field_of_the_wrong_kind_is_named_in_one_line(tmp_path, capsys, edit, expected):
    """The probe round: "PrePostPlan() argument after ** must be a mapping, not str", "unknown model
    'gpt3-1.3b '" with no file named, "sequence item 0: expected str instance, NoneType found"."""
    path = tmp_path / "plan.yaml"
    path.write_text(edit(PLAN))
    assert main(["predict", str(path)]) == 2
    _one_error_line(capsys, expected)
    path.write_text(PLAN + "pre_post: {zero: 1}\n")  # control: a pre_post mapping is taken
    assert main(["predict", str(path)]) == 0


def test_planner_options_cannot_be_changed_after_their_checks():
    """The probe round: `o.micro_batches = [0]` after the checks divided by zero in the search, and
    `o.milp_time_limit = nan` was taken. Options are frozen; a list given is kept as a tuple (the
    list itself could be changed later); dataclasses.replace makes other options, checked."""
    import dataclasses

    o = PlannerOptions(micro_batches=[1, 2])
    assert o.micro_batches == (1, 2)
    for name, value in (("micro_batches", [0]), ("milp_time_limit", float("nan"))):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(o, name, value)
    with pytest.raises(ValueError, match="milp_time_limit must be a finite number of seconds > 0"):
        dataclasses.replace(o, milp_time_limit=float("nan"))
    assert dataclasses.replace(o, milp_time_limit=2.0).milp_time_limit == 2.0  # control


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"runtime": "x"}, "runtime must be None (the GPU's preset) or a RuntimeModel"),
        ({"interference": 0}, "interference must be None (the GPU's preset) or an Interference"),
        ({"progress": 5}, "progress must be None or a function taking a line of text, got 5"),
    ],
)
def test_search_refuses_wrong_cost_models_and_progress_before_work(given, expected, monkeypatch):
    """The probe round: runtime="x" an AttributeError inside, interference=0 silently the preset,
    progress=5 a TypeError after the first candidate's work."""
    from mist.tuning import planner

    monkeypatch.setattr(planner.Problem, "resolve", lambda *a, **k: pytest.fail("work began"))
    with pytest.raises(ValueError, match=re.escape(expected)) as e:
        search(model("gpt3-tiny"), cluster("cpu", 2), 8, **given)
    assert "\n" not in str(e.value)


def test_a_search_the_milp_time_limit_stopped_says_so(monkeypatch):
    """The probe round: with milp_time_limit=1e-9 every MILP stopped before a solution and the
    search said "the leanest candidate needs 513.0 MiB per GPU, 22.1 GiB usable", memory it had.
    The MILP here returns none as HiGHS at its time limit does (no timing in the test); the
    control, a model no GPU holds, still names memory."""
    from mist import NoFeasiblePlan
    from mist.tuning import planner

    monkeypatch.setattr(planner, "solve_inter_stage", lambda *a, **k: None)
    options = PlannerOptions(micro_batches=(1,), milp_time_limit=0.5, refine_offload_step=None)
    with pytest.raises(NoFeasiblePlan, match=r"the MILP reached its time limit \(milp_time_limit 0.5 s\)"):
        search(model("gpt3-1.3b"), cluster("l4", 2), 8, options)
    with pytest.raises(NoFeasiblePlan, match="the leanest candidate needs"):
        search(model("gpt3-13b"), cluster("l4", 1, host_memory=2**30), 8, options)


def test_searches_skip_a_tp_that_cannot_split_the_sequence_under_sequence_parallelism():
    """Review 2026-12-07: Plan.check_model refuses sequence parallelism over a TP that does not
    divide the sequence (megatron-core's assert), and the searches still tried those TPs: a 33-token
    model raised mid-search. Every search's TP sizes now share the rule (plan.tp_splits); the
    control, a 32-token model, may take TP 2."""
    from mist.tuning.megatron_lm import search_megatron_lm
    from mist.tuning.planner import settings
    from mist.tuning.problem import Problem
    from mist.tuning.torchtitan import search_torchtitan

    for search_one in (search, search_megatron_lm):
        plan = search_one(model("gpt3-tiny", seq=33), cluster("l4", 2), 4)
        assert plan.tp == 1 and all((s.tp or plan.tp) == 1 for s in plan.stages)
    assert search_torchtitan(model("llama-tiny", seq=33), cluster("l4", 2), 4).tp == 1
    tps = {c.tp for c in settings(Problem.resolve(model("gpt3-tiny"), cluster("l4", 2), 4), PlannerOptions())}
    assert tps == {1, 2}
    with pytest.raises(ValueError, match="with sequence parallelism, the sequence of 33"):
        search(model("gpt3-tiny", seq=33, layers=1), cluster("l4", 2), 1)


def test_a_search_without_offloading_that_fits_nothing_does_not_name_host_memory():
    """Review 2026-12-07: a search told not to offload said "(offloading at most 172.8 GiB of host
    memory per GPU)". It says what it searched; the control offloads."""
    from mist import NoFeasiblePlan
    from mist.tuning.stage_cost import SearchSpace

    for space, said in (
        (SearchSpace(offload=False), "(no offloading searched)"),
        (SearchSpace(), "offloading at most"),
    ):
        options = PlannerOptions(micro_batches=(1,), refine_offload_step=None, space=space)
        with pytest.raises(NoFeasiblePlan, match=re.escape(said)):
            search(model("gpt3-13b"), cluster("l4", 1, host_memory=2**30), 8, options)


def test_the_memory_a_search_that_fits_nothing_names_is_a_lower_bound():
    """ "The leanest candidate needs at least X": no plan of the search fits in less. Planned with
    one byte a GPU less than X usable, nothing fits; with ample memory, the plan found needs X or
    more. (The bound had priced a last stage at the first stage's micro-batches in flight and one
    micro-batch a step; here it is equal, and tight: in these cases a plan fits in X.)"""
    from measure.budget import GpuBudget
    from mist import NoFeasiblePlan
    from mist.tuning.planner import min_memory_needed
    from mist.tuning.problem import Problem

    name, gpu, gpus, batch = random.choice(
        [
            ("gpt3-tiny", "cpu", 1, 8),
            ("gpt3-tiny", "cpu", 2, 8),
            ("gpt3-tiny", "cpu", 4, 8),
            ("gpt3-1.3b", "l4", 2, 16),
        ]
    )
    options = PlannerOptions(refine_offload_step=None)
    m = model(name)
    need = min_memory_needed(
        Problem.resolve(m, cluster(gpu, gpus), batch, None, None, options.grad_accumulation), options
    )
    assert 0 < need < float("inf")
    plan = search(m, cluster(gpu, gpus), batch, options)
    assert max(st.memory_bytes for st in plan.stages) >= need
    # usable = cap on the CPU "device"; on a GPU, (cap - context) x (1 - fragmentation): measure.budget
    reserve = GpuBudget(1) if gpu != "cpu" else GpuBudget(1, context_bytes=0, fragmentation=0.0)
    usable = int(need) - 1
    cap = int(usable / (1 - reserve.fragmentation)) + reserve.context_bytes
    assert GpuBudget(cap, reserve.context_bytes, reserve.fragmentation).usable_bytes < need
    with pytest.raises(NoFeasiblePlan, match="the leanest candidate needs at least"):
        search(m, cluster(gpu, gpus, gpu_memory=cap), batch, options)


def test_the_inter_stage_program_has_a_solution_exactly_where_layers_and_devices_add_up():
    """What tells a MILP stopped by its time limit from one with no solution (stages that fit too
    few layers each, devices that cannot add up or would grow along the pipeline)."""
    from mist.tuning.planner import _layers_add_up

    two = [{(1, 4): None, (2, 4): None}, {(1, 4): None}]
    assert _layers_add_up(two, 3) and _layers_add_up(two, 2) and not _layers_add_up(two, 4)
    devices = [{(2, 2): None, (2, 4): None}, {(2, 4): None, (2, 2): None}]
    assert _layers_add_up(devices, 4, 6)  # 4 then 2
    assert _layers_add_up(devices, 4, 8) and _layers_add_up(devices, 4, 4)
    assert not _layers_add_up(devices, 4, 5)
    growing = [{(2, 2): None}, {(2, 4): None}]
    assert not _layers_add_up(growing, 4, 6)  # 2 then 4: devices never grow along the pipeline


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layers", 257),
        ("layers", 10**7),
        ("seq", 10**12),
        ("hidden", 2**17 + 128),
        ("vocab", 2**22 + 1),
        ("ffn", 2**20),
    ],
)
def test_a_model_past_any_published_size_is_refused_in_one_line(field, value):
    """The probe round: `mist plan --layers 10000000` never ended, 400 layers searched for 197 s, a
    plan's `model_overrides: {seq: 10**12}` predicted with a memory warning. Each bound (specs.
    MAX_MODEL_SIZES) is far past every published model; the bound itself is taken (the control)."""
    from mist.model.specs import MAX_MODEL_SIZES

    with pytest.raises(
        ValueError, match=rf"^{field} must be at most {MAX_MODEL_SIZES[field]} \(far beyond"
    ) as e:
        model("gpt3-1.3b", **{field: value})
    assert "\n" not in str(e.value)
    at_bound = {"layers": 256, "seq": 2**24, "hidden": 2**17, "vocab": 2**22, "ffn": 2**19}[field]
    assert getattr(model("gpt3-1.3b", **{field: at_bound}), field) == at_bound


def test_mist_plan_with_ten_million_layers_is_refused_before_the_search(capsys):
    argv = ["plan", "--model", "gpt3-1.3b", "--gpus", "2", "--gpu", "l4", "--global-batch", "8"]
    assert main([*argv, "--layers", "10000000"]) == 2
    _one_error_line(capsys, "layers must be at most 256")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda t: t.replace(
                "{layers: 12}, {layers: 12}", f"{{layers: 12, memory_bytes: {10**300}}}, {{layers: 12}}"
            ),
            "stage 0: memory_bytes must be a whole number of bytes in [0, 2**64]",
        ),
        (
            lambda t: t + f"gpu_memory_bytes: {2**64 + 1}\n",
            "gpu_memory_bytes must be a positive whole number of bytes, at most 2**64",
        ),
        (
            lambda t: t + f"breakdown: {{layer_saved_bytes: {-(10**30)}}}\n",
            "layer_saved_bytes must be a whole number of bytes, at most 2**64",
        ),
        (
            lambda t: t + "model_overrides: {seq: 1000000000000}\n",
            "model_overrides: seq must be at most 16777216",
        ),
    ],
    ids=["stage memory", "gpu memory", "breakdown bytes", "seq"],
)
def test_a_plan_file_amount_past_its_bound_is_one_line(tmp_path, capsys, edit, expected):
    """The probe round: a stage's memory_bytes of 10**300 was read (10**400 is beyond a float, refused
    by the strict reader), and `model_overrides: {seq: 10**12}` predicted with a memory warning."""
    path = tmp_path / "plan.yaml"
    path.write_text(edit(PLAN))
    assert main(["predict", str(path)]) == 2
    _one_error_line(capsys, "plan.yaml", expected)


def test_a_gpu_memory_cap_the_reserve_fills_is_refused_before_the_search(capsys):
    """The probe round of 2026-12-07: `--gpu-mem 24` (24 bytes) searched a 22B model on 32 A100s
    for 19 s, then said no plan fits with -729.6 MiB usable."""
    argv = ["plan", "--model", "gpt3-22b", "--gpus", "32", "--gpu", "a100-40gb", "--global-batch", "256"]
    assert main([*argv, "--quiet", "--gpu-mem", "24"]) == 2
    _one_error_line(capsys, "--gpu-mem 24: 24 bytes leave nothing", "a size without a unit is bytes")
    # control: the CPU device has no reserve, a cap of a few MiB is planned with (and may not fit)
    cpu = ["plan", "--model", "gpt3-1.3b", "--gpus", "1", "--gpu", "cpu", "--global-batch", "4"]
    assert main([*cpu, "--quiet", "--gpu-mem", "3MiB"]) == 2
    _one_error_line(capsys, "no plan for gpt3-1.3b on 1 x cpu fits", "3.0 MiB usable")
