"""Mist's symbolic analysis against the literature's closed forms and against autograd."""

from __future__ import annotations

import math

import pytest
import sympy as sp
import torch
from torch import nn

from measure.saved import cuda_like_dropout, saved_bytes
from mist.model.specs import ModelSpec, cluster, model
from mist.model.symbolic import (
    a,
    attention_workspace,
    b,
    f,
    h,
    head_costs,
    kv,
    layer_costs,
    s,
    swiglu_workspace,
    t,
    trace_layer,
    v,
    value,
)

GPT3 = {f: 4 * h, kv: a}  # GPT-3 shapes: ffn 4h, multi-head attention
LN_STATS = 2 * 2 * 4 * s * b  # two LayerNorms keep mean and rstd in fp32 (below the closed forms)


def test_korthikanti_activation_memory():
    """Per layer, half precision: 34sbh + 5as^2b; with TP t: sbh(10 + 24/t) + 5as^2b/t; with
    sequence parallelism (34sbh + 5as^2b)/t (Korthikanti et al. 2022, Eqs. 1-3)."""
    gpt = model("gpt3-1.3b", flash=False)
    plain = layer_costs(gpt).saved_bytes.subs(GPT3)
    assert sp.simplify(plain.subs(t, 1) - (34 * s * b * h + 5 * a * s**2 * b) - LN_STATS) == 0
    assert sp.simplify(plain - (s * b * h * (10 + 24 / t) + 5 * a * s**2 * b / t) - LN_STATS) == 0
    seq_par = layer_costs(gpt, sequence_parallel=True).saved_bytes.subs(GPT3)
    assert sp.simplify(seq_par - (34 * s * b * h + 5 * a * s**2 * b) / t - LN_STATS / t) == 0


def test_flash_attention_keeps_no_s_squared_term():
    saved = layer_costs(model("gpt3-1.3b", flash=True)).saved_bytes.subs(GPT3)
    lse = 4 * a * s * b / t  # FlashAttention keeps the fp32 row log-sum-exp
    assert sp.simplify(saved - s * b * h * (10 + 24 / t) - lse - LN_STATS) == 0


def test_narayanan_flops():
    """Forward FLOPs of a layer: 24bsh^2 + 4bs^2h (Narayanan et al. 2021) plus elementwise
    terms of lower order; the LM head 2bshV; backward twice the GEMMs."""
    c = layer_costs(model("gpt3-1.3b", flash=False))
    fwd = sp.expand(c.flops_fwd.subs(GPT3).subs(t, 1))
    poly = sp.Poly(fwd, b, s, h, a)
    assert poly.coeff_monomial(b * s * h**2) == 24
    assert poly.coeff_monomial(b * s**2 * h) == 4
    lower = sp.expand(fwd - 24 * b * s * h**2 - 4 * b * s**2 * h)
    assert all(sp.Poly(term, h).degree() <= 1 for term in lower.as_ordered_terms())  # O(bsh), O(as^2b)
    gemm_fwd = 24 * b * s * h**2 + 4 * b * s**2 * h
    assert sp.expand(c.flops_bwd.subs(GPT3).subs(t, 1) - 2 * gemm_fwd).subs(
        {h: 4096, s: 2048, a: 32, b: 1}
    ) < (0.01 * 2 * gemm_fwd.subs({h: 4096, s: 2048, b: 1}))
    assert head_costs(model("gpt3-1.3b"))["head_flops_fwd"] == 2 * b * s * h * v / t


def test_parameter_counts_match_the_presets_names():
    """12h^2 per GPT-3 layer: the presets come out at their nominal sizes."""
    for name, nominal in [("gpt3-1.3b", 1.3e9), ("gpt3-2.7b", 2.7e9), ("gpt3-7b", 6.7e9), ("gpt3-13b", 13e9)]:
        m = model(name)
        per_layer = value(layer_costs(m).params, m, 1, m.seq, 1)
        total = m.layers * per_layer + value(head_costs(m)["embed_params"], m, 1, m.seq, 1)
        assert total == pytest.approx(nominal, rel=0.06), name
    assert sp.simplify(layer_costs(model("gpt3-1.3b")).params.subs(GPT3) - (12 * h**2 / t + 4 * h)) == 0


class MegatronStyleLayer(nn.Module):
    """A GPT-3 layer written as Megatron writes it (no biases), to measure with autograd."""

    def __init__(self, hidden: int, heads: int, p: float = 0.1) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.dense = nn.Linear(hidden, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc2 = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, hid = x.shape
        d = hid // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(bsz, seq, 3, self.heads, d).unbind(2)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1 / math.sqrt(d))
        probs = nn.functional.dropout(scores.softmax(-1), self.p, self.training)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, seq, hid)
        x = x + nn.functional.dropout(self.dense(ctx), self.p, self.training)
        y = self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))
        return x + nn.functional.dropout(y, self.p, self.training)


@pytest.mark.parametrize("shape", [(2, 16, 64, 4), (3, 24, 96, 6)])
def test_saved_bytes_match_autograd_on_a_real_layer(shape):
    """The symbolic count equals, byte for byte, what autograd keeps for a real layer (bf16 on
    CPU, dropout masks as the CUDA kernel keeps them). One CPU difference remains: CPU LayerNorm
    keeps its mean and rstd in the input dtype, CUDA (and the symbolic count) in fp32."""
    bsz, seq, hidden, heads = shape
    layer = MegatronStyleLayer(hidden, heads).to(torch.bfloat16).train()
    x = torch.randn(bsz, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    with cuda_like_dropout():
        measured = saved_bytes(layer, x)
    spec = ModelSpec("tiny", hidden, 1, heads, vocab=128, seq=seq, flash=False)
    predicted = value(layer_costs(spec).saved_bytes, spec, bsz, seq, 1)
    ln_stats_cpu_vs_cuda = 2 * 2 * (4 - 2) * bsz * seq  # two LayerNorms, mean and rstd
    assert measured.total_bytes == predicted - ln_stats_cpu_vs_cuda


def test_backward_peak_holds_what_the_ops_up_to_the_running_one_keep():
    """A layer's backward peak, op by op (backward runs them last to first): what ops 0..i keep
    with op i's working set, the largest over i; under selective recomputation the core
    attention's ops hold their inputs until backward reaches them, then their insides remade.
    Four ops with sizes a test can add up. Control: the largest working set on top of all the
    layer keeps (the model until 2026-12-05) is larger."""
    from mist.model.symbolic import Op, Sym, _backward_peak

    def tensor(nbytes):
        return Sym((sp.Integer(nbytes),), itemsize=1)

    x, q, probs, m = tensor(10), tensor(20), tensor(100), tensor(50)
    ops = [
        Op("layernorm-1", "norm", 0, 0, 0, [x], working=sp.Integer(5)),
        Op("attention-score", "bmm", 0, 0, 0, [q], working=sp.Integer(7), checkpoint_inputs=(q,)),
        Op("attention-softmax", "softmax", 0, 0, 0, [probs], working=sp.Integer(200)),
        Op("mlp-gemm-1", "gemm", 0, 0, 0, [m], working=sp.Integer(30)),
    ]
    assert sorted(int(p) for p in _backward_peak(ops).args) == [10 + 5, 30 + 7, 180 + 30, 130 + 200]
    # selective: the MLP's backward holds x, q (the core's input) and m, not the probabilities
    assert sorted(int(p) for p in _backward_peak(ops, selective=True).args) == [15, 37, 110, 330]
    assert max(int(p) for p in _backward_peak(ops).args) == 330 < 180 + 200


def test_backward_peak_of_gpt3_without_flash_is_the_attention_context():
    """GPT-3 1.3B without FlashAttention on one TP rank at sequence 4096: backward peaks at the
    core attention's context op, the MLP's tensors freed: the attention's inputs and the norm's
    (10sbh + 8sb), P, its dropout mask and the dropped-out P (5as^2b), and the op's working set
    (dP-sized 2as^2b, dV and dOut: 4sbh). Below what the layer keeps (34sbh + 5as^2b + 8sb) with
    the softmax's working set (4as^2b) on top. At sequence 2048 the MLP's second GEMM is the
    peak instead: all but the last dropout's mask kept, its working set (2sbf + 2sbh) and its
    weight's gradient (2fh)."""
    costs = layer_costs(model("gpt3-1.3b", flash=False))
    for seq in (4096, 2048):
        point = {a: 16, kv: 16, b: 2, s: seq, h: 2048, f: 4 * 2048, t: 1}
        peak = max(float(term.xreplace(point)) for term in costs.backward_peak_bytes.args)
        bsh, as2b, saved = 2 * seq * 2048, 16 * seq**2 * 2, float(costs.saved_bytes.xreplace(point))
        context, second_gemm = 14 * bsh + 8 * 2 * seq + 7 * as2b, saved - bsh + 10 * bsh + 2 * 8192 * 2048
        assert peak == (context if seq == 4096 else second_gemm) == max(context, second_gemm), seq
        assert peak < saved + 4 * as2b


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gated_mlp_gate_and_up_backward_as_one_linear(sequence_parallel):
    """megatron-core's gate and up projections are one linear (linear_fc1): its backward holds
    the input's gradient once (the gathered input's under sequence parallelism), both outputs'
    gradients and both weights' gradients, at one op; the second projection's op holds none.
    A GELU MLP's first linear: the input's, the output's and its weight's gradients."""
    ops = {op.name: op for op in trace_layer(model("llama-7b"), sequence_parallel)}
    fc1 = 2 * b * s * h + 2 * (2 * b * s * f / t) + 2 * (2 * h * f / t)
    assert sp.simplify(ops["mlp-gate"].working - fc1) == 0
    assert ops["mlp-up"].working == 0
    gelu = {op.name: op for op in trace_layer(model("gpt3-1.3b"), sequence_parallel)}
    assert sp.simplify(gelu["mlp-gemm-1"].working - (2 * b * s * h + 2 * b * s * f / t + 2 * h * f / t)) == 0


def test_tempo_attention_core_backward_is_one_op_with_its_workspace():
    """Tempo's attention core is one fused op: its backward holds dS (the scores' size), dV, dOut
    and its workspace (``attention_workspace``, a number per device), and no gradient of P or of
    the dropped-out P as the plain layer's softmax and dropout do (4as^2b each)."""
    ops = {op.name: op for op in trace_layer(model("gpt3-1.3b", flash=False, tempo=True))}
    assert ops["attention-softmax"].working == ops["attention-dropout"].working == 0
    context = ops["attention-context"].working.subs(GPT3)
    assert sp.simplify(context - (2 * a * s**2 * b / t + 4 * b * s * h / t + attention_workspace)) == 0
    plain = {op.name: op for op in trace_layer(model("gpt3-1.3b", flash=False))}
    assert attention_workspace not in plain["attention-context"].working.free_symbols
    assert sp.simplify(plain["attention-softmax"].working - 4 * a * s**2 * b / t) == 0


def test_tempo_swiglu_backward_is_one_op_with_its_workspace():
    """Tempo's SwiGLU fused with the down projection is one op: its backward holds d_gate, d_up,
    dOut, the down weight's gradient and its workspace (``swiglu_workspace``), and no gradient of
    silu(gate) or of their product as the plain layer's SiLU and product do."""
    ops = {op.name: op for op in trace_layer(model("llama-7b", tempo=True))}
    assert ops["mlp-silu"].working == ops["mlp-mul"].working == 0
    held = 4 * b * s * f / t + 2 * b * s * h + 2 * h * f / t  # d_gate, d_up, dOut, the weight's gradient
    assert sp.simplify(ops["mlp-down"].working - (held + swiglu_workspace)) == 0
    plain = {op.name: op for op in trace_layer(model("llama-7b"))}
    assert sp.simplify(plain["mlp-mul"].working - 6 * b * s * f / t) == 0
    assert swiglu_workspace not in plain["mlp-down"].working.free_symbols


@pytest.mark.parametrize("device", ["cpu", "h100"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_tempo_attention_workspace_is_what_the_engine_call_declares(device, dropout):
    """What the planner adds for Tempo's attention core is tempo.ops' statement for the call
    tempo.megatron makes on one TP rank: bf16 scores and V of (b, heads / t, s, ...). On a CPU, a
    chunk of heads of the PyTorch path; on a GPU, the kernels' dropped-out P (with dropout only).
    Plain layers and FlashAttention add none."""
    from mist.tuning.stage_cost import Setting, tempo_attention_workspace
    from tempo.ops import workspace_bytes

    tp, micro_batch, seq = 2, 8, 128
    lean = model("gpt3-1.3b", flash=False, tempo=True, seq=seq, dropout=dropout)
    heads = lean.heads // tp

    def setting(m):  # the workspace needs the model, the device, TP and the micro-batch only
        return Setting(m, cluster(device, tp), None, None, tp, 1, micro_batch, 1)

    probs = torch.empty(micro_batch, heads, seq, seq, dtype=torch.bfloat16)
    value_ = torch.empty(micro_batch, heads, seq, lean.hidden // lean.heads, dtype=torch.bfloat16)
    grad_out = torch.empty_like(value_[..., :seq, :])
    call = (grad_out, None, probs, value_, dropout, torch.tensor(0), torch.bfloat16)
    target = "cpu" if device == "cpu" else "cuda"
    declared = workspace_bytes("tempo::attention_core_bwd", call, {}, target)
    assert tempo_attention_workspace(setting(lean)) == declared
    assert declared > 0 or (device != "cpu" and dropout == 0)
    for other in (model("gpt3-1.3b", flash=False, seq=seq), model("gpt3-1.3b", tempo=True, seq=seq)):
        assert tempo_attention_workspace(setting(other)) == 0


@pytest.mark.parametrize("device", ["cpu", "h100"])
def test_tempo_swiglu_workspace_is_what_the_engine_call_declares(device):
    """What the planner adds for Tempo's SwiGLU is tempo.ops' statement for the backward call
    tempo.megatron makes on one TP rank: bf16 gate and up of (s, b, ffn / t). On a CPU two
    ffn-wide temporaries; on a GPU none. Plain layers and GELU MLPs add none."""
    from mist.tuning.stage_cost import Setting, tempo_swiglu_workspace
    from tempo.ops import workspace_bytes

    tp, micro_batch, seq = 2, 4, 64
    lean = model("llama-7b", tempo=True, seq=seq)

    def setting(m):
        return Setting(m, cluster(device, tp), None, None, tp, 1, micro_batch, 1)

    gate = torch.empty(seq, micro_batch, lean.ffn_hidden // tp, dtype=torch.bfloat16, device="meta")
    grad = torch.empty(seq, micro_batch, lean.hidden, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(lean.hidden, lean.ffn_hidden // tp, dtype=torch.bfloat16, device="meta")
    call = (grad, gate, torch.empty_like(gate), weight)
    target = "cpu" if device == "cpu" else "cuda"
    declared = workspace_bytes("tempo::swiglu_down_bwd", call, {}, target)
    assert tempo_swiglu_workspace(setting(lean)) == declared
    assert declared == (2 * gate.numel() * 2 if device == "cpu" else 0)
    # the forward's, which the planner does not price (backward is the peak): h on a GPU
    forward = workspace_bytes("tempo::swiglu_down", (gate, torch.empty_like(gate), weight, None), {}, target)
    assert forward == (2 if device == "cpu" else 1) * gate.numel() * 2
    for other in (model("llama-7b", seq=seq), model("gpt3-1.3b", tempo=True, seq=seq)):
        assert tempo_swiglu_workspace(setting(other)) == 0


def test_layer_choices_are_fields_not_names():
    """A GPT-3 preset given Llama's layer choices costs exactly what the Llama preset does: the
    fields decide, not the family in the name."""
    llama = model("llama-7b")
    assert (llama.norm, llama.gated_mlp, llama.positions, llama.dropout) == ("rmsnorm", True, "rotary", 0.0)
    dressed = model("gpt3-7b", norm="rmsnorm", gated_mlp=True, positions="rotary", dropout=0.0)
    assert dressed.ffn_hidden == llama.ffn_hidden != 4 * llama.hidden
    assert layer_costs(dressed) == layer_costs(llama)
    assert head_costs(dressed) == head_costs(llama)
    falcon = model("falcon-7b")
    sequential = model("falcon-7b", parallel_block=False)
    assert falcon.parallel_block and layer_costs(falcon) != layer_costs(sequential)
    with pytest.raises(ValueError, match="norm must be one of"):
        model("gpt3-7b", norm="batchnorm")
    with pytest.raises(ValueError, match="layers must be a positive integer"):
        model("gpt3-7b", layers=12.5)
