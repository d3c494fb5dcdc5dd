"""Runtime model: per-op compute time, collectives, and their fits to measurements.

Every op class (GEMM, batched GEMM, norm, softmax, dropout, ...) and direction gets a fitted
efficiency curve ``time = c0 + work / rate``: ``work`` is the op's FLOPs (GEMMs) or bytes moved
(memory-bound ops) from the symbolic trace, ``rate`` the sustained FLOP/s or bytes/s, ``c0``
the launch and ramp cost; achieved efficiency ``work / (time * peak)`` rises with size towards
``rate / peak``, as measured GPU kernels do. A weight GEMM's backward is two GEMMs of its
forward's FLOPs: the input gradient (the ``gemm`` backward curve) and the weight gradient (the
``wgrad`` curve). Where the profiles timed both (``profiles.backward_has_weight_gradients``)
each is half the backward column. Where they timed the input gradient alone (L4, A100, V100 in
the Mist artifact) nothing measured the weight gradient, and it is priced as a forward GEMM of
the same FLOPs: where both were timed (A10G) each backward GEMM took the forward's time
(median backward/forward 1.97), not the input gradient's (0.8-0.9 of the forward on the
others, too few points to say the weight gradient shares that speed). No fitted rate may exceed the GPU's
data-sheet peak (``check_rates``). Collectives are alpha-beta lines per GPU count. Fits are
weighted least squares on relative error. Without measurements for a GPU, a roofline from its
data sheet with stated default efficiencies is used.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import sympy as sp

from .profiles import (
    EMBEDDING_OP,
    FINAL_NORM_OP,
    FRAMEWORK_OP,
    HEAD_OP,
    LAYER_OPS,
    LayerProfile,
    best_algo,
    profile_meta,
    read_collectives,
    read_layer_profiles,
)
from .specs import GPUS, ClusterSpec, ModelSpec
from .symbolic import b, head_costs, numeric, s, t, trace_layer, value

PRESETS = Path(__file__).parent / "presets"
COMPUTE_KINDS = ("gemm", "bmm", "attention")
# Profile op -> class of its fitted curve.
OP_CLASS = {
    "enc-1st-layernorm": "norm",
    "enc-2nd-layernorm": "norm",
    "enc-attention-qkv": "gemm",
    "enc-attention-dense": "gemm",
    "enc-MLP-GEMM-1": "gemm",
    "enc-MLP-GEMM-2": "gemm",
    "enc-attention-score": "bmm",
    "enc-attention-context": "bmm",
    "enc-attention-softmax": "softmax",
    "enc-attention-dropout": "dropout",
    "enc-post-attention-dropout": "dropout_add",
    "enc-post-MLP-dropout": "dropout_add",
    "enc-MLP-gelu": "act",
    FRAMEWORK_OP: "framework",  # only in `mist profile` output: megatron-core's layer beyond its ops
}
# With TP > 1 these measured op times include Megatron's all-reduce: the forward of a
# row-parallel GEMM and the backward of a column-parallel one. Not used to fit compute.
COMM_INSIDE = {
    ("enc-attention-dense", 0),
    ("enc-MLP-GEMM-2", 0),
    ("enc-attention-qkv", 1),
    ("enc-MLP-GEMM-1", 1),
}
DEFAULT_EFFICIENCY = {"gemm": 0.7, "bmm": 0.5, "attention": 0.5, "memory": 0.7}  # roofline fallback


@dataclass(frozen=True)
class Line:
    """time = c0 + work / rate."""

    c0: float
    rate: float

    def __call__(self, work):
        return self.c0 + np.asarray(work, float) / self.rate


def fit_line(work: np.ndarray, seconds: np.ndarray) -> Line:
    """Least squares on relative error, c0 >= 0 and rate > 0 (inf: the time does not grow)."""
    from scipy.optimize import nnls

    work, seconds = np.asarray(work, float), np.asarray(seconds, float)
    keep = seconds > 0  # a backward measured as (forward + backward) - forward can round to 0
    if keep.sum() < 2:
        raise ValueError("cannot fit a line to fewer than two positive times")
    work, seconds = work[keep], seconds[keep]
    a = np.stack([np.ones_like(work), work], axis=1) / seconds[:, None]
    (c0, inv_rate), _ = nnls(a, np.ones_like(work))
    if inv_rate <= 0:  # no growth with the work in the measured range: a constant (overhead-bound op)
        return Line(float(c0), float("inf"))
    return Line(float(c0), float(1.0 / inv_rate))


@functools.lru_cache(maxsize=128)
def op_features(model: ModelSpec, sequence_parallel: bool = False):
    """Per traced op: (name, kind, f(b, s, t) -> (flops, fwd_bytes, bwd_bytes)) with numbers in."""
    fixed = numeric(model)
    out = []
    for op in trace_layer(model, sequence_parallel):
        if op.kind == "comm" or (op.flops == 0 and op.fwd_bytes == 0):
            continue
        fn = sp.lambdify(
            (b, s, t), [sp.sympify(x).subs(fixed) for x in (op.flops, op.fwd_bytes, op.bwd_bytes)]
        )
        out.append((op.name, op.kind, fn))
    return tuple(out)


def _stream_bytes(model: ModelSpec, mbs, seq) -> float:
    """The layer's residual stream in half precision: what the framework-overhead line scales with."""
    return 2.0 * mbs * seq * model.hidden


def _profile_op_work(model: ModelSpec, profile_op: str, mbs: int, seq: int, tp: int) -> tuple[float, float]:
    """Work of a profiled op: FLOPs for GEMMs, bytes otherwise; (forward, backward). A weight
    GEMM's backward work is one of its two backward GEMMs (the forward's FLOPs)."""
    if profile_op == FRAMEWORK_OP:
        return _stream_bytes(model, mbs, seq), _stream_bytes(model, mbs, seq)
    names = LAYER_OPS[profile_op]
    fwd = bwd = 0.0
    for name, kind, fn in op_features(model):
        if name in names:
            flops, fb, bb = fn(mbs, seq, tp)
            compute = kind in COMPUTE_KINDS
            fwd += flops if compute else fb
            bwd += (flops if kind == "gemm" else 2 * flops) if compute else bb
    return fwd, bwd


@dataclass
class RuntimeModel:
    gpu: str
    curves: dict[str, tuple[Line, Line]]  # class -> (forward, backward)
    collectives: dict[str, Line] = field(default_factory=dict)  # "all_reduce/4" -> line
    source: str = "roofline"

    # ---- per-layer times

    def layer_times(
        self, model: ModelSpec, mbs, seq, tp, sequence_parallel: bool = False, weight_gradients: bool = True
    ):
        """Forward and backward compute seconds of one layer on one TP rank (no communication).
        ``weight_gradients=False``: without the weight-gradient GEMMs (to compare with profiles
        that did not time them)."""
        fwd = bwd = 0.0
        kinds = {n: c for op, c in OP_CLASS.items() for n in LAYER_OPS.get(op, ())}
        for name, kind, fn in op_features(model, sequence_parallel):
            flops, fb, bb = fn(mbs, seq, tp)
            cls = kinds.get(name, "gemm" if kind in COMPUTE_KINDS else _memory_class(kind))
            f_line, b_line = self.curve(cls)
            fwd = fwd + f_line(flops if kind in COMPUTE_KINDS else fb)
            if kind == "gemm":  # input gradient, and weight gradient: each the forward's FLOPs
                bwd = bwd + b_line(flops) + (self.wgrad_line(flops) if weight_gradients else 0.0)
            elif kind in COMPUTE_KINDS:
                bwd = bwd + b_line(flops * (2.5 if kind == "attention" else 2.0))
            else:
                bwd = bwd + b_line(bb)
        if "framework" in self.curves:  # measured by `mist profile` only (none for the shipped GPUs)
            f_line, b_line = self.curves["framework"]
            fwd, bwd = (
                fwd + f_line(_stream_bytes(model, mbs, seq)),
                bwd + b_line(_stream_bytes(model, mbs, seq)),
            )
        return fwd, bwd

    def head_times(
        self, model: ModelSpec, mbs, seq, tp, weight_gradients: bool = True
    ) -> tuple[float, float]:
        """Final norm + LM head GEMM + cross-entropy over the vocabulary, per micro-batch and TP rank."""
        hc = {k: value(e, model, mbs, seq, tp) for k, e in head_costs(model).items()}
        gemm_f, gemm_b = self.curve("gemm")
        norm_f, norm_b = self.curve("norm")
        loss_f, loss_b = self.curve("loss")
        fwd = norm_f(hc["final_norm_bytes"]) + gemm_f(hc["head_flops_fwd"]) + loss_f(hc["logits_fp32_bytes"])
        bwd = (
            norm_b(2 * hc["final_norm_bytes"])  # a norm's backward moves twice its forward's bytes
            + gemm_b(hc["head_flops_fwd"])
            + (self.wgrad_line(hc["head_flops_fwd"]) if weight_gradients else 0.0)
            + loss_b(hc["logits_fp32_bytes"])
        )
        return float(fwd), float(bwd)

    def embedding_times(self, model: ModelSpec, mbs, seq, tp) -> tuple[float, float]:
        """The (vocab-parallel) embedding lookup forward, its table gradient backward."""
        hc = {k: value(e, model, mbs, seq, tp) for k, e in head_costs(model).items()}
        f_line, b_line = self.curve("embedding")
        return float(f_line(hc["embed_tokens_bytes"])), float(b_line(hc["embed_table_bytes"]))

    @property
    def wgrad_line(self) -> Line:
        """The weight-gradient GEMM's curve (see the module docstring); a preset without one
        prices it as the input gradient."""
        return self.curves["wgrad"][1] if "wgrad" in self.curves else self.curve("gemm")[1]

    def curve(self, cls: str) -> tuple[Line, Line]:
        if cls in self.curves:
            return self.curves[cls]
        if cls == "attention" and "bmm" in self.curves:  # fused attention: as fast as its GEMMs
            return self.curves["gemm"]
        return _roofline(GPUS[self.gpu], cls)

    def collective(
        self, kind: str, nbytes, n: int, cluster: ClusterSpec | None = None, inter_node: bool | None = None
    ):
        """Seconds of a collective over ``n`` GPUs on a ``nbytes`` tensor (ring algorithm).

        Within a node: the fitted alpha-beta line when there is one. Across nodes (``inter_node``,
        default: n exceeds a node) the ring is bound by the inter-node link. No bytes: no collective
        (its fixed latency is not paid).
        """
        nbytes = np.asarray(nbytes, float)
        if n <= 1:
            return np.zeros_like(nbytes)
        if inter_node is None:
            inter_node = cluster is not None and n > cluster.gpus_per_node
        key = f"{kind}/{n}"
        if key in self.collectives and not inter_node:
            seconds = self.collectives[key](nbytes)
        elif cluster is None:
            raise ValueError(f"no fitted {key} for {self.gpu} and no cluster to estimate it from")
        else:
            link = cluster.inter if inter_node else cluster.intra
            steps = 2 * (n - 1) if kind == "all_reduce" else (n - 1)
            seconds = steps * link.latency + nbytes * steps / n / link.bw
        return np.where(nbytes > 0, seconds, 0.0)

    def p2p(self, nbytes: float, cluster: ClusterSpec, inter_node: bool = False) -> float:
        """Seconds of one point-to-point message between neighbouring pipeline stages: the fitted
        send/recv line within a node where there is one, else the cluster's link."""
        if nbytes <= 0:
            return 0.0
        if "send_recv/2" in self.collectives and not inter_node:
            return float(self.collectives["send_recv/2"](nbytes))
        link = cluster.inter if inter_node else cluster.intra
        return link.latency + nbytes / link.bw

    # ---- persistence

    def to_json(self) -> dict:
        return {
            "gpu": self.gpu,
            "source": self.source,
            "curves": {k: [asdict(f), asdict(bw)] for k, (f, bw) in self.curves.items()},
            "collectives": {k: asdict(v) for k, v in self.collectives.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> RuntimeModel:
        return cls(
            d["gpu"],
            {k: (Line(**f), Line(**bw)) for k, (f, bw) in d["curves"].items()},
            {k: Line(**v) for k, v in d["collectives"].items()},
            d["source"],
        )


def _memory_class(kind: str) -> str:
    return {"add": "dropout_add", "norm": "norm", "softmax": "softmax", "dropout": "dropout"}.get(kind, "act")


def _roofline(gpu, cls: str) -> tuple[Line, Line]:
    if cls in COMPUTE_KINDS:
        rate = gpu.flops * DEFAULT_EFFICIENCY[cls]
    else:
        rate = gpu.hbm_bw * DEFAULT_EFFICIENCY["memory"]
    line = Line(10e-6, rate)
    return line, line


def roofline_model(gpu: str) -> RuntimeModel:
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; presets: {', '.join(GPUS)}")
    return RuntimeModel(gpu, {}, {}, "roofline from the data sheet (default efficiencies)")


def fit_runtime_model(profiles: list[LayerProfile], collectives: dict, gpu: str, source: str) -> RuntimeModel:
    """Fit every op class's curves (forward and backward) and every collective's line."""
    samples: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    l2 = GPUS[gpu].l2 if gpu in GPUS else 0
    for p in best_algo(profiles):
        model = p.model
        for op, (fwd_s, bwd_s) in p.ops.items():
            if op not in OP_CLASS:
                continue
            work = _profile_op_work(model, op, p.mbs, model.seq, p.tp)
            if OP_CLASS[op] not in COMPUTE_KINDS and OP_CLASS[op] != "framework" and work[0] <= l2:
                continue  # its data fit in L2: it timed the cache, not the HBM a bandwidth line is for
            if OP_CLASS[op] == "gemm" and p.weight_gradients:
                bwd_s = bwd_s / 2  # the two backward GEMMs timed together: one of them
            for direction, seconds in enumerate((fwd_s, bwd_s)):
                if p.tp > 1 and p.tp_comm_inside and (op, direction) in COMM_INSIDE:
                    continue
                xs, ys = samples.setdefault((OP_CLASS[op], direction), ([], []))
                xs.append(work[direction])
                ys.append(seconds)
    curves = {}
    for cls in sorted({c for c, _ in samples}):
        curves[cls] = tuple(_fit_or_constant(*samples[(cls, d)]) for d in (0, 1))
    if "gemm" in curves:  # the weight gradient: see the module docstring
        timed = any(p.weight_gradients for p in profiles)
        gemm_f, gemm_b = curves["gemm"]
        curves["wgrad"] = (gemm_f, gemm_b if timed else gemm_f)
    curves.update(_fit_outside_layer(profiles, curves))
    lines = {f"{kind}/{n}": fit_line(*zip(*rows, strict=True)) for (kind, n), rows in collectives.items()}
    model = RuntimeModel(gpu, curves, lines, source)
    check_rates(model)
    return model


class RateAbovePeakError(ValueError):
    """A fitted rate the GPU cannot reach: the data or its reading is wrong."""


def check_rates(model: RuntimeModel) -> None:
    """Every fitted compute rate within the data-sheet FLOP/s peak, every memory-bound one within
    the HBM bandwidth (the ``cpu`` device has nominal numbers only: not checked)."""
    spec = GPUS.get(model.gpu)
    if spec is None or model.gpu == "cpu":
        return
    for cls, lines in model.curves.items():
        if cls == "framework":
            continue
        flop_rate = cls in COMPUTE_KINDS or cls == "wgrad"
        peak, unit = (spec.flops, "FLOP/s") if flop_rate else (spec.hbm_bw, "B/s")
        for direction, line in zip(("forward", "backward"), lines, strict=True):
            if np.isfinite(line.rate) and line.rate > peak:
                raise RateAbovePeakError(
                    f"{model.source}: {cls} {direction} fitted at {line.rate:.3g} {unit}, above "
                    f"{model.gpu}'s data-sheet peak {peak:.3g} {unit}"
                )


def _fit_outside_layer(profiles: list[LayerProfile], curves: dict) -> dict[str, tuple[Line, Line]]:
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
            out[name] = (_fit_or_constant(wf, sf), _fit_or_constant(wb, sb))
    return out


def _fit_or_constant(work, seconds) -> Line:
    """A line, or a constant where fewer than two times are positive (e.g. a framework overhead
    that rounds to zero on some micro-batches)."""
    if sum(x > 0 for x in seconds) >= 2:
        return fit_line(work, seconds)
    return Line(float(np.mean(np.maximum(seconds, 0.0))), float("inf"))


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
    """Fit a runtime model per GPU directory in ``data_dir`` on all but ``held_out`` model sizes,
    and report the per-layer error on the held-out ones. Returns {gpu: {"model", "error"}}."""
    out = {}
    root = Path(data_dir)
    dirs = [root] if profile_meta(root) else sorted(p for p in root.iterdir() if p.is_dir())
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
        rm = fit_runtime_model(
            train,
            read_collectives(gpu_dir),
            profile_meta(gpu_dir)["gpu"],
            f"fitted to {gpu_dir.name} profiles ({kept_out})",
        )
        errors = [abs(predicted_layer_seconds(rm, p) / p.layer_seconds - 1) for p in test]
        out[gpu_dir.name] = {
            "gpu": rm.gpu,
            "model": rm,
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


# Sustained / data-sheet DRAM bandwidth of a two-socket server (STREAM triad reaches about 3/4 of
# the channels' peak): what bounds a memory-bound CPU optimizer step on a many-core host.
HOST_STREAM_FRACTION = 0.75


@dataclass(frozen=True)
class CpuAdam:
    """The host optimizer step as measured (``mist profile-host``): one core's rate, the bytes a
    parameter's step moves, and where it was measured."""

    per_core_params_per_s: float
    bytes_moved_per_param: float
    source: str


@functools.lru_cache(maxsize=1)
def load_cpu_adam() -> CpuAdam:
    d = json.loads((PRESETS / "host_cpu_adam.json").read_text())
    one = d["params_per_s"][d["threads"].index(1)]
    return CpuAdam(float(one), float(d["bytes_moved_per_param"]),
                   f"{d['optimizer']} measured on {d['cpu']} ({d['measured']})")  # fmt: skip


def cpu_adam_params_per_s(cluster: ClusterSpec, adam: CpuAdam | None = None) -> float:
    """Parameters per second one GPU's offloaded optimizer step gets from its host: the node's
    rate (its cores at the measured per-core rate, at most what its sustained DRAM bandwidth
    allows) shared by the node's GPUs, which all step at the end of the iteration."""
    adam = adam or load_cpu_adam()
    host = cluster.host
    dram_bound = HOST_STREAM_FRACTION * host.mem_bw / adam.bytes_moved_per_param
    node = min(host.cores * adam.per_core_params_per_s, dram_bound)
    return node / cluster.gpus_per_node


def load_runtime_model(gpu: str) -> RuntimeModel:
    """The shipped fitted preset for ``gpu`` if there is one, else the data-sheet roofline."""
    path = PRESETS / f"runtime_{gpu}.json"
    if path.exists():
        return RuntimeModel.from_json(json.loads(path.read_text()))
    return roofline_model(gpu)
