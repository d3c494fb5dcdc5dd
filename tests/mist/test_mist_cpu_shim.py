"""The CPU engine's stand-ins for a GPU: bf16 GEMMs in float32, rounded once; one-byte dropout
masks; subnormals flushed; megatron-core's fusions uncompiled."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from measure.cpu_peak import cpu_peak_bytes
from mist.engine.cpu_shim import GEMM_SCRATCH, bf16_gemms_in_float32

U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significand bits)
U_FP32 = 2.0**-24


def _bf16(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape)).to(torch.bfloat16)


def _within_rounding(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, k: int) -> None:
    """``got`` is ``exact`` (computed in float64 from the bf16 operands) rounded to bf16 once,
    after a float32 sum of ``k`` terms whose absolute values add up to ``magnitude``: each element
    within u_bf16·|exact| + 2k·u_fp32·magnitude (the sum's error bound, doubled for its products)."""
    bound = U_BF16 * exact.abs() + 2 * k * U_FP32 * magnitude
    assert ((got.double() - exact).abs() <= bound).all(), ((got.double() - exact).abs() / bound).max()


def _abs(t: torch.Tensor) -> torch.Tensor:
    return t.double().abs()


def test_products_are_the_float64_ones_rounded_once(rng):
    a, b, c = _bf16(rng, 33, 70), _bf16(rng, 70, 21), _bf16(rng, 21)
    x, y, z = _bf16(rng, 3, 17, 40), _bf16(rng, 3, 40, 9), _bf16(rng, 3, 17, 9)
    with bf16_gemms_in_float32():
        mm, addmm = a @ b, torch.addmm(c, a, b, beta=0.5, alpha=2.0)
        bmm, baddbmm = x.bmm(y), torch.baddbmm(z, x, y, beta=0.5, alpha=2.0)
    for got in (mm, addmm, bmm, baddbmm):
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
    _within_rounding(mm, a.double() @ b.double(), _abs(a) @ _abs(b), 70)
    _within_rounding(
        addmm,
        0.5 * c.double() + 2.0 * (a.double() @ b.double()),
        0.5 * _abs(c) + 2.0 * (_abs(a) @ _abs(b)),
        71,
    )
    _within_rounding(bmm, x.double().bmm(y.double()), _abs(x).bmm(_abs(y)), 40)
    _within_rounding(
        baddbmm,
        0.5 * z.double() + 2.0 * x.double().bmm(y.double()),
        0.5 * _abs(z) + 2.0 * _abs(x).bmm(_abs(y)),
        41,
    )


def test_gradients_flow_through_it(rng):
    a, b = _bf16(rng, 16, 24).requires_grad_(), _bf16(rng, 24, 8).requires_grad_()
    g = _bf16(rng, 16, 8)
    with bf16_gemms_in_float32():
        (a @ b).backward(g)
    _within_rounding(a.grad, g.double() @ b.double().t(), _abs(g) @ _abs(b).t(), 8)
    _within_rounding(b.grad, a.double().t() @ g.double(), _abs(a).t() @ _abs(g), 16)


def test_other_dtypes_and_errors_are_unchanged(rng):
    a, b = (torch.from_numpy(rng.standard_normal(shape)).float() for shape in ((9, 5), (5, 7)))
    outside = a @ b
    with bf16_gemms_in_float32():
        assert torch.equal(a @ b, outside)
        with pytest.raises(RuntimeError):
            a.to(torch.bfloat16) @ b  # mixed dtypes: refused as torch refuses them
        with pytest.raises(RuntimeError):
            a @ a  # shapes that do not chain


def _scratch_ranges(call) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    stack, n = list(prof.profiler.kineto_results.experimental_event_tree()), 0
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        n += e.tag == _EventType.TorchOp and e.name == GEMM_SCRATCH
    return n


def test_its_copies_are_left_out_of_the_memory_measured_and_it_ends_on_exit(rng):
    """Inside, the float32 copies are made in GEMM_SCRATCH ranges: the peak measured without them
    is the product's own bytes; with them counted (the negative control) the float32 copies of
    both operands and of the product show. Nested use keeps it on; on exit torch's own kernels
    are back (no scratch ranges)."""
    a, b = _bf16(rng, 256, 128), _bf16(rng, 128, 64)
    product = 256 * 64 * 2
    with bf16_gemms_in_float32():
        left_out, _ = cpu_peak_bytes(lambda: a @ b, exclude=(GEMM_SCRATCH,))
        counted, _ = cpu_peak_bytes(lambda: a @ b)
        with bf16_gemms_in_float32():
            pass
        assert _scratch_ranges(lambda: a @ b) == 1
    assert left_out == product
    assert counted >= product + 4 * (256 * 128 + 128 * 64)
    assert _scratch_ranges(lambda: a @ b) == 0


def test_dropout_stand_in_keeps_a_one_byte_mask_as_cuda_does():
    """Under one_byte_dropout_masks a training dropout on a CPU keeps a bool mask for backward (as
    CUDA's dropout does and Mist's model prices), each output element the input's kept or zeroed
    and scaled (within two bf16 roundings), the gradient through the same mask; eval and p = 0
    unchanged, and F.dropout restored on exit. Negative control: torch's own CPU dropout keeps
    its mask in bf16."""
    from mist.engine.cpu_shim import one_byte_dropout_masks

    def saved_dtypes(fn):
        dtypes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: dtypes.append(t.dtype) or t, lambda t: t):
            out = fn()
        return out, dtypes

    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    original = torch.nn.functional.dropout
    _, dtypes = saved_dtypes(lambda: torch.nn.functional.dropout(x, 0.3))
    assert dtypes == [torch.bfloat16]  # the control: torch's CPU dropout
    with one_byte_dropout_masks():
        y, dtypes = saved_dtypes(lambda: torch.nn.functional.dropout(x, 0.3))
        assert dtypes == [torch.bool]
        y.backward(torch.ones_like(y))
        # the mask read off the gradient of ones, not off y: an input may be exactly zero (torch
        # 2.11's bfloat16 randn on a CPU draws exact zeros), and so its kept output
        kept = x.grad != 0
        exact = x.detach().double() / 0.7  # the scale and the product each rounded once at most
        eps = torch.finfo(torch.bfloat16).eps
        assert (y[~kept] == 0).all()  # the output through the gradient's mask
        assert ((y.detach().double() - exact)[kept].abs() <= eps * exact[kept].abs()).all()
        assert ((x.grad[kept].double() - 1 / 0.7).abs() <= eps / 0.7).all()
        assert 0 < kept.float().mean() < 1
        assert torch.equal(torch.nn.functional.dropout(x, 0.3, training=False), x)
        assert torch.equal(torch.nn.functional.dropout(x, 0.0), x)
    assert torch.nn.functional.dropout is original


def _subnormals(rng: np.random.Generator, n: int) -> torch.Tensor:
    """``n`` float32 subnormals, random in magnitude (1 to 2^23 - 1 ulps of 2^-149) and sign."""
    ulps = rng.integers(1, 2**23, size=n) * rng.choice([-1, 1], size=n)
    return torch.from_numpy(np.ldexp(ulps.astype(np.float64), -149)).float()


def test_subnormals_are_flushed_inside_and_the_mode_before_comes_back(rng):
    """Under subnormals_flushed arithmetic reads and writes subnormals as zero, in this thread and
    in a thread started inside it (gloo's are), normal numbers unchanged; nested use keeps it on,
    and on exit the mode before comes back, off or on. Negative control: outside it a product
    keeps its subnormals."""
    from mist.engine.cpu_shim import flushing_subnormals, subnormals_flushed

    if not torch.set_flush_denormal(False):  # the mode cannot be set on this CPU: nothing to test
        pytest.skip("this CPU cannot flush subnormals (torch.set_flush_denormal)")
    tiny = _subnormals(rng, 64)
    normal = torch.from_numpy(rng.uniform(0.5, 2.0, 64) * rng.choice([-1, 1], 64)).float()
    assert torch.equal(tiny * 1.0, tiny) and (tiny != 0).all()  # the control: kept outside
    assert not flushing_subnormals()
    seen = []
    with subnormals_flushed():
        assert flushing_subnormals()
        assert torch.equal(tiny * 1.0, torch.zeros_like(tiny))  # read as zero
        assert torch.equal(normal * 2.0**-100 * 2.0**100, normal)  # normal all the way: unchanged
        # two normal factors whose product is subnormal: written as zero
        assert torch.equal((normal * 2.0**-70 * 2.0**-70).abs(), torch.zeros_like(normal))
        thread = threading.Thread(target=lambda: seen.append(flushing_subnormals()))
        thread.start()
        thread.join()
        with subnormals_flushed():
            pass
        assert flushing_subnormals()
    assert seen == [True]
    assert not flushing_subnormals() and torch.equal(tiny * 1.0, tiny)
    torch.set_flush_denormal(True)  # on before: still on after
    try:
        with subnormals_flushed():
            pass
        assert flushing_subnormals()
    finally:
        torch.set_flush_denormal(False)


_COMPILED = (  # whether megatron-core's SwiGLU is torch.compile's wrapper
    "import megatron.core.fusions.fused_bias_swiglu as S; "
    "print(hasattr(S.swiglu, '_torchdynamo_orig_callable'))"
)


def _in_fresh_python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_megatron_fusions_run_as_their_plain_torch_ops(rng):
    """After install, megatron-core's SwiGLU (a ``jit_fuser`` function: torch.compile, which
    compiles again in every process) is the plain function it wraps, in a module imported before
    install; its forward is F.silu(a)·b, its backward autograd's of that, in float64 (within
    rounding: the backward is written out in another order). Control: without install,
    megatron-core compiles it."""
    assert _in_fresh_python(_COMPILED) == "True"  # the control
    assert _in_fresh_python(f"from mist.engine import cpu_shim; cpu_shim.install(); {_COMPILED}") == "False"
    from megatron.core.fusions import fused_bias_swiglu

    from mist.engine import cpu_shim

    cpu_shim.install()
    assert not hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable")
    x = torch.from_numpy(rng.standard_normal((16, 3, 2 * 24))).requires_grad_()
    g = torch.from_numpy(rng.standard_normal((16, 3, 24)))
    y = fused_bias_swiglu.bias_swiglu_impl(x, None)
    (grad,) = torch.autograd.grad(y, x, g)
    reference = x.detach().requires_grad_()
    a, b = reference.chunk(2, -1)
    expected = torch.nn.functional.silu(a) * b
    (expected_grad,) = torch.autograd.grad(expected, reference, g)
    assert torch.equal(y, expected)
    # each gradient element is a few products and sums: within 16 float64 roundings of their size
    a, b = (t.detach().abs() for t in (a, b))
    size = torch.cat((g.abs() * b * (1 + a), g.abs() * a), -1)
    assert ((grad - expected_grad).abs() <= 16 * torch.finfo(torch.float64).eps * size).all()
