"""Run megatron-core on a CPU-only torch: the one place that stands in for CUDA.

megatron-core asks the CUDA runtime for its current device, synchronises streams and keeps a
"CUDA" random-number-generator state per parallel region (the model-parallel tracker that
gives each TP rank its own dropout stream). On a CPU these map onto the CPU: tensors are made on
"cpu", synchronisation is a no-op (gloo collectives are synchronous), and the tracker's states
are states of the CPU generator (so the tracker still gives each region its own stream).
megatron-core's fused elementwise functions (``jit_fuser``: torch.compile) run as the plain
torch ops they are written in (``_eager_fusions``).
Nothing here changes anything when CUDA is available. ``gpu_standins`` stands in for what a GPU
run computes, keeps and takes time on: bf16 matrix units (``bf16_gemms_in_float32``, on every CPU
alike, whatever bf16 instructions it has), one-byte dropout masks (``one_byte_dropout_masks``) and
arithmetic whose speed does not depend on the values (``subnormals_flushed``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import warnings
from collections.abc import Iterator

import torch

_INSTALLED = False


def install() -> None:
    """Idempotent; call before importing megatron.core modules that read these at import time."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.manual_seed = lambda seed, *args, **kwargs: torch.manual_seed(seed)
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # The tracker warns when the CPU generator moves inside a "CUDA" RNG region; here the two
    # are the same generator, so it always would.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _eager_fusions()
    _INSTALLED = True


def _eager_fusions() -> None:
    """megatron-core's ``jit_fuser`` functions (torch.compile: SwiGLU's forward and backward, among
    others) as their plain torch ops: module-level ones in the modules imported so far, and every
    one decorated from now on (methods decorated before this, as L2Norm's, stay compiled; the
    engine's layers use none).
    Inductor compiles them again in every new process: 4.3 s of a 2-rank Llama launch of the
    engine's 15 on the Intel Xeon VM (2026-12-05), where a GPU job compiles once in hours. What a
    layer keeps is the same (the autograd Functions around them save their inputs either way; a
    Llama plan's step peaks, measured both ways at micro-batches 1, 4 and 8, within 0.2%), and the
    profiles time the layer as the engine runs it."""
    from megatron.core import jit

    jit.disable_jit_fuser()  # what the modules imported from now on decorate with
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("megatron.core"):
            continue
        for attr, value in list(vars(module).items()):
            if _compiled_function(value):
                setattr(module, attr, value._torchdynamo_orig_callable)


def _compiled_function(value: object) -> bool:
    """Whether ``value`` is torch.compile's own wrapper of a plain function: not a MagicMock (which
    has every attribute), not torch.compiler.disable's wrapper (which carries the same attribute),
    not another decorator's wrapper of one (functools.wraps copies the attribute onto it)."""
    return (
        isinstance(value, types.FunctionType)
        and getattr(value, "_torchdynamo_wrapper_id", None) == id(value)
        and not getattr(value, "_torchdynamo_disable", False)
        and isinstance(getattr(value, "_torchdynamo_orig_callable", None), types.FunctionType)
    )


# The profiler range the float32 GEMMs' scratch is made in (measure.cpu_peak leaves it out).
GEMM_SCRATCH = "cpu_shim: bf16 GEMM scratch"
_GEMM_OUTPUT_SHAPES = {  # aten GEMM -> the shape of its output, from its arguments
    "mm": lambda a, b: (a.shape[0], b.shape[1]),
    "bmm": lambda a, b: (a.shape[0], a.shape[1], b.shape[2]),
    "addmm": lambda c, a, b: (a.shape[0], b.shape[1]),
    "baddbmm": lambda c, a, b: (a.shape[0], a.shape[1], b.shape[2]),
}
_gemm_depth = 0


def _float32_gemm(name: str):
    """aten GEMM ``name``'s CPU kernel that multiplies bfloat16 operands in float32 and rounds the
    result to bfloat16 once; other dtypes as before. Both call the op's ``out=`` overload, which
    is registered apart and left as it is."""
    out_overload = getattr(torch.ops.aten, name).out
    output_shape = _GEMM_OUTPUT_SHAPES[name]

    def kernel(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        shape, device = output_shape(*args), tensors[0].device
        if any(t.dtype != torch.bfloat16 for t in tensors):  # unchanged, errors included
            return out_overload(
                *args, **kwargs, out=torch.empty(shape, dtype=tensors[0].dtype, device=device)
            )
        result = torch.empty(shape, dtype=torch.bfloat16, device=device)  # made outside: it is the op's
        with torch.profiler.record_function(GEMM_SCRATCH):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            result.copy_(
                out_overload(*wide, **kwargs, out=torch.empty(shape, dtype=torch.float32, device=device))
            )
            del wide
        return result

    return kernel


@contextlib.contextmanager
def bf16_gemms_in_float32() -> Iterator[None]:
    """On a CPU, bfloat16 matrix products computed in float32 and rounded once, as a GPU's tensor
    cores accumulate them; nothing changes on a GPU. torch's own bf16 GEMM is ~35x slower than
    float32 on a CPU without bf16 matrix instructions (AVX512-BF16, AMX; measured 1.3 against
    44 GFLOP/s on AMD Zen 3), which made the engine's steps mostly GEMM; the results are the
    same to bf16 rounding (both accumulate in float32). The copies this makes are the stand-in's,
    not the GPU run's: they are made inside the profiler range GEMM_SCRATCH, which the engine's
    memory measurement leaves out. Re-entrant; the kernels are restored on exit."""
    global _gemm_depth
    if torch.cuda.is_available() or _gemm_depth:
        _gemm_depth += 1
        try:
            yield
        finally:
            _gemm_depth -= 1
        return
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": meant
        warnings.simplefilter("ignore")
        for name in _GEMM_OUTPUT_SHAPES:
            lib.impl(name, _float32_gemm(name), "CPU")
    _gemm_depth = 1
    try:
        yield
    finally:
        _gemm_depth = 0
        lib._destroy()


_dropout_depth = 0


@contextlib.contextmanager
def one_byte_dropout_masks() -> Iterator[None]:
    """On a CPU, training dropout as CUDA's: ``torch.native_dropout``, which keeps a bool mask for
    backward. torch's CPU ``F.dropout`` multiplies by a noise tensor in the input's dtype and keeps
    that (2 bytes an element in bf16; traced in the engine, 2026-12-04: 0.5 MiB a layer and
    micro-batch of 4 at hidden 256 above what a GPU keeps and Mist's model prices). The values
    are a dropout's either way (a different random stream). Nothing changes on a GPU, in eval,
    at p = 0 or 1, or in place. Re-entrant; ``F.dropout`` is restored on exit."""
    global _dropout_depth
    if torch.cuda.is_available() or _dropout_depth:
        _dropout_depth += 1
        try:
            yield
        finally:
            _dropout_depth -= 1
        return
    functional = torch.nn.functional
    original = functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or inplace or not 0.0 < p < 1.0 or input.device.type != "cpu":
            return original(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    functional.dropout = dropout
    _dropout_depth = 1
    try:
        yield
    finally:
        _dropout_depth = 0
        functional.dropout = original


def flushing_subnormals() -> bool:
    """Whether this thread's arithmetic flushes subnormal floats to zero (torch sets the mode,
    ``torch.set_flush_denormal``, but has no getter): float32's smallest subnormal times one."""
    return float(torch.tensor([2.0**-149]) * 1.0) == 0.0


@contextlib.contextmanager
def subnormals_flushed() -> Iterator[None]:
    """On a CPU, subnormal floats read and written as zero (``torch.set_flush_denormal``: the FTZ and
    DAZ bits of this thread, which threads it starts afterwards inherit, gloo's among them; the
    engine and its profiles compute on one thread), so that a step's time depends on its work and
    not on its values, as on a GPU, whose arithmetic takes subnormals at full speed. x86 cores take
    a microcode assist on an operation with a subnormal operand or result; training makes some (a
    fresh layer, as the profile times, has none): measured in docs/mist.md. The values change only
    below the smallest normal number (float32 and bfloat16: 1.2e-38; float64: 2.2e-308). Nothing
    changes on a GPU or where the CPU cannot flush. Re-entrant: this thread's mode before is
    restored on exit."""
    if torch.cuda.is_available():
        yield
        return
    before = flushing_subnormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


@contextlib.contextmanager
def gpu_standins() -> Iterator[None]:
    """The stand-ins above: what the engine and its profiles run under on a CPU."""
    with bf16_gemms_in_float32(), one_byte_dropout_masks(), subnormals_flushed():
        yield
