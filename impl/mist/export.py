"""A plan as a job another trainer launches: ``python -m mist export PLAN --to megatron-lm|torchtitan``.

**Megatron-LM.**
The plan decides the model's shape, the parallel sizes, the batch, what recomputes and what the
optimizer shards or offloads; the command says all of it in Megatron-LM's flags (``pretrain_gpt.py``
at the release matching the pinned megatron-core, 0.16.1). What a plan does not decide (data,
tokenizer, learning rate, iterations) is a placeholder the user fills: synthetic data and a null
tokenizer sized to the priced vocabulary by default. A plan part Megatron-LM cannot express is
refused by name (``CannotExport``), never dropped.

The gradient reduction overlaps backward (``--overlap-grad-reduce``, with ``--ddp-bucket-size``
where the plan gives one) when the plan says so (``Plan.overlap_grad_reduce``: what the searches
plan, priced by ``stage_cost._hidden_reduction_s``), and with the distributed optimizer the
weights' all-gather runs in the next forward (``--overlap-param-gather``) when the stages say so
(``StagePlan.gather_in_forward``, priced by ``stage_cost._gather_in_forward_s``). What the
command leaves at Megatron-LM's defaults, on purpose: Adam, and the softmax in the activations'
precision (``engine.megatron.model_settings``). The gradients are what the plan was priced for
(``Plan.priced_engine``): 16-bit (``--grad-reduce-in-bf16``), or Megatron-LM's fp32 main grads,
its default, for a plan priced with ``mist plan/predict --engine megatron-lm``.

**torchtitan** (0.2.2, whose job config is a TOML file): the parallel degrees (FSDP2 for ZeRO-2/3,
DDP for none, its all-reduce overlapped with backward in torchtitan's 100 MiB buckets, 26.2M of
its fp32 gradients, where the plan priced Megatron-LM's default buckets of 40M 16-bit ones), the
pipeline's stages as explicit module lists and its 1F1B schedule, activation checkpointing (none
or every layer), micro and global batch, FSDP's CPU offload. torchtitan builds a registered model
flavor (``--flavor``), Llama-style only; the export cannot see its shape, so it says which shape
the plan was priced for.
"""

from __future__ import annotations

import itertools
import json
import math
import shlex
from dataclasses import dataclass

from measure.checks import finite

from .engine.megatron import megatron_limits, model_settings
from .model.specs import ModelSpec
from .plan import Plan

# megatron-core settings (engine.megatron.model_settings) and the Megatron-LM flag that takes each
VALUE_FLAGS = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("max_sequence_length", "--seq-length"),
    ("max_sequence_length", "--max-position-embeddings"),
    ("position_embedding_type", "--position-embedding-type"),
    ("normalization", "--normalization"),
    ("hidden_dropout", "--hidden-dropout"),
    ("attention_dropout", "--attention-dropout"),
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
)
TRANSFORMER_IMPLS = ("transformer_engine", "local")
# Megatron-LM's default vocabulary padding multiple (--make-vocab-size-divisible-by), per TP rank
VOCAB_MULTIPLE = 128


class CannotExport(ValueError):
    """The plan holds parts the target cannot express: one line each in ``parts``."""

    def __init__(self, target: str, parts: list[str]) -> None:
        self.target, self.parts = target, parts
        super().__init__(f"{target} cannot express: " + "; ".join(parts))


@dataclass(frozen=True)
class JobInputs:
    """What a launch needs that a plan does not decide. The defaults are placeholders that let the
    command start (synthetic data, a null tokenizer, a short run); fill them for real training."""

    data_path: str | None = None  # None: Megatron-LM's synthetic data (--mock-data)
    tokenizer_type: str | None = None  # None: NullTokenizer sized to the priced vocabulary
    tokenizer_model: str | None = None
    train_iters: int = 100
    lr: float = 1e-4
    script: str = "pretrain_gpt.py"
    transformer_impl: str = "transformer_engine"  # or "local": megatron-core's own layers

    def __post_init__(self) -> None:
        for name in ("data_path", "tokenizer_type", "tokenizer_model", "script"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ValueError(f"{name} must be a non-empty string (or left out), got {value!r}")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(
                f"transformer_impl must be one of {TRANSFORMER_IMPLS}, got {self.transformer_impl!r}"
            )
        if not (isinstance(self.train_iters, int) and self.train_iters > 0):
            raise ValueError(f"train_iters must be a whole number > 0, got {self.train_iters!r}")
        if not (finite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")


def _recompute_arguments(plan: Plan) -> tuple[list[str], list[str]]:
    """Megatron-LM recomputes whole layers by block (the first k of every stage) or uniformly
    (every layer), or every layer's core attention (selective); a plan's per-stage choices must
    be one of those."""
    stages = plan.stages
    if any(s.selective for s in stages):
        if all(s.selective and s.recompute == 0 for s in stages):
            return ["--recompute-granularity", "selective"], []  # its default module: core_attn
        return [], [
            "selective recomputation on some stages only, or with whole layers recomputed "
            f"(selective {[s.selective for s in stages]}, layers {[s.recompute for s in stages]})"
        ]
    block = max(s.recompute for s in stages)
    method = "uniform" if all(s.recompute == s.layers for s in stages) else "block"
    if block == 0:
        return [], []
    if method == "uniform" or all(s.recompute == min(block, s.layers) for s in stages):
        # Megatron-LM's block count is per model chunk: a stage of V chunks recomputes V times it
        count = "1" if method == "uniform" else str(block // plan.virtual_stages)
        return [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            method,
            "--recompute-num-layers",
            count,
        ], []
    return [], [f"a different number of recomputed layers per stage {[s.recompute for s in stages]}"]


def _optimizer_arguments(plan: Plan) -> tuple[list[str], list[str]]:
    """ZeRO-1 is Megatron-LM's distributed optimizer; optimizer offload needs that optimizer and the
    precision-aware one (megatron-core's OptimizerConfig checks both)."""
    args, cannot = [], []
    zero = {s.zero for s in plan.stages}
    offload = {s.offload_optimizer for s in plan.stages}
    if zero - {0, 1}:
        cannot.append("ZeRO stage 2/3 (Megatron-LM's distributed optimizer shards optimizer state only)")
    elif len(zero) > 1:
        cannot.append("the distributed optimizer on some stages only")
    if len(offload) > 1:
        cannot.append(f"a different optimizer offload fraction per stage {sorted(offload)}")
    fraction = offload.pop() if len(offload) == 1 else 0.0
    if fraction and zero == {0} and plan.dp > 1:
        cannot.append(
            "optimizer offload without ZeRO-1 at DP > 1 (Megatron-LM offloads only its distributed "
            "optimizer, which shards the state: a different plan)"
        )
    if zero == {1} or (fraction and plan.dp == 1):  # at DP 1 the distributed optimizer shards nothing
        args.append("--use-distributed-optimizer")
    gathers = {s.gather_in_forward for s in plan.stages}
    if len(gathers) > 1:
        cannot.append(
            "the weights gathered in forward on some stages only (--overlap-param-gather is global)"
        )
    elif gathers == {True}:
        if plan.overlap_grad_reduce:
            args.append("--overlap-param-gather")
            if plan.virtual_stages > 1:  # Megatron-LM would begin every rank's gather at the start
                args.append("--no-align-param-gather")  # of the schedule: priced (and run) in forward
        else:
            cannot.append(
                "the weights gathered in forward without the gradient reduction overlapped "
                "(Megatron-LM's --overlap-param-gather needs --overlap-grad-reduce)"
            )
    if fraction:
        args += [
            "--optimizer-cpu-offload",
            "--optimizer-offload-fraction",
            repr(fraction),
            "--use-precision-aware-optimizer",
        ]
    return args, cannot


def engine_run_as(plan: Plan, target: str) -> str:
    """The engine whose gradients ``target`` runs ``plan``'s as: Megatron-LM keeps fp32 main grads
    for a plan priced with 4-byte ones, else 16-bit ones; torchtitan always reduces in fp32."""
    if target == "torchtitan":
        return "torchtitan"
    return "megatron-lm" if plan.pricing_engine.grad_bytes == 4 else "megatron-core"


def priced_otherwise_note(plan: Plan, target: str) -> str | None:
    """A line where ``target`` runs ``plan``'s gradients otherwise than they were priced; None
    where it runs them as priced (or the plan was not priced). A priced plan that records no
    engine (written before plans did, or by hand) was priced as `mist predict` prices it:
    megatron-core's."""
    if plan.predicted_iteration_s is None and plan.priced_engine is None:
        return None
    priced, runs = plan.pricing_engine, engine_run_as(plan, target)
    if priced.engine == runs:
        return None
    return (
        f"the plan was priced for {priced.engine}'s gradients; {target} runs them as --engine {runs} "
        f"prices (`mist predict PLAN --engine {runs}` prices what runs)"
    )


def megatron_lm_arguments(plan: Plan, model: ModelSpec) -> tuple[list[str], list[str]]:
    """Megatron-LM's arguments (an argv) for what ``plan`` and ``model`` decide: the model, parallel
    sizes, batch, recomputation, optimizer and precision; and one line per part it cannot express
    (empty: it expresses the whole plan). Stages sharing a TP and DP of their own are lifted."""
    plan = plan.with_stage_parallelism_lifted()
    settings = model_settings(plan, model)
    args = [
        "--micro-batch-size",
        str(plan.micro_batch),
        "--global-batch-size",
        str(plan.global_batch),
        "--bf16",
    ]
    # the gradients as priced: Megatron-LM's bf16 default keeps fp32 main grads (a plan priced for
    # `--engine megatron-lm`); --grad-reduce-in-bf16 keeps, accumulates and sums them over DP in 16
    # bits, as the other engines priced (megatron-core's, mist.engine.run's; a plan not priced yet)
    if engine_run_as(plan, "megatron-lm") == "megatron-core":
        args.append("--grad-reduce-in-bf16")
    for field, flag in VALUE_FLAGS:
        args += [flag, str(settings[field])]
    switches = {
        "--disable-bias-linear": not settings["add_bias_linear"],
        "--swiglu": settings["gated_linear_unit"],  # gated, SiLU: what --swiglu sets
        "--sequence-parallel": settings["sequence_parallel"],
        "--untie-embeddings-and-output-weights": True,  # the priced head has weights of its own
    }
    args += [flag for flag, on in switches.items() if on]
    if settings["num_query_groups"] != settings["num_attention_heads"]:
        args += ["--group-query-attention", "--num-query-groups", str(settings["num_query_groups"])]
    limits = megatron_limits(plan, model)
    cannot = list(limits.values())
    if settings["num_layers_in_first_pipeline_stage"] is not None and "uneven_middle_stages" not in limits:
        first, last = (
            settings["num_layers_in_first_pipeline_stage"],
            settings["num_layers_in_last_pipeline_stage"],
        )
        args += [
            "--decoder-first-pipeline-num-layers",
            str(first),
            "--decoder-last-pipeline-num-layers",
            str(last),
        ]
    if plan.virtual_stages > 1:  # interleaved 1F1B (Plan.check: even stages, whole chunks)
        args += ["--num-virtual-stages-per-pipeline-rank", str(plan.virtual_stages)]
    if plan.overlap_grad_reduce:
        args.append("--overlap-grad-reduce")
        if plan.grad_bucket_params is not None:
            args += ["--ddp-bucket-size", str(plan.grad_bucket_params)]
    for part in (_recompute_arguments(plan), _optimizer_arguments(plan)):
        args += part[0]
        cannot += part[1]
    if any(s.offload_activations for s in plan.stages):
        cannot.append("offloading activations to the CPU")
    return args, cannot


def _null_tokenizer_arguments(vocab: int, tp: int) -> list[str]:
    """A null tokenizer whose padded vocabulary is exactly ``vocab``: it adds one end-of-document
    token, and Megatron-LM pads to a multiple of (divisible-by x TP); the largest divisor of
    vocab / TP up to Megatron-LM's 128 keeps it at ``vocab``."""
    divisible_by = math.gcd(vocab // tp, VOCAB_MULTIPLE)
    return [
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(vocab - 1),
        "--make-vocab-size-divisible-by",
        str(divisible_by),
    ]


def megatron_lm_command(plan: Plan, model: ModelSpec, inputs: JobInputs | None = None) -> str:
    """One shell command that launches ``plan`` on Megatron-LM: torchrun on every node (NODE_RANK,
    MASTER_ADDR and MASTER_PORT from the environment) running ``inputs.script`` with every argument
    it needs. Raises CannotExport naming each part Megatron-LM cannot express."""
    inputs = inputs or JobInputs()
    if inputs.tokenizer_model is not None and inputs.tokenizer_type is None:
        raise ValueError("a tokenizer model needs its --tokenizer-type (Megatron-LM's tokenizer class)")
    args, cannot = megatron_lm_arguments(plan, model)
    lifted = plan.with_stage_parallelism_lifted()
    tp = lifted.tp
    if inputs.transformer_impl == "local" and model.flash:
        cannot.append(
            "FlashAttention with --transformer-impl local (megatron-core's own attention is unfused; "
            "use transformer_engine, or plan with --no-flash)"
        )
    if inputs.tokenizer_type is None and model.vocab % tp:
        cannot.append(f"a vocabulary of {model.vocab} over TP {tp} (Megatron-LM pads it to a multiple of TP)")
    cannot += _node_limits(plan)
    if cannot:
        raise CannotExport("Megatron-LM", cannot)
    args += [
        "--transformer-impl",
        inputs.transformer_impl,
        "--attention-backend",
        "flash" if model.flash else "unfused",
    ]
    args += ["--data-path", inputs.data_path] if inputs.data_path else ["--mock-data"]
    if inputs.tokenizer_type is None:
        args += _null_tokenizer_arguments(model.vocab, tp)
    else:
        args += ["--tokenizer-type", inputs.tokenizer_type]
        args += ["--tokenizer-model", inputs.tokenizer_model] if inputs.tokenizer_model else []
    args += ["--train-iters", str(inputs.train_iters), "--lr", repr(float(inputs.lr))]
    nodes, per_node = nodes_and_processes(plan)
    # Megatron-LM requires one connection per device with TP on GPUs before Blackwell, so that its
    # communication kernels run in the order they were issued
    env = "CUDA_DEVICE_MAX_CONNECTIONS=1 " if tp > 1 else ""
    launcher = (
        f"{env}torchrun --nnodes {nodes} --nproc-per-node {per_node} --node-rank ${{NODE_RANK:-0}} "
        "--master-addr ${MASTER_ADDR:-localhost} --master-port ${MASTER_PORT:-6000}"
    )
    lines = [f"{launcher} {shlex.quote(inputs.script)}"]
    flags = [i for i, a in enumerate(args) if a.startswith("--")] + [len(args)]
    for start, end in itertools.pairwise(flags):
        lines.append("  " + shlex.join(args[start:end]))
    return " \\\n".join(lines)


def _torchtitan_limits(plan: Plan, model: ModelSpec, flavor: str) -> list[str]:
    """What torchtitan cannot express of ``plan`` (lifted), one line each (empty: it can)."""
    return [
        *_torchtitan_layout_limits(plan, model, flavor),
        *_torchtitan_model_limits(model),
        *_torchtitan_parallel_limits(plan),
        *_torchtitan_memory_limits(plan),
    ]


def _torchtitan_layout_limits(plan: Plan, model: ModelSpec, flavor: str) -> list[str]:
    """What torchtitan cannot build of the model's flavor and the plan's stage layout."""
    cannot = []
    if not flavor:
        cannot.append(
            f"no model flavor: torchtitan builds a registered one (--flavor) of the priced shape "
            f"({_shape(model)})"
        )
    if any((s.tp or plan.tp, s.dp or plan.dp) != (plan.tp, plan.dp) for s in plan.stages):
        cannot.append("stages with TP/DP of their own that differ (torchtitan: one TP and DP for all stages)")
    if plan.pre_post is not None:
        cannot.append("a strategy of the embedding/head's own (torchtitan's follow their stage's)")
    if plan.virtual_stages > 1:
        cannot.append(
            f"{plan.virtual_stages} virtual stages a rank: the plan is priced in megatron-core's "
            "interleaved order, which torchtitan's Interleaved1F1B schedule does not follow"
        )
    return cannot


def _torchtitan_model_limits(model: ModelSpec) -> list[str]:
    """What torchtitan's models cannot be of ``model``'s architecture."""
    cannot = []
    llama_style = model.norm == "rmsnorm" and model.gated_mlp and model.positions == "rotary"
    if not llama_style or model.dropout:
        cannot.append(
            f"{model.name}: torchtitan's models are Llama-style (RMSNorm, SwiGLU, rotary, no dropout)"
        )
    if not model.flash:
        cannot.append("attention without FlashAttention (torchtitan's is PyTorch SDPA's fused kernel)")
    if model.tempo:
        cannot.append("Tempo's layers (torchtitan builds its own)")
    return cannot


def _torchtitan_parallel_limits(plan: Plan) -> list[str]:
    """What torchtitan cannot run of the plan's TP, DP, ZeRO and gradient reduction, and of its
    nodes."""
    cannot = []
    if plan.tp > 1 and not plan.sequence_parallel:
        cannot.append("TP without sequence parallelism (torchtitan's TP always shards the sequence)")
    stages = plan.stages
    zero = {s.zero for s in stages}
    pipelined = len(stages) > 1
    ddp = zero == {0} and plan.dp > 1
    if len(zero) > 1:
        cannot.append("ZeRO per stage (torchtitan's FSDP2 shards every stage alike)")
    elif zero == {1} and not pipelined:
        cannot.append("ZeRO-1 without PP (torchtitan's FSDP2 shards the gradients too, and the weights)")
    elif zero & {2, 3} and pipelined and plan.dp > 1:
        cannot.append(
            "ZeRO-2/3 in a pipeline (torch's pipeline stages keep FSDP2's gradients whole until the "
            "last micro-batch: plan ZeRO-1, as mist plan --target torchtitan does)"
        )
    elif ddp and (plan.tp > 1 or pipelined):
        cannot.append("DP without sharding beside TP or PP (torchtitan's DDP is for DP alone)")
    elif ddp and plan.grad_accum > 1:
        cannot.append(
            f"DDP's gradients summed once over {plan.grad_accum} micro-batches (torchtitan's DDP "
            "all-reduces every micro-batch's)"
        )
    if plan.dp == 1 and (plan.tp > 1 or pipelined):
        cannot.append(
            "TP or PP without DP (torchtitan's mixed precision comes with FSDP: it would train in fp32)"
        )
    elif plan.dp == 1 and zero & {2, 3}:
        cannot.append("ZeRO-2/3 over one replica (torchtitan applies no FSDP there, nor its CPU offload)")
    if ddp and not plan.overlap_grad_reduce:
        cannot.append("DDP's all-reduce after backward (torch's DDP always overlaps it with backward)")
    if zero == {1} and pipelined and plan.overlap_grad_reduce:
        cannot.append(
            "the reduce-scatter overlapped with backward (a pipeline's FSDP2 reduce-scatters after the "
            "last micro-batch's backward)"
        )
    if plan.overlap_grad_reduce and plan.grad_bucket_params is not None:
        cannot.append(f"gradient buckets of {plan.grad_bucket_params} parameters (torchtitan has no option)")
    if any(s.zero == 2 and not s.gather_in_forward for s in stages) and plan.dp > 1:
        cannot.append("ZeRO-2's weight gather after the step (FSDP2 gathers ahead of each forward)")
    return cannot + _node_limits(plan)


def _torchtitan_memory_limits(plan: Plan) -> list[str]:
    """What torchtitan cannot do of the plan's offloading and recomputation."""
    cannot = []
    stages = plan.stages
    offloads = {(s.offload_weights, s.offload_grads, s.offload_optimizer) for s in stages}
    if offloads != {(0.0, 0.0, 0.0)} and not _fsdp_cpu_offload(plan):
        cannot.append(
            "offloading other than all of ZeRO-3's weights, gradients and optimizer (FSDP's CPU offload)"
        )
    if any(s.offload_activations for s in stages):
        cannot.append("offloading activations to the CPU")
    if any(s.selective for s in stages):
        cannot.append(
            "selective recomputation of the core attention (torchtitan's selective mode chooses ops)"
        )
    if not (all(s.recompute == 0 for s in stages) or all(s.recompute == s.layers for s in stages)):
        cannot.append(
            f"recomputing some layers of a stage {[s.recompute for s in stages]} (torchtitan: none or all)"
        )
    return cannot


def _fsdp_cpu_offload(plan: Plan) -> bool:
    """A ZeRO-3 plan offloading all of its weights, gradients and optimizer: FSDP's CPU offload."""
    return all(
        s.zero == 3 and (s.offload_weights, s.offload_grads, s.offload_optimizer) == (1.0, 1.0, 1.0)
        for s in plan.stages
    )


def _torchtitan_parallelism(plan: Plan) -> dict:
    """[parallelism]: DP as FSDP2 shards (ZeRO-2/3; ZeRO-1 in a pipeline) or DDP replicas, TP, and
    PP with each stage's modules named (any split) under 1F1B."""
    stages, sharded = plan.stages, {s.zero for s in plan.stages} & {1, 2, 3}
    parallelism = {
        "data_parallel_replicate_degree": 1 if sharded else plan.dp,
        "data_parallel_shard_degree": plan.dp if sharded else 1,
        "tensor_parallel_degree": plan.tp,
        "pipeline_parallel_degree": len(stages),
    }
    if sharded:  # ZeRO-3 frees each layer's weights after forward; ZeRO-1/2 keep them to the step
        parallelism["fsdp_reshard_after_forward"] = "always" if sharded == {3} else "never"
    if len(stages) > 1:
        first, names = 0, []
        for i, s in enumerate(stages):
            part = ["tok_embeddings"] if i == 0 else []
            part += [f"layers.{n}" for n in range(first, first + s.layers)]
            part += ["norm", "output"] if i == len(stages) - 1 else []
            names.append(part)
            first += s.layers
        parallelism["pipeline_parallel_schedule"] = "1F1B"
        parallelism["pipeline_parallel_microbatch_size"] = plan.micro_batch
        parallelism["module_fqns_per_model_part"] = names
    return parallelism


def torchtitan_config(plan: Plan, model: ModelSpec, flavor: str, inputs: JobInputs | None = None) -> dict:
    """torchtitan's job config (sections of JobConfig) for ``plan`` on its Llama 3 model ``flavor``.
    Raises CannotExport naming each part torchtitan cannot express."""
    inputs = inputs or JobInputs()
    plan = plan.with_stage_parallelism_lifted()
    cannot = _torchtitan_limits(plan, model, flavor)
    if cannot:
        raise CannotExport("torchtitan", cannot)
    pipelined = len(plan.stages) > 1
    training = {
        # without PP each step accumulates micro-batches of local_batch_size; with PP one local batch
        # per step is split into the pipeline's micro-batches
        "local_batch_size": plan.global_batch // plan.dp if pipelined else plan.micro_batch,
        "global_batch_size": plan.global_batch,
        "seq_len": model.seq,
        "steps": inputs.train_iters,
        "mixed_precision_param": "bfloat16",
        "enable_cpu_offload": _fsdp_cpu_offload(plan),
    }
    if inputs.data_path:
        training["dataset_path"] = inputs.data_path
    config = {
        "job": {"description": f"Mist plan: {model.name} on {plan.gpus} x {plan.gpu}"},
        "model": {"name": "llama3", "flavor": flavor},
        "training": training,
        "parallelism": _torchtitan_parallelism(plan),
        "activation_checkpoint": {"mode": "full" if plan.stages[0].recompute else "none"},
        "optimizer": {"lr": inputs.lr},
    }
    if inputs.tokenizer_model:
        config["model"]["hf_assets_path"] = inputs.tokenizer_model
    return config


def nodes_and_processes(plan: Plan) -> tuple[int, int]:
    """(nodes, processes a node) torchrun starts for ``plan``: its GPUs over the fewest nodes."""
    nodes = math.ceil(plan.gpus / plan.gpus_per_node)
    return nodes, plan.gpus // nodes


def _node_limits(plan: Plan) -> list[str]:
    nodes, per_node = nodes_and_processes(plan)
    return (
        []
        if nodes * per_node == plan.gpus
        else [f"{plan.gpus} GPUs over {nodes} nodes (torchrun starts as many on each node)"]
    )


def _shape(model: ModelSpec) -> str:
    return (
        f"hidden {model.hidden}, {model.layers} layers, {model.heads} heads, {model.kv} KV heads, "
        f"MLP {model.ffn_hidden}, vocabulary {model.vocab}"
    )


def toml_text(config: dict) -> str:
    """``config`` (sections of scalars and lists) as TOML: JSON's strings, numbers and arrays are
    TOML's; booleans are written lower-case."""
    lines = []
    for section, fields in config.items():
        lines.append(f"[{section}]")
        for key, value in fields.items():
            text = (
                ("true" if value else "false")
                if isinstance(value, bool)
                else json.dumps(value, ensure_ascii=False)
            )
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)
