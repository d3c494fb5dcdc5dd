"""Triton kernels against the PyTorch path. Without a GPU they run under TRITON_INTERPRET=1
(set in conftest); `nox -s gpu_check` runs the same tests compiled on CUDA."""

from __future__ import annotations

import weakref

import pytest
import torch

from tempo.ops import attention as A
from tempo.ops import gelu as G
from tempo.ops import layernorm as L

pytest.importorskip("triton")
import triton
import triton.language as tl

from tempo.kernels.attention import attention_core_bwd_triton, attention_core_fwd_triton
from tempo.kernels.dropout import dropout_triton, keep_mask
from tempo.kernels.gelu import gelu_bwd_triton, gelu_fwd_triton
from tempo.kernels.layernorm import layer_norm_bwd_triton, layer_norm_fwd_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(300)


def assert_within_ulps(a: torch.Tensor, b: torch.Tensor) -> None:
    """Element-wise: one unit in the last place of the output dtype (the interpreter converts
    float32 -> bfloat16 by truncation, the GPU and torch round to nearest), plus a few float32
    ulps for float32 math done in another order or with another erf."""
    torch.testing.assert_close(
        a.float(),
        b.float(),
        rtol=torch.finfo(b.dtype).eps,
        atol=16 * torch.finfo(torch.float32).eps,
        equal_nan=True,
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    ok = torch.isfinite(b)
    return ((a[ok].double() - b[ok].double()).norm() / b[ok].double().norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 2e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)]
)
def test_gelu_kernels(approximate, dtype, tol):
    x_min = G.branch_point(approximate)[0]
    inf, big = float("inf"), torch.finfo(dtype).max
    x = torch.cat(
        [
            torch.randn(6000) * 3,
            x_min + 0.05 * torch.randn(600),
            torch.empty(300).uniform_(-30, 30),
            torch.tensor([inf, -inf, float("nan"), 0.0, big, -big]),
        ]
    ).to(dtype)
    y_ref, bits_ref = G.gelu_forward_torch(x, approximate)
    y, bits = gelu_fwd_triton(x.to(DEVICE), approximate)
    y = y.cpu()
    assert torch.equal(bits.cpu(), bits_ref), "branch bits must be identical"
    assert_within_ulps(y, y_ref)
    g = torch.randn_like(x)
    dx_ref = G.gelu_backward_torch(g, y_ref, bits_ref, approximate)
    dx = gelu_bwd_triton(g.to(DEVICE), y_ref.to(DEVICE), bits_ref.to(DEVICE), approximate).cpu()
    assert torch.equal(dx.isnan(), dx_ref.isnan())
    assert rel(dx, dx_ref) <= tol
    # The decided special values (tempo/ops/gelu.py), asserted for both paths rather than taken
    # from torch: GELU(+inf) = +inf, GELU(-inf) = 0, NaN -> NaN; GELU'(+inf) = 1, GELU'(-inf) = 0;
    # and GELU(x) = x, GELU'(x) = 1 at the dtype's max, GELU = GELU' = 0 at -max.
    for out, grad in ((y, dx), (y_ref, dx_ref)):
        pos, neg, nan = (x == inf) | (x == big), (x == -inf) | (x == -big), x.isnan()
        assert pos.sum() == 2 and neg.sum() == 2 and nan.sum() == 1
        assert torch.equal(out[pos], x[pos]) and torch.all(out[neg] == 0) and out[nan].isnan().all()
        assert torch.equal(grad[pos], g[pos]) and torch.all(grad[neg] == 0) and grad[nan].isnan().all()
        assert torch.all(torch.isfinite(grad[~nan]))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_layer_norm_kernels(dtype, tol):
    rows, d = 37, 200  # d not a power of two: masked lanes
    x = (torch.randn(rows, d) * 2 + 1).to(dtype)
    w, b = (1 + 0.3 * torch.randn(d)).to(dtype), (0.1 * torch.randn(d)).to(dtype)
    y_ref, rstd_ref = L.layer_norm_forward_torch(x, w, b, 1, 1e-5)
    y, rstd = layer_norm_fwd_triton(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), 1, 1e-5)
    assert_within_ulps(y.cpu(), y_ref)
    assert rel(rstd.cpu(), rstd_ref) <= 1e-5
    g = torch.randn(rows, d).to(dtype)
    ref = L.layer_norm_backward_torch(g, y_ref, rstd_ref, w, b, 1)
    out = layer_norm_bwd_triton(*(t.to(DEVICE) for t in (g, y_ref, rstd_ref, w, b)), 1)
    for a, r in zip(out, ref, strict=True):
        assert rel(a.cpu(), r) <= tol


def test_dropout_kernel_regenerates_its_mask():
    x = torch.randn(5000).to(DEVICE) + 5
    seed = int(torch.randint(0, 2**31 - 2, ()))
    y = dropout_triton(x, 0.25, seed)
    keep = y != 0
    frac = 1 - keep.float().mean().item()
    assert abs(frac - 0.25) < 6 * (0.25 * 0.75 / 5000) ** 0.5
    torch.testing.assert_close(y[keep], x[keep] / 0.75)
    g = torch.randn(5000).to(DEVICE)
    torch.testing.assert_close(dropout_triton(g, 0.25, seed), g * keep / 0.75)
    # negative control: the backward with another seed must fail the same check
    with pytest.raises(AssertionError, match="not close"):
        torch.testing.assert_close(dropout_triton(g, 0.25, seed + 1), g * keep / 0.75)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_attention_kernels(p):
    b, h, sq, sk, d = 2, 3, 7, 45, 8  # sk not a power of two
    s = torch.randn(b, h, sq, sk)
    v = torch.randn(b, h, sk, d)
    go = torch.randn(b, h, sq, d)
    seed = 77
    # The mask the kernel draws, exposed by V = identity (dropped-out P comes back as the output).
    eye = torch.eye(sk).expand(b, h, sk, sk).contiguous()
    dropped, probs = attention_core_fwd_triton(s.to(DEVICE), eye.to(DEVICE), p, seed)
    keep = (dropped.cpu() != 0).double()
    torch.testing.assert_close(probs.cpu(), torch.softmax(s, -1))
    s64, v64 = s.double().requires_grad_(), v.double().requires_grad_()
    out_ref = (torch.softmax(s64, -1) * keep / (1 - p)) @ v64
    out, probs = attention_core_fwd_triton(s.to(DEVICE), v.to(DEVICE), p, seed)
    torch.testing.assert_close(out.cpu().double(), out_ref, rtol=1e-5, atol=1e-5)
    gs, gv = attention_core_bwd_triton(go.to(DEVICE), None, probs, v.to(DEVICE), p, seed, torch.float32)
    gs_ref, gv_ref = torch.autograd.grad(out_ref, (s64, v64), go.double())
    torch.testing.assert_close(gs.cpu().double(), gs_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gv.cpu().double(), gv_ref, rtol=1e-5, atol=1e-5)
    if p > 0:  # negative control: the backward with another seed must not pass the same check
        gs_wrong, _ = attention_core_bwd_triton(
            go.to(DEVICE), None, probs, v.to(DEVICE), p, seed + 1, torch.float32
        )
        assert not torch.allclose(gs_wrong.cpu().double(), gs_ref, rtol=1e-5, atol=1e-5)


def test_attention_kernel_matches_torch_path_without_dropout():
    s, v = torch.randn(2, 2, 9, 9), torch.randn(2, 2, 9, 4)
    out_ref, probs_ref = A.attention_core_fwd_torch(s, v, 0.0, torch.tensor(0))
    out, probs = attention_core_fwd_triton(s.to(DEVICE), v.to(DEVICE), 0.0, 0)
    torch.testing.assert_close(out.cpu(), out_ref)
    torch.testing.assert_close(probs.cpu(), probs_ref)


# ---------------------------------------------------------------- RMSNorm and SwiGLU kernels

from tempo.kernels.rmsnorm import rms_norm_bwd_triton, rms_norm_fwd_triton  # noqa: E402
from tempo.kernels.swiglu import swiglu_bwd_triton, swiglu_fwd_triton  # noqa: E402
from tempo.layernorm_rows import ROWS_PER_PROGRAM, gamma_floor  # noqa: E402
from tempo.ops import rmsnorm as R  # noqa: E402
from tempo.ops import swiglu as S  # noqa: E402


def assert_within_roundings(
    a: torch.Tensor, b: torch.Tensor, roundings: int = 2, via: torch.dtype | None = None
) -> None:
    """Element-wise: ``roundings`` ulps of the coarser of b's dtype and ``via``, for results rounded
    that many times on the way (HF's RMSNorm rounds x_hat to x's dtype, then y; SwiGLU rounds
    silu(gate), then the product). Where the float32 values before the first rounding differ by a
    few ulps (another exp, another summation order) that rounding can land one ulp apart, and the
    next one can add another; the interpreter's bfloat16 truncation can lose one ulp at each.
    Plus a few ulps of the math dtype, absolute, for results near 0."""
    eps = max(torch.finfo(t).eps for t in (b.dtype, via or b.dtype))
    # compared in float64 so that float64 results are checked to their own ulps, not float32's
    math_eps = torch.finfo(torch.float64 if b.dtype == torch.float64 else torch.float32).eps
    torch.testing.assert_close(
        a.double(), b.double(), rtol=roundings * eps, atol=16 * math_eps, equal_nan=True
    )


# Norm-wise agreement of the RMSNorm backward with the PyTorch path: float32 and float64 differ by
# summation order only (a few ulps); half types also by the output's rounding where the float32 dx
# differ (one ulp each, under round to nearest; the interpreter truncates to bfloat16, a norm-wise
# error of about one unit roundoff), hence one ulp (eps, two unit roundoffs) of the dtype.
RMS_BWD_TOL = {torch.float64: 1e-13, torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _rms_inputs(dtype: torch.dtype, wdtype: torch.dtype, rows: int = 37, d: int = 200):
    """rows not a multiple of ROWS_PER_PROGRAM, d not a power of two (masked lanes), and gamma with
    a zero, entries below the floor of either sign and one just above it."""
    assert rows % ROWS_PER_PROGRAM
    x = (torch.randn(rows, d, dtype=torch.float64) * 2 + 0.3).to(dtype)
    w = 1 + 0.3 * torch.randn(d, dtype=torch.float64)
    w[:5] = torch.tensor([0.0, 1e-8, -3e-7, 2 * gamma_floor(dtype), -0.0])
    return x, w.to(wdtype), torch.randn(rows, d, dtype=torch.float64).to(torch.promote_types(dtype, wdtype))


@pytest.mark.parametrize(
    ("dtype", "wdtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_rms_norm_kernels(dtype, wdtype):
    x, w, g = _rms_inputs(dtype, wdtype)
    eps = 1e-6
    y_ref, rstd_ref = R.rms_norm_forward_torch(x, w, eps)
    y, rstd = rms_norm_fwd_triton(x.to(DEVICE), w.to(DEVICE), eps)
    assert y.dtype == y_ref.dtype and rstd.dtype == rstd_ref.dtype
    assert_within_roundings(y.cpu(), y_ref, via=dtype)
    torch.testing.assert_close(rstd.cpu(), rstd_ref, rtol=4 * torch.finfo(rstd.dtype).eps, atol=0)
    # negative control: one gamma entry off by 5% (a few bfloat16 ulps) must fail the same check
    w_wrong = w.clone()
    w_wrong[7] *= 1.05
    y_wrong, _ = rms_norm_fwd_triton(x.to(DEVICE), w_wrong.to(DEVICE), eps)
    with pytest.raises(AssertionError, match="not close"):
        assert_within_roundings(y_wrong.cpu(), y_ref, via=dtype)

    # backward from the reference's (y, rstd), so it is checked on its own
    tol = RMS_BWD_TOL[dtype]
    dx_ref, dw_ref = R.rms_norm_backward_torch(g, y_ref, rstd_ref, w)
    dx, dw = rms_norm_bwd_triton(*(t.to(DEVICE) for t in (g, y_ref, rstd_ref, w)))
    assert dx.dtype == dx_ref.dtype and dw.dtype == dw_ref.dtype
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()  # gamma = 0 and below the floor
    assert rel(dx.cpu(), dx_ref) <= tol and rel(dw.cpu(), dw_ref) <= tol
    # negative control: rstd 5% off must fail it
    dx_wrong, _ = rms_norm_bwd_triton(*(t.to(DEVICE) for t in (g, y_ref, rstd_ref * 1.05, w)))
    assert rel(dx_wrong.cpu(), dx_ref) > tol


def test_rms_norm_kernels_propagate_nan_and_inf():
    """As the PyTorch path defines them: a NaN makes its row NaN (rstd too); an inf makes rstd 0,
    its own output NaN (inf * 0) and the row's others 0; the backward carries them on."""
    x, w, g = _rms_inputs(torch.float32, torch.float32, rows=5, d=24)
    x[1, 3], x[3, 7] = float("nan"), float("inf")
    y_ref, rstd_ref = R.rms_norm_forward_torch(x, w, 1e-6)
    y, rstd = rms_norm_fwd_triton(x.to(DEVICE), w.to(DEVICE), 1e-6)
    assert rstd_ref[1].isnan() and rstd_ref[3] == 0 and y_ref[3, 7].isnan()
    assert_within_roundings(y.cpu(), y_ref)
    assert_within_roundings(rstd.cpu(), rstd_ref)
    dx_ref, dw_ref = R.rms_norm_backward_torch(g, y_ref, rstd_ref, w)
    dx, dw = rms_norm_bwd_triton(*(t.to(DEVICE) for t in (g, y_ref, rstd_ref, w)))
    assert torch.equal(dx.cpu().isnan(), dx_ref.isnan()) and torch.equal(dw.cpu().isnan(), dw_ref.isnan())
    assert dx_ref[0].isfinite().all() and dx_ref[1].isnan().all()
    assert_within_roundings(dx.cpu(), dx_ref)


def test_rms_norm_bwd_workspace_is_its_partials():
    """The CUDA workspace the memory estimator adds for the backward is what its wrapper allocates
    besides the outputs: the float32 per-program dgamma partials."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tempo.ops import workspace_bytes

    class Empties(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.nbytes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format:
                self.nbytes.append(out.untyped_storage().nbytes())
            return out

    x, w, g = _rms_inputs(torch.bfloat16, torch.bfloat16, rows=40, d=24)
    y, rstd = R.rms_norm_forward_torch(x, w, 1e-6)
    args = tuple(t.to(DEVICE) for t in (g, y, rstd, w))
    with Empties() as mode:
        dx, _ = rms_norm_bwd_triton(*args)
    partials = sum(mode.nbytes) - dx.untyped_storage().nbytes()
    assert partials == 3 * 24 * 4  # ceil(40 / 16) programs, one float32 row each
    assert workspace_bytes("tempo::rms_norm_bwd", args, {}, "cuda") == partials


def assert_silu_backward_within_bound(a, b, dh, gate, up) -> None:
    """d_gate = dh up s (1 + x (1 - s)), s = sigmoid(x), from two float32 (float64) paths with
    their own exp: each s is off by a few ulps, and x (1 - s) carries that error times |x| (the
    cancellation in 1 - s for large x), so element by element
    |a - b| <= 2 ulps of the output at |b| + 16 u |dh up| s (1 + |x|),
    u the math dtype's unit roundoff; NaN exactly where b has it. An ulp at |b| is eps |b| down to
    the smallest normal, and the fixed subnormal spacing below it: two float32 values either side of
    a float16 rounding boundary round one subnormal step apart (d_gate 6.1e-6 at seed 2106705788)."""
    assert torch.equal(a.isnan(), b.isnan()), "NaN where the reference has none, or the reverse"
    math = torch.float64 if b.dtype == torch.float64 else torch.float32
    x, dh_up = gate.double(), dh.double() * up.double()
    s = torch.sigmoid(x)
    scale = (dh_up * s).abs() * (1 + x.abs())
    out = torch.finfo(b.dtype)
    ulp_at_b = out.eps * b.double().abs().clamp_min(out.tiny)  # eps x smallest normal: the subnormal step
    bound = 2 * ulp_at_b + 16 * torch.finfo(math).eps / 2 * scale
    ok = b.isfinite() & scale.isfinite()
    assert torch.equal(a[~ok & ~b.isnan()], b[~ok & ~b.isnan()]), "infinities differ"
    worst = ((a.double() - b.double()).abs()[ok] / bound[ok].clamp_min(torch.finfo(math).tiny)).max().item()
    assert worst <= 1, f"d_gate exceeds its bound by {worst:.2f}x"


def _swiglu_inputs(dtype: torch.dtype):
    """2100 elements: not a multiple of the block; both tails of silu, and +-inf, NaN, 0."""
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 100.0, -100.0, 20.0, -20.0])
    gate = torch.cat([torch.randn(2100 - 2 * special.numel()) * 3, special, torch.randn(special.numel())])
    up = torch.cat([torch.randn(2100 - 2 * special.numel()), torch.randn(special.numel()), special])
    dh = torch.randn(2100)
    return (t.to(dtype).view(7, 300) for t in (gate, up, dh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_swiglu_kernels(dtype):
    gate, up, dh = _swiglu_inputs(dtype)
    h_ref = S.swiglu_forward_torch(gate, up)
    h = swiglu_fwd_triton(gate.to(DEVICE), up.to(DEVICE)).cpu()
    assert h.dtype == dtype and h_ref.isnan().any() and h_ref.isinf().any()
    assert_within_roundings(h, h_ref)  # equal_nan: NaN exactly where the PyTorch path has it
    dgate_ref, dup_ref = S.swiglu_backward_torch(dh, gate, up)
    dgate, dup = swiglu_bwd_triton(*(t.to(DEVICE) for t in (dh, gate, up)))
    assert dgate_ref.isnan().any() and dup_ref.isnan().any()
    assert_silu_backward_within_bound(dgate.cpu(), dgate_ref, dh, gate, up)
    assert_within_roundings(dup.cpu(), dup_ref)
    # overwrite_dh: the same d_gate, written over dh's storage
    dh_dev = dh.to(DEVICE)
    dgate2, dup2 = swiglu_bwd_triton(dh_dev, gate.to(DEVICE), up.to(DEVICE), overwrite_dh=True)
    assert dgate2.data_ptr() == dh_dev.data_ptr()
    for again, first in ((dgate2, dgate), (dup2, dup)):
        torch.testing.assert_close(again, first, rtol=0, atol=0, equal_nan=True)
    # negative controls: gate and up swapped must fail both checks, on the rows of finite random
    # values alone (the special values sit in the last row), so the values, not NaN placement, fail
    h_swapped = swiglu_fwd_triton(up.to(DEVICE), gate.to(DEVICE)).cpu()
    dgate_swapped, _ = swiglu_bwd_triton(*(t.to(DEVICE) for t in (dh, up, gate)))
    assert h_swapped[:6].isfinite().all() and h_ref[:6].isfinite().all()
    with pytest.raises(AssertionError, match="not close"):
        assert_within_roundings(h_swapped[:6], h_ref[:6])
    assert dgate_swapped[:6].isfinite().all() and dgate_ref[:6].isfinite().all()
    with pytest.raises(AssertionError, match="exceeds"):
        assert_silu_backward_within_bound(dgate_swapped[:6].cpu(), dgate_ref[:6], dh[:6], gate[:6], up[:6])


def test_ops_dispatch_to_the_rms_norm_and_swiglu_kernels(monkeypatch):
    """The custom ops' Triton branches (argument order, dtypes, d_gate over dh) against their
    PyTorch paths on the CPU. Without a GPU ``use_triton`` is told to say yes, so the kernels run
    in the interpreter on CPU tensors; each kernel wrapper counts its calls, proving it ran."""
    import tempo.kernels.rmsnorm as KR
    import tempo.kernels.swiglu as KS

    x, w, gy = _rms_inputs(torch.float32, torch.float32, rows=18, d=40)
    gate, up = torch.randn(2, 9, 40), torch.randn(2, 9, 40)
    wd, bd, go = torch.randn(24, 40), torch.randn(24), torch.randn(2, 9, 24)

    def run(device):
        xs = [t.to(device).requires_grad_() for t in (x, w, gate, up, wd, bd)]
        y = R.rms_norm(xs[0], xs[1])
        out = S.swiglu_down(*xs[2:])
        grads = torch.autograd.grad((y * gy.to(device)).sum() + (out * go.to(device)).sum(), xs)
        return [t.detach().cpu() for t in (y, out, *grads)]

    ref = run("cpu")
    calls = []
    for module in (KR, KS):
        for name in [n for n in vars(module) if n.endswith("_triton")]:
            fn = getattr(module, name)
            monkeypatch.setattr(
                module, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k)
            )
    if DEVICE == "cpu":
        for module in (R, S):
            monkeypatch.setattr(module, "use_triton", lambda *ts, float64=False: all(t.numel() for t in ts))
    got = run(DEVICE)
    # swiglu_fwd_triton twice: the backward recomputes h with it
    expected = ["rms_norm_bwd_triton", "rms_norm_fwd_triton", "swiglu_bwd_triton", *["swiglu_fwd_triton"] * 2]
    assert sorted(calls) == expected
    for a, r in zip(got, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hf_value", [False, True], ids=["contiguous-v", "hf-v"])
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("scores_dtype", [torch.float32, torch.float64])
def test_attention_kernels_workspace_is_what_they_allocate(p, scores_dtype, hf_value):
    """What the wrappers allocate besides their outputs is what the estimator and Mist's planner
    add (tempo.ops.workspace_bytes): the dropped-out P with dropout, none without; backward also
    dD where dS cannot be written over it (the scores' dtype differs). HF's V (a transposed
    (B, S, H, D)) is copied by each product with it: in forward that adds to the workspace; in
    backward the copy is freed with its product, before dV (its size) is made, so the estimator
    adds none. dS from the shared buffer equals dS from its own (float64 scores: a buffer of its
    own). Counted as the peak of the live storages the wrappers' own allocations and matrix
    products make (the interpreter's copies of each kernel's arguments are not the kernel's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tempo.ops import workspace_bytes
    from tempo.sizes import attention_core_workspace_bytes

    aten = torch.ops.aten
    allocating = {aten.empty.memory_format, aten.empty_like.default, aten.bmm.default, aten.mm.default}
    allocating |= {aten.clone.default}

    class Made(TorchDispatchMode):
        """The peak of the live bytes the wrapper's allocations hold (a storage is live while
        anything refers to it: followed through a weak reference)."""

        def __init__(self):
            super().__init__()
            self.live, self.peak = {}, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func not in allocating:
                return out
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.numel():
                    storage = t.untyped_storage()
                    self.live[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
            self.live = {ptr: (ref, n) for ptr, (ref, n) in self.live.items() if ref() is not None}
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
            return out

    def besides(mode: Made, outputs) -> int:
        return mode.peak - sum(t.untyped_storage().nbytes() for t in outputs)

    s = torch.randn(2, 3, 5, 33).to(DEVICE)
    v = torch.randn(2, 33, 3, 8).transpose(1, 2) if hf_value else torch.randn(2, 3, 33, 8)
    v, go = v.to(DEVICE), torch.randn(2, 3, 5, 8).to(DEVICE)
    with Made() as mode:
        out, probs = attention_core_fwd_triton(s, v, p, 5)
    assert besides(mode, (out, probs)) == workspace_bytes("tempo::attention_core", (s, v, p, 5), {}, "cuda")
    args = (go, None, probs, v, p, 5, scores_dtype)
    with Made() as mode:
        gs, gv = attention_core_bwd_triton(*args)
    # float64 scores stand in for any dtype other than V's; the op itself sends float64 to its
    # PyTorch path (and workspace_bytes prices it so), so here the kernels' own price
    kernels = attention_core_workspace_bytes(
        tuple(probs.shape), v.element_size(), p > 0, "cuda", False, scores_dtype != v.dtype
    )
    assert besides(mode, (gs, gv)) == kernels
    if scores_dtype == v.dtype:
        assert kernels == workspace_bytes("tempo::attention_core_bwd", args, {}, "cuda")
    assert gs.dtype == scores_dtype
    # dS written over dD (float32 scores) against dS in a buffer of its own (float64): the same
    # float32 math, stored in another dtype
    shared, _ = attention_core_bwd_triton(go, None, probs, v, p, 5, torch.float32)
    own, _ = attention_core_bwd_triton(go, None, probs, v, p, 5, torch.float64)
    torch.testing.assert_close(shared.double(), own, rtol=0, atol=0)
    if p == 0.0:  # the PyTorch path draws another dropout mask: compared without dropout only
        reference, _ = A.attention_core_bwd_torch(go, None, probs, v, p, torch.tensor(5), torch.float64)
        torch.testing.assert_close(own.cpu(), reference.cpu(), rtol=1e-5, atol=1e-6)


@triton.jit
def _masks_at(out_ptr, base, seed, p, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """keep_mask at offsets base + i (WIDE), or the 32-bit counter the attention kernels used."""
    offsets = base + tl.arange(0, BLOCK).to(tl.int64)
    if WIDE:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        keep = keep_mask(seed, offsets, p)
    else:
        keep = tl.rand(seed, offsets.to(tl.int32)) >= p
    tl.store(out_ptr + tl.arange(0, BLOCK), keep.to(tl.int8))


def test_the_dropout_mask_does_not_repeat_past_two_to_the_32_elements():
    """keep_mask (the dropout and attention kernels' one mask) at element offsets 2^32 + i is not
    its mask at i: a 32-bit counter, as the attention kernels had, wrapped there and repeated the
    mask in every attention of b a s^2 >= 2^32 probabilities (seq 8192, 64 heads). Below 2^32 it
    is the mask the 32-bit counter gave (the control: the same bits, so earlier runs' masks)."""
    n, seed = 1024, int(torch.randint(0, 2**31 - 1, ()))

    def mask(base: int, wide: bool) -> torch.Tensor:
        out = torch.empty(n, dtype=torch.int8, device=DEVICE)
        _masks_at[(1,)](out, base, seed, 0.5, BLOCK=n, WIDE=wide)
        return out.cpu()

    low = mask(0, True)
    assert torch.equal(low, mask(0, False)) and torch.equal(mask(2**31, True), mask(2**31, False))
    assert torch.equal(mask(2**32, False), low)  # the old counter's repeat
    assert (mask(2**32, True) != low).float().mean() > 0.3  # independent masks differ in half
