"""GPU data sheets: the vendors' published numbers, one home for every system's models (Mist's
planner, CTA-pipelining's latency model), in presets/datasheets.json: one entry per GPU, units in
the field names. Dense (no sparsity) half-precision peaks; dense FP32 peaks on CUDA cores, no TF32
(torch's default for matmuls, which nothing here changes): what a float32 GEMM can reach, a
quarter to a sixteenth of the half-precision peak. ``null`` where no model here uses the number.

Add a GPU by adding its entry to the file (``python -m mist list`` shows the presets); the file is
read on first use (``datasheets()``), never at import, through the strict checks of
``measure.presets``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from .presets import MAX_PRESET_BYTES, check_fields, count, load_preset, number, text

# presets/ is data (no __init__.py): the module measure.presets is presets.py beside it
DATASHEETS_FILE = Path(__file__).parent / "presets" / "datasheets.json"


@dataclass(frozen=True)
class DataSheet:
    name: str
    flops: float  # dense fp16/bf16 tensor-core peak, FLOP/s
    fp32_flops: float | None  # dense FP32 peak (CUDA cores, no TF32), FLOP/s
    memory: int | None  # bytes
    hbm_bw: float | None  # bytes/s
    l2: int | None  # bytes
    pcie_bw: float | None  # host <-> device, bytes/s per direction
    nvlink_bw: float | None  # bytes/s per GPU per direction; None: no NVLink (PCIe between GPUs)
    sms: int | None
    source: str


# An entry's fields in the file, in DataSheet's order (name: the entry's key)
SHEET_FIELDS = (
    "dense_bf16_flop_per_s",
    "fp32_flop_per_s",
    "memory_bytes",
    "hbm_bytes_per_s",
    "l2_bytes",
    "pcie_bytes_per_s",
    "nvlink_bytes_per_s",
    "sms",
    "source",
)
# The most streaming multiprocessors a GPU may have: 8x the B200's 148
MAX_SMS = 1024
_UNKNOWN = " (or null: not on record)"


def _sheet(path: Path | str, name: str, d: object) -> DataSheet:
    """One entry, read strictly: every field there, numbers finite and > 0 (or null where the
    field may be unknown), byte amounts and SMs whole numbers."""
    check_fields(path, name, d, SHEET_FIELDS)

    def rate(field: str) -> float | None:
        value = d[field]
        return None if value is None else number(path, f"{name}.{field}", value, above=True, or_else=_UNKNOWN)

    def amount(field: str, most: int) -> int | None:
        value = d[field]
        return None if value is None else count(path, f"{name}.{field}", value, most=most, or_else=_UNKNOWN)

    return DataSheet(
        name,
        number(path, f"{name}.dense_bf16_flop_per_s", d["dense_bf16_flop_per_s"], above=True),
        rate("fp32_flop_per_s"),
        amount("memory_bytes", MAX_PRESET_BYTES),
        rate("hbm_bytes_per_s"),
        amount("l2_bytes", MAX_PRESET_BYTES),
        rate("pcie_bytes_per_s"),
        rate("nvlink_bytes_per_s"),
        amount("sms", MAX_SMS),
        text(path, f"{name}.source", d["source"]),
    )


def read_datasheets(path: Path) -> dict[str, DataSheet]:
    """The data sheets in ``path`` (datasheets.json's form), read strictly: one line naming the
    file and the field for whatever is wrong."""
    d = load_preset(path)
    if not d:
        raise ValueError(f"{path}: no data sheet (a mapping of GPU names to their data sheets)")
    for name in d:
        text(path, "a GPU's name", name)
    return {name: _sheet(path, name, entry) for name, entry in d.items()}


@functools.cache
def datasheets() -> dict[str, DataSheet]:
    """The shipped data sheets by GPU name, read on first use."""
    return read_datasheets(DATASHEETS_FILE)
