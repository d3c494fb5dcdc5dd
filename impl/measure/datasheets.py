"""GPU data sheets: the vendors' published numbers, one home for every system's models (Mist's
planner, CTA-pipelining's latency model). Dense (no sparsity) half-precision peaks; ``None``
where no model here uses the number."""

from __future__ import annotations

from dataclasses import dataclass

from .units import GB, GiB, MiB


@dataclass(frozen=True)
class DataSheet:
    name: str
    flops: float  # dense fp16/bf16 tensor-core peak, FLOP/s
    memory: int | None  # bytes
    hbm_bw: float | None  # bytes/s
    l2: int | None  # bytes
    pcie_bw: float | None  # host <-> device, bytes/s per direction
    nvlink_bw: float | None  # bytes/s per GPU per direction; None: no NVLink (PCIe between GPUs)
    sms: int | None
    source: str


DATASHEETS: dict[str, DataSheet] = {
    d.name: d
    for d in (
        DataSheet("l4", 121e12, 24 * GiB, 300 * GB, 48 * MiB, 32 * GB, None, None, "NVIDIA L4 data sheet"),
        DataSheet("a10g", 125e12, 24 * GiB, 600 * GB, 6 * MiB, 32 * GB, None, None, "NVIDIA A10 / AWS A10G"),
        DataSheet(
            "v100",
            125e12,
            32 * GiB,
            900 * GB,
            6 * MiB,
            16 * GB,
            150 * GB,
            None,
            "V100 SXM2 data sheet: NVLink 2 300 GB/s (150 each way)",
        ),
        DataSheet(
            "a100-40gb",
            312e12,
            40 * GiB,
            1555 * GB,
            40 * MiB,
            32 * GB,
            300 * GB,
            None,
            "A100 SXM4 40GB data sheet: NVLink 3 600 GB/s (300 each way)",
        ),
        DataSheet(
            "h100",
            989e12,
            80 * GiB,
            3350 * GB,
            50 * MiB,
            64 * GB,
            450 * GB,
            132,
            "H100 SXM data sheet: NVLink 4 900 GB/s (450 each way)",
        ),
        DataSheet(
            "h200",
            989e12,
            int(141 * GB),
            4800 * GB,
            50 * MiB,
            64 * GB,
            450 * GB,
            132,
            "H200 SXM data sheet: 132 SMs, 989 TFLOP/s dense BF16, NVLink 900 GB/s (450 each way)",
        ),
        DataSheet(
            "b200",
            2.25e15,
            None,
            None,
            None,
            None,
            900 * GB,
            148,
            "HGX B200 data sheet: 148 SMs, 2.25 PFLOP/s dense BF16, NVLink 5 1.8 TB/s (900 each way)",
        ),
    )
}

# Dense FP32 peaks (CUDA cores, no TF32: torch's default for matmuls, which nothing here changes), FLOP/s:
# what a float32 GEMM can reach, a quarter to a sixteenth of the half-precision ``flops``. From the
# same data sheets (A10G: the A10's); the GPUs Mist fits profiles of.
FP32_FLOPS: dict[str, float] = {
    "l4": 30.3e12,
    "a10g": 31.2e12,
    "v100": 15.7e12,
    "a100-40gb": 19.5e12,
    "h100": 67e12,
    "h200": 67e12,
}
