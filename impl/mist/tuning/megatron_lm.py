"""Plans Megatron-LM can run, searched exhaustively and priced by Mist's cost model.

Megatron-LM (at the pinned megatron-core's release) gives every stage one TP and DP; splits the
layers evenly or with the first and last stage uneven
(``--decoder-first/last-pipeline-num-layers``); interleaves the pipeline
(``--num-virtual-stages-per-pipeline-rank``: V model chunks a rank, the stages even, the
micro-batches a multiple of the stages); recomputes whole layers by block (the first k layers of
every stage, of every chunk when interleaved; k = all: every layer) or every layer's core attention
(selective: none of it kept where FlashAttention keeps none); shards the optimizer state with its
distributed optimizer (ZeRO-1) or not at all; and offloads one fraction of the optimizer (only its
distributed one); its users overlap the gradient reduction with backward
(``--overlap-grad-reduce``), which every plan here does, and with the distributed optimizer
gather the weights after the step or in the next forward (``--overlap-param-gather``).
``MegatronLMSpace`` says which of those choices a search tries. Every plan it makes exports
(``mist.export``): ``mist plan --target megatron-lm`` searches the widest space, the Megatron-LM
grid baseline (``baselines/megatron/grid.py``) the choices its users tune.

For each setting (TP, DP, micro-batch, split, ZeRO, offload fraction) the smallest block k that fits
is the fastest (recomputation only adds time); ``exhaustive.fastest_fitting`` finds it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..model.interference import Interference
from ..model.runtime import RuntimeModel
from ..model.specs import GRAD_ACCUMULATION, TARGET_ENGINES, ClusterSpec, GradAccumulation, ModelSpec
from ..plan import Plan, StagePlan, tp_splits
from .exhaustive import fastest_fitting, layer_splits
from .problem import divisors, powers_of_two


@dataclass(frozen=True)
class MegatronLMSpace:
    """Which of Megatron-LM's choices a search tries."""

    micro_batches: tuple[int, ...] | None = None  # None: every divisor of the sequences per replica
    uneven: int | None = None  # the first/last stage within this many layers of the rest (None: any)
    zero: tuple[int, ...] = (0, 1)  # 1: the distributed optimizer
    offload_fractions: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # of the optimizer's state
    pipeline_powers_of_two: bool = False  # stages: powers of two only, or every divisor
    recompute: bool = True  # block recomputation tried (else none)
    selective: bool = True  # selective recomputation tried (the core attention; not with FlashAttention)
    # virtual stages a rank tried besides 1 (None: every divisor > 1 of an even stage's layers)
    virtual_stages: tuple[int, ...] | None = None
    # with the distributed optimizer: the weights gathered after the step, in the next forward
    # (--overlap-param-gather), or both tried
    gather_in_forward: tuple[bool, ...] = (False, True)

    def __post_init__(self) -> None:
        if not self.gather_in_forward or not all(isinstance(g, bool) for g in self.gather_in_forward):
            raise ValueError(f"gather_in_forward: one or both of False, True; got {self.gather_in_forward!r}")
        if self.micro_batches is not None and not all(
            isinstance(b, int) and b > 0 for b in self.micro_batches
        ):
            raise ValueError(f"micro_batches must be whole numbers > 0, got {self.micro_batches}")
        if not set(self.zero) <= {0, 1}:
            raise ValueError(f"Megatron-LM's ZeRO is 0 or 1 (its distributed optimizer), got {self.zero}")
        if not all(0.0 <= f <= 1.0 for f in self.offload_fractions):
            raise ValueError(f"offload fractions must be in [0, 1], got {self.offload_fractions}")
        if self.virtual_stages is not None and not all(
            isinstance(v, int) and v >= 1 for v in self.virtual_stages
        ):
            raise ValueError(f"virtual_stages must be whole numbers >= 1, got {self.virtual_stages}")


@dataclass(frozen=True)
class MegatronLMSetting:
    """One point of the space, before recomputation is chosen."""

    tp: int
    dp: int
    micro_batch: int
    split: tuple[int, ...]  # layers per stage
    zero: int
    offload_optimizer: float
    selective: bool = False  # every layer's core attention recomputed (then no whole layer is)
    virtual: int = 1  # model chunks a rank (interleaved 1F1B)
    gather_in_forward: bool = False  # --overlap-param-gather (with the distributed optimizer)


def settings(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, space: MegatronLMSpace
) -> Iterator[MegatronLMSetting]:
    """Every setting of ``space``: TP a power of two within a node dividing the heads and the
    vocabulary (Megatron-LM pads the vocabulary to a multiple of TP), stages dividing the rest, DP
    what is left; the distributed optimizer only at DP > 1, optimizer offload
    only with it (at DP 1 it shards nothing, so ZeRO-0 there is the same plan)."""
    n = cluster.gpus
    for tp in powers_of_two(cluster.gpus_per_node):
        if n % tp or not tp_splits(model, tp) or model.vocab % tp:
            continue
        stage_counts = powers_of_two(n // tp) if space.pipeline_powers_of_two else range(1, n // tp + 1)
        for pp in stage_counts:
            if (n // tp) % pp or pp > model.layers:
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            micro_batches = space.micro_batches or divisors(per_replica)
            # FlashAttention keeps no scores: selective recomputation would only add time
            selective = (False, True) if space.selective and not model.flash else (False,)
            for split in layer_splits(model.layers, pp, space.uneven):
                for mb, zero, offload, sel in itertools.product(
                    micro_batches, space.zero, space.offload_fractions, selective
                ):
                    if per_replica % mb or (zero and dp == 1) or (offload and not zero and dp > 1):
                        continue
                    gathers = space.gather_in_forward if zero else (False,)
                    for v, gather in itertools.product(
                        _virtual_stages(split, per_replica // mb, space), gathers
                    ):
                        yield MegatronLMSetting(tp, dp, mb, split, zero, offload, sel, v, gather)


def _virtual_stages(split: tuple[int, ...], micro_batches: int, space: MegatronLMSpace) -> list[int]:
    """Model chunks a rank for a split: 1, and where the pipeline interleaves (Plan.check: 2 or more
    even stages, micro-batches a multiple of them) each of the space's that divides a stage."""
    stages, layers = len(split), split[0]
    if stages < 2 or len(set(split)) > 1 or micro_batches % stages:
        return [1]
    tried = space.virtual_stages if space.virtual_stages is not None else range(2, layers + 1)
    return [1, *(v for v in tried if v > 1 and layers % v == 0)]


def setting_plan(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, setting: MegatronLMSetting, recompute: int
) -> Plan:
    """``setting`` with block recomputation of the first ``recompute`` layers of every stage."""
    stages = [
        StagePlan(
            layers=n,
            recompute=min(recompute, n),
            selective=setting.selective,
            zero=setting.zero,
            offload_optimizer=setting.offload_optimizer,
            gather_in_forward=setting.gather_in_forward,
        )
        for n in setting.split
    ]
    return Plan.of(
        model,
        cluster,
        global_batch=global_batch,
        tp=setting.tp,
        dp=setting.dp,
        micro_batch=setting.micro_batch,
        stages=stages,
        virtual_stages=setting.virtual,
        overlap_grad_reduce=True,
    )


def space_plans(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, space: MegatronLMSpace
) -> Iterator[Plan]:
    """Every plan of ``space`` (unpriced): each setting with every block-recompute count."""
    for setting in settings(model, cluster, global_batch, space):
        for k in recompute_counts(setting, space):
            yield setting_plan(model, cluster, global_batch, setting, k)


def recompute_counts(setting: MegatronLMSetting, space: MegatronLMSpace) -> list[int]:
    """The block-recompute counts of a setting, a stage's layers: none under selective recomputation
    (Megatron-LM recomputes either whole layers or the core attention); interleaved, whole blocks of
    every chunk (multiples of the chunks)."""
    if not space.recompute or setting.selective:
        return [0]
    v = setting.virtual
    return list(range(0, max(setting.split) + 1, v))


def check_model(model: ModelSpec) -> None:
    """Raises ValueError if Megatron-LM has no model of this shape (before any search)."""
    if model.parallel_block:
        raise ValueError(
            f"{model.name}: Megatron-LM has no layer with attention and MLP in parallel on one norm "
            "(Falcon); plan it with --no-parallel-block, or without --target"
        )
    if model.tempo:
        raise ValueError(f"{model.name}: Megatron-LM builds its own layers, not Tempo's; drop --tempo")


def search_megatron_lm(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    space: MegatronLMSpace | None = None,
    runtime: RuntimeModel | None = None,
    interference: Interference | None = None,
    progress: Callable[[str], None] | None = None,
    grad_accumulation: GradAccumulation = GRAD_ACCUMULATION["megatron-core"],
) -> Plan:
    """The fastest plan of ``space`` that fits, priced by the closed form (as Mist's search ranks);
    raises NoFeasiblePlan if none fits. The model is not checked (``check_model``): the grid baseline
    prices Falcon's parallel block as if Megatron-LM had it, so that every system is priced on the
    same model, and ``mist.export`` refuses it. ``grad_accumulation``: Megatron-LM's gradients as
    the export runs them, 16-bit (megatron-core's, the default: ``--grad-reduce-in-bf16``) or its
    bf16 default's fp32 main grads (``GRAD_ACCUMULATION["megatron-lm"]``)."""
    if grad_accumulation.engine not in TARGET_ENGINES["megatron-lm"]:
        raise ValueError(
            f"Megatron-LM accumulates gradients as megatron-core (16-bit) or megatron-lm (fp32 main "
            f"grads), not as {grad_accumulation.engine}"
        )
    space = space or MegatronLMSpace()
    # where the distributed optimizer gathers the weights changes time, not memory: the other
    # choice is priced at the recomputation the first needs (fastest_fitting's variants)
    first, *others = space.gather_in_forward
    searched = [
        s for s in settings(model, cluster, global_batch, space) if not s.zero or s.gather_in_forward == first
    ]
    return fastest_fitting(
        global_batch,
        sorted(searched, key=lambda s: max(s.split) - min(s.split)),
        lambda setting, k: setting_plan(model, cluster, global_batch, setting, k),
        lambda setting: recompute_counts(setting, space),
        model,
        cluster,
        runtime,
        interference,
        progress,
        what=f"no Megatron-LM configuration of {model.name} fits {cluster.gpus} x {cluster.gpu.name}",
        variants=lambda s: [dataclasses.replace(s, gather_in_forward=g) for g in others] if s.zero else [],
        grad_accumulation=grad_accumulation,
    )
