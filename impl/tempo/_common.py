"""Small helpers shared by Tempo's ops: input checks, compute dtypes, bit packing, RNG seeds."""

from __future__ import annotations

import torch

from measure.checks import finite, real

from .sizes import CHUNK_ELEMS

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {t.dtype}; Tempo's ops accept floating tensors only: "
            f"{', '.join(str(d) for d in FLOAT_DTYPES)}"
        )


def check_probability(p: float) -> None:
    """A dropout probability: a number in [0, 1) (a string or None raised a TypeError from '<=')."""
    if not (real(p) and 0.0 <= p < 1.0):
        raise ValueError(f"dropout probability must be a number in [0, 1), got {p!r}")


def check_eps(eps: float) -> None:
    """A norm's epsilon: a finite number >= 0 (a negative one or NaN gave NaN rows without a word)."""
    if not (finite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def check_training(training: object) -> None:
    """``training`` is True or False: "no" would be truthy, and dropout applied."""
    if not isinstance(training, bool):
        raise ValueError(f"training must be True or False, got {training!r}")


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math runs in: float32 for half types and float32, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (any shape) into uint8, 8 elements per byte, element i -> bit i % 8."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8).to(torch.uint8) * _bit_weights(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of pack_bits: a flat bool tensor of ``numel`` elements."""
    bits = (packed.view(-1, 1) & _bit_weights(packed.device)) != 0
    return bits.view(-1)[:numel]


def _bit_weights(device: torch.device) -> torch.Tensor:
    """Bit i's value, 2**i, for i < 8: made per call, under whatever mode is current. A tensor made
    once at import was a FakeTensor forever where the first import ran under FakeTensorMode (a
    memory estimate), and real calls then failed: in 10 of tests/measure's tests, by the order
    xdist gave them."""
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def packed_numel(numel: int) -> int:
    return (numel + 7) // 8


def new_seed() -> torch.Tensor:
    """A dropout seed drawn from torch's default CPU generator (so torch.manual_seed governs it).

    It lives on the CPU so reading it in a kernel launch never synchronises a GPU.
    """
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64)


def chunks(n: int, size: int = CHUNK_ELEMS):
    """(index, slice) pairs covering range(n) in pieces of ``size``."""
    for i, start in enumerate(range(0, n, size)):
        yield i, slice(start, min(start + size, n))


def dropout_keep_mask(
    seed: torch.Tensor | int,
    chunk_index: int,
    shape: torch.Size | tuple[int, ...],
    p: float,
    device: torch.device,
) -> torch.Tensor:
    """The keep-mask of chunk ``chunk_index`` of a dropout with ``seed``: a pure function of its
    arguments, regenerated bit-for-bit in backward, so it is never stored.

    PyTorch path (CPU, or CUDA without Triton). The Triton kernels use a counter-based generator
    (Philox via tl.rand); each path regenerates its own mask consistently.
    """
    gen = torch.Generator(device=device)
    # Distinct, well-mixed seeds per chunk (golden-ratio increment, as in SplitMix64).
    gen.manual_seed((int(seed) + chunk_index * 0x9E3779B97F4A7C15) % (1 << 63))
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32) >= p


def use_triton(*tensors: torch.Tensor, float64: bool = False) -> bool:
    """Run the fused Triton kernels? On CUDA tensors when triton imports (never on CPU).

    Not for empty tensors: the kernels' grids and row lengths assume at least one element, and the
    PyTorch paths handle empty shapes as torch does, on any device. Not for float64 unless the
    op's kernels compute in it (``float64``: RMSNorm's and SwiGLU's do); the others compute in
    float32, and float64 (the tests' reference precision) came back float32-rounded.
    """
    if not all(t.is_cuda for t in tensors) or any(t.numel() == 0 for t in tensors):
        return False
    if not float64 and any(t.dtype == torch.float64 for t in tensors):
        return False
    from .kernels import TRITON_AVAILABLE

    return TRITON_AVAILABLE
