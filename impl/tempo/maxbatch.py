"""Largest training batch that fits a GPU, estimated without a GPU.

    python -m tempo.maxbatch --model bert-large --head qa --seq 384 --precision fp32 --gpu-mem 11GB [--tempo]

One whole training step (forward, backward, AdamW step; fp32 master weights for fp16/bf16) is
run on fake tensors and every storage is followed (measure/memory.py); the search extrapolates
depth from two shallow copies of the model, then the whole model is estimated at the answer and
its neighbours (``--no-verify``: not), which settles it where the extrapolation is not exact.
Usable memory = GPU memory - reserve, where the reserve covers what torch's allocator does not
see: the CUDA context and library workspaces (--context-gb, default 0.75) and fragmentation
(--fragmentation, default 5% of the rest).

``--compile``: the model under ``torch.compile`` (default activation memory budget). Its
partition is traced on fake tensors for the bytes it keeps (measure.compiled), and the eager
step is estimated with its saved activations counted at that share (measure.memory's
``kept_scale``), the rest as run eagerly: checked against compiled steps measured on a CPU
(artifacts/tempo_bert/compile_check.py), not yet on a GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from contextlib import nullcontext

from torch._subclasses.fake_tensor import FakeTensorMode

from measure.budget import GpuBudget
from measure.cli import OneLineParser, quiet_broken_pipe
from measure.compiled import compiled_loss
from measure.memory import (
    DepthExtrapolatedEstimator,
    KeptScale,
    StepMemoryEstimator,
    default_dtype,
    refine_max_batch,
)
from measure.parallel import interrupted_in_one_line
from measure.saved import SavedTensorsMeter, SavedTensorsReport, cuda_like, saved_bytes
from measure.training import PRECISIONS, Precision
from measure.units import GiB

from .models import CONFIGURATIONS, HEADS, build_model, check_configuration, layer_modules, make_batch, models
from .ops import workspace_bytes

# The search tries batches up to this; an answer equal to it means "at least this many".
SEARCH_CAP = 1 << 16


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text!r}")
    return int(text)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"takes a finite number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"takes a fraction in [0, 1), got {text!r}")
    return value


def _gpu_mem(text: str) -> str:
    """Checked here, where argparse can name the flag; parsed again with the reserve later."""
    try:
        GpuBudget.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def saved_bytes_as_built(
    model: str,
    configuration: str,
    seq: int,
    layers: int,
    compiled_at: float | None,
    precision: str,
    head: str = "pretraining",
    target: str = "cuda",
) -> SavedTensorsReport:
    """Exact bytes a ``layers``-deep copy of ``model`` as ``configuration`` builds it keeps for
    backward at batch 1 in ``precision`` (its model dtype and autocast, as measure.training runs
    a step; on the CUDA target dropout and SDPA as their CUDA kernels keep; the saved-tensor
    meter's report): run eagerly (``compiled_at`` None) or as ``torch.compile`` partitions it at
    that activation memory budget (measure.compiled; the partitioned graph runs as one function,
    so every byte is the top module's)."""
    p = Precision(precision)
    with FakeTensorMode(), default_dtype(p.model_dtype):
        m = build_model(model, head, configuration, num_layers=layers).train()
        batch = make_batch(model, head, 1, seq)
        with cuda_like() if target == "cuda" else nullcontext(), p.autocast("cpu"):
            if compiled_at is None:
                r = saved_bytes(m, **batch)
            else:
                loss_of = compiled_loss(m, batch, compiled_at)
                with SavedTensorsMeter(m, tuple(batch.values())) as meter:
                    loss_of(m, batch)
                r = meter.report()
    return r


def saved_bytes_by_part(
    model: str, configuration: str, seq: int, precision: str, compiled: bool, **where: str
) -> tuple[int, int]:
    """(a layer's, the rest's) bytes ``model`` keeps for backward at batch 1, eager or compiled at
    the default budget: a 2-layer copy's minus a 1-layer copy's (every layer keeps the same),
    and the 1-layer copy's minus that (its embedding, head and loss); the batch's own tensors not
    counted (a step keeps them anyway). ``where``: head, target."""
    at = 1.0 if compiled else None
    one = saved_bytes_as_built(model, configuration, seq, 1, at, precision, **where).activation_bytes
    two = saved_bytes_as_built(model, configuration, seq, 2, at, precision, **where).activation_bytes
    return two - one, one - (two - one)


def compile_kept_scale(model: str, configuration: str, seq: int, precision: str, **where: str) -> KeptScale:
    """What ``model`` as ``configuration`` keeps under torch.compile (default budget) over what it
    keeps run eagerly, at batch 1, in its layers and elsewhere: the ``kept_scale`` of its
    max-batch estimate under compile (the eager step keeping what compile keeps;
    measure.memory). Below the default budget the partitioner splits a model as a whole, so no
    layer-wise share exists there. ``where``: head (default pretraining), target (cuda)."""
    compiled = saved_bytes_by_part(model, configuration, seq, precision, True, **where)
    eager = saved_bytes_by_part(model, configuration, seq, precision, False, **where)
    layers, rest = (c / e if e else 1.0 for c, e in zip(compiled, eager, strict=True))
    return KeptScale(layers, rest, layer_modules)


def kept_scale_text(shares: dict[str, float]) -> str:
    """A KeptScale's shares as a result file records them (kept_scale_json), in words."""
    return f"x{shares['layers']:.3f} in the layers, x{shares['rest']:.3f} elsewhere"


def kept_scale_json(scale: KeptScale) -> dict[str, float]:
    """A result file's record of ``scale``: its two shares."""
    return {"layers": round(scale.layers, 6), "rest": round(scale.rest, 6)}


def estimator(
    model: str, head: str, seq: int, precision: str, configuration: str, kept_scale: KeptScale | None = None
) -> DepthExtrapolatedEstimator:
    """The depth-extrapolated step estimate of ``model`` as ``configuration`` builds it;
    ``kept_scale``: measure.memory's (the share of its saved activations' bytes counted)."""
    check_configuration(model, configuration, head)  # a bad name: one line, before any model is built
    make_batch(model, head, 1, seq, device="meta")  # a bad head or seq likewise
    return DepthExtrapolatedEstimator(
        lambda n: build_model(model, head, configuration, num_layers=n),
        lambda b: make_batch(model, head, b, seq),
        precision,
        num_layers=models()[model].layers,
        op_workspace=workspace_bytes,
        kept_scale=kept_scale,
    )


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, str, GpuBudget]:
    """The command line, checked before any work: (arguments, configuration, GPU budget)."""
    ap = OneLineParser(
        prog="python -m tempo.maxbatch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    try:
        presets = list(models())  # read here, first: a broken preset file is one line too
    except ValueError as e:
        ap.error(str(e))
    ap.add_argument("--model", required=True, choices=presets)
    ap.add_argument("--head", default="pretraining", choices=HEADS)
    ap.add_argument(
        "--seq", type=_positive_int, required=True, help="sequence length, 1 to the model's positions"
    )
    ap.add_argument(
        "--precision",
        default="fp16",
        choices=PRECISIONS,
        help="fp32 | fp16/bf16 (half model, fp32 master weights) | amp-fp16/amp-bf16 (autocast)",
    )
    ap.add_argument(
        "--gpu-mem", type=_gpu_mem, required=True, help="GPU memory, e.g. 11GB, 16GB, 80GB, 141GB"
    )
    ap.add_argument("--tempo", action="store_true", help="shorthand for --config tempo")
    ap.add_argument("--config", default=None, choices=list(CONFIGURATIONS), help="default: hf-eager")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="the model under torch.compile (default budget): its step keeping what compile keeps",
    )
    default = GpuBudget(0)  # the reserve's defaults, measure.budget's
    ap.add_argument(
        "--context-gb",
        type=_non_negative_float,
        default=default.context_bytes / GiB,
        help="reserve, GiB (>= 0)",
    )
    ap.add_argument(
        "--fragmentation",
        type=_fraction,
        default=default.fragmentation,
        help="reserve, fraction of the rest, in [0, 1)",
    )
    ap.add_argument("--no-verify", action="store_true", help="skip the full-depth estimate at the answer")
    args = ap.parse_args(argv)
    if args.tempo and args.config not in (None, "tempo"):
        ap.error("--tempo and --config disagree; give one")
    configuration = "tempo" if args.tempo else (args.config or "hf-eager")
    if args.compile and CONFIGURATIONS[configuration].checkpointing:
        ap.error(f"--compile with {configuration}: a checkpointed model under torch.compile is not estimated")
    try:
        budget = GpuBudget.parse(
            args.gpu_mem, context_bytes=int(args.context_gb * GiB), fragmentation=args.fragmentation
        )
        make_batch(args.model, args.head, 1, args.seq)  # validates seq against the model
        check_configuration(args.model, configuration, args.head)
    except ValueError as e:
        ap.error(str(e))
    if budget.usable_bytes <= 0:
        ap.error(f"--gpu-mem {args.gpu_mem} leaves nothing after the reserve")
    return args, configuration, budget


def main(argv: list[str] | None = None) -> int:
    args, configuration, budget = _parse(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    print(
        f"{args.model} ({args.head} head), seq {args.seq}, {args.precision}, {configuration}"
        f"{' under torch.compile' if args.compile else ''}; "
        f"{args.gpu_mem} GPU: {budget.usable_bytes / GiB:.2f} GiB usable after the reserve",
        flush=True,
    )
    scale = None
    if args.compile:  # the partition's kept bytes; the step's other bytes as run eagerly
        scale = compile_kept_scale(args.model, configuration, args.seq, args.precision, head=args.head)
        print(
            f"torch.compile keeps {kept_scale_text(kept_scale_json(scale))} of what eager keeps", flush=True
        )
    est = estimator(args.model, args.head, args.seq, args.precision, configuration, kept_scale=scale)
    b, report = est.max_batch(budget.usable_bytes, limit=SEARCH_CAP)
    if b == 0:
        print(f"even batch 1 does not fit: it needs {report.peak_gib:.2f} GiB")
        return 1
    if b == SEARCH_CAP:  # the search stopped at its cap: the true maximum is larger, and unknown
        print(
            f"max batch: at least {b}, the search's cap (batch {b} needs an estimated "
            f"{report.peak_gib:.2f} GiB of the {budget.usable_bytes / GiB:.2f} usable; larger was not tried)"
        )
        return 0
    if not args.no_verify:  # the whole model at the answer and its neighbours: exact, with a breakdown
        full = StepMemoryEstimator(
            lambda: build_model(args.model, args.head, configuration),
            lambda n: make_batch(args.model, args.head, n, args.seq),
            args.precision,
            op_workspace=workspace_bytes,
            kept_scale=scale,
        )
        exact, report = refine_max_batch(full.peak, budget.usable_bytes, b, limit=SEARCH_CAP)
        if exact != b:
            print(f"note: the depth-extrapolated search said {b}; the full-depth estimate says {exact}")
        b = exact
        if b == 0:
            print(f"even batch 1 does not fit: it needs {report.peak_gib:.2f} GiB")
            return 1
    print(f"max batch: {b}  (estimated peak {report.peak_gib:.2f} GiB, in {report.peak_phase})")
    for category, nbytes in report.breakdown.items():
        if nbytes:
            print(f"  {category:<16} {nbytes / GiB:8.2f} GiB")
    if args.compile and report.breakdown:
        print("  (the breakdown is the eager step's: activations at their eager bytes)")
    return 0


if __name__ == "__main__":
    with (
        quiet_broken_pipe(),  # `| head`: ends quietly, status 141
        interrupted_in_one_line(
            "python -m tempo.maxbatch", "it saves nothing: the same command searches again"
        ),
    ):
        sys.exit(main())
