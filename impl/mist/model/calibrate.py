"""Fitting the runtime model to per-op profiles, and checking the fit.

Each profiled op's forward and backward time is paired with its work from the symbolic trace
(FLOPs for GEMMs, bytes moved otherwise) and each op class's curve is fitted by least squares on
relative error (``fit_line``). What the profiles' backward column of a weight GEMM holds decides
how it is read (see ``runtime``'s docstring). Rates are checked against the GPU's data sheet
(``check_rates``). ``calibrate`` fits on some model sizes and reports the error on the others.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .profile_data import (
    EMBEDDING_OP,
    FINAL_NORM_OP,
    FRAMEWORK_OP,
    GATED_LAYER_OP,
    GRAD_ACCUMULATE_OP,
    HEAD_OP,
    LAYER_OPS,
    TEMPO_GATED_OP,
    TEMPO_OP,
    LayerProfile,
    best_algo,
    check_complete,
    gated_layer,
    profile_meta,
    read_collectives,
    read_layer_profiles,
)
from .runtime import (
    COMM_INSIDE,
    COMPUTE_KINDS,
    MEASURED_LAYERS,
    OP_CLASS,
    Line,
    RuntimeModel,
    op_features,
    residual_stream_bytes,
    tempo_work,
)
from .specs import CPU_PRESET, GRAD_ACCUMULATION, ModelSpec, gpus
from .symbolic import head_costs, layer_costs, value

# curves fitted to a whole layer's time beyond something else (its ops; the plain layer)
WHOLE_LAYER_CLASSES = ("framework", "tempo", "tempo_gated", "gated")
# curves whose work is the same at every micro-batch of one TP size (the embedding table's
# gradient, the gradient accumulation's add) or that are a difference of two timings (the loss:
# the head's time less the GEMM curve's): a profile at one TP size (the GPU check's) can fit them
# only as a constant, which is then no rate to hold to a peak; a fitted rate still is held to it
FIXED_WORK_CLASSES = ("loss", "embedding", "accumulate")


def fit_line(work: np.ndarray, seconds: np.ndarray, peak: float | None = None) -> Line:
    """Least squares on relative error, c0 >= 0 and rate > 0. Where the time does not grow with
    the work in the measured range (an overhead-bound op), or grows too little for its rate to be a
    float, the line is a constant (rate None, ``Line``): never an infinite rate, which no hardware
    reaches and JSON cannot hold.

    With ``peak`` (the data sheet's rate for this work), where the line is steeper than the peak
    allows but no time is (each op's work over its time within the peak): the slope is the noise
    of a few kernels of a few microseconds each (their launch overheads differ by more than the
    work's time at the peak), not their speed, and the line is the best one at the peak's slope.
    Where a time itself is faster than the peak, the unbounded line, which ``check_rates``
    refuses: no hardware ran it, the data or its reading (a dtype, a unit) is wrong. A fit within
    the peak is the unbounded one, to the bit."""
    from scipy.optimize import nnls

    work, seconds = np.asarray(work, float), np.asarray(seconds, float)
    if not (np.isfinite(work).all() and np.isfinite(seconds).all()):
        raise ValueError("cannot fit a line to work or times that are not finite numbers")
    keep = seconds > 0  # a backward measured as (forward + backward) - forward can round to 0
    if keep.sum() < 2:
        raise ValueError("cannot fit a line to fewer than two positive times")
    work, seconds = work[keep], seconds[keep]
    a = np.stack([np.ones_like(work), work], axis=1) / seconds[:, None]
    (c0, inv_rate), _ = nnls(a, np.ones_like(work))
    if peak is not None and inv_rate < 1.0 / peak and np.max(work / seconds) <= peak:
        # inv_rate = 1/peak + extra, extra >= 0: the same least squares, the peak's share moved over
        (c0, extra), _ = nnls(a, 1.0 - work / peak / seconds)
        # the peak itself, not 1/(1/peak), which can round one step above it (L4's 1.21e14)
        return Line(float(c0), peak if extra == 0 else min(peak, 1.0 / (1.0 / peak + float(extra))))
    # 1 / a denormal slope overflows to inf (as a slope of 0 would divide by zero): both are constants
    rate = 1.0 / float(inv_rate) if inv_rate > 1.0 / np.finfo(float).max else None
    return Line(float(c0), rate)


def _profile_op_work(model: ModelSpec, profile_op: str, mbs: int, seq: int, tp: int) -> tuple[float, float]:
    """Work of a profiled op: FLOPs for GEMMs, bytes otherwise; (forward, backward). A weight
    GEMM's backward work is one of its two backward GEMMs (the forward's FLOPs)."""
    if profile_op == GRAD_ACCUMULATE_OP:  # bytes the add moves, as GradAccumulation counts them
        # mist.engine.run's half-precision gradients, the engine `mist profile` times the add of
        moved = GRAD_ACCUMULATION["megatron-core"].bytes_per_param * value(
            layer_costs(model).params, model, mbs, seq, tp
        )
        return moved, moved
    if profile_op == FRAMEWORK_OP:
        return residual_stream_bytes(model, mbs, seq), residual_stream_bytes(model, mbs, seq)
    if profile_op in (TEMPO_OP, TEMPO_GATED_OP):
        layer = gated_layer(model) if profile_op == TEMPO_GATED_OP else model
        return tempo_work(layer, mbs, seq, tp), tempo_work(layer, mbs, seq, tp)
    names = LAYER_OPS[profile_op]
    fwd = bwd = 0.0
    for name, kind, fn in op_features(model):
        if name in names:
            flops, fb, bb = fn(mbs, seq, tp)
            compute = kind in COMPUTE_KINDS
            fwd += flops if compute else fb
            bwd += (flops if kind == "gemm" else 2 * flops) if compute else bb
    return fwd, bwd


def fit_runtime_model(
    profiles: list[LayerProfile], collectives: dict, gpu: str, source: str, dtype: str = "fp16"
) -> RuntimeModel:
    """Fit every op class's curves (forward and backward) and every collective's line; ``dtype``:
    what the profiles ran in, whose peak bounds the fitted FLOP/s (``check_rates``).

    A CPU's profile (`mist profile`, at the very shapes its plans run, every TP size they use) gets
    each TP size's curves fitted to that size's points alone as well (``RuntimeModel.tp_curves``):
    there an op at TP 2 is not its TP-1 line at half the work, and one line through both sizes
    priced a TP-1 micro-batch 9% under the line through TP 1's points alone (measured on a 2-vCPU
    Xeon, 2026-12-05: the 4-layer GPT-3's micro-batch of 2 at 72.3 against 79.6 ms, the same
    profile). A GPU's curves are fitted across sizes and model shapes, which their held-out error
    checks."""
    # a mechanism measured on a layer is a difference of two timings: at small sizes it can round
    # to nothing (written as 0), so it may be a constant rather than a line
    lines = {
        (kind, n): (_fit_or_constant if kind in MEASURED_LAYERS else fit_line)(*zip(*rows, strict=True))
        for (kind, n), rows in collectives.items()
    }
    curves = _fit_curves(profiles, gpu, dtype)
    tps = sorted({p.tp for p in profiles})
    by_tp = {}
    if gpu == CPU_PRESET and len(tps) > 1:
        # a class with no points at one size keeps the curve through every size, never the data
        # sheet's roofline (one whose times there are too few positive ones is that size's constant)
        by_tp = {tp: curves | _fit_curves([p for p in profiles if p.tp == tp], gpu, dtype) for tp in tps}
    overall = _fit_gated(profiles, RuntimeModel(gpu, curves, lines, source, by_tp))
    for tp, tp_curves in by_tp.items():  # each size's own where it timed the layer, as the others
        tp_curves.update(
            _fit_gated([p for p in profiles if p.tp == tp], RuntimeModel(gpu, tp_curves)) or overall
        )
    curves.update(overall)
    held = _held_at_peak(curves, gpu, dtype)
    if held:  # said where the model is read (its source), not only here
        source = (
            f"{source}; held at the data-sheet peak (times steeper than it, none faster): {', '.join(held)}"
        )
    model = RuntimeModel(gpu, curves, lines, source, by_tp)
    check_rates(model, dtype)
    return model


def _held_at_peak(curves: dict[str, tuple[Line, Line]], gpu: str, dtype: str) -> list[str]:
    """The curves ``fit_line`` held at their class's data-sheet peak ("class direction")."""
    out = []
    for cls, lines in sorted(curves.items()):
        if (bounded := class_peak(gpu, cls, dtype)) is not None:
            for direction, line in zip(("forward", "backward"), lines, strict=True):
                if line.rate is not None and line.rate >= bounded[0] * (1 - 1e-12):
                    out.append(f"{cls} {direction}")
    return out


def _fit_gated(profiles: list[LayerProfile], priced: RuntimeModel) -> dict[str, tuple[Line, Line]]:
    """The "gated" curve: what the plain Llama layer (``gated_layer``, its GATED_LAYER_OP row)
    measures beyond ``priced``'s price of it, the op lines fitted to the GPT-3 layer's ops and the
    framework's. Work: the residual stream's bytes, as the framework's; an excess below zero is
    priced as none, as the framework's and Tempo's are. {} where no profile timed that layer."""
    work, excess = ([], []), ([], [])
    for p in best_algo(profiles):
        if GATED_LAYER_OP not in p.ops:
            continue
        layer = gated_layer(p.model)
        price = priced.layer_times(layer, p.mbs, layer.seq, p.tp, weight_gradients=p.weight_gradients)
        for direction in (0, 1):
            work[direction].append(residual_stream_bytes(layer, p.mbs, layer.seq))
            excess[direction].append(max(p.ops[GATED_LAYER_OP][direction] - float(price[direction]), 0.0))
    if not work[0]:
        return {}
    return {"gated": tuple(_fit_or_constant(work[d], excess[d]) for d in (0, 1))}


def _fit_curves(profiles: list[LayerProfile], gpu: str, dtype: str) -> dict[str, tuple[Line, Line]]:
    """Every op class's (forward, backward) curves fitted to ``profiles``, the weight gradient's and
    those of the ops outside the layer (``_fit_outside_layer``) with them; on a GPU each within its
    data-sheet peak in ``dtype`` (``class_peak``, ``fit_line``)."""
    # (class, direction) -> [(work, seconds, data fits in L2)]
    samples: dict[tuple[str, int], list[tuple[float, float, bool]]] = {}
    l2 = gpus()[gpu].l2 if gpu in gpus() else 0
    for p in best_algo(profiles):
        model = p.model
        for op, (fwd_s, bwd_s) in p.ops.items():
            if op not in OP_CLASS:
                continue
            work = _profile_op_work(model, op, p.mbs, model.seq, p.tp)
            whole_layer = OP_CLASS[op] in WHOLE_LAYER_CLASSES  # an excess of a layer's time, not an op's
            cached = OP_CLASS[op] not in COMPUTE_KINDS and not whole_layer and work[0] <= l2
            if OP_CLASS[op] == "gemm" and p.weight_gradients:
                bwd_s = bwd_s / 2  # the two backward GEMMs timed together: one of them
            for direction, seconds in enumerate((fwd_s, bwd_s)):
                if p.tp > 1 and p.tp_comm_inside and (op, direction) in COMM_INSIDE:
                    continue
                samples.setdefault((OP_CLASS[op], direction), []).append((work[direction], seconds, cached))
    curves = {}
    small_shapes_only = gpu == CPU_PRESET  # `mist profile` on a CPU: at the very shapes its plans run
    for cls in sorted({c for c, _ in samples}):
        fits = [_beyond_cache(samples[(cls, d)], small_shapes_only) for d in (0, 1)]
        if all(work for work, _ in fits):  # a class with nothing to fit keeps the data sheet's roofline
            peak = class_peak(gpu, cls, dtype)
            curves[cls] = tuple(_fit_or_constant(*f, peak=peak and peak[0]) for f in fits)
    if "gemm" in curves:  # the weight gradient: see the module docstring
        timed = any(p.weight_gradients for p in profiles)
        gemm_f, gemm_b = curves["gemm"]
        curves["wgrad"] = (gemm_f, gemm_b if timed else gemm_f)
    bandwidth = class_peak(gpu, "loss", dtype)  # the loss's and the embedding's work: bytes
    curves.update(_fit_outside_layer(profiles, curves, bandwidth and bandwidth[0]))
    return curves


class RateAbovePeakError(ValueError):
    """A fitted rate the GPU cannot reach: the data or its reading is wrong."""


# profile.json's dtype (`mist profile` writes torch's name) -> which data-sheet FLOP/s peak bounds it
HALF_DTYPES = ("fp16", "bf16", "torch.float16", "torch.bfloat16")
FP32_DTYPES = ("fp32", "torch.float32")


def peak_flops(gpu: str, dtype: str) -> float:
    """The data-sheet FLOP/s peak of ``gpu`` in ``dtype``: the tensor cores' in half precision, the
    CUDA cores' in float32 (a quarter to a sixteenth of it: checked against the half-precision
    peak, a float32 fit 4x too fast would pass)."""
    spec = gpus()[gpu]
    if dtype in HALF_DTYPES:
        return spec.flops
    if dtype in FP32_DTYPES and spec.fp32_flops is not None:
        return spec.fp32_flops
    known = ", ".join(HALF_DTYPES + (FP32_DTYPES if spec.fp32_flops is not None else ()))
    raise ValueError(f"no data-sheet FLOP/s peak of {gpu} for dtype {dtype!r} (known: {known})")


def class_peak(gpu: str, cls: str, dtype: str) -> tuple[float, str] | None:
    """The data-sheet rate that bounds op class ``cls`` on ``gpu`` and its unit: FLOP/s in
    ``dtype`` for the compute classes, the HBM bandwidth for the memory-bound ones; None where
    there is none (the ``cpu`` device's nominal numbers, a class fitted to a layer's excess time)."""
    spec = gpus().get(gpu)
    if spec is None or gpu == CPU_PRESET or cls in WHOLE_LAYER_CLASSES:
        return None
    if cls in COMPUTE_KINDS or cls == "wgrad":
        return peak_flops(gpu, dtype), "FLOP/s"
    return spec.hbm_bw, "B/s"


def check_rates(model: RuntimeModel, dtype: str = "fp16") -> None:
    """Every fitted compute rate within the data-sheet FLOP/s peak of ``dtype`` (``peak_flops``),
    every memory-bound one within the HBM bandwidth; a curve of these that does not grow with its
    work (a constant: an infinite rate) is above both. The ``cpu`` device has nominal numbers only:
    its lines are checked finite and > 0 where they are made (``Line``), not against a peak."""
    for cls, lines in model.curves.items():
        if (bounded := class_peak(model.gpu, cls, dtype)) is None:  # no hardware rate to exceed
            continue
        peak, unit = bounded
        in_dtype = f" in {dtype}" if unit == "FLOP/s" else ""
        bound = f"{model.gpu}'s data-sheet peak {peak:.3g} {unit}{in_dtype}"
        for direction, line in zip(("forward", "backward"), lines, strict=True):
            if line.rate is None and cls not in FIXED_WORK_CLASSES:
                raise RateAbovePeakError(
                    f"{model.source}: {cls} {direction} does not grow with its work (an infinite rate), "
                    f"above {bound}; profile larger shapes"
                )
            if line.rate is not None and line.rate > peak:
                raise RateAbovePeakError(
                    f"{model.source}: {cls} {direction} fitted at {line.rate:.3g} {unit}, above {bound}"
                )


def _fit_outside_layer(
    profiles: list[LayerProfile], curves: dict, bandwidth: float | None = None
) -> dict[str, tuple[Line, Line]]:
    """The "loss" and "embedding" curves from the profiles' post-process and embedding rows.

    Post-process is the LM head's GEMM and the cross-entropy over the vocabulary: the GEMM is
    priced by the fitted GEMM curves, the rest is the loss, memory-bound in the fp32 logits
    (work: their bytes; the kernels pass over them a few times, so the rate is a fraction of the
    bandwidth). The embedding row: the lookup forward (work: the rows read), the table's gradient
    backward (work: the table's bytes)."""
    if "gemm" not in curves:
        return {}
    gemm_f, gemm_b = curves["gemm"]
    loss, embed = ([], [], [], []), ([], [], [], [])
    for p in best_algo(profiles):
        model = p.model
        hc = {k: value(e, model, p.mbs, model.seq, p.tp) for k, e in head_costs(model).items()}
        if HEAD_OP in p.ops:
            fwd_s, bwd_s = p.ops[HEAD_OP]
            wgrad = float(curves["wgrad"][1](hc["head_flops_fwd"])) if p.weight_gradients else 0.0
            loss[0].append(hc["logits_fp32_bytes"])
            loss[1].append(fwd_s - float(gemm_f(hc["head_flops_fwd"])))
            loss[2].append(hc["logits_fp32_bytes"])
            loss[3].append(bwd_s - float(gemm_b(hc["head_flops_fwd"])) - wgrad)
        if EMBEDDING_OP in p.ops:
            fwd_s, bwd_s = p.ops[EMBEDDING_OP]
            embed[0].append(hc["embed_tokens_bytes"])
            embed[1].append(fwd_s)
            embed[2].append(hc["embed_table_bytes"])
            embed[3].append(bwd_s)
    out = {}
    for name, (wf, sf, wb, sb) in (("loss", loss), ("embedding", embed)):
        if len(wf) >= 2:
            out[name] = (_fit_or_constant(wf, sf, peak=bandwidth), _fit_or_constant(wb, sb, peak=bandwidth))
    return out


def _beyond_cache(
    rows: list[tuple[float, float, bool]], small_shapes_only: bool
) -> tuple[list[float], list[float]]:
    """(work, seconds) to fit a memory-bound class on: the ops whose data did not fit in L2, which
    timed the HBM a bandwidth line is for (a GPU's profiles: its plans run larger shapes). With
    ``small_shapes_only`` (the CPU engine's profile, taken at the very shapes its plans run) and
    fewer than two such ops, all of them: the cache is then what the predicted ops run from too,
    and the data sheet's roofline would be a guess."""
    beyond = [(w, s) for w, s, cached in rows if not cached]
    if small_shapes_only and sum(s > 0 for _, s in beyond) < 2:
        beyond = [(w, s) for w, s, _ in rows]
    return [w for w, _ in beyond], [s for _, s in beyond]


def _fit_or_constant(work, seconds, peak: float | None = None) -> Line:
    """A line (within ``peak``: ``fit_line``), or a constant where fewer than two times are positive
    (e.g. a framework overhead that rounds to zero on some micro-batches)."""
    if sum(x > 0 for x in seconds) >= 2:
        return fit_line(work, seconds, peak)
    return Line(float(np.mean(np.maximum(seconds, 0.0))), None)


def predicted_layer_seconds(rm: RuntimeModel, p: LayerProfile) -> float:
    """A profiled layer's forward + backward as the model predicts it, TP all-reduces included."""
    model = p.model
    fwd, bwd = rm.layer_times(model, p.mbs, model.seq, p.tp, weight_gradients=p.weight_gradients)
    comm = 0.0
    if p.tp > 1 and p.tp_comm_inside:
        message = p.mbs * model.seq * model.hidden * 2
        comm = 4 * float(rm.collective("all_reduce", message, p.tp))  # 2 forward + 2 backward
    return float(fwd + bwd) + comm


def calibrate(data_dir: Path, held_out: tuple[str, ...] = ("2_6B", "13B")) -> dict[str, dict]:
    """Per GPU directory in ``data_dir``: the runtime model fitted to every profile in it
    ("model": what plans are priced by), and the per-layer error of the same fit made without
    ``held_out`` model sizes on those sizes (or, for one profiled size, without its largest
    micro-batch on it). The model a planner uses sees every measured point: the held-out fit
    only says how well the procedure predicts what it did not see. (Fitted without it, a CPU
    profile's micro-batch 8 was priced by a line through 1-4: the plans of the measured
    comparison, all at micro-batch 8 or 4, moved 13% between profiles of one machine.)"""
    out = {}
    root = Path(data_dir)
    dirs = [root] if profile_meta(root) else sorted(p for p in root.iterdir() if p.is_dir())
    for gpu_dir in dirs:  # an interrupted `mist profile` is refused before anything is fitted
        check_complete(gpu_dir)
    for gpu_dir in dirs:
        profiles = read_layer_profiles(gpu_dir)
        if not profiles:
            continue
        if {p.size for p in profiles} & set(held_out):
            kept_out = f"sizes {', '.join(held_out)} held out"
            is_test = {id(p): p.size in held_out for p in profiles}
        else:  # one profiled size (e.g. from `mist profile`): hold out the largest micro-batch
            largest = max(p.mbs for p in profiles)
            kept_out = f"micro-batch {largest} held out"
            is_test = {id(p): p.mbs == largest for p in profiles}
        train = [p for p in profiles if not is_test[id(p)]]
        test = best_algo([p for p in profiles if is_test[id(p)]])
        meta = profile_meta(gpu_dir)
        collectives, gpu, dtype = read_collectives(gpu_dir), meta["gpu"], meta["dtype"]
        rm = fit_runtime_model(
            train, collectives, gpu, f"fitted to {gpu_dir.name} profiles ({kept_out})", dtype
        )
        errors = [abs(predicted_layer_seconds(rm, p) / p.layer_seconds - 1) for p in test]
        source = f"fitted to every {gpu_dir.name} profile (held-out error: {kept_out})"
        out[gpu_dir.name] = {
            "gpu": rm.gpu,
            "model": fit_runtime_model(profiles, collectives, gpu, source, dtype),
            "held_out_cases": len(errors),
            "mean_abs_error": float(np.mean(errors)) if errors else None,
            "median_abs_error": float(np.median(errors)) if errors else None,
            "max_abs_error": float(np.max(errors)) if errors else None,
        }
        head = [e for e in map(lambda p: _head_error(rm, p), test) if e is not None]
        if head:  # the final norm + LM head + loss row, held out the same way
            out[gpu_dir.name]["head_mean_abs_error"] = float(np.mean(head))
            out[gpu_dir.name]["head_max_abs_error"] = float(np.max(head))
    return out


def _head_error(rm: RuntimeModel, p: LayerProfile) -> float | None:
    """|predicted / measured - 1| of the final norm + head + loss of a profiled case."""
    if HEAD_OP not in p.ops:
        return None
    model = p.model
    fwd, bwd = rm.head_times(model, p.mbs, model.seq, p.tp, weight_gradients=p.weight_gradients)
    measured = sum(p.ops[HEAD_OP]) + sum(p.ops.get(FINAL_NORM_OP, (0.0, 0.0)))
    return abs((fwd + bwd) / measured - 1)
