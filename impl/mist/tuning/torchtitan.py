"""Plans torchtitan can run, searched exhaustively and priced by Mist's cost model:
``mist plan --target torchtitan``; every plan it makes exports (``mist export --to torchtitan``).

torchtitan (0.2.2) shards data-parallel replicas with FSDP2 (ZeRO-3; ZeRO-2 when it keeps the
weights gathered from forward to the step) or replicates them with DDP (DP alone, no TP or PP);
with TP or PP it trains in bf16 only through FSDP, so those need DP > 1. In a pipeline FSDP2 is
ZeRO-1: torch's pipeline stages keep the gathered weights and the whole gradients (fp32) over the
step's micro-batches and reduce-scatter them once, after the last backward, not overlapped with
it (GRAD_ACCUMULATION["torchtitan"]);
its TP always shards the sequence; it pipelines any split of the layers with 1F1B (searched here:
even, or the first and last stage uneven); it checkpoints the activations of no layer or of every
layer; and FSDP's CPU offload keeps all of the weights, gradients and optimizer on the host. Its
DDP all-reduces every micro-batch's gradients (its train step never skips the sync), which a plan
prices once an iteration: DDP is searched without gradient accumulation only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..model.interference import Interference
from ..model.runtime import RuntimeModel
from ..model.specs import GRAD_ACCUMULATION, ClusterSpec, ModelSpec
from ..plan import Plan, StagePlan, tp_splits
from .exhaustive import fastest_fitting, layer_splits
from .problem import divisors, powers_of_two


@dataclass(frozen=True)
class TorchtitanSetting:
    tp: int
    dp: int
    micro_batch: int
    split: tuple[int, ...]  # layers per stage
    zero: int  # 0: DDP (or no DP); 1: FSDP2 in a pipeline; 2 or 3: FSDP2
    cpu_offload: bool  # FSDP's: all of the weights, gradients and optimizer on the host (ZeRO-3)


def check_model(model: ModelSpec) -> None:
    """Raises ValueError if torchtitan has no model of this kind (before any search)."""
    if model.norm != "rmsnorm" or not model.gated_mlp or model.positions != "rotary" or model.dropout:
        raise ValueError(
            f"{model.name}: torchtitan's models are Llama-style (RMSNorm, SwiGLU, rotary, no dropout)"
        )
    if not model.flash:
        raise ValueError("torchtitan's attention is PyTorch SDPA's fused kernel: plan with FlashAttention")
    if model.tempo:
        raise ValueError(f"{model.name}: torchtitan builds its own layers, not Tempo's; plan without --tempo")


def settings(model: ModelSpec, cluster: ClusterSpec, global_batch: int) -> Iterator[TorchtitanSetting]:
    n = cluster.gpus
    for tp in powers_of_two(cluster.gpus_per_node):
        if n % tp or not tp_splits(model, tp):
            continue
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            if pp > model.layers or global_batch % dp:
                continue
            if dp == 1 and (tp > 1 or pp > 1):  # torchtitan's mixed precision needs FSDP there
                continue
            zeros = [0] if dp == 1 else [1] if pp > 1 else [2, 3] if tp > 1 else [0, 2, 3]
            for split in layer_splits(model.layers, pp):
                for mb, zero in itertools.product(divisors(global_batch // dp), zeros):
                    if zero == 0 and dp > 1 and mb != global_batch // dp:
                        continue  # DDP all-reduces every micro-batch's gradients (see _torchtitan_limits)
                    for cpu_offload in (False, True) if zero == 3 else (False,):
                        yield TorchtitanSetting(tp, dp, mb, split, zero, cpu_offload)


def setting_plan(
    model: ModelSpec, cluster: ClusterSpec, global_batch: int, setting: TorchtitanSetting, recompute: bool
) -> Plan:
    offload = 1.0 if setting.cpu_offload else 0.0
    # FSDP2 without resharding (ZeRO-2) gathers the weights ahead of the next forward's modules
    stages = [
        StagePlan(
            layers=n,
            recompute=n if recompute else 0,
            zero=setting.zero,
            offload_weights=offload,
            offload_grads=offload,
            offload_optimizer=offload,
            gather_in_forward=setting.zero == 2,
        )
        for n in setting.split
    ]
    # torch's DDP overlaps its gradient all-reduce with backward and FSDP2 reduce-scatters by
    # layer, but a pipeline's FSDP2 reduce-scatters after the last micro-batch's backward
    return Plan.of(
        model,
        cluster,
        global_batch=global_batch,
        tp=setting.tp,
        dp=setting.dp,
        micro_batch=setting.micro_batch,
        stages=stages,
        overlap_grad_reduce=setting.zero != 1,
    )


def search_torchtitan(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    runtime: RuntimeModel | None = None,
    interference: Interference | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The fastest plan torchtitan can run that fits (NoFeasiblePlan if none does), priced for its
    fp32 gradient reductions (GRAD_ACCUMULATION["torchtitan"])."""
    check_model(model)
    return fastest_fitting(
        global_batch,
        sorted(settings(model, cluster, global_batch), key=lambda s: max(s.split) - min(s.split)),
        lambda setting, k: setting_plan(model, cluster, global_batch, setting, bool(k)),
        lambda setting: [0, 1],  # checkpointing no layer, or every layer
        model,
        cluster,
        runtime,
        interference,
        progress,
        what=f"no torchtitan configuration of {model.name} fits {cluster.gpus} x {cluster.gpu.name}",
        grad_accumulation=GRAD_ACCUMULATION["torchtitan"],
    )
