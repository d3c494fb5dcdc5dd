"""A training plan: what the planner outputs and ``mist predict`` evaluates (YAML or JSON).

The file is the Plan's fields (below) plus ``plan_format``, now 2. Stages list their layers,
recomputed layers, whether the others recompute their core attention (``selective``), ZeRO
stage, offloaded fractions in [0, 1] and, for plans from other tools, their own TP/DP;
``model_overrides`` changes the named preset's fields (e.g. ``seq``, ``flash``,
``heads``, ``dropout``); ``host_memory_per_node_bytes`` the DRAM per node offloading may use (a
whole number of bytes; null: the GPU type's usual host); ``gpu_memory_bytes`` a cap on each
device's memory (null: its data sheet's; mist.engine.run enforces it); ``pre_post`` the embedding's and head's
own ZeRO stage and offloaded fractions (null: as their stage's other parameters);
``virtual_stages`` the model chunks each pipeline rank holds (Megatron-LM's interleaved 1F1B; 1,
the default: plain 1F1B); ``overlap_grad_reduce`` whether the data-parallel gradient reduction
runs bucket by bucket during the last micro-batch's backward (Megatron-LM's
``--overlap-grad-reduce``; false, its default: after backward), in buckets of at least
``grad_bucket_params`` parameters (null: Megatron-LM's default, max(40M, 1M x DP)); a stage's
``gather_in_forward`` whether its ZeRO-1/2 layers' updated weights are gathered bucket by bucket
during the next iteration's first forward, each bucket's gather waited for as its first layer
starts and the next one's begun (Megatron-LM's ``--overlap-param-gather``; false: right after
the step; only for ZeRO-1/2 stages whose weights stay on the device). Predictions
are filled in by ``predict``: per stage ``steady_s``, ``extra_s`` and, of it, ``step_s`` after the
gradient-clipping barrier, ``wait_s`` before its first forward (seconds), ``memory_bytes``
(per GPU) and ``host_memory_bytes`` (what each of its GPUs offloads to the host), and the
plan's ``breakdown`` (``usable_memory_bytes``, ``usable_host_memory_bytes_per_gpu``,
``layer_saved_bytes``, ``fits``, ``engine``: the engine whose gradient accumulation it priced,
``Plan.priced_engine``, ...). Every amount of memory in format 2 is a whole number of
bytes: predicted needs round up (``bytes_needed``), capacities round down (``bytes_available``).

Format 1 (files without ``plan_format`` are read as 1) held the same fields in floating GiB
(``memory_gib``, ``host_memory_gib``, ``host_memory_per_node_gib``, ``usable_memory_gib``,
``usable_host_memory_gib_per_gpu``) and MiB (``layer_saved_mib``). ``Plan.from_dict`` reads it
and converts those fields to bytes there, once, with the same rounding as ``predict``, so a
format-1 file loads to the same plan as its format-2 twin; nothing else in Mist sees GiB.
A file naming a field both ways (e.g. ``memory_gib`` and ``memory_bytes``) is refused, as is a
format-2 file with a format-1 name. Plans are always written as format 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import yaml

from measure.checks import finite, fraction, whole
from measure.results import write_text_atomic
from measure.strict import StrictDataError, json_data, loads_json, loads_yaml, read_text_file

from .model.specs import (
    GRAD_ACCUMULATION,
    ClusterSpec,
    GradAccumulation,
    ModelSpec,
    cluster,
    gpus,
    hosts,
    model,
    models,
    preset_overrides,
)

PLAN_FORMAT = 2  # what save() writes; from_dict() also reads 1 (memory in GiB)
READABLE_FORMATS = (1, 2)
# The most micro-batches per iteration the pipeline simulator takes: its work is O(stages x
# micro-batches) (memory O(stages)); 65536 is far beyond any real global batch split into micro-batches.
MAX_MICRO_BATCHES = 1 << 16
MAX_GLOBAL_BATCH = MAX_MICRO_BATCHES  # sequences: bounds the pipeline simulator's work
# The most bytes any amount of memory in a plan may be: a 64-bit address space, more than any
# device or host can address (a stage's memory_bytes of 10**300 was read, recomputed or not).
MAX_BYTES = 2**64


def grad_accum(global_batch: int, dp: int, micro_batch: int) -> int:
    """Micro-batches per iteration (G): the global batch over DP replicas of micro-batches (the one
    place this is computed; the plan and the search's candidates both ask here)."""
    return global_batch // (dp * micro_batch)


def activation_offloaded_layers(fraction, not_recomputed):
    """How many of a stage's ``not_recomputed`` layers keep their activations on the host
    (``StagePlan.offload_activations``): ``fraction`` of them rounded to whole layers, half to
    even; mist.engine.run offloads the first such layers (a recomputed layer's input stays on the
    device). The one rule the cost model prices and the engine runs. Scalars or numpy arrays."""
    return np.round(fraction * not_recomputed)


def gather_allowed(zero, offload_weights):
    """Whether a stage may gather its weights in the next forward (``StagePlan.gather_in_forward``):
    ZeRO-1/2 weights kept on the device. Scalars or numpy arrays."""
    return ((zero == 1) | (zero == 2)) & (offload_weights == 0)


def tp_splits(model: ModelSpec, tp: int, sequence_parallel: bool = True) -> bool:
    """Whether a Megatron layer of ``model`` splits over TP ``tp``: the heads and key/value heads,
    and with sequence parallelism the sequence (each rank holds an equal slice of it). The one rule
    Plan.check_model and every search's TP sizes share."""
    return not (model.heads % tp or model.kv % tp or (sequence_parallel and tp > 1 and model.seq % tp))


def grad_bucket(bucket_params: int | None, dp: int) -> int:
    """Parameters a gradient bucket holds at least: ``bucket_params``, or Megatron-LM's DDP default
    (--ddp-bucket-size: max(40M, 1M x DP))."""
    return bucket_params or max(40_000_000, 1_000_000 * dp)


def check_interleaving(stages: int, micro_batches: int, virtual: int) -> None:
    """Raises ValueError unless megatron-core's interleaved schedule runs ``virtual`` model chunks a
    pipeline rank (1: plain 1F1B, always): at least 2 stages, and micro-batches a step a multiple
    of the stages (its groups of S micro-batches; it refuses a short last group)."""
    if not (whole(virtual) and virtual >= 1):
        raise ValueError(f"virtual_stages must be a whole number >= 1, got {virtual!r}")
    if virtual == 1:
        return
    if stages < 2:
        raise ValueError(f"virtual_stages {virtual} needs at least 2 pipeline stages, got {stages}")
    if micro_batches % stages:
        raise ValueError(
            f"virtual_stages {virtual}: the {micro_batches} micro-batches a step must be a multiple of "
            f"the {stages} stages (megatron-core's interleaved schedule)"
        )


def bytes_needed(amount: float) -> int:
    """Memory a plan needs, in whole bytes: rounded up, so a need is never understated and
    ``bytes_needed(x) <= budget`` exactly when ``x <= budget`` for a whole-byte budget."""
    return math.ceil(amount)


def bytes_available(amount: float) -> int:
    """Memory a plan may use, in whole bytes: rounded down, so a capacity is never overstated
    (as the cluster has always taken a host size: ``int(GiB * 2**30)``)."""
    return math.floor(amount)


# Format 1's names of the memory fields and their format-2 names: the factor from the old unit
# to bytes and the rounding (needs up, capacities down). Plan.from_dict, the one place that
# reads format 1, converts them; nothing else in Mist sees GiB.
_FORMAT_1_STAGE = {
    "memory_gib": ("memory_bytes", 2**30, bytes_needed),
    "host_memory_gib": ("host_memory_bytes", 2**30, bytes_needed),
}
_FORMAT_1_PLAN = {
    "host_memory_per_node_gib": ("host_memory_per_node_bytes", 2**30, bytes_available),
}
_FORMAT_1_BREAKDOWN = {
    "usable_memory_gib": ("usable_memory_bytes", 2**30, bytes_available),
    "usable_host_memory_gib_per_gpu": ("usable_host_memory_bytes_per_gpu", 2**30, bytes_available),
    "layer_saved_mib": ("layer_saved_bytes", 2**20, bytes_needed),
}


def _rename_format_1(d: dict, renames: dict, version: int, where: str) -> None:
    """Format 1's memory fields of ``d`` (in place) as format 2's, in bytes. Refuses a field
    named both ways (which one is meant?) and, in a format-2 file, a format-1 name (a file
    either is format 1 or is not: no unit is guessed)."""
    for old, (new, scale, rounding) in renames.items():
        if old not in d:
            continue
        unit = {2**30: "GiB", 2**20: "MiB"}[scale]
        if new in d:
            raise ValueError(
                f"{where}both {old} ({unit}, plan_format 1) and {new} (bytes) are given; keep one"
            )
        if version != 1:
            raise ValueError(
                f"{where}{old} is a plan_format 1 field ({unit}); plan_format {version} has {new}"
            )
        value = d.pop(old)
        if value is not None:
            if not finite(value):
                raise ValueError(f"{where}{old} must be a number, got {value!r}")
            value = rounding(value * scale)
        d[new] = value


@dataclass
class StagePlan:
    layers: int
    recompute: int = 0  # layers of this stage that recompute their forward in backward
    zero: int = 0  # 0: none, 1: optimizer state, 2: + gradients, 3: + weights sharded over DP
    offload_weights: float = 0.0  # fractions kept on the host
    offload_grads: float = 0.0
    offload_optimizer: float = 0.0
    # of the layers not recomputed, whose activations wait on the host, rounded to whole layers
    # (activation_offloaded_layers)
    offload_activations: float = 0.0
    selective: bool = False  # the other layers recompute their core attention (Megatron's selective)
    # ZeRO-1/2: the layers' updated weights gathered in the next forward, not after the step
    # (Megatron-LM's --overlap-param-gather)
    gather_in_forward: bool = False
    tp: int | None = None  # this stage's own TP / DP (default: the plan's), e.g. from Aceso
    dp: int | None = None
    # predictions (filled by predict)
    steady_s: float | None = None
    extra_s: float | None = None  # after the last backward: gradient sync, clipping's norm, step
    step_s: float | None = None  # of extra_s, after the gradient-clipping barrier: the optimizer step
    # what its first forward waits for its weights (gather_in_forward), on the pipeline's fill path
    wait_s: float | None = None
    memory_bytes: int | None = None  # per GPU of this stage
    host_memory_bytes: int | None = None  # offloaded bytes this stage's GPUs each keep on the host

    def check(self, i: int) -> None:
        for name in ("layers", "recompute", "zero"):
            if not whole(getattr(self, name)):
                raise ValueError(f"stage {i}: {name} must be a whole number, got {getattr(self, name)!r}")
        for name in ("tp", "dp"):
            if getattr(self, name) is not None and not whole(getattr(self, name)):
                raise ValueError(f"stage {i}: {name} must be a whole number, got {getattr(self, name)!r}")
        for name in ("memory_bytes", "host_memory_bytes"):
            value = getattr(self, name)
            if value is not None and not (whole(value) and 0 <= value <= MAX_BYTES):
                raise ValueError(
                    f"stage {i}: {name} must be a whole number of bytes in [0, 2**64], got {value!r:.40}"
                )
        for name in ("steady_s", "extra_s", "step_s", "wait_s"):
            _check_seconds(f"stage {i}: {name}", getattr(self, name))
        if self.layers < 1:
            raise ValueError(f"stage {i}: layers must be >= 1, got {self.layers}")
        if not 0 <= self.recompute <= self.layers:
            raise ValueError(
                f"stage {i}: recompute must be in [0, layers={self.layers}], got {self.recompute}"
            )
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"stage {i}: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        for name in ("selective", "gather_in_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"stage {i}: {name} must be true or false, got {getattr(self, name)!r}")
        for name in ("offload_weights", "offload_grads", "offload_optimizer", "offload_activations"):
            if not fraction(getattr(self, name)):
                raise ValueError(f"stage {i}: {name} is a fraction in [0, 1], got {getattr(self, name)!r}")
        if self.gather_in_forward and not gather_allowed(self.zero, self.offload_weights):
            raise ValueError(
                f"stage {i}: gather_in_forward is for ZeRO-1/2 weights kept on the device (got zero "
                f"{self.zero}, offload_weights {self.offload_weights})"
            )


@dataclass
class PrePostPlan:
    """The embedding's (first stage) and head's (last stage) own strategy; a plan without one
    treats them as its stage's other parameters."""

    zero: int = 0
    offload_weights: float = 0.0
    offload_grads: float = 0.0
    offload_optimizer: float = 0.0

    def check(self) -> None:
        if not whole(self.zero) or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"pre_post: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        for name in ("offload_weights", "offload_grads", "offload_optimizer"):
            if not fraction(getattr(self, name)):
                raise ValueError(f"pre_post: {name} is a fraction in [0, 1], got {getattr(self, name)!r}")


# What predict() (and a search) fills in, per stage and per plan
STAGE_PREDICTIONS = ("steady_s", "extra_s", "step_s", "wait_s", "memory_bytes", "host_memory_bytes")
PLAN_PREDICTIONS = ("predicted_iteration_s", "simulated_iteration_s", "tuning_s", "breakdown")
# what predict() writes into a plan's breakdown (tuning.planner.predict), each field's kind:
# bytes (a whole number, negative where nothing is left), a rate or time (a finite number >= 0),
# true/false, a name, or the engine whose gradients it priced (a key of GRAD_ACCUMULATION)
BREAKDOWN_FIELDS = {
    "usable_memory_bytes": "bytes",
    "fits": "bool",
    "usable_host_memory_bytes_per_gpu": "bytes",
    "host": "name",
    "cpu_adam_params_per_s_per_gpu": "amount",
    "layer_fwd_ms": "amount",
    "layer_bwd_ms": "amount",
    "layer_saved_bytes": "bytes",
    "clip_barrier_ms": "amount",
    "runtime_model": "name",
    "interference_model": "name",
    "engine": "engine",
}


def _check_seconds(name: str, value: object) -> None:
    """A predicted time read back from a file: none yet, or a finite number of seconds >= 0."""
    if value is not None and not (finite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0 or null, got {value!r}")


# each kind of breakdown field: what it is said to be, and the check
_BREAKDOWN_KINDS = {
    "bytes": (
        "a whole number of bytes, at most 2**64 either way",
        lambda v: whole(v) and abs(v) <= MAX_BYTES,
    ),
    "amount": ("a finite number >= 0", lambda v: finite(v) and v >= 0),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "name": ("a name (a string)", lambda v: isinstance(v, str)),
    "engine": (
        f"one of {', '.join(GRAD_ACCUMULATION)}",
        lambda v: isinstance(v, str) and v in GRAD_ACCUMULATION,
    ),
}


def _check_breakdown(breakdown: dict) -> None:
    unknown = sorted(set(breakdown) - set(BREAKDOWN_FIELDS))
    if unknown:
        known = ", ".join(BREAKDOWN_FIELDS)
        raise ValueError(f"breakdown: unknown field(s) {', '.join(map(str, unknown))}; it has: {known}")
    for name, value in breakdown.items():
        what, ok = _BREAKDOWN_KINDS[BREAKDOWN_FIELDS[name]]
        if not ok(value):
            raise ValueError(f"breakdown: {name} must be {what}, got {value!r}")


def _refuse_unknown_or_missing_fields(where: str, given: dict, kind: type) -> None:
    """A key the plan format does not have, named with what it has (a misspelt field was a
    dataclass's 'unexpected keyword argument'); then one it must have, named with what it is (a
    misspelt required field is named as written first)."""
    known = [f.name for f in fields(kind) if f.init]
    # a YAML key may be null or a number (`null:`, `7:`): named as written, sorted as text
    unknown = sorted((k for k in given if k not in known), key=str)
    if unknown:
        names = ", ".join(k if isinstance(k, str) else repr(k) for k in unknown)
        raise ValueError(f"{where}unknown field(s) {names}; a {kind.__name__} has: {', '.join(known)}")
    required = [
        f.name for f in fields(kind) if f.init and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing := [name for name in required if name not in given]:
        raise ValueError(
            f"{where}missing field(s) {', '.join(missing)}; a {kind.__name__} needs: {', '.join(required)}"
        )


@dataclass(kw_only=True)  # built by keyword: eight numbers in a row are easy to misorder
class Plan:
    model: str
    gpu: str
    gpus: int
    gpus_per_node: int
    global_batch: int
    tp: int
    dp: int
    micro_batch: int
    stages: list[StagePlan]
    model_overrides: dict = field(default_factory=dict)  # e.g. {"flash": false, "seq": 4096}
    sequence_parallel: bool = True  # with TP > 1
    host_memory_per_node_bytes: int | None = None  # None: the GPU type's usual host (specs.hosts())
    gpu_memory_bytes: int | None = None  # a cap per device (None: its data sheet's memory)
    pre_post: PrePostPlan | None = None  # the embedding/head's own strategy (None: their stage's)
    # model chunks a pipeline rank holds (Megatron-LM's interleaved 1F1B; 1: plain 1F1B): every
    # stage's layers and recomputed layers split evenly over them
    virtual_stages: int = 1
    # the DP gradient reduction overlapped with the last backward, by buckets (Megatron-LM's
    # --overlap-grad-reduce and --ddp-bucket-size; None: its default bucket)
    overlap_grad_reduce: bool = False
    grad_bucket_params: int | None = None
    predicted_iteration_s: float | None = None
    simulated_iteration_s: float | None = None
    tuning_s: float | None = None
    breakdown: dict = field(default_factory=dict)

    @property
    def grad_accum(self) -> int:
        return grad_accum(self.global_batch, self.dp, self.micro_batch)

    @property
    def priced_engine(self) -> GradAccumulation | None:
        """How the engine this plan was priced for accumulates its gradients (``predict``'s
        ``grad_accumulation``, kept in the breakdown); None for a plan not priced yet."""
        name = self.breakdown.get("engine")
        if name is not None and name not in GRAD_ACCUMULATION:  # a breakdown changed after loading
            raise ValueError(f"breakdown engine {name!r} is none of {sorted(GRAD_ACCUMULATION)}")
        return None if name is None else GRAD_ACCUMULATION[name]

    @property
    def pricing_engine(self) -> GradAccumulation:
        """The engine ``predict`` prices this plan for unless told another: the one it was priced
        for, else megatron-core's (a plan not priced yet, or priced before plans recorded it)."""
        return self.priced_engine or GRAD_ACCUMULATION["megatron-core"]

    def stage_parallelism(self, i: int) -> tuple[int, int, int]:
        """(tp, dp, micro-batch) of stage i. A stage with its own DP splits each of the G
        micro-batches of the pipeline over its own replicas: micro-batch = global / (G dp_i)."""
        stage = self.stages[i]
        tp, dp = stage.tp or self.tp, stage.dp or self.dp
        return tp, dp, self.global_batch // (self.grad_accum * dp)

    def strategies_with_dp(self) -> list[tuple[StagePlan | PrePostPlan, int]]:
        """Every strategy the plan holds with the DP it runs over: each stage's, and the
        embedding/head's (``pre_post``), held by the first and the last stage, over the larger
        of their DPs."""
        held = [(s, self.stage_parallelism(i)[1]) for i, s in enumerate(self.stages)]
        if self.pre_post is not None:
            held.append((self.pre_post, max(held[0][1], held[-1][1])))
        return held

    def with_stage_parallelism_lifted(self) -> Plan:
        """This plan with its stages' TP and DP written at the plan's level, where every stage has
        the same (an Aceso-style search trades TP for DP stage by stage and may end with all of
        them alike): the same GPUs, micro-batches a step and sequences per replica, so the same
        plan, in the form a runtime with one TP and DP for all stages (Megatron-LM, the engine)
        takes. Stages that differ are left as they are; so is a plan already in that form."""
        shapes = {self.stage_parallelism(i) for i in range(len(self.stages))}
        if len(shapes) > 1 or all(s.tp is None and s.dp is None for s in self.stages):
            return self
        ((tp, dp, micro_batch),) = shapes
        stages = [replace(s, tp=None, dp=None) for s in self.stages]
        return replace(self, tp=tp, dp=dp, micro_batch=micro_batch, stages=stages)

    def check(self) -> None:
        for name in ("model", "gpu"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a name (a string), got {getattr(self, name)!r}")
        # a string is not a boolean: "false" would be truthy, and planned as on
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        for name in ("gpus", "gpus_per_node", "global_batch", "tp", "dp", "micro_batch"):
            value = getattr(self, name)
            if not whole(value) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.global_batch > MAX_GLOBAL_BATCH:
            raise ValueError(
                f"global_batch must be at most {MAX_GLOBAL_BATCH} sequences, got {self.global_batch}"
            )
        if not isinstance(self.stages, list) or not self.stages:
            raise ValueError("stages must be a non-empty list")
        for name in ("host_memory_per_node_bytes", "gpu_memory_bytes"):
            amount = getattr(self, name)
            if amount is not None and not (whole(amount) and 0 < amount <= MAX_BYTES):
                raise ValueError(
                    f"{name} must be a positive whole number of bytes, at most 2**64, got {amount!r:.40}"
                )
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of "
                f"dp x micro_batch = {self.dp * self.micro_batch}"
            )
        if self.pre_post is not None:
            self.pre_post.check()
        used = 0
        for i, stage in enumerate(self.stages):
            stage.check(i)
            tp, dp = stage.tp or self.tp, stage.dp or self.dp
            if tp < 1 or dp < 1:
                raise ValueError(f"stage {i}: tp and dp must be >= 1")
            if tp > self.gpus_per_node:
                raise ValueError(f"stage {i}: tp ({tp}) larger than GPUs per node ({self.gpus_per_node})")
            if self.global_batch % (self.grad_accum * dp):
                raise ValueError(
                    f"stage {i}: its {dp} replicas cannot split micro-batches of "
                    f"{self.global_batch // self.grad_accum} sequences evenly"
                )
            used += tp * dp
        if used != self.gpus:
            shapes = " + ".join(
                f"{t}x{d}" for t, d, _ in map(self.stage_parallelism, range(len(self.stages)))
            )
            raise ValueError(f"the stages use {shapes} = {used} GPUs (tp x dp each), but gpus = {self.gpus}")
        self._check_interleaving()
        if not isinstance(self.overlap_grad_reduce, bool):
            raise ValueError(f"overlap_grad_reduce must be true or false, got {self.overlap_grad_reduce!r}")
        bucket = self.grad_bucket_params
        if bucket is not None and not (whole(bucket) and bucket >= 1):
            raise ValueError(f"grad_bucket_params must be a whole number >= 1 or null, got {bucket!r}")
        for name in ("predicted_iteration_s", "simulated_iteration_s", "tuning_s"):
            _check_seconds(name, getattr(self, name))
        if not isinstance(self.breakdown, dict):
            raise ValueError("breakdown must be a mapping")
        _check_breakdown(self.breakdown)

    def check_model(self, spec: ModelSpec | None = None) -> None:
        """Raises ValueError unless the stages hold ``spec``'s layers (default: the model the plan
        names), each stage's TP divides its heads and key/value heads, and, with sequence
        parallelism, its sequence (each rank holds an equal slice of it)."""
        spec = spec or self.model_spec()
        if sum(s.layers for s in self.stages) != spec.layers:
            raise ValueError(
                f"the stages hold {sum(s.layers for s in self.stages)} layers, the model has {spec.layers}"
            )
        for i in range(len(self.stages)):
            tp = self.stage_parallelism(i)[0]
            if not tp_splits(spec, tp, sequence_parallel=False):
                raise ValueError(
                    f"stage {i}: TP {tp} must divide the heads ({spec.heads}) and key/value heads ({spec.kv})"
                )
            if not tp_splits(spec, tp, self.sequence_parallel):
                raise ValueError(
                    f"stage {i}: sequence parallelism needs TP {tp} to divide the sequence ({spec.seq})"
                )

    def _check_interleaving(self) -> None:
        """Virtual stages as megatron-core's interleaved schedule runs them and Megatron-LM's
        ``--num-virtual-stages-per-pipeline-rank`` says them: every stage the same layers and
        recomputed layers, each a multiple of the chunks, and one TP/DP for all stages."""
        v = self.virtual_stages
        check_interleaving(len(self.stages), self.grad_accum, v)
        if v == 1:
            return
        layers = {s.layers for s in self.stages}
        if len(layers) > 1 or next(iter(layers)) % v:
            raise ValueError(
                f"virtual_stages {v}: every stage must hold the same layers, a multiple of {v} "
                f"(got {[s.layers for s in self.stages]})"
            )
        if any(s.recompute % v for s in self.stages):
            raise ValueError(
                f"virtual_stages {v}: each stage's recomputed layers must be a multiple of {v} (the "
                f"first recompute / {v} layers of every chunk), got {[s.recompute for s in self.stages]}"
            )
        if len({self.stage_parallelism(i) for i in range(len(self.stages))}) > 1:
            raise ValueError(f"virtual_stages {v}: every stage must have the plan's TP and DP")

    @classmethod
    def of(cls, model_spec: ModelSpec, cluster_spec: ClusterSpec, **fields) -> Plan:
        """A plan for ``model_spec`` on ``cluster_spec``: the model named exactly (its preset and the
        fields it changes), the cluster's GPU type, GPUs and node size; ``fields`` give the rest
        (and may narrow ``gpus``). A cluster's own device cap or host memory (``cluster(gpu_memory=,
        host_memory=)``) is the plan's too, so that the engine enforces the cap it was planned for."""
        gpu, host = cluster_spec.gpu, cluster_spec.host
        base = {
            "model": model_spec.name,
            "model_overrides": preset_overrides(model_spec),
            "gpu": gpu.name,
            "gpus": cluster_spec.gpus,
            "gpus_per_node": cluster_spec.gpus_per_node,
            "gpu_memory_bytes": None if gpu.memory == gpus()[gpu.name].memory else gpu.memory,
            "host_memory_per_node_bytes": None if host == hosts()[gpu.name] else host.memory,
        }
        return cls(**{**base, **fields})

    def model_spec(self) -> ModelSpec:
        """The model this plan is for: the named preset with the plan's ``model_overrides``."""
        return model(self.model, **self.model_overrides)

    def cluster(self) -> ClusterSpec:
        """The cluster this plan is for."""
        return cluster(
            self.gpu,
            self.gpus,
            self.gpus_per_node,
            host_memory=self.host_memory_per_node_bytes,
            gpu_memory=self.gpu_memory_bytes,
        )

    def to_dict(self) -> dict:
        return {"plan_format": PLAN_FORMAT, **asdict(self)}

    def what_runs(self) -> dict:
        """The plan's fields without what predict() and the searches fill in: two plans with the
        same ``what_runs()`` are the same run on mist.engine.run (which keeps 16-bit gradients
        whatever engine a plan was priced for; an export follows ``priced_engine`` too)."""
        d = asdict(self)
        d["stages"] = [{k: v for k, v in st.items() if k not in STAGE_PREDICTIONS} for st in d["stages"]]
        return {k: v for k, v in d.items() if k not in PLAN_PREDICTIONS}

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """The plan of a file's mapping, checked. Format 1 (no ``plan_format``, or 1) has its
        memory in GiB: converted to bytes here, the only place that reads that format."""
        d = dict(d)
        version = d.pop("plan_format", 1)  # files from before plan_format existed are format 1
        if not whole(version) or version not in READABLE_FORMATS:
            raise ValueError(
                f"plan_format {version!r} is not supported (this version reads "
                f"{' and '.join(map(str, READABLE_FORMATS))})"
            )
        if not isinstance(d.get("stages"), list) or not all(isinstance(s, dict) for s in d["stages"]):
            raise ValueError("stages must be a list of mappings (one per pipeline stage)")
        overrides = d.get("model_overrides", {})
        if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
            raise ValueError(f"model_overrides must be a mapping of model fields by name, got {overrides!r}")
        if not isinstance(d.get("breakdown", {}), dict):
            raise ValueError("breakdown must be a mapping")
        if not isinstance(d.get("pre_post"), dict | None):
            raise ValueError(
                f"pre_post must be a mapping of the embedding's and head's zero and offload_* fields, "
                f"or null, got {d['pre_post']!r}"
            )
        # copies: the caller's mapping stays as it was
        d["stages"] = [dict(s) for s in d["stages"]]
        _rename_format_1(d, _FORMAT_1_PLAN, version, "")
        for i, s in enumerate(d["stages"]):
            _rename_format_1(s, _FORMAT_1_STAGE, version, f"stage {i}: ")
        if "breakdown" in d:
            d["breakdown"] = dict(d["breakdown"])
            _rename_format_1(d["breakdown"], _FORMAT_1_BREAKDOWN, version, "breakdown: ")
        for where, given, kind in (
            ("", d, cls),
            *((f"stage {i}: ", s, StagePlan) for i, s in enumerate(d["stages"])),
            *((("pre_post: ", d["pre_post"], PrePostPlan),) if isinstance(d.get("pre_post"), dict) else ()),
        ):
            _refuse_unknown_or_missing_fields(where, given, kind)
        d["stages"] = [StagePlan(**s) for s in d["stages"]]
        if d.get("pre_post") is not None:
            d["pre_post"] = PrePostPlan(**d["pre_post"])
        plan = cls(**d)
        plan.check()
        return plan

    def save(self, path: str | Path) -> None:
        """Write the plan (JSON for a ``.json`` path, else YAML), whole or not at all, only if it
        reads back (ValueError otherwise). A plan file names its model as a preset and the fields
        it changes: a plan of a model built otherwise is refused, as it could not be read back as
        the same model."""
        if self.model not in models():
            raise ValueError(
                f"a plan of model {self.model!r} cannot be saved: a plan file names a preset and the "
                f"fields it changes (build the model as mist.model(<preset>, field=value); presets: "
                f"{', '.join(sorted(models()))})"
            )
        path = Path(path)
        data = json_data(self.to_dict())  # numpy numbers as Python's: YAML would refuse them
        try:
            Plan.from_dict(data)  # what Plan.load will check, before the file is touched
        except (TypeError, ValueError) as e:
            raise ValueError(f"this plan would not read back, so it is not saved: {e}") from None
        text = json.dumps(data, indent=1) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        write_text_atomic(path, text)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            text = read_text_file(path)  # a FIFO or a device is refused, not read without end
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a text file") from None
        try:
            data = loads_json(text) if path.suffix == ".json" else loads_yaml(text)
        except (json.JSONDecodeError, yaml.YAMLError, StrictDataError) as e:
            where = str(e).replace("\n", " ")
            kind = "JSON" if path.suffix == ".json" else "YAML"
            raise ValueError(f"{path}: not valid {kind} ({where})") from None
        if not isinstance(data, dict) or "stages" not in data:
            raise ValueError(f"{path}: not a plan (expected a mapping with 'stages')")
        try:
            plan = cls.from_dict(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None
        # the model it names, built now: an unknown name or a bad override is the file's error
        # (a name with a stray space was refused later, by whatever used it, naming no file)
        if plan.model not in models():
            raise ValueError(f"{path}: model {plan.model!r} is no preset (presets: {', '.join(models())})")
        try:
            plan.model_spec()
        except ValueError as e:
            raise ValueError(f"{path}: model_overrides: {e}") from None
        return plan

    def table(self) -> str:
        head = (
            f"{self.model} on {self.gpus} x {self.gpu} ({self.gpus // self.gpus_per_node or 1} node(s)), "
            f"global batch {self.global_batch}: TP {self.tp} x DP {self.dp} x PP {len(self.stages)}, "
            f"micro-batch {self.micro_batch}, {self.grad_accum} micro-batches"
            + (f", {self.virtual_stages} virtual stages a rank" if self.virtual_stages > 1 else "")
            + (", gradient reduction overlapped with backward" if self.overlap_grad_reduce else "")
        )
        rows = [
            head,
            " ".join(f"{c:>{w}}" for c, w in COLUMNS),
        ]
        for i, s in enumerate(self.stages):
            tp, dp, _ = self.stage_parallelism(i)
            cells = [
                i,
                f"{tp}x{dp}",
                s.layers,
                s.recompute,
                "yes" if s.selective else "no",
                s.zero,
                "yes" if s.gather_in_forward else "no",
            ]
            cells += [
                f"{getattr(s, 'offload_' + k):.2f}" for k in ("weights", "grads", "optimizer", "activations")
            ]
            cells += [_ms(s.steady_s), _ms(s.extra_s), _gib(s.memory_bytes), _gib(s.host_memory_bytes)]
            rows.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True)))
        if self.pre_post is not None:
            e = self.pre_post
            rows.append(
                f"embedding/head: ZeRO {e.zero}, offloaded weights {e.offload_weights:.3g}, "
                f"grads {e.offload_grads:.3g}, optimizer {e.offload_optimizer:.3g}"
            )
        if self.predicted_iteration_s is not None:
            # the simulation is what predict --json's iteration_s and the claims report; the
            # closed form is what the search ranked the plans by
            closed = f"{self.predicted_iteration_s:.3f} s by the closed form the search ranks by"
            simulated = self.simulated_iteration_s
            head = "predicted iteration: " + (
                f"{closed} (not simulated)"
                if simulated is None
                else f"{_num(simulated, 3)} s by the 1F1B simulation ({closed})"
            )
            rows.append(head + (f"; tuned in {self.tuning_s:.1f} s" if self.tuning_s is not None else ""))
        return "\n".join(rows)


# "AG fwd": the ZeRO-1/2 weights' all-gather in the next forward (gather_in_forward)
COLUMNS = [
    ("stage", 5),
    ("TPxDP", 6),
    ("layers", 6),
    ("recomp", 6),
    ("sel", 3),
    ("ZeRO", 4),
    ("AG fwd", 6),
    ("off W", 5),
    ("off G", 5),
    ("off O", 5),
    ("off A", 5),
    ("T (ms)", 8),
    ("D (ms)", 8),
    ("mem GiB", 8),
    ("host GiB", 8),
]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _gib(x: int | None) -> str:  # the table shows GiB: bytes converted only here, for reading
    return _num(None if x is None else x / 2**30)
