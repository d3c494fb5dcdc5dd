"""Lean attention core: keeps softmax probabilities and V, regenerates the dropout mask."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import tempo
from measure.saved import saved_bytes
from tempo.ops import attention as A


def reference(q, k, v, mask, keep=None, p=0.0):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    probs = torch.softmax(s, -1)
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs @ v


def qkv(b=2, h=3, s=40, d=8, dtype=torch.float64):
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.zeros(b, 1, 1, s, dtype=dtype)
    mask[0, ..., -5:] = torch.finfo(dtype).min  # padded keys in the first sequence
    return q, k, v, mask


def test_no_dropout_matches_eager_and_gradcheck():
    q, k, v, mask = qkv(s=12)
    out, _ = tempo.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.0)
    torch.testing.assert_close(out, reference(q, k, v, mask))
    assert torch.autograd.gradcheck(
        lambda q, k, v: tempo.scaled_dot_product_attention(q, k, v, mask)[0], (q, k, v)
    )


def test_dropout_gradcheck_fixed_seed():
    q, k, v, mask = qkv(s=12)

    def f(q, k, v):
        torch.manual_seed(3)
        return tempo.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.3)[0]

    # fast mode (the Jacobian against random vectors): the full one took ~30 s of the suite, and
    # the backward is checked element by element through the same mask in the test below
    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


def test_dropout_backward_matches_autograd_through_the_same_mask():
    """Recover the mask the forward used (V = identity exposes dropped P), then compare the
    backward with autograd through an explicitly masked reference."""
    b, h, s = 2, 2, 300  # several chunks of heads
    scores = torch.randn(b, h, s, s, dtype=torch.float64)
    seed = torch.tensor(99)
    dropped, probs = A.attention_core_op(
        scores, torch.eye(s, dtype=torch.float64).expand(b, h, s, s), 0.2, seed
    )
    keep = (dropped != 0).double()
    v = torch.randn(b, h, s, 16, dtype=torch.float64)
    go = torch.randn(b, h, s, 16, dtype=torch.float64)
    gs, gv = A.attention_core_bwd(go, None, probs, v, 0.2, seed, torch.float64)
    s_ref, v_ref = scores.clone().requires_grad_(), v.clone().requires_grad_()
    out_ref = (torch.softmax(s_ref, -1) * keep / 0.8) @ v_ref
    gs_ref, gv_ref = torch.autograd.grad(out_ref, (s_ref, v_ref), go)
    torch.testing.assert_close(gs, gs_ref)
    torch.testing.assert_close(gv, gv_ref)
    # negative control: another seed's mask gives another gradient
    gs_wrong, _ = A.attention_core_bwd(go, None, probs, v, 0.2, seed + 1, torch.float64)
    assert not torch.allclose(gs_wrong, gs_ref)


def test_gradient_through_returned_probabilities():
    q, k, v, mask = qkv(s=10)

    def f(q, k, v):
        out, probs = tempo.scaled_dot_product_attention(q, k, v, mask)
        return out.sum() + (probs**2).sum()

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradient_through_the_probabilities_alone():
    """The output unused: its gradient comes as None and is taken as zero (gradcheck in float64)."""
    q, k, v, mask = qkv(s=10)
    weights = torch.randn(2, 3, 10, 10, dtype=torch.float64)

    def f(q, k, v):
        return (tempo.scaled_dot_product_attention(q, k, v, mask)[1] * weights).sum()

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_backward_through_the_output_makes_no_gradient_for_the_probabilities():
    """P is returned but mostly unused: its gradient must not be made as a tensor of zeros, one
    more P-sized tensor in backward (measured with the profiler, bf16, 8 chunks of heads). The
    backward holds its outputs (dS, dV), dOut and its declared workspace, nothing P-sized more.
    Control: the same backward handed a zero gradient for P, as autograd materialised it before,
    holds that P more and breaks the bound."""
    from measure.cpu_peak import cpu_peak_bytes
    from tempo.ops import workspace_bytes

    b, h, s, d = 2, 32, 128, 16
    scores = torch.randn(b, h, s, s, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(b, h, s, d, dtype=torch.bfloat16)
    probs_bytes = scores.numel() * 2
    seed = torch.tensor(0)
    call = (go, None, scores, v, 0.0, seed, scores.dtype)
    # dS, dV and dOut, and the workspace
    bound = probs_bytes + 2 * v.numel() * 2 + workspace_bytes("tempo::attention_core_bwd", call, {}, "cpu")

    def backward(materialised: bool) -> int:
        out, probs = A.attention_core(scores, v)
        scores.grad = v.grad = None

        def run():
            if materialised:
                torch.autograd.backward((out, probs), (go, torch.zeros_like(probs)))
            else:
                out.backward(go)

        peak, _ = cpu_peak_bytes(run)
        return peak

    backward(False)  # lazy one-time allocations
    assert backward(False) <= bound
    assert backward(True) > bound


def test_keeps_probabilities_and_v_only():
    b, h, s, d = 2, 4, 64, 16
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    class Core(torch.nn.Module):
        def forward(self, q, k, v):
            return tempo.scaled_dot_product_attention(q, k, v, None, dropout_p=0.1)[0]

    r = saved_bytes(Core(), q, k, v)
    # Q and K (inputs) are kept by the QK^T matmul; the core keeps bf16 P and the seed; V is an input.
    assert r.activation_bytes == b * h * s * s * 2 + 8
    assert r.input_bytes == 3 * b * h * s * d * 2


def test_autocast_keeps_half_probabilities():
    q, k, v, _ = qkv(s=16, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, probs = tempo.scaled_dot_product_attention(q, k, v)
    assert probs.dtype == torch.bfloat16 and out.dtype == torch.bfloat16


def test_bad_shapes_are_refused_clearly():
    with pytest.raises(ValueError, match="disagree on Sk"):
        tempo.attention_core(torch.randn(1, 2, 4, 5), torch.randn(1, 2, 6, 3))
    with pytest.raises(ValueError, match="same leading dims"):
        tempo.attention_core(torch.randn(1, 2, 4, 5), torch.randn(1, 1, 5, 3))
    with pytest.raises(TypeError, match="floating"):
        tempo.attention_core(torch.ones(1, 2, 4, 5, dtype=torch.long), torch.randn(1, 2, 5, 3))


def test_opcheck():
    torch.library.opcheck(
        A.attention_core_op,
        (
            torch.randn(2, 2, 5, 5, requires_grad=True),
            torch.randn(2, 2, 5, 3, requires_grad=True),
            0.2,
            torch.tensor(5),
        ),
    )


def test_opcheck_backward_with_a_transposed_value_view():
    """HF passes V as a transposed view; the fake kernel must promise the real strides."""
    v = torch.randn(2, 5, 2, 3).transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D)
    out, probs = A.attention_core_op(torch.randn(2, 2, 5, 5), v, 0.1, torch.tensor(5))
    torch.library.opcheck(
        A.attention_core_bwd, (torch.randn_like(out), None, probs, v, 0.1, torch.tensor(5), torch.float32)
    )


def _gamma(n: int, u: float) -> float:
    """Higham's bound on the relative error of an n-term sum rounded at unit roundoff u."""
    return n * u / (1 - n * u)


def _core_error_bounds(scores: torch.Tensor, value: torch.Tensor, grad_out: torch.Tensor, dtype: torch.dtype):
    """Float64 (out, P, dS, dV) of softmax(scores) @ value and the worst-case error of each from
    the op's roundings, element by element: P computed in float32 (float64: in float64, which
    the float32 terms only widen) and rounded to ``dtype``; the matmuls summed in ``dtype`` (a
    CPU may accumulate a half matmul in float32 or not: the bound takes the worse); dS computed
    in float32 from P and dP = grad_out @ value^T and rounded to ``dtype``. First-order terms,
    with the magnitudes they multiply taken at their bounds, so second-order terms are covered."""
    s, v, g = (t.double() for t in (scores, value, grad_out))
    n, dv = s.shape[-1], v.shape[-1]
    u, tiny = torch.finfo(dtype).eps / 2, torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    u32 = torch.finfo(torch.float32).eps / 2
    p = torch.softmax(s, -1)
    out, dp = p @ v, g @ v.transpose(-1, -2)
    c = (p * dp).sum(-1, keepdim=True)
    ds, dvv = p * (dp - c), p.transpose(-1, -2) @ g
    # P: float32's exp of (s - max) and row sum (relative (|s - max| + n + 4) u32), then rounding
    shift = (s - s.amax(-1, keepdim=True)).abs().clamp(max=1e4)
    err_p = (u + (shift + n + 4) * u32 * (1 + u)) * p + tiny
    p_hi = p + err_p
    err_out = u * out.abs() + (_gamma(n, u) * p_hi + err_p) @ v.abs() + tiny
    err_dv = u * dvv.abs() + (_gamma(n, u) * p_hi + err_p).transpose(-1, -2) @ g.abs() + tiny
    err_dp = u * dp.abs() + _gamma(dv, u) * (g.abs() @ v.abs().transpose(-1, -2)) + tiny
    dp_hi = dp.abs() + err_dp
    err_c = (err_p * dp_hi + p_hi * err_dp).sum(-1, keepdim=True) + _gamma(n + 1, u32) * (p_hi * dp_hi).sum(
        -1, keepdim=True
    )
    c_hi = c.abs() + err_c
    err_ds = (
        u * ds.abs()
        + err_p * (dp_hi + c_hi)
        + p_hi * (err_dp + err_c)
        + 3 * u32 * p_hi * (dp_hi + c_hi)
        + tiny
    )
    return (out, err_out), (p, err_p), (ds, err_ds), (dvv, err_dv)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_accepted_dtype_against_a_float64_reference(dtype):
    """Output, P and both gradients within the worst-case error of the op's roundings
    (``_core_error_bounds``) of the float64 values, for fresh scores (spread so some rows are
    peaked), padded keys and values. Without dropout: its mask is tested in every dtype on its
    own (test_dropout) and through this op in float64 (gradcheck above)."""
    b, h, sq, sk, dv = 2, 3, 24, 40, 16
    scores = (3 * torch.randn(b, h, sq, sk)).to(dtype)
    scores[0, ..., -5:] = torch.finfo(dtype).min  # padded keys in the first sequence
    value = torch.randn(b, h, sk, dv).to(dtype)
    grad_out = torch.randn(b, h, sq, dv).to(dtype)
    s, v = scores.clone().requires_grad_(), value.clone().requires_grad_()
    out, probs = tempo.attention_core(s, v)
    out.backward(grad_out)
    assert out.dtype == probs.dtype == s.grad.dtype == v.grad.dtype == dtype
    computed = (out, probs, s.grad, v.grad)
    for name, got, (exact, bound) in zip(
        ("out", "P", "dS", "dV"), computed, _core_error_bounds(scores, value, grad_out, dtype), strict=True
    ):
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), f"{name}: worst error / bound {(err / bound).max().item():.3g}"


def test_negative_control_a_float32_core_computed_in_bfloat16_fails_the_float32_bound():
    """The bound above is tight enough to see a half-precision P or matmul in a float32 op."""
    scores, value, grad_out = torch.randn(2, 3, 24, 40), torch.randn(2, 3, 40, 16), torch.randn(2, 3, 24, 16)
    (exact_out, err_out), (exact_p, err_p), _, _ = _core_error_bounds(scores, value, grad_out, torch.float32)
    half_out, half_p = tempo.attention_core(scores.bfloat16(), value.bfloat16())
    assert not ((half_out.double() - exact_out).abs() <= err_out).all()
    assert not ((half_p.double() - exact_p).abs() <= err_p).all()


def test_a_boolean_mask_attends_where_true_as_sdpa_reads_it():
    """A boolean mask was added to the scores as 0/1 (no mask at all, silently); it is now read as
    torch's SDPA reads it (True attends), and an integer mask is refused in one line. Control: the
    same mask as its additive form gives the same output."""
    q, k, v, _ = qkv(s=int(torch.randint(4, 24, ())))
    s = q.shape[-2]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    out, _ = tempo.scaled_dot_product_attention(q, k, v, causal, dropout_p=0.0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    torch.testing.assert_close(out, ref)  # float64: torch's own tolerances for it
    additive = torch.zeros(s, s, dtype=q.dtype).masked_fill(~causal, torch.finfo(q.dtype).min)
    torch.testing.assert_close(out, tempo.scaled_dot_product_attention(q, k, v, additive)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"attention_mask must be float .* or bool .*, got torch\.int64"):
        tempo.scaled_dot_product_attention(q, k, v, causal.long())


def test_the_backward_takes_the_path_its_forward_took(monkeypatch):
    """The forward decides on (scores, value), so float64 scores take the PyTorch path (torch.rand's
    dropout mask); the backward decided on (grad, probs, value), which are value's dtype, and took
    the kernel (Philox's mask): another mask, wrong gradients, with mixed dtypes on CUDA. Here
    use_triton says yes as it would on a GPU, and the kernel may not be reached."""
    import tempo.kernels.attention as kernels

    monkeypatch.setattr(A, "use_triton", lambda *tensors, float64=False: True)
    monkeypatch.setattr(kernels, "attention_core_bwd_triton", lambda *a: pytest.fail("the kernel's mask"))
    probs = torch.softmax(torch.randn(2, 3, 5, 5), -1)
    value, grad = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    seed = torch.tensor(int(torch.randint(0, 2**31 - 1, ())))
    grad_scores, _ = A.attention_core_bwd(grad, None, probs, value, 0.2, seed, torch.float64)
    assert grad_scores.dtype == torch.float64
    with pytest.raises(pytest.fail.Exception, match="the kernel's mask"):  # the control: float32 scores
        A.attention_core_bwd(grad, None, probs, value, 0.2, seed, torch.float32)


def test_value_flattens_is_whether_view_flattens_the_heads():
    """tempo.ops.value_flattens (which prices V's copy) against view() itself, on V of random
    shapes (sizes 0 and 1 included), random dim orders, strided slices and broadcast dims."""
    from tempo.ops import value_flattens

    def views(v: torch.Tensor) -> bool:
        try:
            v.view(-1 if v.numel() else 0, *v.shape[-2:])
        except RuntimeError:
            return False
        return True

    seen = set()
    for _ in range(400):
        dims = int(torch.randint(2, 6, ()))
        shape = [
            int(torch.randint(0, 4, ())) if torch.rand(()) < 0.2 else int(torch.randint(1, 5, ()))
            for _ in range(dims)
        ]
        v = torch.empty(shape).permute(*torch.randperm(dims).tolist())
        if dims > 2 and torch.rand(()) < 0.3:  # every other entry of a leading dim
            v = v[::2]
        if dims > 2 and torch.rand(()) < 0.3 and v.shape[0] == 1:  # a broadcast leading dim
            v = v.expand(3, *v.shape[1:])
        assert value_flattens(v) == views(v), (tuple(v.shape), v.stride())
        seen.add(views(v))
    assert seen == {True, False}  # both kinds drawn: the comparison meant something
    hf = torch.empty(2, 16, 4, 8).transpose(1, 2)  # HF's V
    megatron = torch.empty(16, 2, 4, 8).permute(1, 2, 0, 3)  # megatron-core's, as tempo.megatron passes it
    assert not value_flattens(hf) and value_flattens(megatron)


def test_float64_attention_on_cuda_is_priced_as_the_path_it_takes():
    """On CUDA the attention core takes its PyTorch path for float64 (its kernels compute in
    float32), so its workspace is that path's: the chunk of heads and V's copy held through
    backward; RMSNorm's kernels compute in float64 and keep their own price."""
    from tempo.ops import FLOAT64_KERNEL_OPS, workspace_bytes

    v = torch.empty(2, 64, 4, 16, dtype=torch.float64).transpose(1, 2)
    s, go = torch.empty(2, 4, 64, 64, dtype=torch.float64), torch.empty(2, 4, 64, 16, dtype=torch.float64)
    seed = torch.tensor(1)
    for name, args in (
        ("tempo::attention_core", (s, v, 0.1, seed)),
        ("tempo::attention_core_bwd", (go, None, s, v, 0.1, seed, torch.float64)),
    ):
        assert workspace_bytes(name, args, {}, "cuda") == workspace_bytes(name, args, {}, "cpu")
    # float32 tensors whose scores were float64: the backward's dispatch takes the PyTorch path too
    mixed = (go.float(), None, s.float(), v.float(), 0.1, seed, torch.float64)
    assert workspace_bytes("tempo::attention_core_bwd", mixed, {}, "cuda") == workspace_bytes(
        "tempo::attention_core_bwd", mixed, {}, "cpu"
    )
    half = (s.float(), v.float(), 0.1, seed)  # the control: float32 takes the kernels, priced otherwise
    assert workspace_bytes("tempo::attention_core", half, {}, "cuda") != workspace_bytes(
        "tempo::attention_core", half, {}, "cpu"
    )
    x, w = torch.empty(8, 32, dtype=torch.float64), torch.empty(32, dtype=torch.float64)
    rstd = torch.empty(8, 1, dtype=torch.float64)
    # its kernel's own price: one program's float64 dgamma partials
    assert workspace_bytes("tempo::rms_norm_bwd", (x, x, rstd, w), {}, "cuda") == 8 * 32
    # the ops that run float64 kernels are the ones whose dispatch asks use_triton for float64
    import tempo.ops

    for module in pkgutil.iter_modules(tempo.ops.__path__):
        source = inspect.getsource(importlib.import_module(f"tempo.ops.{module.name}"))
        names = [n for n in FLOAT64_KERNEL_OPS if f'"{n}"' in source]
        assert ("float64=True" in source) == bool(names), module
