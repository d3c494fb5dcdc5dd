"""Train with megatron-core as a plan says:
``torchrun --nproc-per-node N -m mist.engine.run --plan plan.yaml``.

megatron-core provides the model (GPTModel: tensor-parallel layers, sequence parallelism,
pipeline stages); around its modules the engine runs the plan's parts it has no switch for:

* the parallel attention + MLP block (Falcon), and norms that allow sequence parallelism without
  Transformer Engine or Apex: layer specs of its own (layers.py);
* stages of any sizes (megatron-core's pipeline layout; its first/last-stage settings allow only
  even middle stages) and the 1F1B executor over the plan's micro-batches (pipeline.py);
* a different number of recomputed layers per stage (the first r layers of each stage
  checkpointed; here), the others' core attention recomputed under selective recomputation
  (megatron-core's own, per stage);
* gradients in one contiguous buffer per dtype, ZeRO-1/2/3 (zero.py); the all-reduce of
  sequence-parallel parameters' grads across the TP group (here; under ZeRO-2 in zero.py);
* half-precision weights with fp32 master weights and torch's fused AdamW (measure.training):
  like Megatron's fused Adam it steps without temporaries, so the step holds only the fp32 grads;
  gradients clipped to a global norm of 1.0 first, as Megatron-LM and torchtitan do by default
  (``clip_gradients``: one all-reduce over every rank, the barrier Mist's cost model prices);
* the embedding's and head's own ZeRO stage and offloading (the plan's ``pre_post``: one
  optimizer per part, here);
* optimizer-state offloading, alone or of a rank's share under ZeRO-1/2/3, activation, weight
  and gradient offloading (offload.py; ZeRO-2's gradients in zero.py).

* stages with a TP and DP of their own (layout.py: megatron-core's state per stage, the pieces of
  each micro-batch's sequences sent between stages whose shapes differ).

Refused at launch, in one line and in the report (``--out``; ``PlanRefused``): on a GPU, weight and
gradient offloading with ZeRO-3 over DP replicas (CPU only so far: ``_gpu_offload_limits``);
interleaved pipelines with what Megatron-LM does not interleave; a Megatron-LM limit the engine
does not build around (none now: ``unsupported``). ZeRO-1 shards fp32 master weights and Adam state over
the DP replicas, ZeRO-2 the gradients too (ShardedMasterAdamW), ZeRO-3 the weights too (torch's
FSDP2 around megatron-core's layers, the embedding and the head, each a group: of the whole
stage, or of the part whose strategy it is). On a CPU it runs with gloo and the CUDA stand-ins
of cpu_shim; on GPUs with NCCL. Each rank reports its losses, the times of its timed steps, and
memory (exact tensor bytes held + the allocator peak of a steady step: the median and the worst
of a few, profiled before the timed ones); rank 0 gathers them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from measure.cli import OneLineParser, check_writable_file
from measure.launch import launch_env_problem
from measure.parallel import die_with_launcher
from measure.results import write_json_atomic
from measure.training import MasterWeightAdamW, gradient_to_step

from ..model.specs import GRAD_ACCUMULATION
from ..plan import Plan, grad_bucket
from .layers import block_spec
from .layout import RankLayout, init_megatron_state
from .megatron import megatron_limits, model_settings
from .offload import (
    HOST_WORK,
    CopyTiming,
    GradientOffload,
    OffloadedMasterAdamW,
    ShardedGradientOffload,
    ShardedWeightOffload,
    WeightOffload,
    local,
    offload_layer_activations,
    set_copy_timing,
    weights_at_rest_on_host,
)
from .pipeline import ModelChunks, Pipeline1F1B, PipelineInterleaved, gpt_modules
from .zero import (
    ContiguousGrads,
    ShardedMasterAdamW,
    flat_collective,
    layer_buckets,
    shard_parameters,
)


class PlanRefused(ValueError):
    """A plan this engine cannot execute on this device: ``reasons``, each one of its parts."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("mist.engine.run cannot execute this plan yet: " + "; ".join(reasons))
        self.reasons = reasons


def runnable(plan: Plan, world_size: int | None = None) -> Plan:
    """``plan`` checked before any work, in the form megatron-core builds: a ValueError where it is
    not a plan (a plan built in code is checked as a loaded one is: micro-batches, ZeRO stages, its
    stages' layers, TP dividing the heads), is for other than ``world_size`` processes, or caps a
    GPU's memory at what this one cannot give; PlanRefused where this engine cannot execute it here."""
    plan.check()
    plan.check_model()
    if world_size is not None and world_size != plan.gpus:
        raise ValueError(f"the plan is for {plan.gpus} processes, this run has {world_size}")
    plan = plan.with_stage_parallelism_lifted()
    reasons = unsupported(plan, "cuda" if torch.cuda.is_available() else "cpu")
    if reasons:
        raise PlanRefused(reasons)
    if torch.cuda.is_available():
        _allocator_fraction(plan)
    return plan


def _allocator_fraction(plan: Plan) -> float | None:
    """The fraction of this GPU the allocator may take under the plan's cap (None: no cap): the cap
    less the CUDA context, which lives outside the allocator (the reserve the planner took off:
    measure.budget). A cap this GPU cannot give, or one the context alone fills, is refused in one
    line: clamped, the run would be held to another cap than the plan's and its out-of-memory
    recorded under the plan's."""
    if plan.gpu_memory_bytes is None:
        return None
    from measure.budget import GpuBudget

    # this rank's device (checked before _start makes it the current one)
    total = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    context = GpuBudget(plan.gpu_memory_bytes).context_bytes
    if plan.gpu_memory_bytes > total:
        raise ValueError(
            f"the plan caps each GPU at {plan.gpu_memory_bytes / 2**30:.2f} GiB, more than this GPU's "
            f"{total / 2**30:.2f} GiB: plan with --gpu-mem at most that"
        )
    if plan.gpu_memory_bytes <= context:
        raise ValueError(
            f"the plan caps each GPU at {plan.gpu_memory_bytes / 2**30:.2f} GiB, no more than the CUDA "
            f"context's reserve of {context / 2**30:.2f} GiB"
        )
    return (plan.gpu_memory_bytes - context) / total


def unsupported(plan: Plan, device: str = "cpu") -> list[str]:
    """The plan's parts mist.engine.run cannot execute on ``device`` ("cpu" or "cuda"; empty: it
    can): what no Megatron model can be built as (megatron.megatron_limits), and what this engine
    does not do around it."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    # layers.py's spec; _config's layout; layout.py; _parameter_parts; offload.py
    built_here = (
        "parallel_block",
        "uneven_middle_stages",
        "stage_parallelism",
        "pre_post",
        "offload_weights_grads",
        "tempo",
    )
    spec = plan.model_spec()
    limits = megatron_limits(plan, spec)
    reasons = [why for name, why in limits.items() if name not in built_here]
    head_tps = {plan.stage_parallelism(i)[0] for i in (0, len(plan.stages) - 1)}  # embedding, head
    if any(spec.vocab % tp for tp in head_tps):
        reasons.append(
            f"a vocabulary of {spec.vocab} over TP {max(head_tps)} (megatron-core splits it evenly; "
            "Megatron-LM pads it to a multiple of TP: plan the padded vocabulary)"
        )
    parts = [*plan.stages, *([plan.pre_post] if plan.pre_post is not None else [])]
    beyond_megatron_lm = plan.pre_post is not None or any(
        s.zero >= 2 or s.offload_weights or s.offload_grads or s.offload_activations for s in parts
    )
    if plan.virtual_stages > 1 and beyond_megatron_lm:  # interleaved: Megatron-LM's space (megatron_lm.py)
        reasons.append(
            "interleaved pipelines with ZeRO-2/3, weight, gradient or activation offloading, or "
            "the embedding/head's own strategy (the engine interleaves Megatron-LM's plans: ZeRO "
            "0/1 and optimizer offload)"
        )
    if device == "cuda":
        reasons += _gpu_offload_limits(plan)
    return reasons


def _gpu_offload_limits(plan: Plan) -> list[str]:
    """What offload.py does on a CPU only: weights or gradients offloaded where a ZeRO-3 part has
    DP replicas (FSDP2's gathers and reduce-scatters would read and write the host shards, which
    NCCL cannot; ShardedWeightOffload, ShardedGradientOffload)."""
    held = plan.strategies_with_dp()
    if any((part.offload_weights or part.offload_grads) and part.zero >= 3 and dp > 1 for part, dp in held):
        return [
            "weight or gradient offloading with ZeRO-3 over DP replicas on a GPU (offload.py runs "
            "it on the CPU engine only; on a GPU with ZeRO-0/1/2, or one replica)"
        ]
    return []


def _config(spec, plan: Plan, dtype: torch.dtype, tp: int | None = None, selective: bool = False):
    """megatron-core's config of a stage whose TP is ``tp`` (None: the plan's); ``selective``: its
    layers recompute their core attention in backward (megatron-core's selective recomputation)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = model_settings(plan, spec)
    if tp is not None:  # a stage's own
        settings["tensor_model_parallel_size"] = tp
        settings["sequence_parallel"] = plan.sequence_parallel and tp > 1
    for not_config in ("position_embedding_type", "max_sequence_length", "vocab_size"):  # GPTModel's
        settings.pop(not_config)
    activation = {"silu": nn.functional.silu, "gelu": nn.functional.gelu}[settings.pop("activation")]
    if len(plan.stages) > 1:
        # megatron-core's own layout of layers over stages, any counts (its first/last-stage
        # settings allow only even middle stages): the layer offsets follow it
        settings["num_layers_in_first_pipeline_stage"] = settings["num_layers_in_last_pipeline_stage"] = None
        last = len(plan.stages) - 1
        settings["pipeline_model_parallel_layout"] = [
            ["embedding"] * (i == 0) + ["decoder"] * s.layers + ["loss"] * (i == last)
            for i, s in enumerate(plan.stages)
        ]
    if selective:  # its default module: the core attention
        settings["recompute_granularity"] = "selective"
    return TransformerConfig(
        **settings,
        activation_func=activation,
        use_cpu_initialization=not torch.cuda.is_available(),  # on a GPU: initialise there (fast)
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        cuda_graph_scope=[],  # the whole layer, as megatron-core's default "full", which warns
    )


@dataclass
class Part:
    """Parameters of a stage that share a strategy, and that strategy."""

    params: list[nn.Parameter]
    zero: int
    offload_optimizer: float
    offload_grads: float


def _parameter_parts(model, plan: Plan, mine) -> list[Part]:
    """The parts of this stage with a strategy of their own: the embedding (first stage) and head
    (last stage) take the plan's ``pre_post`` if it has one, everything else the stage's."""
    params = [p for p in model.parameters() if p.requires_grad]
    edge = plan.pre_post
    edge_ids = (
        {id(p) for gpt in gpt_modules(model) for m in _edges(gpt) for p in m.parameters()}
        if edge is not None
        else set()
    )
    rest = [p for p in params if id(p) not in edge_ids]
    parts = [Part(rest, mine.zero, mine.offload_optimizer, mine.offload_grads)]
    if edge_ids:
        edges = [p for p in params if id(p) in edge_ids]
        parts.append(Part(edges, edge.zero, edge.offload_optimizer, edge.offload_grads))
    return [part for part in parts if part.params]


def _edges(gpt) -> list[nn.Module]:
    """The embedding (first stage) and the head (last stage) this stage holds."""
    return [m for m in (getattr(gpt, "embedding", None), getattr(gpt, "output_layer", None)) if m is not None]


@dataclass
class ModuleGroup:
    """Modules of a stage that share a strategy (what offloading and ZeRO-3 act on, module by
    module), and that strategy: the stage's or the plan's ``pre_post``."""

    modules: list[nn.Module]
    zero: int
    offload_weights: float
    offload_grads: float
    prefetch: bool  # the next module's weights brought up with this one's (forward order)


def _module_groups(gpt, plan: Plan, mine) -> list[ModuleGroup]:
    """The stage's modules in the order forward runs them: its layers, and the embedding before and
    the head after with the stage's strategy, or with pre_post's if the plan has one (then not
    prefetched: they run at opposite ends, one at a time, as the memory model prices them)."""
    first = [gpt.embedding] if hasattr(gpt, "embedding") else []
    last = [gpt.output_layer] if hasattr(gpt, "output_layer") else []
    stage = (mine.zero, mine.offload_weights, mine.offload_grads)
    if plan.pre_post is None:
        groups = [ModuleGroup([*first, *gpt.decoder.layers, *last], *stage, prefetch=True)]
    else:
        edge = plan.pre_post
        groups = [
            ModuleGroup(list(gpt.decoder.layers), *stage, prefetch=True),
            ModuleGroup([*first, *last], edge.zero, edge.offload_weights, edge.offload_grads, prefetch=False),
        ]
    return [g for g in groups if g.modules]


def _sharded(g: ModuleGroup, dp: int) -> bool:
    """Whether FSDP2 shards a group's weights (ZeRO-3 over DP replicas): its weight offload then
    keeps shards on the host, not the weights themselves."""
    return g.zero == 3 and dp > 1


def _weight_offloads(groups: list[ModuleGroup], dp: int) -> list:
    """Weight offloading of each group with a fraction to offload: of its FSDP2 shards under ZeRO-3,
    else of the weights themselves."""
    return [
        ShardedWeightOffload(g.modules, g.offload_weights)
        if _sharded(g, dp)
        else WeightOffload(g.modules, g.offload_weights, g.prefetch)
        for g in groups
        if g.offload_weights > 0
    ]


def _rest_on_host(groups: list[ModuleGroup]) -> frozenset[int]:
    """Ids of the weights ``_weight_offloads`` will keep on the host (ZeRO-3's: the FSDP2 shards,
    so known once they are made), known before the optimizers are built: ZeRO-1/2's weight buffers
    leave them out, the optimizer's and the gradients' offloaded shares take them first."""
    return frozenset(
        id(p)
        for g in groups
        if g.offload_weights > 0
        for layer in weights_at_rest_on_host(g.modules, g.offload_weights)
        for p in layer
    )


def _shard_zero3_groups(model, groups: list[ModuleGroup], mine, dp: int, device) -> list[ModuleGroup]:
    """ZeRO-3 (FSDP2 over the DP group) of the groups whose strategy has it, module by module; the
    final norm, in no group, follows the stage's. Returns those groups."""
    from megatron.core import parallel_state as ps

    sharded = [g for g in groups if _sharded(g, dp)]
    if sharded:
        in_groups = {id(p) for g in groups for m in g.modules for p in m.parameters()}
        zero3 = {id(p) for g in sharded for m in g.modules for p in m.parameters()}
        whole = {
            p for p in model.parameters() if id(p) not in zero3 and (id(p) in in_groups or mine.zero != 3)
        }
        modules = [m for g in sharded for m in g.modules]
        shard_parameters(model, ps.get_data_parallel_group(), device, modules, whole)
    return sharded


class PartOptimizers:
    """The optimizers of a stage's parts (_parameter_parts), stepped as one."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.state_tensors()]

    def host_tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts if hasattr(part, "host_tensors") for t in part.host_tensors()]


# Megatron-LM's --clip-grad default (torchtitan's max_norm too): the global L2 norm gradients are
# clipped to before every step
CLIP_GRAD = 1.0


def step_gradients(
    optimizer: PartOptimizers, parts: list[Part], dp: int
) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(parameter, gradient, sharded) of every gradient this rank's optimizers step by: a ZeRO-1/2
    part's share (its reduced sums, put where its step reads them), else each parameter's
    (``gradient_to_step``); sharded where each DP rank holds its own part of the gradients (a
    ZeRO-1/2 share, FSDP2's shards of ZeRO-3 over DP > 1)."""
    out = []
    for part, opt in zip(parts, optimizer.parts, strict=True):
        if isinstance(opt, ShardedMasterAdamW):
            pairs, sharded = opt.gradients_to_step(), True
        else:
            pairs = [(p, g) for p in part.params if (g := gradient_to_step(p)) is not None]
            sharded = part.zero >= 3 and dp > 1
        out += [(p, local(g), sharded) for p, g in pairs]
    return out


def clip_gradients(
    optimizer: PartOptimizers,
    parts: list[Part],
    dp: int,
    tp_duplicates: set[int],
    max_norm: float,
    device: torch.device,
) -> float:
    """Megatron-LM's gradient clipping: the L2 norm of the whole model's gradients as the
    optimizers are about to read them (averaged over DP), each element counted once over the DP,
    TP and pipeline ranks, summed by one all-reduce over every rank; every gradient scaled by
    max_norm / (norm + 1e-6) where that is below 1. Returns the norm.

    Counted once: a ZeRO-1/2 rank's share (each parameter stepped by one replica), FSDP2's shards
    (ZeRO-3 over DP > 1), else only DP rank 0's copy; of the parameters every TP rank holds whole
    (``tp_duplicates``: norms, biases of row-parallel layers), only TP rank 0's."""
    from megatron.core import parallel_state as ps

    dp_rank, tp_rank = ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank()
    steps_by = step_gradients(optimizer, parts, dp)
    grads = [g for _, g, _ in steps_by]
    counted = [
        g
        for p, g, sharded in steps_by
        if (sharded or dp_rank == 0) and (id(p) not in tp_duplicates or tp_rank == 0)
    ]
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in counted:  # accumulated in fp32 per tensor (fp64 for fp64 runs), no full-size copy
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        squares += torch.linalg.vector_norm(g, dtype=acc).double().square().to(device)
    dist.all_reduce(squares)
    norm = float(squares.sqrt())
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for where in {g.device for g in grads}:  # on a GPU some may be host sums (GradientOffload)
            torch._foreach_mul_([g for g in grads if g.device == where], scale)
    return norm


def _optimizer(
    part: Part,
    dp: int,
    model,
    lr: float,
    sequence_parallel: bool,
    gather_in_forward: tuple | None = None,
    rest_on_host: frozenset[int] = frozenset(),
):
    """One part's optimizer: ZeRO-1/2 sharded over the DP group (its share optionally offloaded;
    ZeRO-2: its share's gradients too; ``gather_in_forward`` and ``rest_on_host``:
    ShardedMasterAdamW's), else (ZeRO-3 shards included) the whole part, that fraction stepping on
    the host."""
    from megatron.core import parallel_state as ps

    if part.zero in (1, 2) and dp > 1:
        mine = {id(p) for p in part.params}
        buckets = [[p for p in bucket if id(p) in mine] for bucket in layer_buckets(model)]
        return ShardedMasterAdamW(
            [b for b in buckets if b],
            ps.get_data_parallel_group(),
            lr,
            shard_grads=part.zero == 2,
            offload_fraction=part.offload_optimizer,
            sequence_parallel_group=ps.get_tensor_model_parallel_group() if sequence_parallel else None,
            offload_grads=part.offload_grads if part.zero == 2 else 0.0,
            gather_in_forward=gather_in_forward,
            rest_on_host=rest_on_host,
        )
    if part.offload_optimizer > 0:  # of all the part's parameters, or with ZeRO-3 of this rank's shards
        return OffloadedMasterAdamW(part.params, part.offload_optimizer, lr, at_rest_on_host=rest_on_host)
    return MasterWeightAdamW(part.params, lr=lr, fused=True)


def _stepped_apart(stepper) -> list[list[nn.Parameter]] | None:
    """A part's parameters grouped by the replica that steps them: ZeRO-1's owners' shares
    (ShardedMasterAdamW; only ZeRO-1 over replicas sums all gradients and steps a share), else
    None (every replica steps the whole part)."""
    return stepper.shares() if isinstance(stepper, ShardedMasterAdamW) else None


class StageGradients:
    """Where a stage's gradients go between backward and the step, part by part: ZeRO-2/3 reduce
    each (to its owner, or scattered) as backward makes it, so no full buffer (ZeRO-2's offload in
    ShardedMasterAdamW, ZeRO-3's in ShardedGradientOffload over FSDP2's shards); the rest are
    views into one contiguous buffer, all-reduced over DP after backward (``overlap``: bucket by
    bucket during the last micro-batch's backward, ContiguousGrads), less those accumulated on the
    host (GradientOffload), all-reduced there. ``order``: the parameters in the model's order;
    ``rest_on_host``: ids of the weights at rest on the host, whose gradients sum there first."""

    def __init__(
        self,
        parts: list[Part],
        sharded: list[ModuleGroup],
        optimizer: PartOptimizers,
        dp: int,
        order: list[nn.Parameter],
        overlap: tuple | None = None,
        rest_on_host: frozenset[int] = frozenset(),
    ) -> None:
        self.dp, self.optimizer = dp, optimizer
        self.reduced_as_made = [part.zero >= 2 and dp > 1 for part in parts]
        self.drained = [
            GradientOffload(part.params, part.offload_grads, rest_on_host, _stepped_apart(stepper))
            for part, stepper, made in zip(parts, optimizer.parts, self.reduced_as_made, strict=True)
            if part.offload_grads > 0 and not made
        ]
        # after sharding: FSDP2's shards are the parameters
        self.drained_shards = [
            ShardedGradientOffload(g.modules, g.offload_grads, rest_on_host)
            for g in sharded
            if g.offload_grads > 0
        ]
        on_host = {id(p) for d in self.drained for p in d.params}
        kept = {
            id(p)
            for part, made in zip(parts, self.reduced_as_made, strict=True)
            if not made
            for p in part.params
            if id(p) not in on_host
        }
        kept = [p for p in order if id(p) in kept]  # the model's order: backward runs it reversed
        self.buffer = ContiguousGrads(kept, overlap) if kept else None

    def sync(self, dp_group, device: torch.device) -> None:
        """The DP averages (the host sums' through ``device``, where the DP group's collectives
        run: GradientOffload.all_reduce), and the host sums where the optimizer reads them."""
        if self.buffer is not None and self.dp > 1:
            self.buffer.all_reduce(dp_group, divide_by=self.dp)
        for host in self.drained:
            if self.dp > 1:
                host.all_reduce(dp_group, self.dp, device)
            host.attach()
        for host in self.drained_shards:  # FSDP2 averaged them over DP
            host.attach()

    def wait_overlapped(self) -> None:
        """The device buffer's bucket sums begun in backward done (before anything else writes it)."""
        if self.buffer is not None:
            self.buffer.wait()

    def zero(self) -> None:
        """After the step: host sums zeroed, ZeRO-2/3's reduced shards dropped, the buffer zeroed."""
        for host in [*self.drained, *self.drained_shards]:
            host.zero()
        for part, made in zip(self.optimizer.parts, self.reduced_as_made, strict=True):
            if made:
                part.zero_grad()
        if self.buffer is not None:
            self.buffer.zero()

    def device_buffers(self) -> list[torch.Tensor]:
        return self.buffer.buffers if self.buffer is not None else []

    def host_tensors(self) -> list[torch.Tensor]:
        """The host buffers gradients accumulate in (ZeRO-2: of this rank's share)."""
        offloaded = [t for d in [*self.drained, *self.drained_shards] for t in d.host_tensors()]
        zero2 = [o for o in self.optimizer.parts if isinstance(o, ShardedMasterAdamW)]
        return offloaded + [t for o in zero2 for t in o.host_gradient_tensors()]


def _reduction_overlap(plan: Plan, dp: int, dp_group) -> tuple | None:
    """ContiguousGrads' ``overlap`` for Megatron-LM's --overlap-grad-reduce (the DP sum bucket by
    bucket during the last backward): (group, bucket parameters, micro-batches a step), or None."""
    if not plan.overlap_grad_reduce or dp == 1:
        return None
    return dp_group, grad_bucket(plan.grad_bucket_params, dp), plan.grad_accum


def _gather_in_forward(plan: Plan, mine, dp: int, model) -> tuple | None:
    """ShardedMasterAdamW's ``gather_in_forward`` for the stage's ``gather_in_forward``
    (Megatron-LM's --overlap-param-gather): the stage's transformer layers in forward order and
    the plan's bucket size; or None. Its weights are on the device (StagePlan.check: no offloaded
    weights gather in forward). The embedding, final norm and head are gathered after the step, as
    stage_cost prices them (Megatron-LM gathers its embedding and head in forward too: a layer's
    bytes or two)."""
    if not mine.gather_in_forward or dp == 1:
        return None
    layers = [layer for gpt in gpt_modules(model) for layer in gpt.decoder.layers]
    return layers, grad_bucket(plan.grad_bucket_params, dp)


def _checkpoint_first_layers(model, count: int) -> None:
    """Recompute the first ``count`` local layers in backward (activation checkpointing); under
    selective recomputation the others alone recompute their core attention (a whole layer
    recomputed keeps none of it already). The recomputation draws the same dropout masks as the
    forward did (``_replay_tracked_streams``)."""
    from torch.utils.checkpoint import checkpoint

    for layer in list(model.decoder.layers)[:count]:
        layer.self_attention.checkpoint_core_attention = False
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(
                _forward, *args, use_reentrant=False, context_fn=_replay_tracked_streams, **kwargs
            )

        layer.forward = wrapped


def _replay_tracked_streams() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's (forward, recomputation) contexts: the recomputation starts
    megatron-core's tracked random streams (the core attention's dropout is drawn from the
    model-parallel one) where the forward started them, and leaves them where they were. The
    checkpoint restores the default generator only: without this a recomputed layer drew new
    attention masks, and its gradients were not those of the loss computed (measured: the first
    gradient norm 2.36685 with 4 layers recomputed against 2.36144 without). megatron-core's own
    checkpoint restores the tracker the same way."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    # the tracker's fork replaces a state when it is done, never changes it in place, so the
    # forward's states can be kept by reference; a CUDA-graph-safe tracker's would advance
    if getattr(tracker, "use_cudagraphable_rng", False):
        raise ValueError(
            "the engine's recomputation needs megatron-core's plain RNG tracker (not graph-safe)"
        )
    return contextlib.nullcontext(), _TrackedStreamsAt(tracker, tracker.get_states())


class _TrackedStreamsAt:
    """A context, re-enterable (one per recomputation), in which ``tracker``'s streams start at
    ``states`` and after which they are where they were before it."""

    def __init__(self, tracker, states: dict) -> None:
        self.tracker, self.states = tracker, states
        self.before: dict | None = None

    def __enter__(self) -> None:
        self.before = self.tracker.get_states()
        self.tracker.set_states(dict(self.states))  # a copy: the recomputation's forks write into it

    def __exit__(self, *exc) -> None:
        self.tracker.set_states(self.before)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


MEMORY_STEPS = 5  # profiled steady steps before the timed ones: the median and the worst are reported
UNTIMED_STEPS = 1 + MEMORY_STEPS  # _measure's order: step 0 (it makes the state), the memory steps


def _step_peak(step, device: torch.device) -> tuple[int, float]:
    """(peak bytes allocated above the level at the step's start, the step's loss); on a CPU the
    offloaded optimizer's host work and the bf16 GEMMs' float32 copies left out, as a GPU's."""
    from measure.cpu_peak import device_peak_bytes

    from .cpu_shim import GEMM_SCRATCH

    return device_peak_bytes(step, device, exclude=(HOST_WORK, GEMM_SCRATCH))


def _tensor_bytes(tensors) -> int:
    """Bytes of the storages under ``tensors``, each once (ZeRO-3's DTensors: this rank's shard)."""
    seen, total = set(), 0
    for t in map(local, tensors):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _start(plan: Plan, seed: int) -> RankLayout:
    """This process in the plan: its process group, megatron-core's parallel state (one TP/DP for
    all stages: megatron-core's own; stages that differ: each rank's stage's), the GPU cap."""
    from . import cpu_shim

    cpu_shim.install()  # first: the CUDA stand-ins megatron-core needs on a CPU
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_world_size() != plan.gpus:
        raise ValueError(f"the plan is for {plan.gpus} processes, this run has {dist.get_world_size()}")
    layout = RankLayout.of(plan)
    if layout.uniform:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=len(plan.stages)
        )
        model_parallel_cuda_manual_seed(seed)
    else:  # stages whose TP/DP differ: megatron-core's state for this rank's stage
        init_megatron_state(layout, dist.get_rank(), seed)
    if torch.cuda.is_available() and (fraction := _allocator_fraction(plan)) is not None:
        torch.cuda.set_per_process_memory_fraction(fraction)
    return layout


def _build_stage(plan: Plan, stage: int, device: torch.device, seed: int) -> tuple[nn.Module, list[int], int]:
    """This rank's stage as megatron-core builds it, on ``device`` (``_build_chunk``). Interleaved,
    its V chunks of 1/V of its layers and recomputed layers each, chunk c built from the seed as
    the rank of virtual stage c S + i would build it alone: the model is the one a pipeline of
    S V plain stages trains."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    mine, v = plan.stages[stage], plan.virtual_stages
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if v == 1:
        return _build_chunk(plan, stage, device, mine.layers, mine.recompute, first, last)
    built = []
    for c in range(v):
        model_parallel_cuda_manual_seed(seed)
        built.append(
            _build_chunk(
                plan,
                stage,
                device,
                mine.layers // v,
                mine.recompute // v,
                first and c == 0,
                last and c == v - 1,
            )
        )
    chunks, shapes, offloaded = zip(*built, strict=True)
    return ModelChunks(list(chunks)), shapes[0], sum(offloaded)


def _build_chunk(
    plan: Plan,
    stage: int,
    device: torch.device,
    layers: int,
    recompute: int,
    pre_process: bool,
    post_process: bool,
) -> tuple[nn.Module, list[int], int]:
    """``layers`` of the stage as megatron-core builds them (the embedding before them if
    ``pre_process``, the final norm and head after if ``post_process``), on ``device``, the first
    ``recompute`` recomputed and activations offloaded as the plan says, in megatron's
    half-precision wrapper; with the shape of its first layer's input ([tokens here, batch,
    hidden], filled by the first forward) and how many layers offload their activations."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    spec = plan.model_spec()
    settings = model_settings(plan, spec)
    mine = plan.stages[stage]
    model = GPTModel(
        config=_config(spec, plan, torch.bfloat16, plan.stage_parallelism(stage)[0], mine.selective),
        transformer_layer_spec=block_spec(settings["normalization"], spec.parallel_block, layers, spec.tempo),
        vocab_size=settings["vocab_size"],
        max_sequence_length=settings["max_sequence_length"],
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type=settings["position_embedding_type"],
    ).train()
    model = model.to(device)
    _checkpoint_first_layers(model, recompute)
    layer_input_shape: list[int] = []  # sequence parallelism shards the tokens

    def record_input_shape(_layer, args, kwargs) -> None:
        if not layer_input_shape:
            layer_input_shape.extend((args[0] if args else kwargs["hidden_states"]).shape)

    if model.decoder.layers:
        model.decoder.layers[0].register_forward_pre_hook(record_input_shape, with_kwargs=True)
    offloaded_layers = offload_layer_activations(model, recompute, mine.offload_activations)
    # megatron's half-precision wrapper: casts inputs and outputs
    return Float16Module(model.config, model), layer_input_shape, offloaded_layers


def _batches(plan: Plan, layout: RankLayout, stage: int, seed: int, device: torch.device) -> list:
    """The same few sequences every step (a decreasing loss shows the whole pipeline learns): each
    pipeline micro-batch drawn whole, this rank's replica taking its sequences of it."""
    from megatron.core import parallel_state as ps

    spec = plan.model_spec()
    g = torch.Generator().manual_seed(seed)
    lo, hi = layout.rows(stage, ps.get_data_parallel_rank())
    return [
        torch.randint(0, spec.vocab, (layout.sequences, spec.seq + 1), generator=g)[lo:hi].to(device)
        for _ in range(plan.grad_accum)
    ]


@dataclass
class _BuiltStage:
    """One rank's part of a plan, built: its stage of the model, optimizers, gradient buffers,
    weight offloads and pipeline schedule (what a step and the report read)."""

    stage: int
    tp: int
    device: torch.device
    model: nn.Module
    layer_input_shape: list[int]
    offloaded_layers: int
    parts: list
    optimizer: PartOptimizers
    zero12: list  # the ZeRO-1/2 parts' optimizers (their weight gathers)
    gradients: StageGradients
    tp_duplicates: set[int]  # parameters every TP rank holds whole (clipping counts them once)
    weights: list  # weight offloads
    pipeline: Pipeline1F1B | PipelineInterleaved


def _build(plan: Plan, seed: int, lr: float) -> _BuiltStage:
    """This rank's stage of ``plan``, built on this process group (the group started)."""
    from megatron.core import parallel_state as ps

    layout = _start(plan, seed)
    stage = ps.get_pipeline_model_parallel_rank()
    mine = plan.stages[stage]
    tp, dp, _ = plan.stage_parallelism(stage)  # this stage's (Plan.stage_parallelism)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    model, layer_input_shape, offloaded_layers = _build_stage(plan, stage, device, seed)
    groups = [g for gpt in gpt_modules(model) for g in _module_groups(gpt, plan, mine)]
    # every TP rank holds these whole (named now: FSDP2 drops megatron-core's attributes)
    whole_on_tp = {n for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", False)}
    sharded = _shard_zero3_groups(model, groups, mine, dp, device)
    parts = _parameter_parts(model, plan, mine)  # after sharding: FSDP2 replaces the parameters
    sequence_parallel = plan.sequence_parallel and tp > 1
    gather = _gather_in_forward(plan, mine, dp, model)
    rest_on_host = _rest_on_host(groups)  # after sharding: ZeRO-3's are its shards
    optimizer = PartOptimizers(
        [_optimizer(part, dp, model, lr, sequence_parallel, gather, rest_on_host) for part in parts]
    )
    gradients = StageGradients(
        parts,
        sharded,
        optimizer,
        dp,
        list(model.parameters()),
        _reduction_overlap(plan, dp, ps.get_data_parallel_group()),
        rest_on_host,
    )
    tp_duplicates = {id(p) for n, p in model.named_parameters() if n in whole_on_tp}
    # after the optimizers and gradient buffers: they are made where the weights are, the device
    weights = _weight_offloads(groups, dp)
    batches = _batches(plan, layout, stage, seed, device)
    schedule = Pipeline1F1B if plan.virtual_stages == 1 else PipelineInterleaved
    return _BuiltStage(
        stage,
        tp,
        device,
        model,
        layer_input_shape,
        offloaded_layers,
        parts,
        optimizer,
        [o for o in optimizer.parts if isinstance(o, ShardedMasterAdamW)],
        gradients,
        tp_duplicates,
        weights,
        schedule(model, plan.model_spec(), plan, batches, layout),
    )


class _Steps:
    """A training step of a built stage, and what each step leaves to report."""

    def __init__(self, built: _BuiltStage, dp: int) -> None:
        self.built, self.dp = built, dp
        self.phases: list[dict[str, float]] = []  # per step: where the time went
        self.grad_bytes: list[int] = []  # per step: the .grad tensors on the device when backward ends
        self.first_grad_norm: list[float] = []  # the first step's, before and after clipping
        self.clipped_norms: list[float] = []  # per step: the global gradient norm before clipping
        self.in_backward: list[int] = []  # per step: buckets whose DP sum began during backward (overlap)
        self.in_forward: list[int] = []  # per step: weight-gather groups the forward waited for (overlap)

    def step(self) -> float:
        from megatron.core import parallel_state as ps

        b, device = self.built, self.built.device
        t0 = _now(device)
        loss = b.pipeline.iteration()
        t1 = _now(device)
        self.grad_bytes.append(_tensor_bytes(p.grad for p in b.model.parameters() if p.grad is not None))
        b.gradients.wait_overlapped()  # before the TP sum writes the same gradients
        buffer = b.gradients.buffer
        self.in_backward.append(buffer.launched_in_backward if buffer is not None else 0)
        if b.tp > 1:
            _sum_sequence_parallel_grads(b.model, ps.get_tensor_model_parallel_group())
        b.gradients.sync(ps.get_data_parallel_group(), device)
        if not self.first_grad_norm:  # the first step's, as the optimizer reads them
            self.first_grad_norm.append(self._grad_norm())
        t_clip = _now(device)
        self.clipped_norms.append(
            clip_gradients(b.optimizer, b.parts, self.dp, b.tp_duplicates, CLIP_GRAD, device)
        )
        if len(self.first_grad_norm) == 1:
            self.first_grad_norm.append(self._grad_norm())  # and after clipping
        t2 = _now(device)
        self.in_forward.append(sum(o.gathered_in_forward for o in b.zero12))
        for offload in b.weights:  # the step writes the host copies their copies up read
            offload.settle()
        b.optimizer.step()
        b.gradients.zero()
        self.phases.append(
            {
                "pipeline_s": t1 - t0,
                "grad_sync_s": t_clip - t1,  # the TP and DP reductions
                # the norm's all-reduce over every rank: where a stage also waits for the others
                "clip_s": t2 - t_clip,
                "optimizer_s": _now(device) - t2,
            }
        )
        return loss

    def _grad_norm(self) -> float:
        """The L2 norm of the gradients this rank steps by (step_gradients: ZeRO-1/2 its share,
        ZeRO-3 its shards)."""
        b = self.built
        norms = [g.double().norm().cpu() for _, g, _ in step_gradients(b.optimizer, b.parts, self.dp)]
        return float(torch.stack(norms).norm()) if norms else 0.0

    def held_bytes(self) -> int:
        b = self.built
        at_rest_on_host = {t.data_ptr() for w in b.weights for t in w.host_tensors()}
        on_device = [p for p in b.model.parameters() if local(p).data_ptr() not in at_rest_on_host]
        return _tensor_bytes([*on_device, *b.optimizer.state_tensors(), *b.gradients.device_buffers()])


def _report(built: _BuiltStage, steps: _Steps, measured: dict) -> dict:
    """This rank's report of a run: what it measured, and what its stage holds and did."""
    from megatron.core import parallel_state as ps

    b, buffer = built, built.gradients.buffer
    return {
        "rank": dist.get_rank(),
        "stage": b.stage,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        **measured,
        "losses": measured["losses"] if ps.is_pipeline_last_stage() else None,
        "phases": steps.phases[UNTIMED_STEPS:],  # the timed steps' only
        # the .grad tensors on the device as backward ends, each storage whole (ZeRO-3: FSDP2's
        # gradient shards, less those offloaded; ZeRO-2 keeps its reduced share apart, uncounted)
        "device_grad_bytes": steps.grad_bytes[-1],
        # the L2 norm of the gradients this rank steps by in the first step, after the DP average
        # (ZeRO-1/2: its share, ZeRO-3: its shards, whose norms add up over the DP ranks)
        "first_grad_norm": steps.first_grad_norm[0],
        "first_clipped_grad_norm": steps.first_grad_norm[1],  # the same after clipping
        "global_grad_norms": steps.clipped_norms,  # every step's, before clipping (the same on every rank)
        **_offload_report(b.optimizer, b.weights, b.gradients),
        "activation_offloaded_layers": b.offloaded_layers,  # layers whose saved activations wait on the host
        # overlapped DP reduction: the device buffer's buckets, and of them those whose sum began
        # during the last step's backward (not overlapping: 0 and 0)
        "gradient_buckets": len(buffer.buckets) if buffer is not None else 0,
        "buckets_reduced_in_backward": steps.in_backward[-1],
        # overlapped ZeRO-1/2 weight gather: its groups, and those the last step's forward waited
        # for (gathered after the previous step instead: 0 and 0)
        "weight_gather_groups": sum(len(o.gather_groups) for o in b.zero12),
        "weight_gathers_in_forward": steps.in_forward[-1],
        # every weight this rank holds, summed in float64 after the run: equal across DP replicas
        # unless their weights are sharded (ZeRO-3) or went apart
        "weight_sum": float(sum(local(p).detach().double().sum() for p in b.model.parameters())),
        "layer_input_shape": b.layer_input_shape,
        # built here: the plan's count for this stage (interleaved: over its chunks)
        "layers": sum(len(gpt.decoder.layers) for gpt in gpt_modules(b.model)),
        **_sequence_parallel_report(b.model),
    }


def run(plan: Plan, steps: int = 5, seed: int = 0, lr: float = 1e-2) -> dict:
    """Train ``steps`` iterations of ``plan`` on this process group; the report of this rank."""
    plan = runnable(plan)
    from megatron.core import parallel_state as ps

    built = _build(plan, seed, lr)
    training = _Steps(built, plan.stage_parallelism(built.stage)[1])
    measured = _measure(training.step, steps, training.held_bytes, plan.gpu_memory_bytes, built.device)
    for o in built.zero12:  # the last step's weights, gathered (no forward came to wait for them)
        o.finish_gathers()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _report(built, training, measured))
    ps.destroy_model_parallel()
    return {"ranks": gathered}


def _sum_sequence_parallel_grads(model, tp_group) -> None:
    """Sequence-parallel weights (the norms) hold partial sums over the sequence shards: summed
    over the TP group (ZeRO-3: this rank's shard of them)."""
    sp = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    sp = [local(g) for g in sp if g is not None]
    flat_collective(sp, lambda flat: dist.all_reduce(flat, group=tp_group, async_op=True))


def _sequence_parallel_report(model) -> dict:
    """The weights whose gradients are summed over the TP group (sequence parallelism's norms), and
    the sum of their values: equal on every rank of a stage when their gradients were summed."""
    weights = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    return {
        "sequence_parallel_params": len(weights),
        "sequence_parallel_checksum": sum(local(p).double().sum().item() for p in weights),
    }


def _offload_report(optimizer: PartOptimizers, weights: list, gradients: StageGradients) -> dict:
    """What offloading keeps on the host, by kind (none of it in the held bytes)."""
    return {
        "host_optimizer_bytes": _tensor_bytes(optimizer.host_tensors()),
        # weights at rest on the host, and how many were left on the device after the step
        # (none: each came down after its layer's backward)
        "host_weight_bytes": _tensor_bytes([t for w in weights for t in w.host_tensors()]),
        "weights_left_on_device": sum(w.resident() for w in weights),
        # the host buffers gradients accumulate in (ZeRO-2: of this rank's share)
        "host_gradient_bytes": _tensor_bytes(gradients.host_tensors()),
    }


def _measure(step, steps: int, held_bytes, cap: int | None, device: torch.device) -> dict:
    """Step 0 (it creates the optimizer state: held bytes afterwards, not a step peak), then the
    memory steps, each under the allocator profiler, then ``steps`` timed, unprofiled ones, unless
    a device peak went above the plan's cap on some rank: losses, times and memory. The memory
    steps' peaks vary (on a CPU by up to ~10% of the total at this tiny scale: gloo's threads and
    FSDP2's asynchronous gathers and reduce-scatters free buffers at varying times), so the
    typical step (the median) is compared with the model and the worst reported beside it."""
    losses = [step()]
    step_peaks = []
    for _ in range(MEMORY_STEPS):
        step_peak, loss = _step_peak(step, device)
        step_peaks.append(step_peak)
        losses.append(loss)
    held = held_bytes()
    # The plan's cap on a CPU: a measured device peak above it ends the run as out of memory on
    # every rank (they all stop before the timed steps, so none waits in a collective); on a GPU
    # the allocator enforces it (_start) and raises.
    over = torch.tensor([int(cap is not None and held + max(step_peaks) > cap)], device=device)
    dist.all_reduce(over, op=dist.ReduceOp.MAX)
    out_of_memory = bool(over.item())
    times = []
    for _ in range(0 if out_of_memory else steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    return {
        "losses": losses,
        "step_s": times,  # none when out of memory: an over-cap run has no time
        "out_of_memory": out_of_memory,  # some rank's device peak went above the plan's cap
        "memory_cap_bytes": cap,
        "held_bytes": held,
        "step_peaks_bytes": step_peaks,
        "memory_bytes": held + statistics.median_low(step_peaks),
        "worst_memory_bytes": held + max(step_peaks),
    }


def _write_out_of_memory_report(path: Path, plan: Plan) -> None:
    """A GPU rank that ran out of memory under the plan's cap: a report of that rank alone, with the
    allocator's peak as its memory (before the allocation that failed: a lower bound of what the
    plan needs) and no time (the form ``run``'s reports have)."""
    from megatron.core import parallel_state as ps

    peak = torch.cuda.max_memory_allocated()
    stage = ps.get_pipeline_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    rank = {
        "rank": int(os.environ.get("RANK", "0")),
        "stage": stage,
        "losses": None,
        "step_s": [],
        "out_of_memory": True,
        "memory_cap_bytes": plan.gpu_memory_bytes,
        "memory_bytes": peak,
        "worst_memory_bytes": peak,
        "failed_allocation": True,
        "phases": [],
    }
    write_json_atomic(path, {"ranks": [rank]})


def preload() -> None:
    """What a rank imports before it runs, CPU shim first: a launcher that forks its ranks from one
    warm process (measure.fork_launch, the engine's tests) calls this there once."""
    from . import cpu_shim

    cpu_shim.install()
    import megatron.core.models.gpt
    import megatron.core.optimizer  # noqa: F401


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked before any work (exit 2 on bad input), and the launch's
    environment (torchrun's)."""
    ap = OneLineParser(
        prog="torchrun ... -m mist.engine.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--plan", required=True)
    ap.add_argument(
        "--steps", type=int, default=5, help="timed steps (after one warm-up and the memory steps)"
    )
    ap.add_argument("--out", help="write rank 0's gathered report (JSON)")
    ap.add_argument(
        "--copy-timing",
        choices=[t.value for t in CopyTiming],
        default=CopyTiming.IN_LINE.value,
        help="when offloading's copies are made on a CPU: in line (training), or, to check the "
        "waits a GPU's copy stream needs, as late or as early as a stream may, their destinations "
        "poisoned until then (a missing wait shows in the losses; offload.CopyTiming); the memory "
        "and times reported are then not offloading's",
    )
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    args.copy_timing = CopyTiming(args.copy_timing)
    if args.copy_timing is not CopyTiming.IN_LINE and torch.cuda.is_available():
        ap.error("--copy-timing checks on a CPU what a GPU's copy stream does; on a GPU the stream runs")
    if (problem := launch_env_problem("mist.engine.run")) is not None:
        ap.error(problem)
    if args.out:  # before the training, not after it
        try:
            check_writable_file(Path(args.out))
        except ValueError as e:
            ap.error(f"--out: {e}")
    return args


def _print_report(report: dict) -> None:
    """Rank 0's summary of the gathered ``report``: losses, each rank's worst memory, an
    out-of-memory error."""
    losses = next(r["losses"] for r in report["ranks"] if r["losses"] is not None)
    print("losses:", " ".join(f"{x:.4f}" for x in losses))
    for r in report["ranks"]:
        print(
            f"rank {r['rank']} (stage {r['stage']}, tp {r['tp_rank']}): "
            f"{r['worst_memory_bytes'] / 2**20:.2f} MiB at the worst step"
        )
    if report["ranks"][0]["out_of_memory"]:
        cap = report["ranks"][0]["memory_cap_bytes"]
        print(
            f"error: out of memory: a device peak went above the plan's cap of {cap / 2**20:.2f} MiB",
            file=sys.stderr,
        )


def priced_otherwise(plan: Plan) -> list[str]:
    """What the engine runs otherwise than ``plan`` was priced for, a line each."""
    notes = []
    if plan.model_spec().flash:
        notes.append(
            "the engine runs megatron-core's unfused attention, which keeps the s x s scores; "
            "this plan was priced with FlashAttention (model flash: true), which does not: its memory "
            "is under-predicted by them (model_overrides flash: false prices what runs)"
        )
    priced = plan.priced_engine
    if priced is not None and priced != GRAD_ACCUMULATION["megatron-core"]:
        notes.append(
            f"the engine adds every micro-batch's gradients into one zeroed 16-bit buffer and reduces "
            f"them in 16 bits (megatron-core's); this plan was priced for how {priced.engine} "
            f"accumulates and reduces them (`mist predict PLAN --engine megatron-core` prices what runs)"
        )
    return notes


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    die_with_launcher()  # a rank never outlives its launcher (torchrun, or fork_launch's server)
    rank = int(os.environ["RANK"])  # checked by _parse_args
    try:  # before any work: what fails later is a failure, with its traceback
        world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
        plan = runnable(Plan.load(args.plan), world_size)
    except PlanRefused as e:  # a plan, but not one this engine runs here: said in the report too
        print(f"error: {e}", file=sys.stderr)
        # so a caller need not read it back from the message; every rank refuses alike and any
        # may be the first (torchrun stops the others then), so each writes it, whole
        if args.out:
            write_json_atomic(Path(args.out), {"refused": e.reasons})
        return 2
    except (OSError, ValueError) as e:  # a plan file missing or unreadable; not a plan; not for this launch
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        for note in priced_otherwise(plan):  # said, not changed: the plan is run as written
            print(f"note: {note}", file=sys.stderr)
    from .cpu_shim import gpu_standins

    set_copy_timing(args.copy_timing)
    try:
        with gpu_standins():  # on a CPU: its stand-ins for a GPU's bf16 GEMMs and dropout, as the profiles'
            report = run(plan, args.steps)
    except torch.cuda.OutOfMemoryError:  # the allocator's cap (the plan's); torchrun stops the others
        cap = "the GPU's memory" if plan.gpu_memory_bytes is None else f"{plan.gpu_memory_bytes} bytes"
        print(f"error: out of memory under the plan's cap of {cap}", file=sys.stderr)
        if args.out:  # this rank's report of it (the others cannot gather: they wait in a collective)
            _write_out_of_memory_report(Path(args.out), plan)
        return 3
    report["copy_timing"] = args.copy_timing.value  # deferred: its memory and times are not offloading's
    out_of_memory = report["ranks"][0]["out_of_memory"]  # the same on every rank
    if dist.get_rank() == 0:
        _print_report(report)
        if args.out:  # whole or not at all, as the refused and out-of-memory reports
            write_json_atomic(Path(args.out), report)
    dist.destroy_process_group()
    return 3 if out_of_memory else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
