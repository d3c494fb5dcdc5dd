"""A GPU's usable allocator bytes: capacity less the CUDA context and a fragmentation slack.

Torch-free, so planners (Mist) that only do the arithmetic do not load torch.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from .units import GiB


@dataclass(frozen=True)
class GpuBudget:
    """Usable allocator bytes on a GPU of ``capacity_bytes``.

    reserve = CUDA context + library workspaces (``context_bytes``, default 0.75 GiB; an
    H100/H200 context with cuBLAS takes ~0.5-0.7 GiB) + fragmentation slack
    (``fragmentation`` of what is left, default 5%).
    """

    capacity_bytes: int
    context_bytes: int = int(0.75 * GiB)
    fragmentation: float = 0.05

    @property
    def usable_bytes(self) -> int:
        return int((self.capacity_bytes - self.context_bytes) * (1.0 - self.fragmentation))

    @property
    def reserve(self) -> str:
        """The reserve as the results name it in their keys, e.g. "0.75 GiB + 5%"."""
        return f"{self.context_bytes / GiB:g} GiB + {self.fragmentation:.0%}"

    @classmethod
    def parse(cls, text: str, **kwargs) -> GpuBudget:
        """'16GB' / '16GiB' / '11g' (binary GiB, as GPUs are sold), '512MiB', '2TB' / '2TiB' (a
        host's memory; binary too), or a byte count."""
        s = text.strip().lower().replace(" ", "")
        units = {"tib": 2**40, "tb": 2**40, "t": 2**40, "gib": GiB, "gb": GiB, "g": GiB}
        units |= {"mib": 2**20, "mb": 2**20, "m": 2**20}
        accepted = "use e.g. '16GB', '80GiB', '512MiB', '2TB' or a byte count"
        size = None
        for suffix, unit in units.items():
            number = s.removesuffix(suffix)
            if number != s:
                with contextlib.suppress(ValueError):
                    size = float(number) * unit
                break
        if size is None and s.isdigit():
            size = int(s)
        if size is None:
            raise ValueError(f"memory size {text!r} not understood: {accepted}")
        if not (math.isfinite(size) and size >= 1):  # inf, nan, 1e400, zero, negative
            raise ValueError(f"memory size {text!r} must be a positive, finite amount: {accepted}")
        return cls(int(size), **kwargs)
