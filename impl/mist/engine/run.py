"""Train with megatron-core as a plan says:
``torchrun --nproc-per-node N -m mist.engine.run --plan plan.yaml``.

megatron-core provides the model (GPTModel: tensor-parallel layers, sequence parallelism,
pipeline stages); around its modules the engine runs the plan's parts it has no switch for:

* the 1F1B executor over the plan's micro-batches (pipeline.py);
* a different number of recomputed layers per stage (the first r layers of each stage
  checkpointed; here);
* gradients in one contiguous buffer per dtype, ZeRO-1/2/3 (zero.py); the all-reduce of
  sequence-parallel parameters' grads across the TP group (here);
* half-precision weights with fp32 master weights and torch's fused AdamW (measure.training):
  like Megatron's fused Adam it steps without temporaries, so the step holds only the fp32 grads;
* optimizer-state and activation offloading (offload.py).

Refused with a message naming the part: stages with their own TP/DP, uneven middle stages,
ZeRO-3 with TP > 1, and offloading of weights or gradients (not implemented here yet). ZeRO-1
shards fp32 master weights and Adam state over the DP replicas, ZeRO-2 the gradients too
(ShardedMasterAdamW), ZeRO-3 the weights too (torch's FSDP2 around megatron-core's layers). On a
CPU it runs with gloo and the CUDA stand-ins of cpu_shim; on GPUs with NCCL. Each rank reports
its losses, the times of its timed steps, and memory (exact tensor bytes held + the allocator
peak of a steady step: the median and the worst of a few, profiled before the timed ones); rank
0 gathers them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from measure.parallel import die_with_parent

from ..plan import Plan
from .megatron import megatron_limits, model_settings
from .offload import OffloadedMasterAdamW, offload_layer_activations
from .pipeline import Pipeline1F1B
from .zero import ContiguousGrads, ShardedMasterAdamW, flat_collective, layer_buckets, shard_parameters


def unsupported(plan: Plan) -> list[str]:
    """The plan's parts mist.engine.run cannot execute (empty: it can): what no Megatron model can be
    built as (megatron.megatron_limits), and what this engine does not do around it."""

    reasons = megatron_limits(plan, plan.model_spec())
    if any(s.zero >= 3 for s in plan.stages) and plan.dp > 1 and plan.tp > 1:
        reasons.append(
            "ZeRO-3 with TP > 1 (FSDP over megatron-core's tensor-parallel layers is not wired in)"
        )
    if any(s.zero == 2 for s in plan.stages) and plan.sequence_parallel and plan.tp > 1:
        reasons.append("ZeRO-2 with sequence parallelism (its TP gradient sums are not wired in)")
    if any(s.offload_optimizer and s.zero >= 1 for s in plan.stages) and plan.dp > 1:
        reasons.append("optimizer offloading together with ZeRO sharding")
    if plan.sequence_parallel and plan.tp > 1 and not _fused_norm_available():
        reasons.append(
            "sequence parallelism: megatron-core's torch LayerNorm refuses it (needs Transformer Engine or "
            "Apex); set `sequence_parallel: false` in the plan"
        )
    return reasons


def _fused_norm_available() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "apex"))


def _config(spec, plan: Plan, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = model_settings(plan, spec)
    for not_config in ("position_embedding_type", "max_sequence_length", "vocab_size"):  # GPTModel's
        settings.pop(not_config)
    activation = {"silu": nn.functional.silu, "gelu": nn.functional.gelu}[settings.pop("activation")]
    return TransformerConfig(
        **settings,
        activation_func=activation,
        use_cpu_initialization=not torch.cuda.is_available(),  # on a GPU: initialise there (fast)
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )


def _checkpoint_first_layers(model, count: int) -> None:
    """Recompute the first ``count`` local layers in backward (activation checkpointing)."""
    from torch.utils.checkpoint import checkpoint

    for layer in list(model.decoder.layers)[:count]:
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


MEMORY_STEPS = 5  # profiled steady steps before the timed ones: the median and the worst are reported


def _step_peak(step, device: torch.device) -> tuple[int, float]:
    """(peak bytes allocated above the level at the step's start, the step's loss)."""
    if device.type != "cuda":
        from measure.cpu_peak import cpu_peak_bytes

        return cpu_peak_bytes(step)
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start, loss


def _tensor_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, DTensor):  # ZeRO-3 (FSDP2) parameters and their optimizer state: this rank's shard
            t = t.to_local()
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def run(plan: Plan, steps: int = 5, seed: int = 0, lr: float = 1e-2) -> dict:
    """Train ``steps`` iterations of ``plan`` on this process group; the report of this rank."""
    from measure.training import MasterWeightAdamW

    from . import cpu_shim

    reasons = unsupported(plan)
    if reasons:
        raise ValueError("mist.engine.run cannot execute this plan yet: " + "; ".join(reasons))
    cpu_shim.install()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_world_size() != plan.gpus:
        raise ValueError(f"the plan is for {plan.gpus} processes, this run has {dist.get_world_size()}")
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    ps.initialize_model_parallel(
        tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=len(plan.stages)
    )
    model_parallel_cuda_manual_seed(seed)
    spec = plan.model_spec()
    settings = model_settings(plan, spec)
    dtype = torch.bfloat16
    model = GPTModel(
        config=_config(spec, plan, dtype),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=settings["normalization"]),
        vocab_size=settings["vocab_size"],
        max_sequence_length=settings["max_sequence_length"],
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type=settings["position_embedding_type"],
    ).train()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    model = model.to(device)
    stage = ps.get_pipeline_model_parallel_rank()
    mine = plan.stages[stage]
    _checkpoint_first_layers(model, mine.recompute)
    offloaded_layers = offload_layer_activations(model, mine.recompute, mine.offload_activations)
    model = Float16Module(model.config, model)  # megatron's half-precision wrapper: casts inputs and outputs
    zero = plan.stages[stage].zero
    if zero == 3 and plan.dp > 1:
        shard_parameters(model, ps.get_data_parallel_group(), device)
    if zero in (1, 2) and plan.dp > 1:
        optimizer = ShardedMasterAdamW(
            layer_buckets(model), ps.get_data_parallel_group(), lr, shard_grads=zero == 2
        )
    elif mine.offload_optimizer > 0:
        optimizer = OffloadedMasterAdamW(model.parameters(), mine.offload_optimizer, lr)
    else:
        optimizer = MasterWeightAdamW(model.parameters(), lr=lr, fused=True)
    # The same few sequences every step: a decreasing loss shows the whole pipeline learns.
    g = torch.Generator().manual_seed(seed + ps.get_data_parallel_rank())
    batches = [
        torch.randint(0, spec.vocab, (plan.micro_batch, spec.seq + 1), generator=g).to(device)
        for _ in range(plan.grad_accum)
    ]
    # ZeRO-2/3 reduce each gradient (to its owner, or scattered) as backward makes it: no full buffer
    grads = None if zero >= 2 and plan.dp > 1 else ContiguousGrads(model.parameters())
    pipeline = Pipeline1F1B(model, spec, plan, batches)
    dp_group, tp_group = ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()

    phases: list[dict[str, float]] = []  # per step: where the time went

    def step() -> float:
        t0 = _now(device)
        loss = pipeline.iteration()
        t1 = _now(device)
        if plan.tp > 1:  # sequence-parallel weights hold partial sums over the sequence shards
            sp = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False)]
            sp = [g for g in sp if g is not None]
            flat_collective(sp, lambda flat: dist.all_reduce(flat, group=tp_group, async_op=True))
        if grads is not None and plan.dp > 1:
            grads.all_reduce(dp_group, divide_by=plan.dp)
        t2 = _now(device)
        optimizer.step()
        if grads is None:  # ZeRO-2/3: the reduced gradient shards are dropped after the step
            optimizer.zero_grad()
        else:
            grads.zero()
        phases.append({"pipeline_s": t1 - t0, "grad_sync_s": t2 - t1, "optimizer_s": _now(device) - t2})
        return loss

    losses = [step()]  # step 0 creates the optimizer state: held bytes afterwards, not a step peak
    # Memory: the first steady steps, each under the allocator profiler. Their peaks vary (on a CPU
    # by up to ~10% of the total at this tiny scale: gloo's threads and FSDP2's asynchronous
    # gathers and reduce-scatters free buffers at varying times), so the typical step (the median)
    # is compared with the model and the worst is reported beside it. Then the timed, unprofiled
    # steps; the phases are theirs only.
    step_peaks = []
    for _ in range(MEMORY_STEPS):
        step_peak, loss = _step_peak(step, device)
        step_peaks.append(step_peak)
        losses.append(loss)
    del phases[:]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    held = _tensor_bytes(
        [*model.parameters(), *optimizer.state_tensors(), *(grads.buffers if grads is not None else [])]
    )
    report = {
        "rank": dist.get_rank(),
        "stage": stage,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "losses": losses if ps.is_pipeline_last_stage() else None,
        "step_s": times,
        "phases": phases,
        "held_bytes": held,
        "step_peaks_bytes": step_peaks,
        "memory_bytes": held + statistics.median_low(step_peaks),
        "worst_memory_bytes": held + max(step_peaks),
        # offloaded: optimizer tensors kept on the host (not in held_bytes), layers whose saved
        # activations wait on the host
        "host_optimizer_bytes": _tensor_bytes(optimizer.host_tensors())
        if hasattr(optimizer, "host_tensors")
        else 0,
        "activation_offloaded_layers": offloaded_layers,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    ps.destroy_model_parallel()
    return {"ranks": gathered}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torchrun ... -m mist.engine.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--plan", required=True)
    ap.add_argument(
        "--steps", type=int, default=5, help="timed steps (after one warm-up and the memory steps)"
    )
    ap.add_argument("--out", help="write rank 0's gathered report (JSON)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    die_with_parent(os.getppid())  # a rank never outlives its launcher (torchrun)
    try:
        plan = Plan.load(args.plan)
        report = run(plan, args.steps)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dist.get_rank() == 0:
        losses = next(r["losses"] for r in report["ranks"] if r["losses"] is not None)
        print("losses:", " ".join(f"{x:.4f}" for x in losses))
        for r in report["ranks"]:
            print(
                f"rank {r['rank']} (stage {r['stage']}, tp {r['tp_rank']}): "
                f"{r['memory_bytes'] / 2**20:.1f} MiB"
            )
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
