"""Symbolic analysis: trace one transformer layer (and the embedding and head) once into sympy.

A ``Sym`` is a tensor with a symbolic shape (sympy expressions of the micro-batch b, sequence s,
tensor-parallel size t and the model's h, a, kv, f, v). Running the layer's code on Syms
records, per op, its FLOPs, the bytes it moves, what it keeps for backward and its
temporaries. Kept tensors are counted once by identity (a tensor the next op keeps too costs
nothing more), as autograd does. Sums over ops become a ``LayerCosts`` of sympy expressions,
compiled with ``lambdify`` so thousands of candidate strategies evaluate as numpy arrays.

Megatron-style tensor parallelism: QKV and the first MLP GEMM are column-parallel, the output
projection and the second MLP GEMM row-parallel; with sequence parallelism the residual stream
(norms, dropouts, residual adds) is split along the sequence too.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import sympy as sp

from .specs import ModelSpec

# micro-batch, sequence, TP size; hidden, heads, key/value heads, MLP hidden, vocabulary
b, s, t, h, a, kv, f, v = sp.symbols("b s t h a kv f v", positive=True)
SYMBOLS = (b, s, t, h, a, kv, f, v)
# Bytes Tempo's fused attention core's backward holds besides its inputs' and outputs' gradients:
# its GPU kernels' buffers or its CPU path's chunk, a number per device and size that tempo.sizes
# states (attention_core_workspace_bytes); LayerCosts.compiled takes it beside b, s and t
attention_workspace = sp.Symbol("attention_workspace", nonnegative=True)
# The same for Tempo's SwiGLU fused with the down projection (tempo.sizes.swiglu_down_workspace_bytes)
swiglu_workspace = sp.Symbol("swiglu_workspace", nonnegative=True)
HALF, FP32, MASK = 2, 4, 1  # bytes per element: activations/weights, statistics, dropout masks
_ids = itertools.count()


@dataclass(eq=False)
class Sym:
    shape: tuple[sp.Expr, ...]
    itemsize: int = HALF
    uid: int = field(default_factory=lambda: next(_ids))
    shard: Sym | None = None  # for a sequence-parallel all-gather's output: the shard it came from
    weight: bool = False

    @property
    def numel(self) -> sp.Expr:
        return sp.Mul(*self.shape)

    @property
    def nbytes(self) -> sp.Expr:
        return self.numel * self.itemsize


@dataclass
class Op:
    name: str
    kind: str  # gemm | bmm | norm | softmax | dropout | act | add | attention | comm | loss | embed
    flops: sp.Expr  # forward FLOPs (backward: 2x for GEMMs, see LayerCosts)
    fwd_bytes: sp.Expr  # bytes read + written by the forward
    bwd_bytes: sp.Expr
    saved: list[Sym]
    # bytes its backward holds besides what is kept: the gradients of its inputs and outputs (no
    # masks), a linear's weight gradient, a fused op's workspace
    working: sp.Expr = sp.S.Zero
    collective: str | None = None  # comm ops: all_reduce | all_gather | reduce_scatter
    message: sp.Expr = sp.S.Zero  # comm ops: bytes of the full (gathered) tensor
    # core attention's first op: its inputs, which checkpointing the core attention keeps
    checkpoint_inputs: tuple[Sym, ...] = ()


# The ops inside Megatron's core attention (scores, softmax, dropout, context; fused: one op):
# what selective recomputation (--recompute-granularity selective, its default core_attn)
# recomputes in backward instead of keeping (Korthikanti et al. 2022, "Reducing Activation
# Recomputation in Large Transformer Models")
CORE_ATTENTION_OPS = (
    "attention-score",
    "attention-softmax",
    "attention-dropout",
    "attention-context",
    "attention-core",
)


class Tracer:
    """Records the ops of one code path run on Syms."""

    def __init__(self, tp: bool = True, sp_: bool = False, tempo: bool = False) -> None:
        self.ops: list[Op] = []
        self.tp, self.sp = tp, sp_
        self.tempo = tempo  # Tempo's layers: what each op keeps (ModelSpec.tempo)

    def op(
        self,
        name,
        kind,
        flops,
        ins: list[Sym],
        outs: list[Sym],
        saved: list[Sym],
        bwd_scale=2.0,
        fwd_bytes=None,
        bwd_bytes=None,
    ):
        """``fwd_bytes``/``bwd_bytes`` override what the op moves (default: its inputs and outputs
        forward, ``bwd_scale`` times that backward) where its kernel is known to move otherwise."""
        moved = sum((tensor.nbytes for tensor in ins + outs), sp.Integer(0))
        working = sum(
            (tensor.nbytes for tensor in ins + outs if not tensor.weight and tensor.itemsize != MASK),
            sp.Integer(0),
        )
        fwd = moved if fwd_bytes is None else sp.sympify(fwd_bytes)
        bwd = sp.nsimplify(bwd_scale) * moved if bwd_bytes is None else sp.sympify(bwd_bytes)
        self.ops.append(Op(name, kind, sp.sympify(flops), fwd, bwd, saved, working))

    def elementwise(self, name: str, flops, ins: list[Sym], outs: list[Sym], saved: list[Sym]) -> None:
        """An activation-like op; its backward reads the outputs' gradients and what it saved and
        writes the inputs' gradients."""
        bwd = sum((tensor.nbytes for tensor in outs + saved + ins), sp.Integer(0))
        self.op(name, "act", flops, ins, outs, saved, bwd_bytes=bwd)

    def comm(self, name: str, collective: str, x: Sym, y: Sym) -> None:
        self.op(name, "comm", 0, [x], [y], [])
        self.ops[-1].collective = collective
        self.ops[-1].message = b * s * h * HALF

    # ---- building blocks (shapes are per tensor-parallel rank)

    def stream(self) -> Sym:
        """A residual-stream tensor: (b, s, h), split along s under sequence parallelism."""
        return Sym((b, s / t if self.sp else s, h))

    def gathered(self, name: str, x: Sym) -> Sym:
        """Sequence-parallel all-gather before a column-parallel GEMM (identity without SP)."""
        if not self.sp:
            return x
        y = Sym((b, s, h), shard=x)  # a GEMM that keeps y keeps the shard and re-gathers it
        self.comm(name, "all_gather", x, y)
        return y

    def norm(self, name: str, x: Sym, rms: bool) -> Sym:
        y = Sym(x.shape)
        stats = Sym(x.shape[:-1], FP32)  # rstd (and mean for LayerNorm), kept for backward
        if self.tempo:  # its output (the next GEMM keeps it anyway) and rstd, not x nor the mean
            self.op(name, "norm", (4 if rms else 7) * x.numel, [x], [y], [y, stats])
            return y
        self.op(name, "norm", (4 if rms else 7) * x.numel, [x], [y], [x, stats])
        if not rms:
            self.ops[-1].saved.append(Sym(x.shape[:-1], FP32))
        return y

    def linear(self, name: str, x: Sym, out_features: sp.Expr, keeps_input: bool = True) -> Sym:
        """``keeps_input`` False: the input is recomputed for the weight gradient (Tempo's SwiGLU)."""
        y = Sym((*x.shape[:-1], out_features))
        weight = Sym((x.shape[-1], out_features), weight=True)
        kept = [x.shard or x] if keeps_input else []
        self.op(name, "gemm", 2 * x.numel * out_features, [x, weight], [y], kept)
        # backward makes the weight's gradient, then adds it into the accumulated one (the
        # engine's megatron-core has no fused accumulation without Apex or Transformer Engine)
        self.ops[-1].working = self.ops[-1].working + weight.nbytes
        return y

    def dropout(self, name: str, x: Sym, enabled: bool) -> Sym:
        if not enabled:
            return x
        y = Sym(x.shape)
        if self.tempo:  # a seed (8 bytes), the mask regenerated in backward
            self.op(name, "dropout", 2 * x.numel, [x], [y], [], bwd_scale=1.0)
            return y
        mask = Sym(x.shape, MASK)
        self.op(name, "dropout", 2 * x.numel, [x], [y, mask], [mask], bwd_scale=1.0)
        return y

    def add(self, name: str, x: Sym, y: Sym) -> Sym:
        total = Sym(x.shape)
        # backward moves nothing: both inputs receive the output's gradient tensor itself
        self.op(name, "add", x.numel, [x, y], [total], [], bwd_scale=0)
        return total

    def reduce_out(self, name: str, x: Sym) -> Sym:
        """Row-parallel output: all-reduce (or reduce-scatter under SP) across the TP group."""
        y = self.stream()
        self.comm(name, "reduce_scatter" if self.sp else "all_reduce", x, y)
        return y

    def attention(self, q: Sym, k: Sym, vv: Sym, flash: bool, dropout: bool, qkv_kept: list[Sym]) -> Sym:
        """Core attention on query, key and value ``q``, ``k``, ``vv`` (``v`` is the vocabulary's
        symbol). ``qkv_kept``: the tensors whose storage keeping q, k and v keeps alive (views of
        the fused QKV projection's output, or the rotated copies of q and k)."""
        batch, seq, heads, head_dim = q.shape
        out = Sym((batch, seq, heads * head_dim))
        core_flops = 4 * batch * heads * seq * seq * head_dim  # QK^T and PV
        if flash:  # keeps q, k, v, the output and the row log-sum-exp; recomputes P in backward
            log_sum_exp = Sym((batch, heads, seq), FP32)
            kept = [*qkv_kept, out, log_sum_exp]
            self.op("attention-core", "attention", core_flops, [q, k, vv], [out], kept, 2.5)
            self.ops[-1].checkpoint_inputs = tuple(qkv_kept)
            return out
        scores = Sym((batch, heads, seq, seq))
        self.op(
            "attention-score", "bmm", 2 * batch * heads * seq * seq * head_dim, [q, k], [scores], qkv_kept
        )
        self.ops[-1].checkpoint_inputs = tuple(qkv_kept)
        probs = Sym(scores.shape)
        # Causal: Megatron's fused upper-triangular softmax reads only the unmasked half of its
        # input (and, backward, of the output's gradient and the probabilities) and writes all
        # of its output (zeros above the diagonal).
        half, full = scores.nbytes / 2, scores.nbytes
        self.op(
            "attention-softmax",
            "softmax",
            5 * scores.numel,
            [scores],
            [probs],
            [probs],
            fwd_bytes=half + full,
            bwd_bytes=half + half + full,
        )
        softmax_and_dropout = len(self.ops) - 1  # where the ops Tempo fuses with the context begin
        dropped = self.dropout("attention-dropout", probs, dropout)
        context_flops = 2 * batch * heads * seq * seq * head_dim
        # Tempo: P, not the dropped-out probabilities (remade from P and the seed in backward)
        kept = probs if self.tempo else dropped
        self.op("attention-context", "bmm", context_flops, [dropped, vv], [out], [kept, *qkv_kept])
        if self.tempo:
            # One fused op (tempo.ops.attention): its backward holds dS, dV and dOut (the context
            # op's working set: P's size, V's, the output's) and its workspace; no separate
            # gradient of P or of the dropped-out P, so the softmax's and the dropout's own
            # working sets are not held.
            for op in self.ops[softmax_and_dropout:-1]:
                op.working = sp.S.Zero
            self.ops[-1].working = self.ops[-1].working + attention_workspace
        return out

    def mlp(self, x: Sym, gated: bool, dropout: bool) -> Sym:
        if gated:  # SwiGLU: down(silu(gate(x)) * up(x))
            gate = self.linear("mlp-gate", x, f / t)
            up = self.linear("mlp-up", x, f / t)
            # megatron-core runs the two as one linear (linear_fc1): its backward holds both
            # outputs' gradients and both weights' at once, and the input's gradient once
            self.ops[-2].working = self.ops[-2].working + self.ops[-1].working - x.nbytes
            self.ops[-1].working = sp.S.Zero
            activated = Sym(gate.shape)
            # Fused, as Megatron-LM runs it (its default --bias-swiglu-fusion): one op keeps the
            # gate and up projections and recomputes silu(gate) in backward, so silu's output
            # is never kept.
            self.elementwise("mlp-silu", 5 * gate.numel, [gate], [activated], [gate])
            product = Sym(gate.shape)
            self.elementwise("mlp-mul", gate.numel, [activated, up], [product], [up])
            # Tempo's SwiGLU: the product is recomputed from gate and up for the down projection
            y = self.linear("mlp-down", product, h, keeps_input=not self.tempo)
            if self.tempo:
                # One fused op (tempo.ops.swiglu_down): its backward holds d_gate and d_up where
                # the down projection's holds the product's gradient (dOut and the weight's
                # gradient as in any linear), and its workspace; no gradient of silu(gate) or of
                # the product beside them
                self.ops[-3].working = self.ops[-2].working = sp.S.Zero
                down = self.ops[-1]
                down.working = down.working - product.nbytes + gate.nbytes + up.nbytes + swiglu_workspace
        else:
            up = self.linear("mlp-gemm-1", x, f / t)
            activated = Sym(up.shape)
            # Tempo's GELU: its output (the next GEMM keeps it anyway) and one bit an element
            # (which side of GELU's minimum), its input recovered in backward
            keep = [activated, Sym((*up.shape[:-1], up.shape[-1] / 8), MASK)] if self.tempo else [up]
            self.elementwise("mlp-gelu", 8 * up.numel, [up], [activated], keep)
            y = self.linear("mlp-gemm-2", activated, h)
        return y


def trace_layer(model: ModelSpec, sequence_parallel: bool = False) -> list[Op]:
    """The ops of one transformer layer of ``model`` on one TP rank, symbolic in (b, s, t, ...).
    x: the residual stream, y: a normed (block) input, as the tracer's building blocks name them."""
    tracer = Tracer(sp_=sequence_parallel, tempo=model.tempo)
    rms = model.norm == "rmsnorm"
    dropout = model.dropout > 0
    head_dim = h / a
    x = tracer.stream()

    def attention_block(y: Sym) -> Sym:
        y = tracer.gathered("attention-gather", y)
        qkv = tracer.linear("attention-qkv", y, (a + 2 * kv) * head_dim / t)
        # query, key and value (vv: v is the vocabulary's symbol)
        q = Sym((b, s, a / t, head_dim))
        k, vv = Sym((b, s, kv / t, head_dim)), Sym((b, s, kv / t, head_dim))
        # q, k and v are views of the QKV projection's output: keeping v keeps all of it
        if model.positions == "rotary":  # rotary on q and k: reads them and writes rotated copies
            tracer.op("attention-rotary", "act", 6 * (q.numel + k.numel), [qkv], [q, k], [], bwd_scale=1)
            qkv_kept = [q, k, qkv]
        else:
            tracer.op("attention-split", "add", 0, [], [], [])
            qkv_kept = [qkv]
        context = tracer.attention(q, k, vv, model.flash, dropout, qkv_kept)
        return tracer.linear("attention-dense", context, h)

    if model.parallel_block:  # parallel attention and MLP on one shared norm
        y = tracer.norm("layernorm-1", x, rms)
        attn = attention_block(y)
        mlp_input = tracer.gathered("mlp-gather", y)
        mlp = tracer.mlp(mlp_input, model.gated_mlp, dropout)
        both = tracer.add("attention-mlp-add", attn, mlp)
        both = tracer.reduce_out("mlp-reduce", both)
        both = tracer.dropout("post-mlp-dropout", both, dropout)
        tracer.add("residual-2", x, both)
        return tracer.ops
    y = tracer.norm("layernorm-1", x, rms)
    attn = tracer.reduce_out("attention-reduce", attention_block(y))
    attn = tracer.dropout("post-attention-dropout", attn, dropout)
    x = tracer.add("residual-1", x, attn)
    y = tracer.norm("layernorm-2", x, rms)
    y = tracer.gathered("mlp-gather", y)
    out = tracer.reduce_out("mlp-reduce", tracer.mlp(y, model.gated_mlp, dropout))
    out = tracer.dropout("post-mlp-dropout", out, dropout)
    tracer.add("residual-2", x, out)
    return tracer.ops


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer, per-TP-rank costs as sympy expressions in SYMBOLS."""

    flops_fwd: sp.Expr
    flops_bwd: sp.Expr
    saved_bytes: sp.Expr  # kept for backward per micro-batch (no recompute)
    # kept with the core attention recomputed in backward (selective recomputation): its inputs
    # instead of its insides
    selective_saved_bytes: sp.Expr
    # the layer's backward at its peak op, the layer's own kept tensors included: what the ops up
    # to that one keep (backward has freed what the later ops kept), with that op's working set
    # (Op.working); the largest over its ops (_backward_peak)
    backward_peak_bytes: sp.Expr
    # the same under selective recomputation: what the layer keeps then, and in the core
    # attention's backward its insides made again, up to the op running
    selective_backward_peak_bytes: sp.Expr
    params: sp.Expr  # parameter count per rank
    # TP collectives per forward, bytes of the full tensor each; backward mirrors them (an
    # all-reduce for each all-reduce; under SP a reduce-scatter per all-gather and vice versa,
    # plus an all-gather per kept shard to rebuild the GEMM input)
    tp_all_reduce: sp.Expr
    tp_all_gather: sp.Expr
    tp_reduce_scatter: sp.Expr

    def compiled(self, model: ModelSpec) -> Callable[..., dict[str, np.ndarray]]:
        return _compile(self, model)


def _backward_peak(ops: list[Op], selective: bool = False) -> sp.Expr:
    """The most bytes a layer's backward holds, its own kept tensors included: at op i's backward
    (backward runs the ops last to first), what ops 0..i keep (a tensor lives until the first op
    that keeps it is done) with op i's working set; the largest over i. Under ``selective``
    recomputation the core attention's ops keep only their inputs (``checkpoint_inputs``) until
    backward reaches them and then their insides, made again. Every op's peak, not the largest
    working set on top of all the layer keeps: the core attention's backward comes after the
    MLP's has freed what the MLP kept."""
    peaks = []
    for i, op in enumerate(ops):
        in_core = op.name in CORE_ATTENTION_OPS
        alive: dict[int, Sym] = {}
        for earlier in ops[: i + 1]:
            held = earlier.saved
            if selective and earlier.name in CORE_ATTENTION_OPS:
                held = [*earlier.checkpoint_inputs, *(earlier.saved if in_core else ())]
            for tensor in held:
                alive.setdefault(tensor.uid, tensor)
        peaks.append(sum((tensor.nbytes for tensor in alive.values()), sp.Integer(0)) + op.working)
    # unevaluated: simplifying a Max of sympy sums takes seconds; numpy takes the maximum
    return sp.Max(*peaks, evaluate=False)


def _unique_saved(ops: list[Op], also: tuple[Sym, ...] = ()) -> sp.Expr:
    seen: dict[int, Sym] = {}
    for tensor in [*(saved for op in ops for saved in op.saved), *also]:
        seen.setdefault(tensor.uid, tensor)
    return sum((tensor.nbytes for tensor in seen.values()), sp.Integer(0))


@functools.lru_cache(maxsize=64)
def layer_costs(model: ModelSpec, sequence_parallel: bool = False) -> LayerCosts:
    ops = trace_layer(model, sequence_parallel)
    core = CORE_ATTENTION_OPS
    core_inputs = tuple(tensor for op in ops for tensor in op.checkpoint_inputs)
    gemm_flops = sum((op.flops for op in ops if op.kind in ("gemm", "bmm", "attention")), sp.Integer(0))
    other_flops = sum((op.flops for op in ops if op.kind not in ("gemm", "bmm", "attention")), sp.Integer(0))
    flash_recompute = sum((op.flops / 2 for op in ops if op.kind == "attention"), sp.Integer(0))
    head_dim = h / a
    norms = 1 if model.parallel_block else 2
    norm_params = norms * h * (1 if model.norm == "rmsnorm" else 2)
    mlp_params = (3 if model.gated_mlp else 2) * h * f
    params = (h * (a + 2 * kv) * head_dim + h * h + mlp_params) / t + norm_params

    def comm(kind: str) -> sp.Expr:
        return sum((op.message for op in ops if op.collective == kind), sp.Integer(0))

    return LayerCosts(
        flops_fwd=sp.expand(gemm_flops + other_flops),
        flops_bwd=sp.expand(2 * gemm_flops + flash_recompute + other_flops),
        saved_bytes=sp.expand(_unique_saved(ops)),
        selective_saved_bytes=sp.expand(
            _unique_saved([op for op in ops if op.name not in core], core_inputs)
        ),
        backward_peak_bytes=_backward_peak(ops),
        selective_backward_peak_bytes=_backward_peak(ops, selective=True),
        params=sp.expand(params),
        tp_all_reduce=comm("all_reduce"),
        tp_all_gather=comm("all_gather"),
        tp_reduce_scatter=comm("reduce_scatter"),
    )


def head_costs(model: ModelSpec) -> dict[str, sp.Expr]:
    """Embedding (vocab-parallel) and the final norm + LM head with cross-entropy, per TP rank."""
    logits = b * s * v / t
    return {
        # the token table and, learned, the position table (the first stage's); the untied LM
        # head's weights (the last stage's) are the token table's shape alone
        "embed_params": v * h / t + (h * s if model.positions == "learned" else 0),
        "head_params": v * h / t,
        "head_flops_fwd": 2 * b * s * h * v / t,
        # final-norm input, head input, fp32 logits for the loss (Megatron's vocab-parallel CE)
        "head_saved_bytes": 2 * b * s * h * HALF + logits * FP32,
        # work units of the runtime model's "loss" and "embedding" curves
        "logits_fp32_bytes": logits * FP32,
        "embed_table_bytes": v * h / t * HALF,  # the table's gradient, zeroed and scattered into
        "embed_tokens_bytes": b * s * h * HALF,  # the looked-up rows
        "final_norm_bytes": 2 * b * s * h * HALF,  # input and output of the final norm
    }


def numeric(model: ModelSpec) -> dict[sp.Symbol, int]:
    return {h: model.hidden, a: model.heads, kv: model.kv, f: model.ffn_hidden, v: model.vocab}


def as_integers(values: dict[sp.Symbol, int]) -> dict[sp.Symbol, sp.Integer]:
    """For ``xreplace``: a plain replacement of symbols by exact integers (no pattern matching,
    unlike ``subs``), 10-60x faster and the same exact result: sympy evaluates the numbers as it
    rebuilds the expression."""
    return {symbol: sp.Integer(number) for symbol, number in values.items()}


def value(expr: sp.Expr, model: ModelSpec, batch: int, seq: int, tp: int) -> float:
    """One expression at one point (for scalars; use LayerCosts.compiled for arrays)."""
    return float(sp.sympify(expr).xreplace(as_integers({**numeric(model), b: batch, s: seq, t: tp})))


def _with_numbers(expr: sp.Expr, fixed: dict[sp.Symbol, sp.Integer]) -> sp.Expr:
    """``expr.xreplace(fixed)``, a Max at its top left unevaluated: xreplace rebuilds a Max and
    sympy then proves which of its terms is largest, seconds a model (half of a small search)
    for what numpy's maximum over all of them gives."""
    if isinstance(expr, sp.Max):
        return sp.Max(*(term.xreplace(fixed) for term in expr.args), evaluate=False)
    return expr.xreplace(fixed)


@functools.lru_cache(maxsize=64)
def _compile(costs: LayerCosts, model: ModelSpec) -> Callable[..., dict[str, np.ndarray]]:
    fixed = as_integers(numeric(model))
    names = [
        "flops_fwd",
        "flops_bwd",
        "saved_bytes",
        "selective_saved_bytes",
        "backward_peak_bytes",
        "selective_backward_peak_bytes",
        "params",
        "tp_all_reduce",
        "tp_all_gather",
        "tp_reduce_scatter",
    ]
    exprs = [_with_numbers(getattr(costs, name), fixed) for name in names]
    lambdified = sp.lambdify((b, s, t, attention_workspace, swiglu_workspace), exprs, "numpy")

    def evaluate(batch, seq, tp, *, attention: float, swiglu: float) -> dict[str, np.ndarray]:
        """``attention``, ``swiglu``: the bytes of Tempo's fused attention core's and SwiGLU's
        workspaces (``attention_workspace``, ``swiglu_workspace``; 0 for other layers), asked for
        always so that no caller prices Tempo's layers without them."""
        sizes = [np.asarray(size, float) for size in (batch, seq, tp, attention, swiglu)]
        values = lambdified(*sizes)
        shape = np.broadcast(*sizes).shape
        return {
            name: np.broadcast_to(np.asarray(column, float), shape)
            for name, column in zip(names, values, strict=True)
        }

    return evaluate
