"""Runtime model: per-op compute time and collectives (fitted in ``calibrate``), from the symbolic trace.

Every op class (GEMM, batched GEMM, norm, softmax, dropout, ...) and direction gets a fitted
efficiency curve ``time = c0 + work / rate``: ``work`` is the op's FLOPs (GEMMs) or bytes moved
(memory-bound ops) from the symbolic trace, ``rate`` the sustained FLOP/s or bytes/s, ``c0``
the launch and ramp cost; achieved efficiency ``work / (time * peak)`` rises with size towards
``rate / peak``, as measured GPU kernels do. A weight GEMM's backward is two GEMMs of its
forward's FLOPs: the input gradient (the ``gemm`` backward curve) and the weight gradient (the
``wgrad`` curve). Where the profiles timed both (``profile_data.backward_has_weight_gradients``)
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

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import sympy as sp

from measure.presets import check_fields, count, load_preset, number, text

from .profile_data import (
    FRAMEWORK_OP,
    GRAD_ACCUMULATE_OP,
    LAYER_OPS,
    TEMPO_GATED_OP,
    TEMPO_OP,
)
from .specs import ClusterSpec, GpuSpec, ModelSpec, gpus
from .symbolic import as_integers, b, head_costs, numeric, s, t, trace_layer, value

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
    TEMPO_OP: "tempo",  # only in `mist profile --tempo` output: Tempo's layer beyond the plain one
    TEMPO_GATED_OP: "tempo_gated",  # the same for a Llama layer (profile_data.gated_layer)
    GRAD_ACCUMULATE_OP: "accumulate",  # only in `mist profile` output: the gradient accumulation's add
}
# What Tempo's ops replace (norms, activations, dropouts, the softmax): the bytes they move forward
# are the work Tempo's excess time is fitted against (``tempo_work``)
TEMPO_KINDS = ("norm", "act", "dropout", "softmax")
# With TP > 1 these measured op times include Megatron's all-reduce: the forward of a
# row-parallel GEMM and the backward of a column-parallel one. Not used to fit compute.
COMM_INSIDE = {
    ("enc-attention-dense", 0),
    ("enc-MLP-GEMM-2", 0),
    ("enc-attention-qkv", 1),
    ("enc-MLP-GEMM-1", 1),
}
# `mist profile`'s benchmarks of a mechanism on one whole layer, filed with the collectives' lines:
# ZeRO-2 (the engine's gradient reductions to each layer's owner), ZeRO-3 (FSDP2 on the layer) and
# tensor parallelism (megatron-core's TP layer)
ZERO2_LAYER = "grad_shard_layer"
ZERO3_LAYER = "fsdp_layer"
TP_LAYER = "tp_layer"  # forward + backward
TP_LAYER_FORWARD = "tp_layer_forward"  # the forward's part (recomputation repeats it)
MEASURED_LAYERS = (ZERO2_LAYER, ZERO3_LAYER, TP_LAYER, TP_LAYER_FORWARD)
# mist.engine.run's own step collectives, timed by `mist profile` running the engine's code (by
# the bytes synchronised): where they are measured the model prices what the engine issues;
# elsewhere Megatron-LM's (DDP's all-reduce; the distributed optimizer's reduce-scatter, all-gather)
ZERO_GRAD_SUM = "zero_grad_sum"  # ZeRO-0/1's gradient sum: an in-place all-reduce of the gradient buffer
ZERO_WEIGHT_SYNC = "zero_weight_sync"  # ZeRO-1/2's updated weights: one broadcast per owner of its share
ENGINE_COLLECTIVES = (ZERO_GRAD_SUM, ZERO_WEIGHT_SYNC)
DEFAULT_EFFICIENCY = {"gemm": 0.7, "bmm": 0.5, "attention": 0.5, "memory": 0.7}  # roofline fallback


@dataclass(frozen=True)
class Line:
    """time = c0 + work / rate. ``rate`` None: a constant, a time that did not grow with the work
    where it was measured (an overhead-bound op, ``calibrate.fit_line``), said so rather than
    written as an infinite rate (not JSON, and above any hardware's peak)."""

    c0: float
    rate: float | None

    def __post_init__(self) -> None:
        # every model's lines are made here (fits, presets, rooflines): an infinite, zero or
        # negative rate would price work at no time or negative time without a word
        rate_ok = self.rate is None or (math.isfinite(self.rate) and self.rate > 0)
        if not (math.isfinite(self.c0) and self.c0 >= 0 and rate_ok):
            raise ValueError(
                f"a line is a finite c0 >= 0 and a finite rate > 0 (None: a constant), "
                f"got c0={self.c0!r}, rate={self.rate!r}"
            )

    def __call__(self, work):
        work = np.asarray(work, float)
        return self.c0 + (work * 0.0 if self.rate is None else work / self.rate)


@functools.lru_cache(maxsize=128)
def op_features(model: ModelSpec, sequence_parallel: bool = False):
    """Per traced op: (name, kind, f(b, s, t) -> (flops, fwd_bytes, bwd_bytes)) with numbers in."""
    fixed = as_integers(numeric(model))
    out = []
    for op in trace_layer(model, sequence_parallel):
        if op.kind == "comm" or (op.flops == 0 and op.fwd_bytes == 0):
            continue
        costs_at = sp.lambdify(
            (b, s, t), [sp.sympify(expr).xreplace(fixed) for expr in (op.flops, op.fwd_bytes, op.bwd_bytes)]
        )
        out.append((op.name, op.kind, costs_at))
    return tuple(out)


def tempo_work(model: ModelSpec, mbs, seq, tp, sequence_parallel: bool = False):
    """Bytes the ops Tempo replaces move forward in one layer of ``model`` with Tempo's layers, on
    one TP rank: what the "tempo" curve (Tempo's time beyond the plain layer) scales with. Both
    the residual stream's ops (b s h) and the attention's (b a s^2 / t) are in it, so a fit at one
    shape carries to others in proportion to what Tempo's ops touch."""
    tempo = model if model.tempo else dataclasses.replace(model, tempo=True, parallel_block=False)
    work = 0.0
    for _, kind, costs_at in op_features(tempo, sequence_parallel):
        if kind in TEMPO_KINDS:
            work = work + costs_at(mbs, seq, tp)[1]
    return work


def residual_stream_bytes(model: ModelSpec, mbs, seq) -> float:
    """The layer's residual stream in half precision: what the framework-overhead line scales with."""
    return 2.0 * mbs * seq * model.hidden


def _at_its_tp(price):
    """``price`` (a RuntimeModel method of (model, mbs, seq, tp, ...)) by the model's curves for
    that TP size (``RuntimeModel.at_tp``)."""

    @functools.wraps(price)
    def at_its_tp(self, model, mbs, seq, tp, *args, **kwargs):
        return price(self.at_tp(tp), model, mbs, seq, tp, *args, **kwargs)

    return at_its_tp


@dataclass
class RuntimeModel:
    gpu: str
    curves: dict[str, tuple[Line, Line]]  # class -> (forward, backward)
    # (kind, GPUs) -> line, e.g. ("all_reduce", 4); a preset's JSON writes the key "all_reduce/4"
    collectives: dict[tuple[str, int], Line] = field(default_factory=dict)
    source: str = "roofline"
    # TP size -> curves fitted to that size's profiles alone (a CPU's `mist profile`, where an
    # op at TP 2 is not its TP-1 line at half the work: ``calibrate.fit_runtime_model``); a TP
    # size without its own is priced by ``curves``, fitted to every size
    tp_curves: dict[int, dict[str, tuple[Line, Line]]] = field(default_factory=dict)

    def at_tp(self, tp) -> RuntimeModel:
        """This model as it prices one rank of TP ``tp``: with that size's own curves where it has them."""
        curves = self.tp_curves.get(int(tp)) if self.tp_curves else None  # a GPU's: one set for all
        return self if curves is None else dataclasses.replace(self, curves=curves, tp_curves={})

    # ---- per-layer times

    @_at_its_tp
    def layer_times(
        self,
        model: ModelSpec,
        mbs,
        seq,
        tp,
        sequence_parallel: bool = False,
        weight_gradients: bool = True,
        only: tuple[str, ...] | None = None,
    ):
        """Forward and backward compute seconds of one layer on one TP rank (no communication).
        ``weight_gradients=False``: without the weight-gradient GEMMs (to compare with profiles
        that did not time them). ``only``: of these traced ops alone (no framework overhead)."""
        fwd = bwd = 0.0
        classes = {traced: op_class for op, op_class in OP_CLASS.items() for traced in LAYER_OPS.get(op, ())}
        for name, kind, costs_at in op_features(model, sequence_parallel):
            if only is not None and name not in only:
                continue
            flops, fwd_bytes, bwd_bytes = costs_at(mbs, seq, tp)
            op_class = classes.get(name, "gemm" if kind in COMPUTE_KINDS else _memory_class(kind))
            f_line, b_line = self.curve(op_class)
            fwd = fwd + f_line(flops if kind in COMPUTE_KINDS else fwd_bytes)
            if kind == "gemm":  # input gradient, and weight gradient: each the forward's FLOPs
                bwd = bwd + b_line(flops) + (self.wgrad_line(flops) if weight_gradients else 0.0)
            elif kind in COMPUTE_KINDS:
                bwd = bwd + b_line(flops * (2.5 if kind == "attention" else 2.0))
            else:
                bwd = bwd + b_line(bwd_bytes)
        if "framework" in self.curves and only is None:  # measured by `mist profile` only (none shipped)
            f_line, b_line = self.curves["framework"]
            fwd, bwd = (
                fwd + f_line(residual_stream_bytes(model, mbs, seq)),
                bwd + b_line(residual_stream_bytes(model, mbs, seq)),
            )
        # what a Llama layer measures beyond its ops' price (RMSNorm and SwiGLU priced by the GPT-3
        # layer's LayerNorm and GELU lines), measured by `mist profile --tempo` only
        if model.gated_mlp and "gated" in self.curves and only is None:
            f_line, b_line = self.curves["gated"]
            work = residual_stream_bytes(model, mbs, seq)
            fwd, bwd = fwd + f_line(work), bwd + b_line(work)
        # Tempo's extra work (its backward recovers inputs, regenerates masks, remakes the SwiGLU
        # product), measured by `mist profile --tempo` only: a model without that curve (every
        # shipped GPU preset) prices a Tempo layer by its traced ops alone (what they move, which
        # is no more than the plain layer's: none of that extra work)
        tempo = "tempo_gated" if model.gated_mlp else "tempo"  # what Tempo replaces differs
        if model.tempo and tempo in self.curves and only is None:
            f_line, b_line = self.curves[tempo]
            work = tempo_work(model, mbs, seq, tp, sequence_parallel)
            fwd, bwd = fwd + f_line(work), bwd + b_line(work)
        return fwd, bwd

    @_at_its_tp
    def head_times(
        self, model: ModelSpec, mbs, seq, tp, weight_gradients: bool = True
    ) -> tuple[float, float]:
        """Final norm + LM head GEMM + cross-entropy over the vocabulary, per micro-batch and TP rank."""
        head = {name: value(expr, model, mbs, seq, tp) for name, expr in head_costs(model).items()}
        gemm_f, gemm_b = self.curve("gemm")
        norm_f, norm_b = self.curve("norm")
        loss_f, loss_b = self.curve("loss")
        fwd = (
            norm_f(head["final_norm_bytes"])
            + gemm_f(head["head_flops_fwd"])
            + loss_f(head["logits_fp32_bytes"])
        )
        bwd = (
            norm_b(2 * head["final_norm_bytes"])  # a norm's backward moves twice its forward's bytes
            + gemm_b(head["head_flops_fwd"])
            + (self.wgrad_line(head["head_flops_fwd"]) if weight_gradients else 0.0)
            + loss_b(head["logits_fp32_bytes"])
        )
        return float(fwd), float(bwd)

    @_at_its_tp
    def embedding_times(self, model: ModelSpec, mbs, seq, tp) -> tuple[float, float]:
        """The (vocab-parallel) embedding lookup forward, its table gradient backward."""
        edge = {name: value(expr, model, mbs, seq, tp) for name, expr in head_costs(model).items()}
        f_line, b_line = self.curve("embedding")
        return float(f_line(edge["embed_tokens_bytes"])), float(b_line(edge["embed_table_bytes"]))

    @property
    def accumulate_line(self) -> Line:
        """The gradient accumulation's add, by the bytes it moves: measured where `mist profile`
        timed it (the ``accumulate`` curve), else the residual add's forward line (every shipped
        GPU preset: memory-bound adds alike, which `mist validate` checks on L4 and A10G)."""
        return self.curves["accumulate"][0] if "accumulate" in self.curves else self.curve("dropout_add")[0]

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
        return _roofline(gpus()[self.gpu], cls)

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
        if (kind, n) in self.collectives and not inter_node:
            seconds = self.collectives[kind, n](nbytes)
        elif cluster is None:
            raise ValueError(
                f"no fitted {kind} over {n} GPUs for {self.gpu} and no cluster to estimate it from"
            )
        else:
            link = cluster.inter if inter_node else cluster.intra
            steps = 2 * (n - 1) if kind == "all_reduce" else (n - 1)
            seconds = steps * link.latency + nbytes * steps / n / link.bw
        return np.where(nbytes > 0, seconds, 0.0)

    def zero3_layer(self, weight_bytes: float, n: int, inter_node: bool = False) -> np.ndarray | None:
        """Seconds ZeRO-3 adds to one layer's forward + backward among ``n`` GPUs where `mist
        profile` measured the engine's mechanism itself (FSDP2 on megatron-core's layer: both
        gathers, the reduce-scatter, its copies and waits, whatever it overlaps already taken out),
        by the layer's full weight bytes; None where it did not (then the collectives price it)."""
        return self._measured_layer(ZERO3_LAYER, weight_bytes, n, inter_node)

    def zero2_layer(self, weight_bytes: float, n: int, inter_node: bool = False) -> np.ndarray | None:
        """Seconds ZeRO-2 adds to one layer's backward among ``n`` GPUs where `mist profile`
        measured the engine's mechanism (the layer's gradients reduced to its owner in one message
        from a backward hook: the copy, the reduction, the wait for the other ranks), by the
        layer's full weight bytes; None where it did not (then a reduce-scatter prices it)."""
        return self._measured_layer(ZERO2_LAYER, weight_bytes, n, inter_node)

    def zero_grad_sum(self, nbytes, n: int, inter_node: bool = False) -> np.ndarray | None:
        """Seconds of ZeRO-0's or ZeRO-1's gradient sum (one operation in the engine) over ``n``
        replicas on ``nbytes`` of gradients where `mist profile` timed the engine's
        (ContiguousGrads' all-reduce); None where it did not."""
        return self._engine_collective(ZERO_GRAD_SUM, nbytes, n, inter_node)

    def zero_weight_sync(self, nbytes, n: int, inter_node: bool = False) -> np.ndarray | None:
        """Seconds of ZeRO-1/2's updated weights reaching ``n`` replicas, ``nbytes`` of them in all,
        where `mist profile` timed the engine's (ShardedMasterAdamW.broadcast_weights: one broadcast
        per owner of its share); None where it did not."""
        return self._engine_collective(ZERO_WEIGHT_SYNC, nbytes, n, inter_node)

    def _engine_collective(self, kind: str, nbytes, gpus: int, inter_node: bool) -> np.ndarray | None:
        line = self._measured_layer(kind, nbytes, gpus, inter_node)
        # no bytes: no collective (its fixed latency is not paid), as ``collective``
        return None if line is None else np.where(np.asarray(nbytes, float) > 0, line, 0.0)

    def tp_layer(
        self, message_bytes: float, n: int, inter_node: bool = False
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(forward, forward + backward) seconds tensor parallelism over ``n`` GPUs adds to one
        layer where `mist profile` measured it as the engine runs it (megatron-core's layer split
        over ``n`` processes against one rank's share alone: its two all-reduces each way, and the
        waits between the ranks' compute that back-to-back collectives do not have), by the bytes
        of one of those all-reduces; None where it did not (then the collectives price it)."""
        both = self._measured_layer(TP_LAYER, message_bytes, n, inter_node)
        forward = self._measured_layer(TP_LAYER_FORWARD, message_bytes, n, inter_node)
        if both is None or forward is None:
            return None
        return np.minimum(forward, both), both

    def _measured_layer(
        self, mechanism: str, nbytes: float, gpus: int, inter_node: bool
    ) -> np.ndarray | None:
        if gpus <= 1 or inter_node or (mechanism, gpus) not in self.collectives:
            return None
        return np.maximum(self.collectives[mechanism, gpus](np.asarray(nbytes, float)), 0.0)

    def p2p(self, nbytes: float, cluster: ClusterSpec, inter_node: bool = False) -> float:
        """Seconds of one point-to-point message between neighbouring pipeline stages: the fitted
        send/recv line within a node where there is one, else the cluster's link."""
        if nbytes <= 0:
            return 0.0
        if ("send_recv", 2) in self.collectives and not inter_node:
            return float(self.collectives["send_recv", 2](nbytes))
        link = cluster.inter if inter_node else cluster.intra
        return link.latency + nbytes / link.bw

    # ---- persistence

    def to_json(self) -> dict:
        def lines(curves: dict[str, tuple[Line, Line]]) -> dict:
            return {name: [asdict(forward), asdict(backward)] for name, (forward, backward) in curves.items()}

        out = {
            "gpu": self.gpu,
            "source": self.source,
            "curves": lines(self.curves),
            "collectives": {f"{kind}/{n}": asdict(line) for (kind, n), line in self.collectives.items()},
        }
        if self.tp_curves:  # JSON's keys are strings
            out["tp_curves"] = {str(tp): lines(curves) for tp, curves in sorted(self.tp_curves.items())}
        return out

    @classmethod
    def from_json(
        cls, preset: dict, path: Path | str = "a runtime preset", gpu: str | None = None
    ) -> RuntimeModel:
        """The model a runtime preset (``to_json``'s mapping) describes, read strictly (see
        ``measure.presets``): exactly its fields; every line a finite c0 >= 0 and a finite rate > 0
        (null: a time that does not grow with the work, as ``calibrate.fit_line`` may fit); the layer's
        curves all there (a missing one would be priced by the data-sheet roofline without a
        word); collectives the kinds the model looks up; ``gpu`` (the file's name says it) the
        preset's own. ``path`` names the file in the one-line errors."""
        check_fields(path, "", preset, ("gpu", "source", "curves", "collectives"), ("tp_curves",))
        name = text(path, "gpu", preset["gpu"])
        if gpu is not None and name != gpu:
            raise ValueError(f"{path}: gpu must be {gpu!r} (the GPU its file name says), got {name!r}")
        curves = check_fields(path, "curves", preset["curves"], LAYER_CURVES, OPTIONAL_CURVES)
        collectives = preset["collectives"]
        # N: GPUs in one collective; 2**20 is far beyond any machine built (the largest train on ~10**5)
        kinds = f"KIND/N, KIND one of {', '.join(COLLECTIVE_KINDS)} and N a whole number from 2 to 2**20"
        if not isinstance(collectives, dict):
            raise ValueError(
                f"{path}: collectives must be a mapping of {kinds} to lines, got {collectives!r}"
            )
        lines = {}
        for key, line in collectives.items():
            kind, _, gpus = key.partition("/")
            if kind not in COLLECTIVE_KINDS or not _whole_key(gpus, 2):
                raise ValueError(f"{path}: collectives: {key!r} is not {kinds}")
            lines[kind, int(gpus)] = _line(path, f"collectives.{key}", line)
        return cls(
            name,
            _curve_pairs(path, "curves", curves),
            lines,
            text(path, "source", preset["source"]),
            _tp_curves(path, preset.get("tp_curves", {})),
        )


def _whole_key(key: object, least: int) -> bool:
    """Whether a preset's key is a whole number from ``least`` to 2**20 in decimal, as written (no
    sign, no leading zero): a GPU count, a TP size."""
    fits = isinstance(key, str) and key.isdecimal() and len(key) <= 7 and key == str(int(key))
    return fits and least <= int(key) <= 2**20


def _curve_pairs(path: Path | str, where: str, curves: dict) -> dict[str, tuple[Line, Line]]:
    """A preset's curves (``where``: which), every one a (forward, backward) pair of lines."""
    return {curve: _line_pair(path, f"{where}.{curve}", pair) for curve, pair in curves.items()}


def _tp_curves(path: Path | str, by_tp: object) -> dict[int, dict[str, tuple[Line, Line]]]:
    """A preset's per-TP curves: TP sizes (whole numbers from 1 to 2**20, as strings) to curves,
    each set with every layer curve (``RuntimeModel.from_json``)."""
    if not isinstance(by_tp, dict):
        raise ValueError(f"{path}: tp_curves must be a mapping of TP sizes to curves, got {by_tp!r}")
    out = {}
    for key, curves in by_tp.items():
        if not _whole_key(key, 1):
            raise ValueError(f"{path}: tp_curves: {key!r} is not a TP size (a whole number from 1 to 2**20)")
        where = f"tp_curves.{key}"
        chosen = check_fields(path, where, curves, LAYER_CURVES, OPTIONAL_CURVES)
        out[int(key)] = _curve_pairs(path, where, chosen)
    return out


# The curves every runtime preset has: the layer's op classes (a profile always times each) and
# the weight gradient's; the others are fitted only from some profiles (the loss and embedding
# from rows the Mist artifact and `mist profile --vocab` have; the framework's and Tempo's excess
# from `mist profile` alone), and are priced otherwise without them (``RuntimeModel.curve``).
LAYER_CURVES = (*sorted({OP_CLASS[op] for op in LAYER_OPS}), "wgrad")
OPTIONAL_CURVES = ("loss", "embedding", "framework", "tempo", "tempo_gated", "gated", "accumulate")
# The collectives the model looks up (``collective``, ``p2p``, the measured mechanisms)
COLLECTIVE_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    *MEASURED_LAYERS,
    *ENGINE_COLLECTIVES,
)


def _line(path: Path | str, where: str, line: object) -> Line:
    """A preset's line {"c0": seconds >= 0, "rate": work/s, finite and > 0, or null for a constant}.
    Infinity is refused: it is not JSON, and no hardware does work in no time."""
    check_fields(path, where, line, ("c0", "rate"))
    rate = line["rate"]
    constant = " (or null: a time that does not grow with the work)"
    return Line(
        number(path, f"{where}.c0", line["c0"]),
        None if rate is None else number(path, f"{where}.rate", rate, above=True, or_else=constant),
    )


def _line_pair(path: Path | str, where: str, pair: object) -> tuple[Line, Line]:
    """A curve: [forward line, backward line]."""
    if not isinstance(pair, list) or len(pair) != 2:
        raise ValueError(f"{path}: {where} must be [forward line, backward line], got {pair!r}")
    return _line(path, f"{where}[0]", pair[0]), _line(path, f"{where}[1]", pair[1])


def read_runtime_preset(path: Path, gpu: str) -> RuntimeModel:
    """The runtime preset of ``gpu`` in ``path`` (runtime_<gpu>.json), read strictly."""
    return RuntimeModel.from_json(load_preset(path), path, gpu)


def _memory_class(kind: str) -> str:
    return {"add": "dropout_add", "norm": "norm", "softmax": "softmax", "dropout": "dropout"}.get(kind, "act")


def memory_bound_rate(gpu: GpuSpec) -> float:
    """Bytes/s an unprofiled memory-bound kernel moves on ``gpu``: the roofline's share of its HBM
    bandwidth (also the optimizer step's and the clipping norm's, which no profile times)."""
    return gpu.hbm_bw * DEFAULT_EFFICIENCY["memory"]


def _roofline(gpu, cls: str) -> tuple[Line, Line]:
    rate = gpu.flops * DEFAULT_EFFICIENCY[cls] if cls in COMPUTE_KINDS else memory_bound_rate(gpu)
    line = Line(10e-6, rate)
    return line, line


def roofline_model(gpu: str) -> RuntimeModel:
    if gpu not in gpus():
        raise ValueError(f"unknown GPU {gpu!r}; presets: {', '.join(gpus())}")
    return RuntimeModel(gpu, {}, {}, "roofline from the data sheet (default efficiencies)")


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


# host_cpu_adam.json's fields: what the model reads, and the strings that say where it was measured
HOST_PRESET_FIELDS = (
    "optimizer",
    "cpu",
    "torch",
    "params",
    "threads",
    "params_per_s",
    "bytes_moved_per_param",
    "measured",
)


def cpu_adam_preset(preset: dict, path: Path | str = "a host preset") -> CpuAdam:
    """The host step a host preset (``profile_cpu_adam``'s mapping) describes, read strictly (see
    ``measure.presets``): exactly its fields; ``threads`` distinct whole numbers >= 1 with 1 among
    them (the per-core rate is one thread's), ``params_per_s`` one finite rate > 0 for each,
    ``bytes_moved_per_param`` a finite number > 0 (not the string "28")."""
    check_fields(path, "", preset, HOST_PRESET_FIELDS)
    for key in ("optimizer", "cpu", "torch", "measured"):
        text(path, key, preset[key])
    count(path, "params", preset["params"])
    threads, rates = preset["threads"], preset["params_per_s"]
    if not isinstance(threads, list):
        raise ValueError(
            f"{path}: threads must be a list of thread counts with 1 among them, got {threads!r}"
        )
    counts = [count(path, f"threads[{i}]", thread_count) for i, thread_count in enumerate(threads)]
    if 1 not in counts or len(set(counts)) < len(counts):
        raise ValueError(f"{path}: threads must be distinct thread counts with 1 among them, got {threads!r}")
    if not isinstance(rates, list) or len(rates) != len(threads):
        raise ValueError(
            f"{path}: params_per_s must be a list of one rate a thread count ({len(threads)}), got {rates!r}"
        )
    per_s = [number(path, f"params_per_s[{i}]", rate, above=True) for i, rate in enumerate(rates)]
    return CpuAdam(
        per_s[counts.index(1)],
        number(path, "bytes_moved_per_param", preset["bytes_moved_per_param"], above=True),
        f"{preset['optimizer']} measured on {preset['cpu']} ({preset['measured']})",
    )


def read_cpu_adam(path: Path) -> CpuAdam:
    """The host preset in ``path`` (host_cpu_adam.json), read strictly."""
    return cpu_adam_preset(load_preset(path), path)


@functools.lru_cache(maxsize=1)
def load_cpu_adam() -> CpuAdam:
    """The shipped host preset (``mist profile-host --write``)."""
    return read_cpu_adam(PRESETS / "host_cpu_adam.json")


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
        return read_runtime_preset(path, gpu)
    return roofline_model(gpu)
