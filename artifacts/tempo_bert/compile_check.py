"""How far the max-batch estimate under torch.compile is from a compiled step's measured peak.

The maxbatch part estimates a compiled model's step as its eager step with the saved activations
counted at what the compiled model keeps (measure.memory's ``kept_scale``): the step's other
transients are taken as eager's. Inductor fuses pointwise ops (fewer transients) and recomputes
some in backward (more), so that is an assumption, checked here on this CPU: a small BERT
(bert-l4h256, fp32) trained one step eagerly and one step through real ``torch.compile``
(inductor's CPU code), each step's peak measured from the allocator's events (measure.cpu_peak),
against the estimator on the CPU target; the eager pair is the control (the estimator alone).
A CPU's inductor is not a GPU's: this checks the assumption where it can run, not the GPU rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from measure.cpu_peak import cpu_peak_bytes
from measure.memory import StepMemoryEstimator
from measure.saved import saved_bytes, storage_key
from measure.training import Precision, make_optimizer, optimizer_state_tensors, train_step
from tempo.models import build_model, make_batch
from tempo.ops import workspace_bytes

MODEL, SEQ, BATCH, PRECISION = "bert-l4h256", 256, 8, "fp32"


def _measured_step(
    configuration: str, compiled: bool, model_name: str, seq: int, batch_size: int
) -> tuple[int, int]:
    """(peak bytes of a real training step on this CPU: what was live before it plus the
    allocator's peak during it; bytes the model keeps for backward), after two warm-up steps
    (the compile happens in the first)."""
    p = Precision(PRECISION)
    model = build_model(model_name, "pretraining", configuration).to(p.model_dtype).train()
    optimizer = make_optimizer(model, p)
    run: Callable = torch.compile(model) if compiled else model

    def loss_of(_model, batch):
        return run(**batch).loss

    for _ in range(2):
        train_step(
            model, make_batch(model_name, "pretraining", batch_size, seq), optimizer, p, loss_of=loss_of
        )
    batch = make_batch(model_name, "pretraining", batch_size, seq)
    live = [*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer), *batch.values()]
    before = sum({storage_key(t): t.untyped_storage().nbytes() for t in live}.values())
    peak, _ = cpu_peak_bytes(lambda: train_step(model, batch, optimizer, p, loss_of=loss_of))
    return before + peak, saved_bytes(run, **batch).total_bytes


def _estimated_peak(
    configuration: str, model_name: str, seq: int, batch_size: int, kept_scale: float = 1.0
) -> int:
    return (
        StepMemoryEstimator(
            lambda: build_model(model_name, "pretraining", configuration),
            lambda b: make_batch(model_name, "pretraining", b, seq),
            PRECISION,
            granularity=1,  # a CPU's allocator does not round to 512 bytes
            target="cpu",
            op_workspace=workspace_bytes,
            kept_scale=kept_scale,
        )
        .peak(batch_size)
        .peak_bytes
    )


def compile_check_point(
    configuration: str, model_name: str = MODEL, seq: int = SEQ, batch_size: int = BATCH
) -> dict:
    """``configuration`` (hf-eager, tempo) run eagerly and compiled on this CPU, measured, and
    estimated: the eager step as such, the compiled one with kept_scale = the compiled model's
    kept bytes over the eager model's (both measured)."""
    shape = (model_name, seq, batch_size)
    eager_peak, eager_kept = _measured_step(configuration, False, *shape)
    compiled_peak, compiled_kept = _measured_step(configuration, True, *shape)
    scale = compiled_kept / eager_kept
    eager_estimate = _estimated_peak(configuration, *shape)
    compiled_estimate = _estimated_peak(configuration, *shape, kept_scale=scale)
    return {
        "eager": {"measured_bytes": eager_peak, "estimated_bytes": eager_estimate, "kept_bytes": eager_kept},
        "compiled": {
            "measured_bytes": compiled_peak,
            "estimated_bytes": compiled_estimate,
            "kept_bytes": compiled_kept,
        },
        "kept_scale": round(scale, 6),
        "eager_error": eager_estimate / eager_peak - 1,
        "compiled_error": compiled_estimate / compiled_peak - 1,
    }


def compile_check_key(configuration: str) -> dict:
    return {
        "model": MODEL,
        "seq": SEQ,
        "batch": BATCH,
        "precision": PRECISION,
        "configuration": configuration,
        "device": "cpu",
    }
