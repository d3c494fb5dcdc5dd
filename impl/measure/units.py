"""Byte and rate units, one home for all (torch-free)."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 1e9  # decimal: link and memory bandwidths, FLOP/s prefixes are in powers of ten


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (so a 3-byte cap does not read
    as "0.0 GiB"): '80.0 GiB', '2.0 MiB', '3 B'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
