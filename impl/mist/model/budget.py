"""Memory budgets of one GPU: what its own memory and its share of the node's DRAM may hold."""

from __future__ import annotations

from measure.budget import GpuBudget

from .specs import CPU_PRESET, ClusterSpec

# Of a node's DRAM, what offloading may use (the rest: the OS, the framework, data loading).
HOST_USABLE_FRACTION = 0.9


def gpu_budget_bytes(cluster: ClusterSpec) -> int:
    """Bytes one GPU may fill: its memory less the framework's reserve (``measure.budget``). The
    CPU "device" of mist.engine.run has no CUDA context or caching allocator: all of it."""
    if cluster.gpu.name == CPU_PRESET:
        return GpuBudget(cluster.gpu.memory, context_bytes=0, fragmentation=0.0).usable_bytes
    return GpuBudget(cluster.gpu.memory).usable_bytes


def host_budget_bytes(cluster: ClusterSpec) -> float:
    """Host bytes one GPU may fill with offloaded state: its share of the node's usable DRAM."""
    return HOST_USABLE_FRACTION * cluster.host.memory / cluster.gpus_per_node
