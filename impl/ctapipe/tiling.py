"""The one tile configuration of CTA-pipelining's kernels, shared by the kernels' launch code
(``gemm``) and the latency model (``sim``), which prices CTA tiles at the size the kernels use.
No torch or Triton here: the latency model imports it on any machine."""

from __future__ import annotations

from dataclasses import dataclass

from measure.checks import whole


@dataclass(frozen=True)
class Tiling:
    """Tile shape of every kernel. GPU default: 128 x 128 x 64 (H100/H200-class tensor cores)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not whole(v, 16) or v & (v - 1):
                raise ValueError(f"{name} must be a whole power of two >= 16 (tl.dot), got {v!r}")
            object.__setattr__(self, name, int(v))  # a numpy integer as Python's: Triton's constexprs

    def launch_options(self) -> dict:
        """Warps and pipeline stages: 8 warps for 128 x 128 tiles and up (tensor-core GEMM practice)."""
        return {"num_warps": 8 if self.block_m * self.block_n >= 128 * 128 else 4, "num_stages": 3}

    def tiles(self, m: int, n: int) -> tuple[int, int]:
        """Row blocks and column tiles of an m x n output."""
        for name, v in (("m", m), ("n", n)):
            if not whole(v, 0):
                raise ValueError(f"an output's {name} must be a whole number >= 0, got {v!r}")
        return -(-m // self.block_m), -(-n // self.block_n)


DEFAULT_TILING = Tiling()
INTERPRETER_TILING = Tiling(16, 16, 16)  # small tiles: many CTAs even at test sizes
