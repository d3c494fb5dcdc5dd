"""Byte and rate units, one home for all (torch-free)."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 1e9  # decimal: link and memory bandwidths, FLOP/s prefixes are in powers of ten
