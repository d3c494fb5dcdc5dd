"""Triton kernels against the PyTorch path. Without a GPU they run under TRITON_INTERPRET=1
(set in conftest); `nox -s gpu_check` runs the same tests compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from tempo.ops import attention as A
from tempo.ops import gelu as G
from tempo.ops import layernorm as L

pytest.importorskip("triton")
from tempo.kernels.attention import attention_core_bwd_triton, attention_core_fwd_triton
from tempo.kernels.dropout import dropout_triton
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
    x = torch.cat([
        torch.randn(6000) * 3, x_min + 0.05 * torch.randn(600), torch.empty(300).uniform_(-30, 30),
        torch.tensor([inf, -inf, float("nan"), 0.0, big, -big]),
    ]).to(dtype)  # fmt: skip
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
