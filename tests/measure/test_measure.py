"""Measurement tools: saved-for-backward bytes (hand-counted), the fake-tensor step estimator
(against real CPU runs), result files (atomic, resumable)."""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import math
import random
import weakref

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining
from transformers.utils import logging as hf_logging

import tempo
from measure.budget import GpuBudget
from measure.cpu_peak import cpu_peak_bytes
from measure.datasheets import DATASHEETS_FILE, datasheets, read_datasheets
from measure.memory import DepthExtrapolatedEstimator, LiveMemoryTracker, StepMemoryEstimator
from measure.saved import SavedTensorsMeter, cuda_like_dropout, saved_bytes
from measure.training import Precision, make_optimizer, optimizer_state_tensors, train_step
from measure.units import GiB
from tempo.ops import cpu_bytes_per_chunk_elem, workspace_bytes
from tests.preset_copies import drop_field, refused_in_one_line, renamed_field, set_field

hf_logging.set_verbosity_error()


# ---------------------------------------------------------------- saved-for-backward bytes


def test_saved_bytes_hand_counted():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 32)
            self.act = nn.ReLU()

        def forward(self, x):
            h = self.lin(x)  # keeps x (an input) and the weight (a parameter), not its output h
            r = self.act(h)  # keeps r, first saved inside the ReLU submodule
            sq = r * r  # keeps r twice: counted once, still attributed to the ReLU
            a, b = h[:, :16], h[:, 16:]  # two views of h's storage
            return sq.sum() + (a * b).sum()  # keeps both views: h counted once, saved first here in M

    x = torch.randn(8, 16, requires_grad=True)
    r = saved_bytes(M(), x)
    assert r.input_bytes == 8 * 16 * 4
    assert r.parameter_bytes == 32 * 16 * 4
    assert r.activation_bytes == 2 * 8 * 32 * 4  # r and h
    # Each storage goes to the innermost module running when it was first saved.
    assert r.by_module == {"act": 8 * 32 * 4, "<model>": 8 * 32 * 4}
    assert r.by_module_type == {"ReLU": 8 * 32 * 4, "M": 8 * 32 * 4}
    assert r.by_dtype == {"float32": 2 * 8 * 32 * 4}
    assert r.storages == 4  # x, the weight, r, h


class _Sentinel:
    """Held by an autograd node's ctx: alive exactly as long as the graph that node is in."""


class _ExpKeepingItsOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)  # a saved output: the case that made a cycle
        ctx.sentinel = _Sentinel()
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


def _graph_alive_after_its_output_goes(hooks) -> bool:
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    with hooks:
        y = _ExpKeepingItsOutput.apply(x)
    sentinel = weakref.ref(y.grad_fn.sentinel)
    del y
    gc.collect()
    return sentinel() is not None


def test_a_measured_graph_is_freed_with_its_output():
    """The meter's pack hook returned each saved tensor itself: a saved output then held its own
    grad_fn, a cycle through autograd's C++ that Python's collector cannot see, so every graph
    measured stayed alive with what its nodes held (megatron-core's process groups: 48 gloo
    threads a layer measured, 12,834 in a seed-sweep worker). Control: hooks that return the
    tensor itself keep the graph."""
    meter = SavedTensorsMeter()
    assert not _graph_alive_after_its_output_goes(meter)
    assert meter.report().activation_bytes == 5 * 7 * 8  # still counted
    itself = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    assert _graph_alive_after_its_output_goes(itself)


def _model_freed_by_reference_counting(measure) -> bool:
    """Whether a model measured (``measure(model)``) is freed as its last name goes, the cyclic
    collector held off: a cycle holding it would keep it (and what it holds) until that collector
    runs, which in a large process is rare."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    freed = weakref.ref(model)
    gc.disable()
    try:
        kept = measure(model)
        del model, kept
        return freed() is None
    finally:
        gc.enable()


def _measured(model: nn.Module) -> SavedTensorsMeter:
    with SavedTensorsMeter(model) as meter:
        model(torch.randn(2, 4)).sum()
    assert meter.report().activation_bytes > 0
    return meter


def test_a_meter_does_not_keep_its_model_in_a_cycle():
    """The meter held its saved-tensor hooks, which hold its bound methods: a cycle (meter -> hooks
    -> meter) that kept the model until Python's cyclic collector ran. In a seed-sweep worker it ran
    too rarely: megatron-core layers measured, each with its process groups, piled up to 6,000 gloo
    threads. Control: a meter kept in a cycle keeps its model."""

    def in_a_cycle(model):
        meter = _measured(model)
        meter.itself = meter
        return meter

    assert _model_freed_by_reference_counting(_measured)
    assert not _model_freed_by_reference_counting(in_a_cycle)


def test_a_measured_graph_gives_the_same_gradients(rng):
    """Saved tensors packed detached (same storage and version counter) unpack to what autograd
    saved: the gradients of a graph measured equal those of the same graph unmeasured."""
    x = torch.from_numpy(rng.standard_normal((6, 5)))
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    grads = []
    for measured in (False, True):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        meter = SavedTensorsMeter(model, inputs=(xi,)) if measured else contextlib.nullcontext()
        with meter:
            y = _ExpKeepingItsOutput.apply(model(xi)).sum()
        y.backward()
        grads.append([xi.grad, *(p.grad for p in model.parameters())])
    for plain, measured in zip(*grads, strict=True):
        # the same float64 ops on the same inputs: equal up to a BLAS's choice of path (a few ulps)
        torch.testing.assert_close(measured, plain, rtol=1e-12, atol=1e-12)


def test_cuda_like_dropout_keeps_a_bool_mask():
    x = torch.randn(10, 100, dtype=torch.bfloat16, requires_grad=True)
    drop = nn.Dropout(0.1)
    assert saved_bytes(drop, x).activation_bytes == 1000 * 2  # CPU: mask in x's dtype
    with cuda_like_dropout():
        assert saved_bytes(drop, x).activation_bytes == 1000  # CUDA: bool mask


# ---------------------------------------------------------------- live-memory tracker


def test_tracker_follows_allocations_and_frees():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), LiveMemoryTracker(granularity=1) as t:
        a = torch.empty(1000)  # 4000 B
        b = a.view(10, 100)  # a view: no new storage
        c = torch.empty(500)  # 2000 B
        assert t.current == 6000
        del a, c
        assert t.current == 4000  # b still holds a's storage
        d = torch.empty(3000, dtype=torch.uint8)
        assert t.peak == 7000 and t.current == 7000
        del b, d
        assert t.current == 0


def test_allocation_granularity_rounds_up():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), LiveMemoryTracker() as t:
        x = torch.empty(3, dtype=torch.uint8)
        assert t.current == 512
        del x


def test_kept_scale_counts_a_share_of_the_saved_storages_while_they_live():
    """KeptScale's shares: a storage marked saved counts its share of its bytes from its marking
    until it is freed; the others count whole. Negative control: share 1 counts full bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from measure.saved import storage_key

    for share, peaks in ((0.25, (7000, 8000)), (1.0, (10000, 10000))):
        with FakeTensorMode(), LiveMemoryTracker(granularity=1) as t:
            kept = torch.empty(1000)  # 4000 B, saved for backward
            t.mark_saved(storage_key(kept), share)
            transient = torch.empty(1500)  # 6000 B
            assert t.peak == peaks[0], (share, t.peak)
            del kept  # freed in backward: no longer counted at all
            assert t.discount == 0
            more = torch.empty(500)  # 2000 B beside the transient: 8000 B live, none saved
            assert t.peak == peaks[1], (share, t.peak)
            del transient, more
    with FakeTensorMode(), LiveMemoryTracker(granularity=1) as t:  # a share above 1: more at once
        kept = torch.empty(1000)
        t.mark_saved(storage_key(kept), 1.5)
        assert t.peak == 6000
        del kept


def test_kept_scale_shares_the_layers_and_the_rest_apart():
    """A step's activations saved inside the layers count the layers' share, the others the
    rest's: counting none of the layers' gives the eager peak less at most what the layers keep,
    and none of the rest's likewise; both at once below either."""
    from measure.memory import KeptScale

    def layers_of(model):
        return list(model.bert.encoder.layer)

    def peak(layers: float, rest: float) -> int:
        scale = KeptScale(layers, rest, layers_of)
        return StepMemoryEstimator(small_bert(False), bert_batch, "fp32", kept_scale=scale).peak(4).peak_bytes

    eager = StepMemoryEstimator(small_bert(False), bert_batch, "fp32").peak(4).peak_bytes
    assert peak(1.0, 1.0) == eager
    no_layers, no_rest = peak(1e-9, 1.0), peak(1.0, 1e-9)
    assert no_layers < eager and no_rest < eager
    assert peak(1e-9, 1e-9) < min(no_layers, no_rest)


@pytest.mark.parametrize("share", [0, -0.5, float("nan"), float("inf"), True, "0.5"])
def test_kept_scale_refuses_what_is_not_a_positive_share(share):
    from measure.memory import KeptScale

    with pytest.raises(ValueError, match="kept_scale's layers must be a finite number above 0"):
        KeptScale(share, 1.0, list)
    with pytest.raises(ValueError, match=r"kept_scale must be a measure\.memory\.KeptScale"):
        StepMemoryEstimator(small_bert(False), bert_batch, "fp32", kept_scale=0.5)


# ---------------------------------------------------------------- step estimator vs real runs


def small_bert(with_tempo: bool):
    def build():
        cfg = BertConfig(
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=1000,
            attn_implementation="eager",
        )
        m = BertForPreTraining(cfg)
        if with_tempo:
            tempo.patch(m)
        return m

    return build


def bert_batch(b: int, seq: int = 128) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, 1000, (b, seq)),
        "labels": torch.randint(0, 1000, (b, seq)),
        "next_sentence_label": torch.randint(0, 2, (b,)),
    }


def real_cpu_peak(build, precision: str, b: int) -> int:
    """Peak bytes of a real step on CPU: live tensors before it + the CPU allocator's own peak
    during it (profiler memory events), independent of the estimator's bookkeeping."""
    p = Precision(precision)
    model = build().to(p.model_dtype).train()
    opt = make_optimizer(model, p)
    train_step(model, bert_batch(1), opt, p)
    batch = bert_batch(b)
    live = [*model.parameters(), *model.buffers(), *optimizer_state_tensors(opt), *batch.values()]
    before = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in live}.values())
    peak, _ = cpu_peak_bytes(lambda: train_step(model, batch, opt, p))
    return before + peak


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("with_tempo", [False, True], ids=["hf-eager", "tempo"])
def test_step_estimate_against_real_cpu_run(precision, with_tempo):
    from tempo.ops import cpu_bytes_per_chunk_elem
    from tempo.sizes import CHUNK_ELEMS

    est = StepMemoryEstimator(
        small_bert(with_tempo),
        bert_batch,
        precision,
        granularity=1,
        target="cpu",
        op_workspace=workspace_bytes,
    ).peak(8)
    real = real_cpu_peak(small_bert(with_tempo), precision, 8)
    if not with_tempo:
        assert abs(est.peak_bytes - real) <= 0.002 * real, (est.peak_bytes, real)
    else:
        # Tempo's CPU path is chunked; the estimator adds the declared workspace bound, so it may
        # over-estimate by at most that bound and must not under-estimate (4 KiB: 0-d scalars).
        slack = CHUNK_ELEMS * cpu_bytes_per_chunk_elem("tempo::gelu_bwd")
        assert real - 4096 <= est.peak_bytes <= real + slack, (est.peak_bytes, real)
    assert set(est.breakdown) >= {"parameters", "optimizer_state", "activations"}


def test_max_batch_is_the_boundary():
    est = StepMemoryEstimator(
        small_bert(True), lambda b: bert_batch(b, 64), "bf16", op_workspace=workspace_bytes
    )
    budget = est.peak(5).peak_bytes + 1000
    b, report = est.max_batch(budget)
    assert b == 5 and report.peak_bytes <= budget
    assert est.peak(6).peak_bytes > budget


def test_refine_max_batch_walks_to_the_exact_boundary():
    """From any start, up or down, to the largest batch whose (exact) peak fits; 0 if none does;
    every answer an evaluated point."""
    import random

    from measure.memory import PeakReport, refine_max_batch

    static, per_seq = random.randint(1, 10**9), random.randint(1, 10**8)
    calls = []

    def peak(b: int) -> PeakReport:
        calls.append(b)
        return PeakReport(b, static + per_seq * b, "backward")

    true_b = random.randint(1, 500)
    usable = static + per_seq * true_b + random.randint(0, per_seq - 1)
    for start in (1, true_b - random.randint(1, 5), true_b, true_b + random.randint(1, 5), 0):
        b, report = refine_max_batch(peak, usable, start)
        assert b == true_b and report.batch_size == b and report.peak_bytes <= usable, start
    assert refine_max_batch(peak, static + per_seq - 1, random.randint(1, 50))[0] == 0
    assert set(calls) <= set(range(1, 512))


@pytest.mark.parametrize("with_tempo", [False, True], ids=["hf-eager", "tempo"])
def test_depth_extrapolation_is_exact(with_tempo):
    def build(n_layers: int):
        cfg = BertConfig(
            hidden_size=128,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            intermediate_size=512,
            vocab_size=500,
            attn_implementation="eager",
        )
        m = BertForPreTraining(cfg)
        if with_tempo:
            tempo.patch(m)
        return m

    batch = lambda b: bert_batch(b, 64)
    full = StepMemoryEstimator(lambda: build(7), batch, "amp-bf16", op_workspace=workspace_bytes).peak(6)
    extrapolated = DepthExtrapolatedEstimator(
        build, batch, "amp-bf16", num_layers=7, op_workspace=workspace_bytes
    ).peak(6)
    assert extrapolated.phase_peaks == full.phase_peaks
    assert extrapolated.peak_bytes == full.peak_bytes and extrapolated.peak_phase == full.peak_phase


def test_gpu_budget_parsing():
    assert GpuBudget.parse("16GB").capacity_bytes == 16 * GiB
    assert GpuBudget.parse("80gib").usable_bytes < 80 * GiB
    assert GpuBudget.parse("512MiB").capacity_bytes == 512 * 2**20
    assert GpuBudget.parse("2TB").capacity_bytes == GpuBudget.parse("2tib").capacity_bytes == 2048 * GiB
    for bad in ("lots", "GB", "1.5.0GB", "2PB"):
        with pytest.raises(ValueError, match="not understood"):
            GpuBudget.parse(bad)
    # an amount that is not one: refused in one line, never an OverflowError or a zero budget
    for bad in ("infGiB", "1e400GiB", "nanGB", "0", "0GB", "-4GB", "0.0MiB"):
        with pytest.raises(ValueError, match="must be a positive, finite amount"):
            GpuBudget.parse(bad)


def op_calls(dt: torch.dtype) -> dict[str, tuple[str, object]]:
    """Each Tempo op's name and a call of it on inputs spanning several chunks."""
    from tempo.ops import dropout as D
    from tempo.ops import gelu as G
    from tempo.ops import layernorm as L
    from tempo.sizes import CHUNK_ELEMS

    n = 3 * CHUNK_ELEMS
    x, g = torch.randn(n, dtype=dt), torch.randn(n, dtype=dt)
    y, bits = G.gelu_fwd(x, "none")
    w, b = torch.ones(512, dtype=dt), torch.zeros(512, dtype=dt)
    y2, rstd = L.layer_norm_fwd(x.view(-1, 512), w, b, 1, 1e-5)
    seed = torch.tensor(1)
    return {
        "gelu_fwd": ("tempo::gelu_fwd", lambda: G.gelu_fwd(x, "none")),
        "gelu_bwd": ("tempo::gelu_bwd", lambda: G.gelu_bwd(g, y, bits, "none")),
        "ln_fwd": ("tempo::layer_norm_fwd", lambda: L.layer_norm_fwd(x.view(-1, 512), w, b, 1, 1e-5)),
        "ln_bwd": ("tempo::layer_norm_bwd", lambda: L.layer_norm_bwd(g.view(-1, 512), y2, rstd, w, b, 1)),
        "dropout": ("tempo::dropout", lambda: D.dropout_op(x, 0.1, seed)),
    }


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["gelu_fwd", "gelu_bwd", "ln_fwd", "ln_bwd", "dropout"])
def test_declared_cpu_workspace_bounds_the_real_one(op, dt):
    """The CPU workspace bound the estimator adds must hold for every op (profiler-measured)."""
    from tempo.ops import cpu_bytes_per_chunk_elem
    from tempo.sizes import CHUNK_ELEMS

    name, call = op_calls(dt)[op]
    call()  # first call: lazy one-time allocations
    peak, result = cpu_peak_bytes(call)
    outputs = result if isinstance(result, tuple) else (result,)
    workspace = peak - sum(t.untyped_storage().nbytes() for t in outputs)
    bound = CHUNK_ELEMS * cpu_bytes_per_chunk_elem(name)
    assert workspace <= bound, f"{op} {dt}: {workspace} B > {bound} B"


def _value_in_layout(layout: str, dt: torch.dtype) -> torch.Tensor:
    """V (4, 10, 128, 64) as each caller hands it to the attention core: contiguous; HF's, a
    transposed (B, S, H, D), whose heads do not flatten into one batch as a view; megatron-core's
    (S, B, H, D) permuted (tempo.megatron), whose heads do."""
    b, h, s, d = 4, 10, 128, 64
    if layout == "hf":
        return torch.randn(b, s, h, d, dtype=dt).transpose(1, 2)
    if layout == "megatron":
        return torch.randn(s, b, h, d, dtype=dt).permute(1, 2, 0, 3)
    return torch.randn(b, h, s, d, dtype=dt)


@pytest.mark.parametrize("layout", ["contiguous", "hf", "megatron"])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_declared_attention_workspace_is_the_real_one(p, dt, layout):
    """The attention core's CPU path, forward and backward (with and without the gradient of the
    returned P), over 5 chunks of heads: what it holds besides inputs and outputs is at most what
    workspace_bytes declares, and in bf16 (what Mist's planner prices) at least 3/4 of it. With
    HF's V that includes V's copy; the control: declared without it, the bound fails."""
    from tempo.ops import attention as A

    seed = torch.tensor(1)
    v = _value_in_layout(layout, dt)
    s = torch.randn(*v.shape[:-1], v.shape[-2], dtype=dt)
    out, probs = A.attention_core_op(s, v, p, seed)
    go, gp = torch.randn_like(out), torch.randn_like(probs)
    backward = ("tempo::attention_core_bwd", A.attention_core_bwd)
    calls = {
        "forward": ("tempo::attention_core", A.attention_core_op, (s, v, p, seed)),
        "backward": (*backward, (go, None, probs, v, p, seed, dt)),
        "backward, P used": (*backward, (go, gp, probs, v, p, seed, dt)),
    }
    for what, (name, op, args) in calls.items():
        op(*args)  # first call: lazy one-time allocations
        peak, result = cpu_peak_bytes(lambda op=op, args=args: op(*args))
        workspace = peak - sum(t.untyped_storage().nbytes() for t in result)
        declared = workspace_bytes(name, args, {}, "cpu")
        assert workspace <= declared, f"{what} p={p} {dt} {layout}: {workspace} B > {declared} B"
        if dt == torch.bfloat16:
            assert workspace >= 0.75 * declared, f"{what} p={p} {layout}: loose ({workspace} of {declared} B)"
        if layout == "hf":  # the control: V's copy is real, and the bound catches its omission
            contiguous = tuple(v.contiguous() if a is v else a for a in args)
            without_copy = workspace_bytes(name, contiguous, {}, "cpu")
            assert without_copy + v.numel() * v.element_size() == declared
            assert workspace > without_copy, f"{what} p={p} {dt}: V's copy not seen"


def test_workspace_knows_every_tempo_op_by_its_exact_name():
    """workspace_bytes prices ops by their exact names; an op renamed or added would fall to the
    default (a chunk on a CPU, nothing on CUDA) without a word. The ops registered are the ones it
    prices by name and the ones the default prices (their chunked PyTorch paths; kernels with no
    workspace). Control: an unknown tempo op gets the default."""
    import importlib
    import pkgutil

    import tempo.ops

    for module in pkgutil.iter_modules(tempo.ops.__path__):  # every op module, one added too
        importlib.import_module(f"tempo.ops.{module.name}")
    registered = {f"tempo::{n}" for n in dir(torch.ops.tempo) if not n.startswith("_") and n != "name"}
    by_name = {
        "tempo::attention_core",
        "tempo::attention_core_bwd",
        "tempo::linear_cross_entropy",
        "tempo::linear_cross_entropy_bwd",
        "tempo::layer_norm_bwd",
        "tempo::rms_norm_bwd",
        "tempo::swiglu_down",
        "tempo::swiglu_down_bwd",
    }
    by_default = {
        "tempo::dropout",
        "tempo::gelu_fwd",
        "tempo::gelu_bwd",
        "tempo::layer_norm_fwd",
        "tempo::rms_norm_fwd",
    }
    assert registered == by_name | by_default, registered ^ (by_name | by_default)
    source = inspect.getsource(workspace_bytes)
    assert all(f'"{name}"' in source for name in by_name)
    x = torch.empty(4, 8)
    assert workspace_bytes("tempo::nothing", (x,), {}, "cpu") == 32 * cpu_bytes_per_chunk_elem(
        "tempo::nothing"
    )
    assert workspace_bytes("tempo::nothing", (x,), {}, "cuda") == 0


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "hid", "vocab", "chunk"),
    [(3 * 256 + 77, 64, 4096, 256), (100, 1024, 4096, 16)],
    ids=["logits dominate", "dW dominates"],
)
def test_declared_linear_cross_entropy_workspace_bounds_the_real_one(dt, n, hid, vocab, chunk):
    """The chunked loss's forward and backward (profiler-measured, several chunks and a remainder)
    hold no more besides inputs and outputs than workspace_bytes declares for the estimator, and
    at least half. Where dW dominates, a 16-bit dW's float32 sum over the chunks is real: the
    control, declared without it, fails the bound."""
    from tempo.ops import linear_ce as C
    from tempo.ops import workspace_bytes

    h, w = torch.randn(n, hid, dtype=dt), torch.randn(vocab, hid, dtype=dt) * 0.1
    labels = torch.randint(0, vocab, (n,))
    grad = torch.tensor(1.0)
    calls = {
        "tempo::linear_cross_entropy": (h, w, labels, chunk, True),
        "tempo::linear_cross_entropy_bwd": (grad, h, w, labels, chunk, True),
    }
    for name, args in calls.items():
        op = (
            C.linear_cross_entropy_op if name == "tempo::linear_cross_entropy" else C.linear_cross_entropy_bwd
        )
        op(*args)  # first call: lazy one-time allocations
        peak, result = cpu_peak_bytes(lambda op=op, args=args: op(*args))
        outputs = result if isinstance(result, tuple) else (result,)
        workspace = peak - sum(t.untyped_storage().nbytes() for t in outputs)
        declared = workspace_bytes(name, args, {}, "cpu")
        assert workspace <= declared, f"{name} {dt}: {workspace} B > {declared} B"
        assert workspace >= 0.5 * declared, f"{name} {dt}: the bound is loose ({workspace} of {declared} B)"
        if name.endswith("_bwd") and dt == torch.bfloat16 and hid == 1024:
            without_sum = declared - vocab * hid * 4
            assert workspace > without_sum, f"the float32 dW sum not seen: {workspace} <= {without_sum} B"


def test_cuda_like_attention_keeps_no_square_matrix():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from measure.saved import cuda_like

    class Attn(nn.Module):
        def forward(self, q, k, v):
            return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    b, h, s, d = 2, 4, 256, 32
    with FakeTensorMode():
        q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with cuda_like():
            r = saved_bytes(Attn(), q, k, v)
    # output (bf16) + logsumexp (float32 per row); Q, K, V are inputs
    assert r.activation_bytes == b * h * s * d * 2 + b * h * s * 4
    assert r.input_bytes == 3 * b * h * s * d * 2


def test_cpu_peak_leaves_out_the_named_host_work():
    """Allocations made inside a profiler range of the excluded name do not count, until freed,
    even after the range (a tensor that outlives it); frees inside it of memory allocated before
    it still count. Negative control: without ``exclude`` everything counts."""

    def call() -> torch.Tensor:
        kept = torch.ones(1 << 20, dtype=torch.uint8)  # 1 MiB on the "device"
        before = torch.ones(2 << 20, dtype=torch.uint8)  # 2 MiB, freed inside the range
        with torch.profiler.record_function("host work"):
            host = torch.ones(4 << 20, dtype=torch.uint8)  # 4 MiB of host work, freed inside
            del host
            del before
            survivor = torch.ones(8 << 20, dtype=torch.uint8)  # 8 MiB, outlives the range
        after = torch.ones(3 << 20, dtype=torch.uint8)  # 3 MiB on the "device", after it
        del survivor, after
        return kept

    counted, _ = cpu_peak_bytes(call)
    left_out, _ = cpu_peak_bytes(call, exclude=("host work",))
    assert counted >= 12 << 20  # kept + survivor + after
    assert 4 << 20 <= left_out < 5 << 20  # kept + after, or kept + before: 4 MiB and change


def _bert_layer(hidden: int, heads: int):
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = BertConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        attn_implementation="eager",
    )
    return BertLayer(cfg).train()


@pytest.mark.slow
def test_saved_bytes_see_what_torch_compile_keeps(rng):
    """The saved-tensor hooks count a compiled layer's own saves: where eager keeps CPU dropout's
    float noise, AOTAutograd keeps less (what it needs to remake it), and the meter sees it; under
    CUDA-like dropout (bool masks) compile keeps what eager keeps, within 1%."""
    torch.manual_seed(int(rng.integers(2**31)))
    layer = _bert_layer(128, 2)
    x = torch.randn(2, 64, 128, requires_grad=True)
    torch._dynamo.reset()
    eager, compiled = saved_bytes(layer, x).total_bytes, saved_bytes(torch.compile(layer), x).total_bytes
    assert compiled < 0.95 * eager
    torch._dynamo.reset()
    with cuda_like_dropout():
        eager, compiled = saved_bytes(layer, x).total_bytes, saved_bytes(torch.compile(layer), x).total_bytes
    assert abs(compiled / eager - 1) < 0.01


def test_format_bytes_keeps_small_amounts_readable():
    from measure.units import format_bytes

    assert [format_bytes(n) for n in (3, 2048, 2 * 2**20, 80 * 2**30)] == [
        "3 B",
        "2.0 KiB",
        "2.0 MiB",
        "80.0 GiB",
    ]


def test_yaml_numbers_and_booleans_as_yaml_1_2_reads_them():
    """Plans and presets are read by YAML 1.2's core schema (less hexadecimal and octal): PyYAML's
    YAML 1.1 read `1:20` as 80 and `yes` as true; 1.2's floats with an exponent and no dot stay
    floats (they were strings, refused by the schema, in the first version of this reader)."""
    from measure.strict import loads_yaml

    read = loads_yaml("a: 1e5\nb: 10\nc: -2E-3\nd: .5\ne: true\nf: 1:20\ng: yes\nh: 0x8\ni: 010\nj: 1_0")
    assert read == {
        "a": 1e5, "b": 10, "c": -2e-3, "d": 0.5, "e": True,
        "f": "1:20", "g": "yes", "h": "0x8", "i": "010", "j": "1_0",
    }  # fmt: skip
    assert type(read["a"]) is float and type(read["b"]) is int


# ---------------------------------------------------------------- the GPU data sheets (a preset file)

_SHEET_CASES = [
    (
        "string",
        set_field("l4", "dense_bf16_flop_per_s", value="121e12"),
        "l4.dense_bf16_flop_per_s must be a finite number > 0",
    ),
    (
        "null peak",
        set_field("l4", "dense_bf16_flop_per_s", value=None),
        "l4.dense_bf16_flop_per_s must be a finite number > 0",
    ),
    (
        "true",
        set_field("h100", "sms", value=True),
        "h100.sms must be a whole number >= 1 (or null: not on record)",
    ),
    (
        "float bytes",
        set_field("l4", "memory_bytes", value=24.5e9),
        "l4.memory_bytes must be a whole number >= 1",
    ),
    (
        "nan",
        set_field("a10g", "hbm_bytes_per_s", value=math.nan),
        "a10g.hbm_bytes_per_s must be a finite number > 0 (or null",
    ),
    (
        "infinite",
        set_field("v100", "nvlink_bytes_per_s", value=math.inf),
        "v100.nvlink_bytes_per_s must be a finite number > 0",
    ),
    ("zero", set_field("l4", "pcie_bytes_per_s", value=0), "l4.pcie_bytes_per_s must be a finite number > 0"),
    (
        "absurd peak",
        set_field("b200", "dense_bf16_flop_per_s", value=1e30),
        "b200.dense_bf16_flop_per_s must be a finite number > 0, at most 1e+18",
    ),
    (
        "absurd SMs",
        set_field("h200", "sms", value=5000),
        "h200.sms must be a whole number >= 1 (or null: not on record), at most 1024",
    ),
    ("no source", drop_field("l4", "source"), "l4: missing source"),
    ("empty source", set_field("l4", "source", value=""), "l4.source must be a non-empty string"),
    ("unknown field", set_field("l4", "fp16_flop_per_s", value=1e14), "l4: unknown field(s) fp16_flop_per_s"),
    (
        "old field name",
        renamed_field("l4", "memory_bytes", to="memory"),
        "l4: unknown field(s) memory; missing memory_bytes",
    ),
    ("not a mapping", set_field("l4", value=121e12), "l4 must be a mapping of dense_bf16_flop_per_s"),
    ("empty", lambda d: d.clear(), "no data sheet"),
    ("duplicate", None, "key 'l4' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
]


@pytest.mark.parametrize(("case", "edit", "said"), _SHEET_CASES, ids=[c[0] for c in _SHEET_CASES])
def test_a_corrupted_data_sheet_is_refused_in_one_line(tmp_path, case, edit, said):
    copy = tmp_path / "datasheets.json"
    refused_in_one_line(read_datasheets, DATASHEETS_FILE, copy, case, edit, said)


def test_the_shipped_data_sheets_read():
    """The control: the shipped file passes the reader that refuses the copies above, as written."""
    sheets = read_datasheets(DATASHEETS_FILE)
    assert sheets == datasheets() and list(sheets) == [
        "l4",
        "a10g",
        "v100",
        "a100-40gb",
        "h100",
        "h200",
        "b200",
    ]
    assert sheets["h200"].memory == int(141e9) and sheets["l4"].memory == 24 * GiB
    assert sheets["b200"].memory is None and sheets["b200"].fp32_flops is None
    written = json.loads(DATASHEETS_FILE.read_text())
    for name, sheet in sheets.items():  # every number as the file gives it
        assert [sheet.flops, sheet.fp32_flops, sheet.memory, sheet.sms] == [
            written[name][k] for k in ("dense_bf16_flop_per_s", "fp32_flop_per_s", "memory_bytes", "sms")
        ]


def test_the_machines_memory_is_a_containers_limit_where_that_is_less(tmp_path):
    """In a container the page count is the node's memory: a plan or a shape checked against it
    could need more than the container may use. The cgroup's limit (v2's "max": none; v1's huge
    number: none either way, as the smaller one is taken) where there is one."""
    import os

    from measure.checks import machine_memory_bytes

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    limit = random.randint(2**30, physical - 1)
    v2.write_text(f"{limit}\n")
    assert machine_memory_bytes((str(v2), str(v1))) == limit
    v2.write_text("max\n")  # no limit in v2: the next file, else the physical memory
    assert machine_memory_bytes((str(v2), str(v1))) == physical
    v1.write_text(f"{2**63 - 4096}\n")  # v1's "no limit"
    assert machine_memory_bytes((str(tmp_path / "absent"), str(v1))) == physical
