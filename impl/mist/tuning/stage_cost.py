"""Overlap-centric schedule model of one pipeline stage, vectorised over strategies.

For a stage (its layers, whether it holds the embedding or the head, how many micro-batches are
in flight under 1F1B) and a parallel setting (TP t, DP d, micro-batch b), every per-stage
strategy -- recomputed layers r, the other layers' core attention recomputed or not (selective),
ZeRO stage z, offloaded fractions of weights, gradients, optimizer state and activations -- is
evaluated at once as numpy arrays:

* steady: one micro-batch's forward + backward. Compute (with TP collectives and recompute) runs
  on the compute stream; per layer, the prefetch of sharded (ZeRO-3) or offloaded weights for
  the next layer, activation swap-out/in and per-micro-batch gradient traffic run on the
  GPU<->GPU, device->host and host->device channels behind it. The stage takes the longest of
  the four, each slowed by the others running at the same time (``Interference``). Compute
  includes adding the micro-batch's weight gradients into the accumulated ones, as the engine
  that runs the plan does it (``Setting.grad_accumulation``).
* extra: the work only the last micro-batch does: gradient synchronisation across DP
  (all-reduce, or reduce-scatter + all-gather under ZeRO), the optimizer step on GPU and, for
  offloaded optimizer state, on the CPU (with the copies it needs). Of it, ``step`` comes after
  gradient clipping's global barrier (``clip_barrier_s``; pipeline_sim says how it is priced).
* wait: what the stage's first forward waits for its weights when ZeRO-1/2's all-gather runs in
  it (``StagePlan.gather_in_forward``), on the pipeline's fill path instead of after the step.
* memory: peak bytes per GPU (weights, gradients, optimizer state, in-flight activations,
  prefetch/swap buffers, one layer's backward working set, the head's logits).
* host memory: what this GPU keeps in its node's DRAM (offloaded weights, gradients, optimizer
  state and activations); a node's GPUs share it (``host_budget_bytes``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from measure.checks import finite, whole
from tempo.sizes import attention_core_workspace_bytes, swiglu_down_workspace_bytes

from ..model.interference import Interference
from ..model.runtime import RuntimeModel, cpu_adam_params_per_s, memory_bound_rate
from ..model.specs import CPU_PRESET, GRAD_ACCUMULATION, ClusterSpec, GradAccumulation, ModelSpec
from ..model.symbolic import CORE_ATTENTION_OPS, HALF, head_costs, layer_costs, value
from ..plan import activation_offloaded_layers, gather_allowed, grad_bucket
from .inter_stage import held_and_fits

# A stage's strategy, as StagePlan fields and strategy_grid columns
STRATEGY_FIELDS = (
    "recompute",
    "selective",
    "zero",
    "offload_weights",
    "offload_grads",
    "offload_optimizer",
    "offload_activations",
    "gather_in_forward",
)
OFFLOADABLE = ("weights", "grads", "optimizer", "activations")  # SearchSpace.offloadable's kinds
OFFLOAD_FIELDS = tuple(f"offload_{kind}" for kind in OFFLOADABLE)  # their StagePlan fields
OFFLOAD_KIND = dict(zip(OFFLOAD_FIELDS, OFFLOADABLE, strict=True))  # a field's kind
ADAM_BYTES_PER_PARAM = 12  # fp32 master weight + two moments
OPTIMIZER_STEP_BYTES_PER_PARAM = 4  # fp32 gradients during the step (fused Adam; torch's foreach
# AdamW adds up to ~4 more for its temporaries), where the gradients are narrower: fp32 ones (Megatron-LM's
# main_grad) are stepped as they are (its .float() of an fp32 tensor is the tensor)


def _some(values: object, ok) -> bool:
    """``values`` is a non-empty tuple or list of items that are each ``ok``."""
    return isinstance(values, tuple | list) and bool(values) and all(ok(item) for item in values)


@dataclass(frozen=True)
class SearchSpace:
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offload_ratios: tuple[float, ...] = (0.0, 0.5, 1.0)
    # The optimizer's fractions, in quarters as Megatron-LM's --optimizer-offload-fraction is
    # searched by the grid (baselines/megatron/grid.py). In halves, four of the 60 comparison
    # cases lost to the grid by 0.01-1.4% (predicted): the MILP placed layers and chose settings
    # by plans whose optimizer needed half on the host where a quarter would have done, and the
    # refinement to eighths cannot move a layer. It costs the search about a third more time: of
    # one stage's optimizer fractions only the fastest that fits is priced (``fitting_rows``).
    # offload_ratios are the other three kinds' fractions only.
    optimizer_offload_ratios: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    offload: bool = True  # weights/grads/optimizer/activations offloading considered at all
    recompute: bool = True  # per-stage recompute counts (else none)
    selective: bool = True  # the other layers' core attention recomputed (Megatron's selective), or not
    # what may be offloaded (the runtime the plans are for may offload only some: Megatron-LM
    # only the optimizer; mist.engine.run on a GPU not yet weights or gradients)
    offloadable: tuple[str, ...] = OFFLOADABLE
    # ZeRO-1/2's updated weights gathered after the step, in the next forward where a stage may
    # (StagePlan.check), or both tried (a stage's choice)
    gather_in_forward: tuple[bool, ...] = (False, True)

    def __post_init__(self) -> None:
        # checked where made: () was an IndexError in the search, "no" or 2 taken as true, a NaN
        # ratio "needs inf GiB", 1.5 or ZeRO-7 refused only later as some stage's error
        for name in ("offload", "recompute", "selective"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _some(self.zero_stages, lambda zero: whole(zero) and 0 <= zero <= 3):
            raise ValueError(
                f"zero_stages: one or more of the ZeRO stages 0, 1, 2, 3; got {self.zero_stages!r}"
            )
        for name in ("offload_ratios", "optimizer_offload_ratios"):
            if not _some(getattr(self, name), lambda ratio: finite(ratio) and 0 <= ratio <= 1):
                raise ValueError(f"{name}: one or more fractions in [0, 1]; got {getattr(self, name)!r}")
        if not _some(self.gather_in_forward, lambda gather: isinstance(gather, bool)):
            raise ValueError(f"gather_in_forward: one or both of False, True; got {self.gather_in_forward!r}")
        if not isinstance(self.offloadable, tuple | list):
            raise ValueError(
                f"offloadable: a list of kinds ({', '.join(OFFLOADABLE)}); got {self.offloadable!r}"
            )
        unknown = set(self.offloadable) - set(OFFLOADABLE)
        if unknown:
            raise ValueError(f"offloadable: unknown {sorted(unknown)}; accepted: {', '.join(OFFLOADABLE)}")
        # tuples of what was given: the search caches by the space (a list is unhashable there), and
        # a list could be changed after the check
        for name in (
            "zero_stages",
            "offload_ratios",
            "optimizer_offload_ratios",
            "offloadable",
            "gather_in_forward",
        ):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def offload_steps(self, field: str, steps) -> tuple[float, ...]:
        """The fractions of ``field`` (offload_<kind>) the search tries: ``steps``, or only 0 where
        that kind may not be offloaded."""
        allowed = self.offload and OFFLOAD_KIND[field] in self.offloadable
        return tuple(steps) if allowed else (0.0,)

    def grid_steps(self, field: str) -> tuple[float, ...]:
        """The fractions of ``field`` the MILP's strategy grid holds (``offload_steps``)."""
        ratios = self.optimizer_offload_ratios if field == "offload_optimizer" else self.offload_ratios
        return self.offload_steps(field, ratios)


@dataclass(frozen=True)
class Setting:
    """The parallel setting shared by all stages."""

    model: ModelSpec
    cluster: ClusterSpec
    runtime: RuntimeModel
    interference: Interference
    tp: int
    dp: int
    micro_batch: int
    stages: int
    sp: bool = True  # sequence parallelism with TP (Megatron's default with TP)
    # how the engine running the plan accumulates gradients over micro-batches
    grad_accumulation: GradAccumulation = GRAD_ACCUMULATION["megatron-core"]
    virtual_stages: int = 1  # model chunks a pipeline rank (interleaved 1F1B)
    # the DP gradient reduction overlapped with the last backward, in buckets of at least this many
    # parameters (Plan.overlap_grad_reduce, Plan.grad_bucket_params; None: Megatron-LM's default)
    overlap_grad_reduce: bool = False
    grad_bucket_params: int | None = None

    @property
    def sequence_parallel(self) -> bool:
        return self.sp and self.tp > 1


@dataclass
class LayerNumbers:
    """Per-layer numbers for a Setting (scalars)."""

    fwd: float  # compute s, TP collectives included
    bwd: float
    saved: float  # bytes kept for backward per micro-batch
    selective_saved: float  # the same with the core attention recomputed (selective recomputation)
    # bytes a layer's backward holds above what the layer keeps, at its peak op
    # (symbolic.LayerCosts.backward_peak_bytes less saved); and under selective recomputation
    backward_excess: float
    selective_backward_excess: float
    core_fwd: float  # seconds of the core attention's forward (what selective recomputation repeats)
    layer_input: float  # bytes a recomputed layer keeps (its input)
    params: float  # per TP rank
    tp_comm_fwd: float
    p2p_bytes: float  # activation sent to the next stage per micro-batch
    p2p: float  # seconds of that message (and of its gradient coming back)
    head_fwd: float = 0.0  # final norm + LM head + loss, per micro-batch (last stage)
    head_bwd: float = 0.0
    embed_fwd: float = 0.0  # the embedding, per micro-batch (first stage)
    embed_bwd: float = 0.0
    head_saved: float = 0.0
    logits: float = 0.0  # the fp32 logits on this TP rank (their gradient: the loss's backward)
    embed_params: float = 0.0  # the embedding's (first stage): tokens, and positions where learned
    head_params: float = 0.0  # the untied LM head's (last stage)


_LAYER_NUMBERS: dict[tuple, tuple] = {}
# the same by the Setting object itself (a Problem hands out one per set of sizes): hashing the
# model and cluster for the key above took a twentieth of an exhaustive search; an entry holds
# its Setting, so its id cannot come back as another's
_BY_SETTING: dict[int, tuple[Setting, LayerNumbers]] = {}


def layer_numbers(setting: Setting) -> LayerNumbers:
    """Per-layer numbers of a setting, memoised (searches price thousands of plans). Keyed by the
    cost models' identity; an entry holds them, so a freed model's id cannot come back as another's."""
    hit = _BY_SETTING.get(id(setting))
    if hit is not None and hit[0] is setting:
        return hit[1]
    if len(_BY_SETTING) > 4096:
        _BY_SETTING.clear()
    numbers = _layer_numbers_by_value(setting)
    _BY_SETTING[id(setting)] = (setting, numbers)
    return numbers


def _layer_numbers_by_value(setting: Setting) -> LayerNumbers:
    key = (
        setting.model,
        setting.cluster,
        id(setting.runtime),
        id(setting.interference),
        setting.tp,
        setting.dp,
        setting.micro_batch,
        setting.sp,
    )
    if key not in _LAYER_NUMBERS:
        if len(_LAYER_NUMBERS) > 4096:
            _LAYER_NUMBERS.clear()
        _LAYER_NUMBERS[key] = (setting.runtime, setting.interference, _layer_numbers(setting))
    return _LAYER_NUMBERS[key][2]


def _layer_numbers(setting: Setting) -> LayerNumbers:
    model, micro_batch, tp = setting.model, setting.micro_batch, setting.tp
    costs = layer_costs(model, setting.sequence_parallel)
    traced = costs.compiled(model)(
        micro_batch,
        model.seq,
        tp,
        attention=tempo_attention_workspace(setting),
        swiglu=tempo_swiglu_workspace(setting),
    )
    fwd, bwd = setting.runtime.layer_times(model, micro_batch, model.seq, tp, setting.sequence_parallel)
    tp_forward, tp_backward = _tp_collectives_s(setting, traced)
    head = {name: value(expr, model, micro_batch, model.seq, tp) for name, expr in head_costs(model).items()}
    head_fwd, head_bwd, embed_fwd, embed_bwd = _edge_times(setting)
    tokens = micro_batch * model.seq
    p2p_bytes = 2.0 * tokens * model.hidden / (tp if setting.sequence_parallel else 1)
    # a stage that fills a node (or more) has its neighbours on other nodes
    neighbours_across = setting.cluster.nodes > 1 and setting.tp * setting.dp >= setting.cluster.gpus_per_node
    return LayerNumbers(
        fwd=float(fwd) + float(tp_forward),
        bwd=float(bwd) + float(tp_backward),
        saved=float(traced["saved_bytes"]),
        selective_saved=float(traced["selective_saved_bytes"]),
        backward_excess=float(traced["backward_peak_bytes"] - traced["saved_bytes"]),
        selective_backward_excess=float(
            traced["selective_backward_peak_bytes"] - traced["selective_saved_bytes"]
        ),
        core_fwd=float(
            setting.runtime.layer_times(
                model, micro_batch, model.seq, tp, setting.sequence_parallel, only=CORE_ATTENTION_OPS
            )[0]
        ),
        layer_input=p2p_bytes,  # what a stage sends on is its next layer's input
        params=float(traced["params"]),
        tp_comm_fwd=float(tp_forward),
        p2p_bytes=p2p_bytes,
        p2p=setting.runtime.p2p(p2p_bytes, setting.cluster, inter_node=neighbours_across),
        head_fwd=head_fwd,
        head_bwd=head_bwd,
        embed_fwd=embed_fwd,
        embed_bwd=embed_bwd,
        head_saved=head["head_saved_bytes"],
        logits=head["logits_fp32_bytes"],
        embed_params=head["embed_params"],
        head_params=head["head_params"],
    )


def tempo_attention_workspace(setting: Setting) -> float:
    """Bytes Tempo's fused attention core's backward holds besides its inputs' and outputs'
    gradients on one TP rank of the plan's device: the GPU kernels' buffers, or on the CPU the
    chunk of heads its PyTorch path works on (stated by tempo.sizes); none in other layers."""
    model = setting.model
    if not model.tempo or model.flash:
        return 0.0
    probs_shape = (setting.micro_batch, model.heads // setting.tp, model.seq, model.seq)
    # scores, P and V all in the training's half precision, as tempo.megatron runs them; its V,
    # megatron-core's (S, B, H, D) permuted, flattens into one batch: no copy of it to price
    dropout = model.dropout > 0
    return float(
        attention_core_workspace_bytes(probs_shape, HALF, dropout, _tempo_target(setting), forward=False)
    )


def tempo_swiglu_workspace(setting: Setting) -> float:
    """Bytes Tempo's SwiGLU fused with the down projection holds in backward besides its inputs'
    and outputs' gradients on one TP rank of the plan's device (stated by tempo.sizes); none in
    other layers."""
    model = setting.model
    if not (model.tempo and model.gated_mlp):
        return 0.0
    ffn_bytes = setting.micro_batch * model.seq * (model.ffn_hidden // setting.tp) * HALF
    return float(swiglu_down_workspace_bytes(ffn_bytes, _tempo_target(setting), forward=False))


def _tempo_target(setting: Setting) -> str:
    """Which of Tempo's paths a plan's layers run: the PyTorch one on a CPU, the kernels on a GPU."""
    return "cpu" if setting.cluster.gpu.name == CPU_PRESET else "cuda"


def _tp_collectives_s(setting: Setting, traced: dict) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's TP collectives; ``traced``: the layer's symbolic
    costs at the setting's sizes. Where the engine's TP layer was measured (its two all-reduces
    each way, with the waits between the ranks' compute) that prices them, forward (which
    recomputation repeats) and backward."""
    model, tp, cluster = setting.model, setting.tp, setting.cluster
    collective = setting.runtime.collective
    messages = 1 if model.parallel_block else 2  # the forward's all-reduces (backward mirrors them)
    message = float(traced["tp_all_reduce"]) / messages
    across_tp = tp > cluster.gpus_per_node
    measured = (
        None if setting.sequence_parallel else setting.runtime.tp_layer(message, tp, inter_node=across_tp)
    )
    if measured is not None:  # the benchmark's layer has two all-reduces a direction
        forward, both = (float(seconds) for seconds in measured)
        return messages * forward / 2, messages * (both - forward) / 2
    # forward collectives; backward mirrors them, plus SP's re-gather of the kept input shards
    forward = (
        collective("all_reduce", float(traced["tp_all_reduce"]) / 2, tp, cluster) * 2
        + collective("all_gather", float(traced["tp_all_gather"]) / 2, tp, cluster) * 2
        + collective("reduce_scatter", float(traced["tp_reduce_scatter"]) / 2, tp, cluster) * 2
    )
    backward = forward + collective("all_gather", float(traced["tp_all_gather"]) / 2, tp, cluster) * 2
    return forward, backward


def _edge_times(setting: Setting) -> tuple[float, float, float, float]:
    """(head forward, head backward, embedding forward, embedding backward) seconds a micro-batch
    takes, TP collectives included. Megatron's vocab-parallel embedding and head under TP: the
    embedding's output is summed over the ranks (reduce-scattered under SP); the head's input
    gradient likewise in backward (and its input gathered forward under SP); the cross-entropy
    sums three fp32 numbers per token (the logits' max, the target's logit, the sum of
    exponentials) over the ranks."""
    model, micro_batch, tp, cluster = setting.model, setting.micro_batch, setting.tp, setting.cluster
    collective = setting.runtime.collective
    head_fwd, head_bwd = setting.runtime.head_times(model, micro_batch, model.seq, tp)
    embed_fwd, embed_bwd = setting.runtime.embedding_times(model, micro_batch, model.seq, tp)
    stream = 2.0 * micro_batch * model.seq * model.hidden
    if setting.sequence_parallel:
        embed_fwd += float(collective("reduce_scatter", stream, tp, cluster))
        head_fwd += float(collective("all_gather", stream, tp, cluster))
        head_bwd += float(collective("reduce_scatter", stream, tp, cluster))
    else:
        embed_fwd += float(collective("all_reduce", stream, tp, cluster))
        head_bwd += float(collective("all_reduce", stream, tp, cluster))
    head_fwd += 3 * float(collective("all_reduce", 4.0 * micro_batch * model.seq, tp, cluster))
    return head_fwd, head_bwd, embed_fwd, embed_bwd


@functools.lru_cache(maxsize=512)
def strategy_grid(layers: int, space: SearchSpace) -> dict[str, np.ndarray]:
    """Every (recompute, selective, zero, offload ratios, weights gathered in forward) combination
    for a stage of ``layers`` layers (read-only); the weights are gathered in forward only where a
    stage may (ZeRO-1/2, kept on the device), each combination once."""
    offloads = [space.grid_steps(name) for name in OFFLOAD_FIELDS]
    recompute = range(layers + 1) if space.recompute else (0,)
    selective = (0, 1) if space.selective else (0,)
    combos = np.array(
        list(itertools.product(recompute, selective, space.zero_stages, *offloads, space.gather_in_forward)),
        float,
    )
    combos[:, -1] *= gather_allowed(combos[:, 2], combos[:, 3])  # zero, offload_weights
    _, first = np.unique(combos, axis=0, return_index=True)
    combos = combos[np.sort(first)]  # in the product's order
    return {name: combos[:, i] for i, name in enumerate(STRATEGY_FIELDS)}


# The embedding's and head's own strategy (``Plan.pre_post``): StagePlan fields it has
EDGE_FIELDS = ("zero", "offload_weights", "offload_grads", "offload_optimizer")


@dataclass(frozen=True)
class GridStates:
    """A strategy grid's distinct EDGE_FIELDS combinations (``columns``: ZeRO and what is offloaded
    of weights, gradients and optimizer state: all its rows' state bytes depend on) and, per row of
    the grid, the index of its combination (``of_row``). A few hundred combinations stand for
    grids of thousands of rows."""

    columns: dict[str, np.ndarray]
    of_row: np.ndarray


@functools.lru_cache(maxsize=512)
def optimizer_groups(layers: int, space: SearchSpace) -> np.ndarray:
    """Per row of ``strategy_grid(layers, space)``, the index of its strategy less the offloaded
    optimizer fraction: rows with the same index differ only in that fraction (read-only)."""
    grid = strategy_grid(layers, space)
    others = np.stack([grid[name] for name in STRATEGY_FIELDS if name != "offload_optimizer"], axis=1)
    _, group = np.unique(others, axis=0, return_inverse=True)
    group = group.reshape(-1)
    group.flags.writeable = False
    return group


@functools.lru_cache(maxsize=512)
def grid_states(layers: int, space: SearchSpace) -> GridStates:
    """``strategy_grid(layers, space)``'s GridStates (read-only)."""
    grid = strategy_grid(layers, space)
    combos, of_row = np.unique(
        np.stack([grid[name] for name in EDGE_FIELDS], axis=1), axis=0, return_inverse=True
    )
    return GridStates({name: combos[:, i] for i, name in enumerate(EDGE_FIELDS)}, of_row.reshape(-1))


def _kept_per_layer(layer: LayerNumbers, grid: dict[str, np.ndarray]) -> np.ndarray:
    """Bytes a layer that is not recomputed keeps for backward: all it saves, or under selective
    recomputation all but its core attention's insides."""
    return np.where(grid["selective"] > 0, layer.selective_saved, layer.saved)


def offloaded_layers(grid: dict[str, np.ndarray], layers: int) -> np.ndarray:
    """How many of a stage's ``layers`` have their activations offloaded, at each grid point."""
    return activation_offloaded_layers(grid["offload_activations"], layers - grid["recompute"])


def _state_bytes(
    params: float, strategy: dict[str, np.ndarray], dp: int, accumulation: GradAccumulation
) -> dict[str, np.ndarray]:
    """Bytes per GPU of ``params`` parameters' weights, gradients (the engine's ``grad_bytes``
    each) and optimizer state (each on the GPU or, the offloaded fraction, on the host), under
    ``strategy``'s ZeRO stage over ``dp`` replicas (its EDGE_FIELDS: a stage's grid or the
    embedding/head's own strategy), and the device bytes the engine keeps beyond them at ZeRO-0
    and ZeRO-1 (``accumulation``'s replicated_extra_bytes, zero1_extra_bytes)."""
    zero, offload_weights, offload_grads, offload_optimizer = (strategy[name] for name in EDGE_FIELDS)
    grad_bytes = accumulation.grad_bytes
    weights = 2.0 * params * np.where(zero >= 3, 1.0 / dp, 1.0)
    grads = float(grad_bytes) * params * np.where(zero >= 2, 1.0 / dp, 1.0)
    opt_params = params * np.where(zero >= 1, 1.0 / dp, 1.0)
    optimizer = ADAM_BYTES_PER_PARAM * opt_params
    replicated_extra = accumulation.replicated_extra_bytes[1 if dp > 1 else 0]
    extra = np.where(zero == 0, replicated_extra, np.where(zero == 1, accumulation.zero1_extra_bytes, 0.0))
    return {
        "gpu": (1 - offload_weights) * weights
        + (1 - offload_grads) * grads
        + (1 - offload_optimizer) * optimizer
        + extra * params,
        # ZeRO-2/3's gradient shards on the device: made by backward's reduce-scatters, freed after
        # the step (no persistent buffer, unlike ZeRO-0/1's)
        "sharded_grads": np.where(zero >= 2, (1 - offload_grads) * grads, 0.0),
        "host": offload_weights * weights + offload_grads * grads + offload_optimizer * optimizer,
        "h2d": 2 * offload_weights * weights,  # offloaded weights come up for forward and backward
        "d2h": offload_grads * grads,  # offloaded gradients accumulate on the host
        # ZeRO-0/1's DP sum of the host gradients: up to the device and back, once a step (NCCL
        # reads device memory only; GradientOffload.all_reduce). ZeRO-2/3 reduce on the device first
        "host_sum_trip": np.where((zero < 2) & (dp > 1), offload_grads * grads, 0.0),
        # ZeRO-1/2's broadcast of the updated weights at rest on the host, through the device
        # (zero.broadcast_through): the other owners' shares come down (this rank's own go up
        # where it stepped them on the host: optimizer_step_s's ``broadcast``)
        "broadcast_down": np.where(broadcasts(zero, dp), offload_weights * weights * (dp - 1) / dp, 0.0),
        "opt_params": opt_params,
        # the step's fp32 copy of the gradients it steps on the GPU (none where they are fp32)
        "step_copy": (OPTIMIZER_STEP_BYTES_PER_PARAM if grad_bytes < 4 else 0.0)
        * (1 - offload_optimizer)
        * opt_params,
    }


def _zero_per_micro_batch(
    setting: Setting,
    layers: int,
    layer_w_full: float,
    edge_w: tuple[float, ...],
    zero,
    edge_zero,
    across: bool,
) -> tuple:
    """(compute, GPU-to-GPU channel) seconds a micro-batch adds for ZeRO: ZeRO-3 gathers weights
    for forward and backward, ZeRO-2/3 reduce-scatter gradients. Where the engine's ZeRO-2 or -3
    was measured whole on a layer (collectives, copies, waits) that prices each unit the engine
    shards alike, by its weight bytes: every layer, and the stage's modules of the embedding/head
    (the embedding, the head, untied: ``edge_w``, each one's bytes; an FSDP2 unit each at ZeRO-3,
    one more owner's bucket at ZeRO-2), the time it is exposed for, added
    to compute rather than overlapped again. The embedding and head of the CPU's 4-layer GPT-3
    at ZeRO-3 (a few hundred KB) cost 7.3-8.5 ms a micro-batch measured on the engine (2 gloo
    processes, against the same plan with them unsharded): the mechanism's fixed costs, hooks,
    copies and waits for the other rank. Their collectives priced them at 1.4 ms; the line,
    fitted at a layer and half of it, prices them at 9.9 ms. Without a measured line their
    collectives price them, at their bytes together (as Megatron-LM-like engines gather them)."""
    dp, cluster, runtime = setting.dp, setting.cluster, setting.runtime
    compute, g2g = 0.0, 0.0
    if dp == 1:
        return compute, g2g
    # (the units the measured line prices, by their bytes; collectives the channel prices, each's bytes)
    for units, count, full, its_zero in (
        ((layer_w_full,) * layers, layers, layer_w_full, zero),
        (edge_w, 1, sum(edge_w), edge_zero),
    ):
        if not units or not full:  # no such unit here (a middle stage has no embedding/head)
            continue
        gather = runtime.collective("all_gather", full, dp, cluster, across)
        # the gradients as the engine reduces them (GradAccumulation.reduce_bytes a parameter)
        reduced = full * setting.grad_accumulation.reduce_bytes / 2
        scatter = runtime.collective("reduce_scatter", reduced, dp, cluster, across)
        on_channel3 = its_zero >= 3  # ZeRO-3 priced on the GPU-to-GPU channel
        on_channel2 = its_zero == 2
        zero3 = _over_units(runtime.zero3_layer, units, dp, across)
        zero2 = _over_units(runtime.zero2_layer, units, dp, across)
        if zero3 is not None:
            compute = compute + np.where(on_channel3, zero3, 0.0)
            on_channel3 = False
        if zero2 is not None:
            compute = compute + np.where(on_channel2, zero2, 0.0)
            on_channel2 = False
        g2g = g2g + count * (
            np.where(on_channel3, 2 * gather + scatter, 0.0) + np.where(on_channel2, scatter, 0.0)
        )
    return compute, g2g


def _over_units(line: Callable, units: tuple[float, ...], dp: int, across: bool) -> float | None:
    """A measured ZeRO line's seconds summed over units of these weight bytes; None where the
    engine's mechanism was not measured (the line is None)."""
    each = {nbytes: line(nbytes, dp, across) for nbytes in set(units)}
    if any(seconds is None for seconds in each.values()):
        return None
    return sum(each[nbytes] for nbytes in units)


def _buffer_gradient_sum(setting: Setting, weight_bytes, across: bool, zero):
    """Seconds of the DP gradient sum after backward at ZeRO stage ``zero`` (0 or 1; an array
    broadcasts) of the gradients of parameters whose 16-bit weights take ``weight_bytes``, sent as
    the engine reduces them (GradAccumulation.reduce_bytes a parameter): where `mist profile` timed
    the engine's (mist.engine.run sums ZeRO-0's and ZeRO-1's gradients alike, ContiguousGrads'
    in-place all-reduce of its buffer) that one line prices both; else Megatron-LM's: DDP's
    all-reduce (ZeRO-0) and the distributed optimizer's reduce-scatter (ZeRO-1)."""
    nbytes = weight_bytes * setting.grad_accumulation.reduce_bytes / 2
    measured = setting.runtime.zero_grad_sum(nbytes, setting.dp, across)
    if measured is not None:
        return measured
    runtime, dp, cluster = setting.runtime, setting.dp, setting.cluster
    return np.where(
        np.asarray(zero) == 1,
        runtime.collective("reduce_scatter", nbytes, dp, cluster, across),
        runtime.collective("all_reduce", nbytes, dp, cluster, across),
    )


def _zero_weight_sync(setting: Setting, nbytes, across: bool):
    """Seconds of ZeRO-1/2's updated weights reaching every DP replica, ``nbytes`` in all: the
    engine's own where `mist profile` timed it (mist.engine.run: one broadcast per owner), else
    the all-gather of Megatron-LM's distributed optimizer."""
    measured = setting.runtime.zero_weight_sync(nbytes, setting.dp, across)
    if measured is not None:
        return measured
    return setting.runtime.collective("all_gather", nbytes, setting.dp, setting.cluster, across)


def _gradient_sync(setting: Setting, stage_w_full: float, edge_w_full: float, zero, edge_zero, across: bool):
    """(before, after) the gradient-clipping barrier: seconds of the step's gradient
    synchronisation over DP, ZeRO-0's and ZeRO-1's gradient sum (_buffer_gradient_sum) or
    nothing more (ZeRO-2/3, whose gradients were reduced in backward); then, after the step,
    the updated weights' sync (ZeRO-1/2: _zero_weight_sync)."""
    dp = setting.dp
    before = after = 0.0
    if dp > 1:
        for full, its_zero in ((stage_w_full, zero), (edge_w_full, edge_zero)):
            summed = _buffer_gradient_sum(setting, full, across, its_zero)
            synced = _zero_weight_sync(setting, full, across)
            before = before + np.where(its_zero >= 2, 0.0, summed)
            after = after + np.where((its_zero >= 1) & (its_zero <= 2), synced, 0.0)
    return before, after


def _hidden_reduction_s(setting: Setting, layer: LayerNumbers, layers: int, recompute, zero, across: bool):
    """Seconds of a stage's DP gradient reduction that the last micro-batch's backward hides when it
    runs bucket by bucket (Megatron-LM's --overlap-grad-reduce; Plan.overlap_grad_reduce), taken
    off what ``_gradient_sync`` prices for the layers (one collective after backward). The layers'
    gradients fill buckets of at least the bucket size in backward order; each bucket's collective
    starts when backward has made it, one after another on the network, beside the backward of the
    layers still to come (priced by the interference model); the last bucket's (the stage's first
    layers) and the embedding/head's come after backward, as before. ZeRO-2/3 reduce as they make
    their gradients already; one bucket hides nothing. Gradients accumulated on the host are
    priced as the device's (as ``_gradient_sync`` prices them)."""
    dp = setting.dp
    if not setting.overlap_grad_reduce or dp == 1 or layers < 2:
        return 0.0
    # layers a bucket
    per_bucket = max(1, math.ceil(grad_bucket(setting.grad_bucket_params, dp) / layer.params))
    buckets = math.ceil(layers / per_bucket)
    if buckets < 2:
        return 0.0
    # It depends on the ZeRO stage and the recompute count only: priced once per pair there is
    # (the grid holds every strategy; priced per strategy it took 13% of a search)
    zero_grid, recompute_grid = np.broadcast_arrays(np.asarray(zero, float), np.asarray(recompute, float))
    pairs = (zero_grid * (layers + 1) + recompute_grid).ravel()
    _, first, inverse = np.unique(pairs, return_index=True, return_inverse=True)
    zero, recompute = zero_grid.ravel()[first], recompute_grid.ravel()[first]
    stage_bytes = 2.0 * layer.params * layers
    whole = _buffer_gradient_sum(setting, stage_bytes, across, zero)
    each = _buffer_gradient_sum(setting, stage_bytes / buckets, across, zero)
    # the backward left once the first bucket is made: its other layers' (recomputation included)
    backward = layers * layer.bwd + recompute * layer.fwd
    window = backward * (layers - per_bucket) / layers
    hidden_comm = (buckets - 1) * each
    exposed = np.maximum(setting.interference.overlap(window, hidden_comm, 0.0, 0.0) - window, 0.0) + each
    hidden = np.where(zero >= 2, 0.0, whole - exposed)
    return hidden[inverse.ravel()].reshape(zero_grid.shape)


def _gather_in_forward_s(
    setting: Setting, layer: LayerNumbers, layers: int, gather, zero, offload_weights, across: bool
) -> tuple:
    """(moved, wait): seconds of a stage's ZeRO-1/2 weight all-gather that leave the step, and
    seconds its next first forward then waits, when the gather runs bucket by bucket in that
    forward (Megatron-LM's --overlap-param-gather; StagePlan.gather_in_forward). ``moved`` is what
    ``_gradient_sync`` prices for the layers (one all-gather after the step); the embedding/head's
    stays there. The buckets are the gradient reduction's; the first layer's forward pre-hook
    begins its bucket's gather and waits for it (exposed), and begins the next one's, which runs
    beside the forward of the bucket before it (priced by the interference model): every bucket's
    gather but the first is hidden behind the forward of the buckets before the last, as far as
    that forward lasts. The wait is on the pipeline's fill path (a stage's first forward starts
    when its input arrives; pipeline_sim), where the step's gather ran beside the other stages'.
    Weights offloaded to the host are gathered after the step, as before (nothing moves)."""
    dp = setting.dp
    if dp == 1:
        return 0.0, 0.0
    per_bucket = min(layers, max(1, math.ceil(grad_bucket(setting.grad_bucket_params, dp) / layer.params)))
    buckets = math.ceil(layers / per_bucket)
    stage_bytes = 2.0 * layer.params * layers
    whole = _zero_weight_sync(setting, stage_bytes, across)
    each = _zero_weight_sync(setting, stage_bytes / buckets, across)
    window = layer.fwd * (buckets - 1) * per_bucket  # the forward of every bucket but the last
    rest = (buckets - 1) * each
    wait = each + max(setting.interference.overlap(window, rest, 0.0, 0.0) - window, 0.0)
    moves = (np.asarray(gather) > 0) & gather_allowed(zero, np.asarray(offload_weights))
    return np.where(moves, whole, 0.0), np.where(moves, wait, 0.0)


def _p2p_s(setting: Setting, layer: LayerNumbers, first: bool, last: bool) -> tuple[float, float]:
    """(on the compute path, beside it) seconds a micro-batch's point-to-point messages take: the
    activation forward and its gradient backward per neighbouring stage, on the critical path of
    1F1B (a stage waits for what it receives). Interleaved, per chunk (a micro-batch enters and
    leaves every chunk of a rank but the model's first and last), and overlapped with the chunks'
    compute as Megatron-LM's interleaved schedule does by default (its
    --overlap-p2p-communication: sends and receives posted ahead, waited for later)."""
    neighbours = 2 * setting.virtual_stages - (1 if first else 0) - (1 if last else 0)
    seconds = 2 * neighbours * layer.p2p
    return (0.0, seconds) if setting.virtual_stages > 1 else (seconds, 0.0)


def _accumulation_s(
    setting: Setting, layer_params: float, edge_params: float, zero, edge_zero, grad_accum: int
):
    """Seconds a micro-batch spends adding its weight gradients into the accumulated ones, an
    elementwise add priced by RuntimeModel.accumulate_line: into the gradient buffer, and under
    ZeRO-2/3 (over more than one replica) into this rank's summed shard, which the first
    micro-batch writes rather than adds to (GradAccumulation.adds_per_micro_batch)."""
    dp = setting.dp
    accumulation = setting.grad_accumulation
    add_line = setting.runtime.at_tp(setting.tp).accumulate_line  # a CPU fit's own for this TP size
    in_buffer, in_shards = 0.0, 0.0
    for params, its_zero in ((layer_params, zero), (edge_params, edge_zero)):
        sharded = (np.asarray(its_zero) >= 2) & (dp > 1)
        in_buffer = in_buffer + np.where(sharded, 0.0, params)
        in_shards = in_shards + np.where(sharded, params / dp, 0.0)
    seconds = 0.0
    for params, sharded in ((in_buffer, False), (in_shards, True)):
        added = accumulation.bytes_per_param * params
        adds = accumulation.adds_per_micro_batch(grad_accum, sharded)
        seconds = seconds + adds * np.where(added > 0, add_line(added), 0.0)
    return seconds


def _sync_and_step(
    setting: Setting,
    stage_w_full: float,
    edge_w_full: float,
    zero,
    edge_zero,
    across: bool,
    parts: tuple,
) -> tuple:
    """(sync, step) seconds of the last micro-batch: the gradient sync and clipping's local norm
    (before the global barrier), then the optimizer step (after it). ``parts``: (state bytes,
    offloaded fractions: EDGE_FIELDS) of the stage's layers and of its embedding/head."""
    cluster = setting.cluster
    sync, step = _gradient_sync(setting, stage_w_full, edge_w_full, zero, edge_zero, across)
    d2h_bw, h2d_bw = _host_rates(setting)
    for state, strategy in parts:
        params = state["opt_params"]
        # the norm reads the gradients this rank steps (offloaded ones priced as if on the GPU: a
        # few percent of the step either way)
        sync = sync + params * setting.grad_accumulation.grad_bytes / memory_bound_rate(cluster.gpu)
        sync = sync + state["host_sum_trip"] * (1 / h2d_bw + 1 / d2h_bw)
        step = step + params * optimizer_step_s(
            setting,
            strategy["offload_optimizer"],
            strategy["offload_weights"],
            strategy["offload_grads"],
            broadcasts(strategy["zero"], setting.dp),
        )
        step = step + state["broadcast_down"] / d2h_bw
    return sync, step


def broadcasts(zero, dp: int) -> np.ndarray:
    """Where each replica steps a share of the weights and broadcasts it after the step: ZeRO-1/2
    over more than one replica (ShardedMasterAdamW)."""
    return np.isin(zero, (1, 2)) & (dp > 1)


def optimizer_step_s(
    setting: Setting, offload_optimizer, offload_weights=0.0, offload_grads=0.0, broadcast=False
):
    """Seconds the optimizer step takes a parameter this rank steps, with those fractions of the
    optimizer stepped on the host, of the weights resting there and of the gradients summed there
    (mist.engine.run's placement: the weights at rest on the host first, then the largest, so
    two fractions share the smaller of the two). Mixed-precision Adam reads and writes its
    state, weights and gradients at 70% of the GPU's memory bandwidth, or the host's Adam steps;
    then each fp16 tensor that is not where its step is crosses the host link once: a
    host-stepped gradient made on the device goes down and its weight, where the weight lives on
    the device, comes up; a device-stepped gradient summed on the host comes up and its weight,
    where it rests on the host, goes down (OffloadedMasterAdamW, MasterWeightAdamW; as fp16 both
    ways: measure.training.to_across). Blocking: the step waits for them. With ``broadcast``
    (where ``broadcasts``), a weight at rest on the host and stepped there goes up once more, into
    the message of the broadcast of the updated weights (zero.broadcast_through; one stepped on
    the device is cast into it from its master there). Piecewise linear in the optimizer's
    fraction (``_fastest_optimizer_fraction`` orders by it)."""
    cluster = setting.cluster
    d2h_bw, h2d_bw = _host_rates(setting)
    on_device = (ADAM_BYTES_PER_PARAM + 4) * 2 / memory_bound_rate(cluster.gpu)
    on_host = 1 / cpu_adam_params_per_s(cluster)
    host_stepped, resting, summed = offload_optimizer, offload_weights, offload_grads
    both_weights = np.minimum(host_stepped, resting)
    both_grads = np.minimum(host_stepped, summed)
    down = (host_stepped - both_grads) + (resting - both_weights)
    up = (host_stepped - both_weights) + (summed - both_grads)
    up = up + np.where(broadcast, both_weights, 0.0)
    adam = (1 - host_stepped) * on_device + host_stepped * on_host
    return adam + 2 * down / d2h_bw + 2 * up / h2d_bw


def clip_barrier_s(setting: Setting) -> float:
    """Seconds of gradient clipping's global step: the all-reduce of one fp32 (the sum of squared
    gradients) over every GPU of the plan, each stage's sync done (Megatron-LM reduces it over the
    model-parallel and the data-parallel groups; one all-reduce over all prices both)."""
    cluster = setting.cluster
    return float(
        setting.runtime.collective(
            "all_reduce", 4.0, cluster.gpus, cluster, cluster.gpus > cluster.gpus_per_node
        )
    )


def _sharded_grads_end_bytes(accumulation: GradAccumulation, zero, weights, own: float):
    """Bytes a module whose 16-bit weights take ``weights`` ends its backward holding where its
    gradients are sharded (0.0 below): FSDP2's (from ZeRO ``accumulation.fsdp2_from_zero``), its
    gradients as autograd makes them and their reduce-scatter input, ``reduce_bytes`` a
    parameter; mist.engine.run's ZeRO-3, ``own`` times ``weights`` (a layer: its gradients and
    the input, 2; the embedding or the head: the input alone, 1; as its tests measured)."""
    zero = np.asarray(zero)
    if accumulation.fsdp2_from_zero is None:
        return np.where(zero >= 3, own * weights, 0.0)
    return np.where(zero >= accumulation.fsdp2_from_zero, (1 + accumulation.reduce_bytes / 2) * weights, 0.0)


def _layer_backward_peak(layer: LayerNumbers, grid: dict, layers: int, layer_end, recomputed: bool = False):
    """Bytes one layer's backward adds above what is held: above what it keeps, its peak op's
    (``LayerNumbers.backward_excess``) and the residual stream's gradient the layer's backward
    carries; a ``recomputed`` layer's activations made again as well.

    What ZeRO-3 (FSDP2) adds, ``layer_end`` (_sharded_grads_end_bytes): a module's gradients as
    backward makes them (whole: there is no persistent buffer to add them into), then its
    reduce-scatter input, which FSDP2 keeps until the next module reduces (one in flight). A
    layer's gradients are made op by op as its activations are freed: at its peak op only that
    op's weight gradient exists (in the op's working set, as in every layer), at its end all of
    them and the reduce-scatter's input, with the layer's activations gone (profiler traces of
    the engine, 2026-12-02). The end is priced as the peak op's bytes with those added and what
    the layer keeps taken off (``freed``: the kept activations, a recomputed layer's input where
    every layer is); that sum, not a tighter count of what the end holds, is what the engine's
    ZeRO-3 tests measured within -8% to +3% (docs/mist.md)."""
    working = _peak_op_bytes(layer, grid, layers, recomputed)
    freed = np.where(grid["recompute"] < layers, _kept_per_layer(layer, grid), layer.layer_input)
    at_end = working + layer_end - freed
    return np.where(layer_end > 0, np.maximum(working, at_end), working)


def _peak_op_bytes(layer: LayerNumbers, grid: dict, layers: int, recomputed: bool):
    """Bytes a layer's backward holds at its peak op above what the layer keeps: the op's excess
    (a kept layer's, ``_kept_excess``; a ``recomputed`` layer's activations made again and the
    plain excess) and the residual stream's gradient the layer's backward carries."""
    if recomputed:
        return layer.saved + layer.backward_excess + layer.layer_input
    return _kept_excess(layer, grid, layers) + layer.layer_input


def _kept_excess(layer: LayerNumbers, grid: dict, layers: int):
    """Bytes a layer that is not recomputed holds in its backward above what it keeps: its peak
    op's, under selective recomputation with the core attention's insides made again (where the
    stage has such a layer)."""
    selective = (grid["selective"] > 0) & (grid["recompute"] < layers)
    return np.where(selective, layer.selective_backward_excess, layer.backward_excess)


def _backward_start(
    layer: LayerNumbers,
    grid: dict,
    activations,
    per_flight,
    buffers,
    layers: int,
    layer_end,
    last_edge_grads,
    last: bool,
):
    """A stage's peak bytes above its static state from backward's start through its layers: the
    last layer's (after the head's), the offloaded layers' swap-in, the recomputed layers' forward
    made again. ``buffers``: gathered copies of ZeRO-3's and offloaded weights;
    ``last_edge_grads``: the head's whole gradients where the last stage shards it (ZeRO-3: made
    first in backward, held as its reduce-scatter's input; its gathered weights are in
    ``buffers``)."""
    recompute = grid["recompute"]
    kept = _kept_per_layer(layer, grid)
    # Offloaded layers (the first ones after the recomputed) come up when their backward begins,
    # the next one's prefetched: two layers' swap buffers (one where one is offloaded), held
    # once backward has freed this micro-batch's layers kept on the device (after them)
    swapped = offloaded_layers(grid, layers)
    swap_buffers = np.minimum(swapped, 2) * kept
    last_swapped = (swapped > 0) & (swapped == layers - recompute)
    # the logits' gradient: megatron's vocab-parallel cross-entropy makes it in place in the fp32
    # softmax it kept (in head_saved); what is new is its cast to the bf16 logits' dtype. The
    # head's backward consumes it before the first layer's begins
    head = layer.logits / 2 if last else 0.0
    # the last layer's backward, once the head's has run and freed what it kept for this
    # micro-batch (its fp32 logits and the final norm's tensors: in ``activations``)
    head_freed = layer.head_saved if last else 0.0
    peak = _layer_backward_peak(layer, grid, layers, layer_end)
    kept_layer_peak = np.where(last_swapped, 0.0, peak - head_freed)
    start = activations + buffers + np.maximum(head, kept_layer_peak) + last_edge_grads
    # backward then reaches the offloaded layers, this micro-batch's kept ones (and its head's) freed
    remade_inputs = recompute * layer.layer_input
    others = activations - per_flight + remade_inputs  # the other micro-batches' and these inputs
    swapping = others + buffers + swap_buffers + peak
    start = np.where(swapped > 0, np.maximum(start, swapping), start)
    # The fully recomputed layers are the stage's first: backward reaches them once this
    # micro-batch's other layers have freed what they kept (the recomputed ones kept their inputs;
    # the offloaded ones' copies are gone), and makes one layer's activations again
    recomputing = others + buffers + _layer_backward_peak(layer, grid, layers, layer_end, recomputed=True)
    return np.where(recompute > 0, np.maximum(start, recomputing), start)


def _weight_buffers(grid: dict, edge: dict, layer_weights: float, edge_weights: float):
    """Device bytes of the gathered copies of weights that rest elsewhere (ZeRO-3's shards or the
    host): two layers' (the running one and the next, prefetched) and the embedding's or head's."""
    buffers = np.where((grid["zero"] >= 3) | (grid["offload_weights"] > 0), 2 * layer_weights, 0.0)
    return buffers + np.where((edge["zero"] >= 3) | (edge["offload_weights"] > 0), edge_weights, 0.0)


def _static_bytes(mine: dict, theirs: dict, grad_accum: int) -> tuple:
    """(static, sharded_grads): a stage's device bytes held throughout (its layers' and its
    embedding/head's state, _state_bytes) but ZeRO-2/3's gradient shards where one micro-batch a
    step makes them during backward, and those shards (0.0 with more micro-batches a step)."""
    sharded_grads = mine["sharded_grads"] + theirs["sharded_grads"] if grad_accum == 1 else 0.0
    return mine["gpu"] + theirs["gpu"] - sharded_grads, sharded_grads


def _device_memory(
    layer: LayerNumbers,
    grid: dict,
    edge: dict,
    activations,
    per_flight,
    layers: int,
    layer_w_full: float,
    first: bool,
    last: bool,
    mine: dict,
    theirs: dict,
    grad_accum: int,
    accumulation: GradAccumulation,
):
    """A stage's peak device bytes: its static state and the larger of two peaks, backward (its
    start, its recomputed layers, and with one micro-batch a step its end) and the optimizer
    step. ``activations``: every in-flight micro-batch's; ``per_flight``: one's; ``accumulation``:
    how the engine shards gradients (_sharded_grads_end_bytes)."""
    recompute, zero, offload_weights = grid["recompute"], grid["zero"], grid["offload_weights"]
    # a layer's full weights; the embedding's or the head's (one at a time: opposite ends)
    layer_weights, edge_weights = layer_w_full, _edge_weight_bytes(layer, first, last)
    layers_zero3 = zero >= 3
    buffers = _weight_buffers(grid, edge, layer_weights, edge_weights)
    layer_end = _sharded_grads_end_bytes(accumulation, zero, layer_weights, own=2.0)
    head_end = _sharded_grads_end_bytes(accumulation, edge["zero"], 2.0 * layer.head_params, own=1.0)
    last_edge_grads = head_end if last else 0.0
    start = _backward_start(
        layer, grid, activations, per_flight, buffers, layers, layer_end, last_edge_grads, last
    )
    # Two peaks: backward and the optimizer step, where mixed-precision Adam holds an fp32 copy of
    # the gradients it steps on the GPU. With one micro-batch a step, ZeRO-2/3's gradient shards
    # are made as backward frees the activations and live until the step: backward also peaks at
    # its end, the first layer's, with every other layer's shard made, one layer gathered (none
    # to prefetch after it), its gradients and the previous one's input (ZeRO-3), and the
    # embedding's gradients (ZeRO-3 of the edges)
    static, sharded_grads = _static_bytes(mine, theirs, grad_accum)
    made = sharded_grads - mine["sharded_grads"] / layers if grad_accum == 1 else 0.0
    gathered = buffers - np.where(layers_zero3 | (offload_weights > 0), layer_weights, 0.0)
    # the first layer's backward at its peak op, with what it kept (a recomputed one: made again)
    first_layer = np.where(
        recompute > 0,
        _peak_op_bytes(layer, grid, layers, recomputed=True),
        _kept_per_layer(layer, grid) + _peak_op_bytes(layer, grid, layers, recomputed=False),
    )
    at_end = gathered + first_layer + made + layer_end
    if first:  # the embedding's gradients, its backward's last
        at_end = at_end + _sharded_grads_end_bytes(accumulation, edge["zero"], edge_weights, own=1.0)
    backward = np.maximum(start, at_end) if grad_accum == 1 else start
    step_peak = mine["step_copy"] + theirs["step_copy"] + sharded_grads
    return static + np.maximum(backward, step_peak)


def _compute_s(
    setting: Setting,
    layer: LayerNumbers,
    layers: int,
    grid: dict,
    first: bool,
    last: bool,
    edge_params: float,
    edge_zero,
    grad_accum: int,
):
    """Seconds of a micro-batch's own compute on a stage: its layers' forward and backward, the
    recomputation (r layers' forward, and under selective the others' core attention), the
    embedding or head, and adding its weight gradients into the accumulated ones."""
    recompute, zero = grid["recompute"], grid["zero"]
    compute = (
        layers * (layer.fwd + layer.bwd)
        + recompute * layer.fwd
        + (layers - recompute) * grid["selective"] * layer.core_fwd
    )
    if last:
        compute = compute + layer.head_fwd + layer.head_bwd
    if first:
        compute = compute + layer.embed_fwd + layer.embed_bwd
    return compute + _accumulation_s(setting, layers * layer.params, edge_params, zero, edge_zero, grad_accum)


def _dp_leaves_node(setting: Setting) -> bool:
    """Whether a DP group (ranks at stride TP) spans more than one node."""
    return setting.tp * setting.dp > setting.cluster.gpus_per_node


def _host_rates(setting: Setting) -> tuple[float, float]:
    """(device-to-host, host-to-device) bytes per second of the offloading copies."""
    interference, host_bw = setting.interference, setting.cluster.gpu.host_bw
    return interference.host_rate("d2h", host_bw), interference.host_rate("h2d", host_bw)


def _micro_batch_s(
    setting: Setting,
    layer: LayerNumbers,
    layers: int,
    grid: dict,
    edge: dict,
    first: bool,
    last: bool,
    state: tuple[dict, dict],
    grad_accum: int,
) -> tuple:
    """(steady, compute, g2g) seconds of one micro-batch on a stage: its channels -- compute (its
    layers, recomputation, ZeRO's exposed collectives, point-to-point on the critical path), the
    GPU-to-GPU channel, and the host copies (activation swaps, offloaded weights and gradients) --
    and ``steady``, the channels overlapped. ``state``: the stage's layers' and its
    embedding/head's state bytes (_state_bytes)."""
    mine, theirs = state
    edge_params = _edge_params(layer, first, last)
    p2p_on_compute, p2p_beside = _p2p_s(setting, layer, first, last)
    compute = _compute_s(setting, layer, layers, grid, first, last, edge_params, edge["zero"], grad_accum)
    compute = compute + p2p_on_compute
    zero_compute, g2g = _zero_per_micro_batch(
        setting,
        layers,
        2.0 * layer.params,
        tuple(2.0 * params for params in _edge_modules(layer, first, last)),  # each one's weight bytes
        grid["zero"],
        edge["zero"],
        _dp_leaves_node(setting),
    )
    compute = compute + zero_compute
    g2g = g2g + p2p_beside
    act_swapped = offloaded_layers(grid, layers) * _kept_per_layer(layer, grid)
    d2h_bw, h2d_bw = _host_rates(setting)
    d2h = (act_swapped + mine["d2h"] + theirs["d2h"]) / d2h_bw  # swap-out, offloaded gradients
    h2d = (act_swapped + mine["h2d"] + theirs["h2d"]) / h2d_bw  # swap-in, offloaded weights
    return setting.interference.overlap(compute, g2g, h2d, d2h), compute, g2g


def _last_micro_batch_s(
    setting: Setting,
    layer: LayerNumbers,
    layers: int,
    grid: dict,
    edge: dict,
    edge_params: float,
    state: tuple[dict, dict],
) -> tuple:
    """(sync, step, wait): seconds the last micro-batch adds on a stage before clipping's global
    barrier (clip_barrier_s) and after it, and what the next iteration's first forward waits for
    its weights (on the fill path)."""
    zero, across = grid["zero"], _dp_leaves_node(setting)
    mine, theirs = state
    # (state bytes, strategy) of the stage's layers and of its embedding/head
    parts = ((mine, grid), (theirs, edge))
    sync, step = _sync_and_step(
        setting,
        layers * (2.0 * layer.params),
        2.0 * edge_params,
        zero,
        edge["zero"],
        across,
        parts,
    )
    sync = sync - _hidden_reduction_s(setting, layer, layers, grid["recompute"], zero, across)
    # a grid without the column gathers after the step
    moved, wait = _gather_in_forward_s(
        setting, layer, layers, grid.get("gather_in_forward", 0.0), zero, grid["offload_weights"], across
    )
    step = step - moved
    return sync, step, wait


def _stage_memory(
    layer: LayerNumbers,
    grid: dict,
    edge: dict,
    layers: int,
    in_flight: float,
    first: bool,
    last: bool,
    state: tuple[dict, dict],
    grad_accum: int,
    accumulation: GradAccumulation,
) -> tuple:
    """(memory, per_flight, host_per_flight): a stage's peak device bytes with ``in_flight``
    micro-batches held, what one more adds, and what one more adds in host memory (its offloaded
    activations: host bytes are affine in in_flight too). ``state``: the stage's layers' and its
    embedding/head's state bytes (_state_bytes); ``accumulation``: the engine's gradients."""
    mine, theirs = state
    per_flight, host_per_flight = _per_flight(layer, grid, layers, last)
    memory = _device_memory(
        layer,
        grid,
        edge,
        in_flight * per_flight,
        per_flight,
        layers,
        2.0 * layer.params,
        first,
        last,
        mine,
        theirs,
        grad_accum,
        accumulation,
    )
    return memory, per_flight, host_per_flight


def _per_flight(layer: LayerNumbers, grid: dict, layers: int, last: bool) -> tuple:
    """(device, host) bytes one more micro-batch in flight holds: what the stage's layers keep for
    backward on the device (a recomputed layer its input; the last stage the head's too) and what
    its offloaded layers keep on the host."""
    kept = _kept_per_layer(layer, grid)
    swapped = offloaded_layers(grid, layers)
    on_device = (layers - grid["recompute"] - swapped) * kept + grid["recompute"] * layer.layer_input
    return on_device + (layer.head_saved if last else 0.0), swapped * kept


def _edge_modules(layer: LayerNumbers, first: bool, last: bool) -> tuple[float, ...]:
    """Parameters of each embedding/head module a stage holds: the embedding (first stage; its
    position table too where learned), the untied LM head (last stage)."""
    return (layer.embed_params,) * first + (layer.head_params,) * last


def _edge_params(layer: LayerNumbers, first: bool, last: bool) -> float:
    """Parameters of the embedding (first stage) and the untied LM head (last stage) a stage holds."""
    return sum(_edge_modules(layer, first, last))


def _edge_weight_bytes(layer: LayerNumbers, first: bool, last: bool) -> float:
    """Half-precision bytes of the embedding's or the head's full weights, the larger where a stage
    holds both: it works on one at a time (they are used at opposite ends of its step)."""
    return 2.0 * max(_edge_modules(layer, first, last), default=0.0)


def _stage_state(
    setting: Setting, layer: LayerNumbers, layers: int, first: bool, last: bool, grid: dict, edge: dict
) -> tuple[float, tuple[dict, dict]]:
    """(the embedding/head's parameters on the stage, (state bytes of the stage's layers, of its
    embedding/head)): _state_bytes under the grid's and the edge's strategies."""
    edge_params = _edge_params(layer, first, last)
    accumulation = setting.grad_accumulation
    mine = _state_bytes(layers * layer.params, grid, setting.dp, accumulation)
    theirs = _state_bytes(edge_params, edge, setting.dp, accumulation)  # none on a middle stage
    return edge_params, (mine, theirs)


def _host_memory(state: tuple[dict, dict], host_per_flight, in_flight: float):
    """Host bytes of a stage: its layers' and embedding/head's offloaded state (_state_bytes) and
    ``in_flight`` micro-batches' offloaded activations."""
    mine, theirs = state
    return mine["host"] + theirs["host"] + in_flight * host_per_flight


def _memory_at_least(
    layer: LayerNumbers,
    first: bool,
    last: bool,
    states: GridStates,
    state: tuple[dict, dict],
    grad_accum: int,
    per_flight: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | None:
    """(device, host) bytes that each row of the grid of ``states`` holds at least with one
    micro-batch in flight (``per_flight``: its activations, _per_flight's; ``state``: the state
    bytes of the grid's distinct (ZeRO, offload) combinations, _state_bytes'), as rounded; None
    where a byte count it relies on is negative. On the device the static state plus the start
    of backward's first sum: the activations and the weight buffers, to which _backward_start
    adds the larger of the head's logits gradient and the last layer's backward (so at least the
    former, >= 0) and the head's whole ZeRO-3 gradients (>= 0); every other branch (swapping,
    recomputing, the end of backward, the optimizer step) enters through a maximum with that
    start. On the host the offloaded state. Rounded addition is monotone, so the bound holds as
    computed, not only as written."""
    if (
        min(layer.logits, layer.embed_params, layer.head_params) < 0
    ):  # the head's and embedding's terms: >= 0 as bytes
        return None
    mine, theirs = state
    static, _ = _static_bytes(mine, theirs, grad_accum)
    edge_weights = _edge_weight_bytes(layer, first, last)
    # a row's embedding/head shares its strategy here
    buffers = _weight_buffers(states.columns, states.columns, 2.0 * layer.params, edge_weights)
    of_row = states.of_row
    return static[of_row] + (per_flight + buffers[of_row]), (mine["host"] + theirs["host"])[of_row]


def fitting_rows(
    setting: Setting,
    layer: LayerNumbers,
    layers: int,
    first: bool,
    last: bool,
    space: SearchSpace,
    grad_accum: int,
    flights: tuple[float, ...],
    budget: float,
    host_budget: float,
) -> np.ndarray:
    """Indices of ``strategy_grid(layers, space)``'s strategies that a frontier of the stage at one
    of ``flights`` (micro-batches held) can keep: those that fit ``budget`` device bytes and
    ``host_budget`` host bytes there, by the rule ``inter_stage.frontier_for`` applies to
    evaluate_stage's arrays (memory at one in flight plus the others' activations), computed the
    same way: the memory alone, which is a third of a stage's evaluation. Held bytes only grow
    with the count, so a frontier keeps none of the rows that do not fit at the fewest, and the
    searches price the times of the rows kept only (in the largest cases a seventh of the grid
    fits).

    Of strategies that differ only in the offloaded optimizer fraction, only the fastest that fits
    at some flight is kept (``_fastest_optimizer_fraction``): the others are equal in every time
    but the step, and slower there, so no frontier keeps them. (An imbalance-blind search, the
    ablation's, ranks without the step: there all fractions that fit tie, and the frontier from
    the whole grid keeps the least, this the fastest by the step: the same where the host's step
    is the slower at every fraction, as with no weights or gradients on the host on every GPU
    preset; where they rest there, a larger fraction can be the faster (L4: with both wholly on
    the host, the whole optimizer), and the tie is broken toward it.)

    In two passes that keep the same rows as one: the rule applied to a lower bound of the memory
    (_memory_at_least) drops what cannot fit, and the exact memory is computed for the rest only
    (in the largest cases a third of the grid), with the state bytes of the grid's distinct
    (ZeRO, offload) combinations taken per row: the same arithmetic on the same numbers."""
    grid, states = strategy_grid(layers, space), grid_states(layers, space)
    per_flight, host_per_flight = _per_flight(layer, grid, layers, last)
    rows = np.arange(len(grid["recompute"]))
    if np.any(per_flight < 0) or np.any(host_per_flight < 0):  # never so: then held bytes could shrink
        return rows
    in_flight = min(flights)
    # each combination's state bytes (a row's embedding/head shares its strategy here)
    _, combos = _stage_state(setting, layer, layers, first, last, states.columns, states.columns)
    least = _memory_at_least(layer, first, last, states, combos, grad_accum, per_flight)
    if least is not None:
        device, host = least
        rows = np.flatnonzero(
            held_and_fits(device, per_flight, host, host_per_flight, in_flight, budget, host_budget)[1]
        )
    strategies = {name: column[rows] for name, column in grid.items()}
    of_row = states.of_row[rows]
    state = tuple({key: bytes_[of_row] for key, bytes_ in part.items()} for part in combos)
    edge = {name: strategies[name] for name in EDGE_FIELDS}
    memory, per_flight, host_per_flight = _stage_memory(
        layer, strategies, edge, layers, 1, first, last, state, grad_accum, setting.grad_accumulation
    )
    host_memory = _host_memory(state, host_per_flight, 1)
    _, fits = held_and_fits(memory, per_flight, host_memory, host_per_flight, in_flight, budget, host_budget)
    fits = np.broadcast_to(fits, rows.shape)
    held = (memory, per_flight, host_memory, host_per_flight)
    held = tuple(np.broadcast_to(column, rows.shape)[fits] for column in held)
    rows = rows[fits]
    if len(space.grid_steps("offload_optimizer")) < 2:
        return rows
    group = optimizer_groups(layers, space)[rows]
    placement = {name: grid[name][rows] for name in ("zero", *OFFLOAD_FIELDS)}
    fastest = _fastest_optimizer_fraction(setting, placement, group, held, flights, budget, host_budget)
    return rows[fastest]


def _fastest_optimizer_fraction(
    setting: Setting,
    placement: dict[str, np.ndarray],
    group: np.ndarray,
    held: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    flights: tuple[float, ...],
    budget: float,
    host_budget: float,
) -> np.ndarray:
    """Which strategies (rows: their ZeRO stages and offloaded fractions ``placement``, ``group``
    (rows that differ only in the optimizer's share one) and ``held``: memory, per_flight,
    host_memory and host_per_flight at one in flight) are, at one of ``flights``, the fastest
    that fits of their group. The optimizer's fraction changes nothing but the step
    (``optimizer_step_s``, a parameter's seconds; the stage's layers and its embedding/head share
    the row's strategy here, so the step is that times the parameters stepped). Ties keep the
    least fraction."""
    keep = np.zeros(len(group), bool)
    fraction = placement["offload_optimizer"]
    per_param = optimizer_step_s(
        setting,
        fraction,
        placement["offload_weights"],
        placement["offload_grads"],
        broadcasts(placement["zero"], setting.dp),
    )
    order = np.lexsort((fraction, per_param, group))  # by group, fastest first
    for flight in sorted(set(flights)):
        rows = order[held_and_fits(*(column[order] for column in held), flight, budget, host_budget)[1]]
        first_of_group = np.ones(len(rows), bool)
        first_of_group[1:] = group[rows][1:] != group[rows][:-1]
        keep[rows[first_of_group]] = True
    return keep


def evaluate_stage(
    setting: Setting,
    layer: LayerNumbers,
    layers: int,
    in_flight: float,
    first: bool,
    last: bool,
    grid: dict[str, np.ndarray],
    grad_accum: int,
    edge: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """steady, extra and memory (arrays over ``grid``) of a stage, plus their parts.

    ``edge``: the strategy (EDGE_FIELDS) of the embedding (first stage) and head (last stage)
    parameters; None: the stage's own. Arrays broadcast against ``grid``'s."""
    if grad_accum < 1:
        raise ValueError("grad_accum must be >= 1")
    edge = edge or {name: grid[name] for name in EDGE_FIELDS}
    shape = np.broadcast_shapes(*(np.shape(column) for column in (*grid.values(), *edge.values())))
    edge_params, (mine, theirs) = _stage_state(setting, layer, layers, first, last, grid, edge)
    steady, compute, g2g = _micro_batch_s(
        setting, layer, layers, grid, edge, first, last, (mine, theirs), grad_accum
    )
    sync, step, wait = _last_micro_batch_s(setting, layer, layers, grid, edge, edge_params, (mine, theirs))
    memory, per_flight, host_per_flight = _stage_memory(
        layer,
        grid,
        edge,
        layers,
        in_flight,
        first,
        last,
        (mine, theirs),
        grad_accum,
        setting.grad_accumulation,
    )
    return {
        "steady": np.broadcast_to(steady, shape),
        "extra": np.broadcast_to(sync + step, shape),
        # the part of extra before the clipping barrier, as computed (extra - step may differ in
        # the last bit, and two strategies with the same sync then neither dominate the other)
        "sync": np.broadcast_to(sync, shape),
        "step": np.broadcast_to(step, shape),  # the part of extra after the clipping barrier
        # before the first forward of the next iteration: what it waits for its weights (on the fill path)
        "wait": np.broadcast_to(wait, shape),
        "memory": np.broadcast_to(memory, shape),
        "compute": np.broadcast_to(compute, shape),
        "g2g": np.broadcast_to(g2g, shape),  # the GPU-to-GPU channel (collectives that can overlap)
        # what one more in-flight micro-batch adds to memory (memory is affine in in_flight)
        "per_flight": np.broadcast_to(per_flight, shape),
        "host_memory": np.broadcast_to(_host_memory((mine, theirs), host_per_flight, in_flight), shape),
        "host_per_flight": np.broadcast_to(host_per_flight, shape),
    }
