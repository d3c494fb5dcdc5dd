"""A GPU's usable allocator bytes: capacity less the CUDA context and a fragmentation slack.

Torch-free, so planners (Mist) that only do the arithmetic do not load torch.
"""

from __future__ import annotations

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

    @classmethod
    def parse(cls, text: str, **kwargs) -> GpuBudget:
        """'16GB' / '16GiB' / '11g' (binary GiB, as GPUs are sold), '512MiB', or a byte count."""
        s = text.strip().lower().replace(" ", "")
        units = {"gib": GiB, "gb": GiB, "g": GiB, "mib": 2**20, "mb": 2**20, "m": 2**20}
        for suffix, unit in units.items():
            number = s.removesuffix(suffix)
            if number != s:
                try:
                    return cls(int(float(number) * unit), **kwargs)
                except ValueError:
                    break
        if s.isdigit():
            return cls(int(s), **kwargs)
        raise ValueError(
            f"memory size {text!r} not understood: use e.g. '16GB', '80GiB', '512MiB' or a byte count"
        )
