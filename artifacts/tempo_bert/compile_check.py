"""How far the max-batch estimate under torch.compile is from a compiled step's measured peak.

The maxbatch part estimates a compiled model's step as its eager step with the saved activations
counted at what the compiled model keeps, in the layers and elsewhere (measure.memory's
``kept_scale``, from torch.compile's partition traced on fake tensors:
tempo.maxbatch.compile_kept_scale): the step's other transients are taken as eager's. Inductor
fuses pointwise ops (fewer transients) and recomputes some in backward (more), so that is an
assumption, checked here with the same estimate: a model trained one step eagerly and one step
through real ``torch.compile`` (inductor's code for the device), each step's peak measured (on
a CPU from the allocator's events, measure.cpu_peak; on a GPU by the CUDA allocator's peak
above what was allocated before), against the estimator on that device's target; the eager pair
is the control (the estimator alone). The compiled model's kept bytes, counted by the
saved-tensor hooks on the real step, are recorded beside the estimate's shares. The
experiment's check is on this CPU (CHECK: bert-l4h256, fp32); the GPU check runs the same at
BERT-base's size in bf16 (tests/test_gpu.py).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from measure.cpu_peak import cpu_peak_bytes
from measure.memory import ALLOC_GRANULARITY, KeptScale, StepMemoryEstimator
from measure.saved import saved_bytes, storage_key
from measure.training import Precision, make_optimizer, optimizer_state_tensors, train_step
from tempo.maxbatch import compile_kept_scale, kept_scale_json
from tempo.models import build_model, make_batch
from tempo.ops import workspace_bytes


@dataclass(frozen=True)
class CheckCase:
    """One model trained with a given batch: where and in what precision."""

    model: str = "bert-l4h256"
    seq: int = 256
    batch: int = 8
    precision: str = "fp32"
    device: str = "cpu"  # or "cuda"

    def make_batch(self, batch: int | None = None, device: str = "cpu") -> dict[str, torch.Tensor]:
        return make_batch(self.model, "pretraining", batch or self.batch, self.seq, device=device)


CHECK = CheckCase()


def _measured_step(configuration: str, compiled: bool, case: CheckCase) -> tuple[int, int]:
    """(peak bytes of a real training step: what was live before it plus the allocator's peak
    during it; bytes the model keeps for backward), after two warm-up steps (the compile
    happens in the first)."""
    p = Precision(case.precision)
    if case.device == "cuda":  # the peak above what earlier work left allocated
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    model = build_model(case.model, "pretraining", configuration).to(case.device, p.model_dtype).train()
    optimizer = make_optimizer(model, p)
    run: Callable = torch.compile(model) if compiled else model

    def loss_of(_model, batch):
        return run(**batch).loss

    for _ in range(2):
        train_step(model, case.make_batch(device=case.device), optimizer, p, loss_of=loss_of)
    batch = case.make_batch(device=case.device)
    if case.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        train_step(model, batch, optimizer, p, loss_of=loss_of)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        live = [*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer), *batch.values()]
        before = sum({storage_key(t): t.untyped_storage().nbytes() for t in live}.values())
        step_peak, _ = cpu_peak_bytes(lambda: train_step(model, batch, optimizer, p, loss_of=loss_of))
        peak = before + step_peak
    return peak, saved_bytes(run, **batch).activation_bytes


def _estimated_peak(configuration: str, case: CheckCase, kept_scale: KeptScale | None = None) -> int:
    cuda = case.device == "cuda"
    return (
        StepMemoryEstimator(
            lambda: build_model(case.model, "pretraining", configuration),
            lambda b: case.make_batch(b),
            case.precision,
            granularity=ALLOC_GRANULARITY if cuda else 1,  # a CPU's allocator does not round up
            target="cuda" if cuda else "cpu",
            op_workspace=workspace_bytes,
            kept_scale=kept_scale,
        )
        .peak(case.batch)
        .peak_bytes
    )


def compile_check_point(configuration: str, case: CheckCase = CHECK) -> dict:
    """``configuration`` (hf-eager, tempo) run eagerly and compiled, measured, and estimated: the
    eager step as such, the compiled one as the maxbatch rows estimate it (compile_kept_scale on
    this device's target)."""
    eager_peak, eager_kept = _measured_step(configuration, False, case)
    compiled_peak, compiled_kept = _measured_step(configuration, True, case)
    scale = compile_kept_scale(case.model, configuration, case.seq, case.precision, target=case.device)
    eager_estimate = _estimated_peak(configuration, case)
    compiled_estimate = _estimated_peak(configuration, case, kept_scale=scale)
    return {
        "eager": {"measured_bytes": eager_peak, "estimated_bytes": eager_estimate, "kept_bytes": eager_kept},
        "compiled": {
            "measured_bytes": compiled_peak,
            "estimated_bytes": compiled_estimate,
            "kept_bytes": compiled_kept,
        },
        "kept_scale": kept_scale_json(scale),  # the estimate's shares (fake-tensor partition)
        "measured_kept_ratio": round(compiled_kept / eager_kept, 6),  # whole model, this step
        "eager_error": eager_estimate / eager_peak - 1,
        "compiled_error": compiled_estimate / compiled_peak - 1,
    }


def compile_check_key(configuration: str, case: CheckCase = CHECK) -> dict:
    return {
        "model": case.model,
        "seq": case.seq,
        "batch": case.batch,
        "precision": case.precision,
        "configuration": configuration,
        "device": case.device,
    }
