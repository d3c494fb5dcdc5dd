"""``python -m mist export PLAN --to megatron-lm``: one command that launches the plan, every field
of the priced model and plan in Megatron-LM's flags, and a refusal by part for what it cannot say.
With a Megatron-LM checkout (MEGATRON_LM, tag core_v0.16.1; ``nox -s megatron_lm_args``), its own
``parse_args``/``validate_args`` check every exported plan of the committed comparison."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from artifacts.mist_vs_megatron.plans import summary_plan
from baselines.megatron.grid import GRID
from mist import Plan, StagePlan, cluster, model
from mist.engine.megatron import megatron_limits, model_settings
from mist.engine.run import unsupported
from mist.export import CannotExport, JobInputs, megatron_lm_arguments, megatron_lm_command
from mist.model.specs import GRAD_ACCUMULATION
from mist.tuning.megatron_lm import recompute_counts, setting_plan, settings

from .megatron_lm_check import megatron_lm_checkout, split_command, validate

REPO = Path(__file__).parents[2]
COMPARISON = REPO / "artifacts/mist_vs_megatron/reference/comparison.json"


def _flags(argv: list[str]) -> dict[str, str | bool]:
    """{flag: its value, or True for a switch} of an argv; each flag at most once."""
    out: dict[str, str | bool] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            assert word not in out, f"{word} twice"
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            out[word] = True if following.startswith("--") else following
    return out


def _plan(name: str, layers: list[int], tp: int = 2, dp: int = 1, **stage) -> Plan:
    stages = [StagePlan(layers=n, **stage) for n in layers]
    return Plan(
        model=name,
        gpu="l4",
        gpus=tp * dp * len(layers),
        gpus_per_node=8,
        global_batch=64,
        tp=tp,
        dp=dp,
        micro_batch=1,
        stages=stages,
    )


def test_every_setting_of_the_priced_model_is_a_flag():
    """The command line and mist.engine.run's megatron-core config come from the same settings
    (engine.megatron.model_settings); what no Megatron model can be built as, the export names
    and the engine builds around."""
    name = random.choice(["gpt3-1.3b", "llama-7b", "gpt3-7b"])
    m = model(name, dropout=random.choice([0.0, 0.1]))
    quarter = m.layers // 4  # uneven first and last stages, even middle ones
    plan = _plan(name, [quarter + 1, quarter, quarter, m.layers - 3 * quarter - 1])
    settings = model_settings(plan, m)
    args, cannot = megatron_lm_arguments(plan, m)
    flags = _flags(args)
    pairs = [
        ("num_layers", "--num-layers"),
        ("hidden_size", "--hidden-size"),
        ("ffn_hidden_size", "--ffn-hidden-size"),
        ("num_attention_heads", "--num-attention-heads"),
        ("hidden_dropout", "--hidden-dropout"),
        ("attention_dropout", "--attention-dropout"),
        ("max_sequence_length", "--seq-length"),
        ("max_sequence_length", "--max-position-embeddings"),
        ("normalization", "--normalization"),
        ("position_embedding_type", "--position-embedding-type"),
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
        ("num_layers_in_first_pipeline_stage", "--decoder-first-pipeline-num-layers"),
        ("num_layers_in_last_pipeline_stage", "--decoder-last-pipeline-num-layers"),
    ]
    for field, flag in pairs:
        assert flags[flag] == str(settings[field]), (flag, flags.get(flag), settings[field])
    assert cannot == [] and flags.get("--swiglu", False) == settings["gated_linear_unit"]
    assert (
        flags["--untie-embeddings-and-output-weights"] and flags["--disable-bias-linear"] and flags["--bf16"]
    )
    # the priced 16-bit gradients (Megatron-LM's bf16 default keeps fp32 main grads: review 2026-12-07)
    assert flags["--grad-reduce-in-bf16"]
    assert flags["--micro-batch-size"] == "1" and flags["--global-batch-size"] == "64"
    plan.stages[0].tp = 4  # a stage with its own TP: refused in the words the engine's list uses
    shared = set(megatron_limits(plan, m).values())
    assert shared and shared <= set(megatron_lm_arguments(plan, m)[1])
    assert unsupported(plan) == []  # the engine builds around what Megatron cannot (layout.py)


def test_model_families_become_their_flags():
    plan = _plan("llama-7b", [16, 16])
    flags = _flags(megatron_lm_arguments(plan, model("llama-7b", kv_heads=8))[0])
    assert flags["--normalization"] == "RMSNorm" and flags["--swiglu"] and flags["--sequence-parallel"]
    assert flags["--position-embedding-type"] == "rope" and flags["--num-query-groups"] == "8"
    assert flags["--group-query-attention"] and flags["--hidden-dropout"] == "0.0"
    args, cannot = megatron_lm_arguments(plan, model("falcon-7b"))
    assert "--swiglu" not in args and any("Falcon" in c for c in cannot)
    plan.sequence_parallel = False
    assert "--sequence-parallel" not in megatron_lm_arguments(plan, model("gpt3-7b"))[0]


def test_what_megatron_lm_cannot_express_is_named_part_by_part():
    m = model("gpt3-1.3b")
    stages = [
        StagePlan(layers=5, recompute=2, zero=3),
        StagePlan(layers=7, recompute=0, offload_activations=0.5),
        StagePlan(layers=6),
        StagePlan(layers=6, tp=2, dp=1),
    ]
    plan = Plan.of(m, cluster("l4", 8), global_batch=64, tp=1, dp=2, micro_batch=2, stages=stages)
    args, cannot = megatron_lm_arguments(plan, m)
    for reason in (
        "TP/DP of their own that differ",
        "uneven middle stages",
        "recomputed layers per stage",
        "ZeRO stage 2/3",
        "offloading activations",
    ):
        assert sum(reason in why for why in cannot) == 1, (reason, cannot)
    assert _flags(args)["--pipeline-model-parallel-size"] == "4"
    with pytest.raises(CannotExport) as refused:
        megatron_lm_command(plan, m)
    assert refused.value.parts == cannot


def test_selective_recomputation_is_megatron_lms_granularity_and_torchtitan_refuses_it():
    """Every stage's core attention recomputed, no whole layer: ``--recompute-granularity selective``
    (its default module, core_attn); selective on some stages only, or with whole layers, has no
    Megatron-LM flag; torchtitan's selective mode picks ops, not the core attention."""
    from mist.export import torchtitan_config

    m = model("llama-1.3b")
    every = [StagePlan(layers=12, selective=True), StagePlan(layers=12, selective=True)]
    plan = Plan.of(m, cluster("l4", 4), global_batch=16, tp=1, dp=2, micro_batch=1, stages=every)
    args, cannot = megatron_lm_arguments(plan, m)
    assert not cannot and _flags(args)["--recompute-granularity"] == "selective", (args, cannot)
    assert "--recompute-method" not in args
    some = [StagePlan(layers=12, selective=True), StagePlan(layers=12)]
    with_layers = [StagePlan(layers=12, recompute=1, selective=True), StagePlan(layers=12, selective=True)]
    for stages in (some, with_layers):
        mixed = Plan.of(m, cluster("l4", 4), global_batch=16, tp=1, dp=2, micro_batch=1, stages=stages)
        _, cannot = megatron_lm_arguments(mixed, m)
        assert sum("selective recomputation on some stages only" in c for c in cannot) == 1, cannot
    with pytest.raises(CannotExport) as refused:
        torchtitan_config(plan, m, "")
    assert sum("selective recomputation" in part for part in refused.value.parts) == 1, refused.value.parts


@pytest.mark.parametrize(
    ("dp", "zero", "expected"),
    [(1, 0, "ok"), (2, 1, "ok"), (2, 0, "without ZeRO-1"), (2, 2, "ZeRO stage 2/3")],
)
def test_optimizer_offload_takes_the_distributed_and_precision_aware_optimizer(dp, zero, expected):
    """Megatron-LM offloads only its distributed optimizer, through the precision-aware one
    (megatron-core's OptimizerConfig asserts both); at DP 1 the distributed optimizer shards
    nothing, so a ZeRO-0 plan is that plan; at DP 2 it would shard: refused."""
    m = model("gpt3-1.3b")
    plan = _plan("gpt3-1.3b", [24], tp=1, dp=dp, zero=zero, offload_optimizer=0.5)
    args, cannot = megatron_lm_arguments(plan, m)
    if expected != "ok":
        assert len(cannot) == 1 and expected in cannot[0], cannot
        return
    flags = _flags(args)
    assert cannot == [] and flags["--optimizer-offload-fraction"] == "0.5"
    assert flags["--optimizer-cpu-offload"] and flags["--use-precision-aware-optimizer"]
    assert flags["--use-distributed-optimizer"]


def test_null_tokenizer_pads_to_the_priced_vocabulary():
    """NullTokenizer adds an end-of-document token and Megatron-LM pads the vocabulary to a multiple
    of --make-vocab-size-divisible-by x TP: the export lands on the priced size exactly, and says
    so when no padding can (a vocabulary TP does not divide)."""
    for vocab, tp in ((50304, 1), (50304, 8), (32000, 4), (51200, 2), (random.randrange(1000, 99999), 1)):
        m = model("gpt3-1.3b", vocab=vocab)
        flags = _flags(split_command(megatron_lm_command(_plan("gpt3-1.3b", [24], tp=tp), m))[2])
        tokens = int(flags["--vocab-size"]) + 1
        multiple = int(flags["--make-vocab-size-divisible-by"]) * tp
        assert math.ceil(tokens / multiple) * multiple == vocab, (vocab, tp, flags)
    with pytest.raises(CannotExport, match="over TP 4"):
        megatron_lm_command(_plan("gpt3-1.3b", [24], tp=4), model("gpt3-1.3b", vocab=50258))


def test_the_command_launches_every_node_and_fills_placeholders():
    m = model("gpt3-7b")
    plan = Plan.of(
        m,
        cluster("l4", 16),
        global_batch=64,
        tp=2,
        dp=2,
        micro_batch=1,
        stages=[StagePlan(layers=8, recompute=8) for _ in range(4)],
    )
    command = megatron_lm_command(plan, m, JobInputs(data_path="/data/web_text_document", train_iters=7))
    env, world, argv = split_command(command)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} and world == 16  # TP > 1 needs one connection
    assert "--nnodes 2 --nproc-per-node 8" in command and "${NODE_RANK:-0}" in command
    flags = _flags(argv)
    assert flags["--data-path"] == "/data/web_text_document" and "--mock-data" not in flags
    assert flags["--train-iters"] == "7" and flags["--recompute-method"] == "uniform"
    assert flags["--attention-backend"] == "flash" and flags["--transformer-impl"] == "transformer_engine"
    with pytest.raises(CannotExport, match="FlashAttention with --transformer-impl local"):
        megatron_lm_command(plan, m, JobInputs(transformer_impl="local"))
    unfused = model("gpt3-7b", flash=False)
    plan.model_overrides = {"flash": False}
    flags = _flags(split_command(megatron_lm_command(plan, unfused, JobInputs(transformer_impl="local")))[2])
    assert flags["--attention-backend"] == "unfused" and flags["--transformer-impl"] == "local"


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mist", "export", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "impl")},
        timeout=120,
    )


def test_command_line_prints_a_command_or_one_line_per_part(tmp_path):
    m = model("gpt3-1.3b")
    good = _plan("gpt3-1.3b", [12, 12], tp=1, recompute=12)
    good.save(tmp_path / "good.yaml")
    done = _export(str(tmp_path / "good.yaml"), "--to", "megatron-lm")
    assert done.returncode == 0 and done.stdout.startswith("torchrun ") and "--mock-data" in done.stdout
    assert done.stdout.strip() == megatron_lm_command(good, m)
    bad = _plan("gpt3-1.3b", [5, 7, 6, 6], recompute=0)
    bad.stages[1].zero, bad.stages[2].offload_weights = 2, 0.5
    bad.save(tmp_path / "bad.yaml")
    done = _export(str(tmp_path / "bad.yaml"), "--to", "megatron-lm")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "" and len(lines) == 3, done.stderr
    assert all(line.startswith("python -m mist export: Megatron-LM cannot express: ") for line in lines)
    for args, says in (
        ([str(tmp_path / "good.yaml"), "--to", "megatron-lm", "--lr", "-1"], "lr must be"),
        ([str(tmp_path / "none.yaml"), "--to", "megatron-lm"], "none.yaml"),
    ):
        done = _export(*args)
        assert done.returncode == 2 and done.stdout == "" and len(done.stderr.strip().splitlines()) == 1
        assert says in done.stderr, done.stderr


def _comparison_plans() -> list[tuple[str, Plan]]:
    """Every plan of every system in the committed comparison, and every setting of the grid on its
    smallest GPT-3 and Llama cases (a spread of TP, PP, splits, micro-batches, ZeRO and optimizer
    offload) with no layer, one layer and every layer of a stage recomputed (what decides the
    recompute flags: none, block, uniform), or selective recomputation alone."""
    points = json.loads(COMPARISON.read_text())["points"]
    plans = [
        (f"{p['key']['model']}/{p['key']['gpus']}/{system}", summary_plan(p["key"], summary))
        for p in points
        for system, summary in p["result"].items()
        if isinstance(summary, dict) and "stages" in summary
    ]
    for family in ("gpt3", "llama"):  # Falcon's parallel block: no Megatron-LM model (refused)
        small = min((p for p in points if p["result"]["family"] == family), key=lambda p: p["key"]["gpus"])[
            "key"
        ]
        m, c = (
            model(small["model"], seq=small["seq"], flash=small["flash"]),
            cluster(small["gpu"], small["gpus"]),
        )
        batch = small["global_batch"]
        for i, setting in enumerate(settings(m, c, batch, GRID)):
            ks = recompute_counts(setting, GRID)
            plans += [
                (f"grid/{small['model']}/{i}/{k}", setting_plan(m, c, batch, setting, k))
                for k in sorted({ks[0], ks[min(1, len(ks) - 1)], ks[-1]})
            ]
    return plans


@pytest.mark.slow
def test_megatron_lm_accepts_every_plan_it_can_express():
    """Megatron-LM's parse_args + validate_args (and megatron-core's configs built from them) on
    every exportable plan; those export refuses are counted, and none is the Megatron-LM target's
    or (but Falcon's, which Megatron-LM cannot build) the grid's. Negative controls: a command
    missing what a rule requires is refused by Megatron-LM itself."""
    checkout = megatron_lm_checkout()
    if checkout is None:
        # Megatron-LM's training code is not on PyPI, the only registry CI reaches, so CI skips
        # this visibly; `nox -s megatron_lm_args -- PATH` runs it (docs/mist.md: its last counts)
        pytest.skip("needs a Megatron-LM checkout at core_v0.16.1 in MEGATRON_LM (nox -s megatron_lm_args)")
    accepted, refused, failures = 0, 0, []
    for name, plan in _comparison_plans():
        try:
            command = megatron_lm_command(plan, plan.model_spec())
        except CannotExport as e:
            refused += 1
            ours = name.endswith(("/megatron_lm_target", "/megatron")) or name.startswith("grid/")
            assert not ours or plan.model_spec().parallel_block, (name, e.parts)
            continue
        error = validate(command, plan.gpu, checkout)
        accepted += error is None
        failures += [(name, error)] if error else []
    print(f"Megatron-LM accepted {accepted} exported plans; export refused {refused}")
    assert not failures and accepted > 100, failures[:5]
    offload = _plan("gpt3-1.3b", [12, 12], tp=2, dp=2, zero=1, offload_optimizer=1.0)
    command = megatron_lm_command(offload, offload.model_spec())
    assert validate(command, "l4", checkout) is None
    # interleaved: the chunks a rank and the block count per chunk (12 layers a stage in 3 chunks
    # of 4, the first 2 of each recomputed), at 2 and at 4 stages
    for layers in ([12, 12], [6, 6, 6, 6]):
        interleaved = _plan("gpt3-1.3b", layers, tp=1, dp=2, zero=1, recompute=6 if len(layers) == 2 else 0)
        interleaved.virtual_stages = 3 if len(layers) == 2 else 2
        interleaved.check()
        assert validate(megatron_lm_command(interleaved, interleaved.model_spec()), "l4", checkout) is None
    selective = _plan("gpt3-1.3b", [12, 12], tp=2, dp=2, selective=True)
    selective.model_overrides["flash"] = False
    assert validate(megatron_lm_command(selective, selective.model_spec()), "l4", checkout) is None
    for drop, says in (
        ("--use-precision-aware-optimizer", "use-precision-aware-optimizer"),
        ("--use-distributed-optimizer", "distributed optimizer"),
        ("CUDA_DEVICE_MAX_CONNECTIONS=1 ", "CUDA_DEVICE_MAX_CONNECTIONS"),
        ("--tensor-model-parallel-size 2", "world size"),
    ):
        instead = "--tensor-model-parallel-size 3" if "tensor" in drop else ""
        error = validate(command.replace(drop, instead), "l4", checkout)
        assert error is not None and says in error, (drop, error)


@pytest.mark.parametrize(
    ("name", "gpus", "batch"), [("gpt3-1.3b", 4, 16), ("llama-1.3b", 4, 16), ("gpt3-2.7b", 2, 32)]
)
def test_the_megatron_lm_target_finds_the_exhaustive_best_and_every_plan_exports(name, gpus, batch):
    """``mist plan --target megatron-lm``'s search (pruned, bisected) gives what pricing every plan
    of its space gives; its plan exports whole; it searches a superset of the grid, so it is never
    predicted slower than the grid's plan."""
    from baselines.megatron.grid import search_grid
    from mist.tuning.exhaustive import cheapest_fitting
    from mist.tuning.megatron_lm import MegatronLMSpace, search_megatron_lm, space_plans
    from mist.tuning.problem import Problem

    m, c = model(name, layers=8), cluster("l4", gpus)  # 8 layers: the exhaustive pricing takes seconds
    space = MegatronLMSpace(offload_fractions=(0.0, 0.5, 1.0))
    # 16-bit gradients, or Megatron-LM's fp32 main grads (--engine megatron-lm); the presets, no
    # memo: every plan priced afresh
    for engine in ("megatron-core", "megatron-lm"):
        grads = GRAD_ACCUMULATION[engine]
        problem = Problem.resolve(m, c, batch, grad_accumulation=grads)
        exhaustive = cheapest_fitting(space_plans(m, c, batch, space), problem, "none fits")
        found = search_megatron_lm(m, c, batch, space, grad_accumulation=grads)
        assert found.predicted_iteration_s == pytest.approx(exhaustive.predicted_iteration_s, rel=1e-12)
        assert found.priced_engine == grads
        args, cannot = megatron_lm_arguments(found, m)
        assert cannot == [] and ("--grad-reduce-in-bf16" in args) == (engine == "megatron-core")
    assert (
        search_megatron_lm(m, c, batch).predicted_iteration_s
        <= search_grid(m, c, batch).predicted_iteration_s
    )


def test_plan_for_megatron_lm_then_export_is_two_commands(tmp_path):
    plan = tmp_path / "plan.yaml"
    base = [
        sys.executable,
        "-m",
        "mist",
        "plan",
        "--gpus",
        "4",
        "--gpu",
        "l4",
        "--global-batch",
        "16",
        "--quiet",
        "--target",
        "megatron-lm",
    ]
    env = {"PYTHONPATH": str(REPO / "impl")}
    done = subprocess.run(
        [*base, "--model", "gpt3-1.3b", "--out", str(plan)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    exported = _export(str(plan), "--to", "megatron-lm")
    assert exported.returncode == 0 and "pretrain_gpt.py" in exported.stdout, exported.stderr
    refused = subprocess.run(
        [*base, "--model", "falcon-7b"], capture_output=True, text=True, env=env, timeout=300
    )
    assert refused.returncode == 2 and refused.stdout == "" and len(refused.stderr.strip().splitlines()) == 1
    assert "parallel on one norm" in refused.stderr


def _llama_plan(tp: int, dp: int, layers: list[int], **stage) -> Plan:
    m = model("llama-7b")
    stages = [StagePlan(layers=n, **stage) for n in layers]
    # torch's DDP overlaps its all-reduce with backward: the plan says so (export refuses otherwise)
    return Plan.of(
        m,
        cluster("a100-40gb", tp * dp * len(layers)),
        global_batch=64,
        tp=tp,
        dp=dp,
        micro_batch=2,
        stages=stages,
        overlap_grad_reduce=True,
    )


@pytest.mark.parametrize(
    ("tp", "dp", "layers", "stage"),
    [
        # PP + TP + FSDP, ZeRO-1 in a pipeline (its gradient sync held to the last micro-batch)
        (2, 2, [15, 17], {"zero": 1, "recompute": None}),
        (1, 8, [32], {"zero": 3, "offload_weights": 1.0, "offload_grads": 1.0, "offload_optimizer": 1.0}),
        (1, 4, [32], {"zero": 0}),  # DDP alone
        (2, 2, [8, 8, 8, 8], {"zero": 1}),  # TP + PP + FSDP, no layer recomputed
    ],
    ids=["pp-tp-fsdp-recompute", "zero3-offload", "ddp", "tp-pp-fsdp"],
)
def test_torchtitan_loads_the_job_config_as_the_plan_says(tmp_path, tp, dp, layers, stage):
    """The TOML of ``mist export --to torchtitan`` through torchtitan's own ConfigManager (the
    loader ``torchtitan.train`` runs) and ParallelDims (which checks the degrees against the world
    size): every field as the plan says, the pipeline's module lists covering the layers in order
    with the plan's split, and the micro-batches a step what the plan has (torchtitan's batch rule:
    global / (local x DP) accumulation steps, local / micro-batch pipeline micro-batches)."""
    config_module = pytest.importorskip("torchtitan.config")
    from torchtitan.distributed import ParallelDims

    from mist.export import toml_text, torchtitan_config

    per_stage = [dict(stage, recompute=n) if stage.get("recompute", 0) is None else stage for n in layers]
    plan = _llama_plan(tp, dp, layers)
    plan.stages = [StagePlan(layers=n, **s) for n, s in zip(layers, per_stage, strict=True)]
    if stage["zero"] == 0:  # torchtitan's DDP sums every micro-batch: a plan without accumulation
        plan.micro_batch = plan.global_batch // dp
    plan.overlap_grad_reduce = stage["zero"] != 1  # a pipeline's FSDP2 reduces after its backward
    config = torchtitan_config(plan, plan.model_spec(), "8B", JobInputs(train_iters=11, lr=3e-4))
    path = tmp_path / "job.toml"
    path.write_text(toml_text(config))
    job = config_module.ConfigManager().parse_args(["--job.config_file", str(path)])
    for section, fields in config.items():
        for key, value in fields.items():
            assert getattr(getattr(job, section), key) == value, (section, key)
    p = job.parallelism
    ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=1,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=1,
        etp=1,
        world_size=plan.gpus,
    )
    batch_degree = p.data_parallel_replicate_degree * p.data_parallel_shard_degree
    steps = job.training.global_batch_size // (job.training.local_batch_size * batch_degree)
    pipeline = job.training.local_batch_size // p.pipeline_parallel_microbatch_size if len(layers) > 1 else 1
    assert steps * pipeline == plan.grad_accum and batch_degree == dp
    if len(layers) > 1:
        parts = p.module_fqns_per_model_part
        assert [len([m for m in part if m.startswith("layers.")]) for part in parts] == layers
        assert [m for part in parts for m in part] == [
            "tok_embeddings",
            *(f"layers.{i}" for i in range(32)),
            "norm",
            "output",
        ]
    assert job.activation_checkpoint.mode == ("full" if plan.stages[0].recompute else "none")
    assert job.training.enable_cpu_offload == (plan.stages[0].offload_weights == 1.0)
    config["parallelism"]["tensor_parallel"] = tp  # negative control: a key torchtitan has not
    path.write_text(toml_text(config))
    with pytest.raises(ValueError, match="tensor_parallel"):
        config_module.ConfigManager().parse_args(["--job.config_file", str(path)])


def test_torchtitan_names_what_it_cannot_express():
    from mist.export import torchtitan_config

    stages = [StagePlan(layers=12, recompute=3, zero=2), StagePlan(layers=12, zero=2)]
    gpt = Plan.of(
        model("gpt3-1.3b"), cluster("l4", 4), global_batch=16, tp=1, dp=2, micro_batch=1, stages=stages
    )
    with pytest.raises(CannotExport) as refused:
        torchtitan_config(gpt, gpt.model_spec(), "")
    text = " | ".join(refused.value.parts)
    for reason in ("no model flavor", "Llama-style", "ZeRO-2/3 in a pipeline", "recomputing some layers"):
        assert sum(reason in part for part in refused.value.parts) == 1, (reason, text)
    # FSDP2 is ZeRO-1 in a pipeline only, and reduce-scatters there after the last backward
    for layers, overlap, reason in (([32], False, "ZeRO-1 without PP"), ([16, 16], True, "overlapped")):
        sharded = _llama_plan(2, 2, layers, zero=1)
        sharded.overlap_grad_reduce = overlap
        with pytest.raises(CannotExport) as refused:
            torchtitan_config(sharded, sharded.model_spec(), "8B")
        assert len(refused.value.parts) == 1 and reason in refused.value.parts[0], refused.value.parts
    llama = _llama_plan(2, 2, [16, 16], zero=0)
    with pytest.raises(CannotExport) as refused:  # one line: DDP over micro-batches is not said too
        torchtitan_config(llama, llama.model_spec(), "8B")
    assert len(refused.value.parts) == 1 and "DDP is for DP alone" in refused.value.parts[0]
    # DDP over micro-batches: torchtitan all-reduces each one's gradients, the plan priced one sum
    ddp = _llama_plan(1, 4, [32], zero=0)
    with pytest.raises(CannotExport, match="summed once over 8 micro-batches"):
        torchtitan_config(ddp, ddp.model_spec(), "8B")
    ddp.micro_batch = 16
    torchtitan_config(ddp, ddp.model_spec(), "8B")


def test_torchtitan_export_prints_the_toml_or_one_line_per_part(tmp_path):
    plan = _llama_plan(1, 8, [32], zero=3)
    plan.save(tmp_path / "plan.yaml")
    done = _export(str(tmp_path / "plan.yaml"), "--to", "torchtitan", "--flavor", "8B")
    assert done.returncode == 0 and done.stdout.startswith("[job]") and "torchtitan.train" in done.stderr
    refused = _export(str(tmp_path / "plan.yaml"), "--to", "torchtitan")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and refused.stdout == "" and len(lines) == 1 and "--flavor" in lines[0]


@pytest.mark.parametrize(("gpus", "batch"), [(4, 16), (2, 32)])
def test_the_torchtitan_target_finds_the_exhaustive_best_and_its_plan_exports(gpus, batch):
    from mist.export import torchtitan_config
    from mist.tuning import torchtitan
    from mist.tuning.exhaustive import cheapest_fitting
    from mist.tuning.problem import Problem

    m, c = (
        model("llama-1.3b", layers=8),
        cluster("l4", gpus),
    )  # 8 layers: the exhaustive pricing takes seconds
    # the presets, no memo: every plan priced afresh, for torchtitan's fp32 reductions
    problem = Problem.resolve(m, c, batch, grad_accumulation=GRAD_ACCUMULATION["torchtitan"])
    every = (
        torchtitan.setting_plan(m, c, batch, s, k) for s in torchtitan.settings(m, c, batch) for k in (0, 1)
    )
    exhaustive = cheapest_fitting(every, problem, "none fits")
    found = torchtitan.search_torchtitan(m, c, batch)
    assert found.predicted_iteration_s == pytest.approx(exhaustive.predicted_iteration_s, rel=1e-12)
    assert found.priced_engine == GRAD_ACCUMULATION["torchtitan"]
    torchtitan_config(found, m, "my-flavor")  # raises CannotExport if a part does not export
    with pytest.raises(ValueError, match="Llama-style"):
        torchtitan.search_torchtitan(model("gpt3-1.3b"), c, batch)


def test_an_option_of_the_other_target_is_refused_not_ignored(tmp_path):
    plan = _llama_plan(1, 8, [32], zero=3)
    plan.save(tmp_path / "plan.yaml")
    torchtitan_with_megatron_option = ["--to", "torchtitan", "--flavor", "8B", "--tokenizer-type", "HF"]
    for args, flag in (
        (torchtitan_with_megatron_option, "--tokenizer-type"),
        (["--to", "megatron-lm", "--flavor", "8B"], "--flavor"),
        (["--to", "megatron-lm", "--flavor", ""], "--flavor"),  # '' was taken as not given
    ):
        done = _export(str(tmp_path / "plan.yaml"), *args)
        assert done.returncode == 2 and done.stdout == "" and len(done.stderr.strip().splitlines()) == 1
        assert flag in done.stderr, done.stderr


@pytest.mark.parametrize("flag", ["--script", "--tokenizer-type", "--tokenizer-model", "--data-path"])
def test_an_empty_value_is_refused_not_written_into_the_command(tmp_path, flag):
    """`--script ''` printed `torchrun ... ''` (no script) and exit 0."""
    _llama_plan(1, 8, [32], zero=3).save(tmp_path / "plan.yaml")
    done = _export(str(tmp_path / "plan.yaml"), "--to", "megatron-lm", flag, " ")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "" and len(lines) == 1, done.stderr
    assert "must be a non-empty string" in lines[0]


def test_a_bad_option_is_one_line_before_any_work():
    bad_iters = ["x.yaml", "--to", "megatron-lm", "--train-iters", "0"]
    for args, says in ((["x.yaml", "--to", "slurm"], "invalid choice: 'slurm'"), (bad_iters, "must be >= 1")):
        done = _export(*args)
        assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
        assert says in done.stderr


def test_the_first_recompute_count_that_fits_is_found_where_memory_is_not_monotone(monkeypatch):
    """One recomputed layer can need more memory than none (a one-layer stage with one micro-batch
    in flight keeps its input and makes all its activations again): 0 fits, 1 does not, 2 does.
    The search must take the plan without recomputation, not bisect past it (it did: a grid plan
    was priced 3.30 s, not 2.78 s). The fit of each count is set here, so the search's logic is
    tested whatever the memory model says of a real case."""
    from mist.tuning import exhaustive
    from mist.tuning.megatron_lm import MegatronLMSetting, setting_plan

    m, c = model("gpt3-1.3b", layers=8), cluster("l4", 4)
    setting = MegatronLMSetting(tp=1, dp=1, micro_batch=16, split=(2, 2, 2, 2), zero=0, offload_optimizer=0.0)
    priced = exhaustive.predict_for

    def predict_for(problem, plan, *args, **kwargs):
        plan = priced(problem, plan, *args, **kwargs)
        plan.breakdown["fits"] = plan.stages[0].recompute != 1
        return plan

    monkeypatch.setattr(exhaustive, "predict_for", predict_for)
    found = exhaustive.fastest_fitting(
        16,
        [setting],
        lambda s, k: setting_plan(m, c, 16, s, k),
        lambda s: list(range(3)),
        m,
        c,
        None,
        None,
        None,
        "none fits",
    )
    assert [s.recompute for s in found.stages] == [0, 0, 0, 0]
