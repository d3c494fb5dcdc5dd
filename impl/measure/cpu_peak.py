"""Real peak of CPU allocations during a call, from the profiler's allocator events.

Independent of the fake-tensor estimator's bookkeeping, so the two can be checked against each
other. The profiler's "total allocated" counter carries over between profiling sessions (frees
made while it was off are never subtracted), so the peak is taken relative to the counter's
value just before the first event of this session. The events are read from the profiler's own
event tree: exporting them as a Chrome trace and parsing its JSON took half of a small training
step's profiled time (measured on the Mist engine's CPU runs).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterable
from typing import Any

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def _events(prof: profile) -> list:
    """Every event of a finished profile, nested ones included."""
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        out.append(event)
        stack.extend(event.children)
    return out


class _Windows:
    """Time ranges per thread, merged where they overlap, to ask which contain a moment (a step
    has thousands: one per float32 GEMM of mist.engine.cpu_shim)."""

    def __init__(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        per_thread: dict[int, list[tuple[int, int]]] = {}
        for tid, lo, hi in sorted(ranges):
            merged = per_thread.setdefault(tid, [])
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self._starts = {tid: [lo for lo, _ in merged] for tid, merged in per_thread.items()}
        self._ranges = per_thread

    def contain(self, tid: int, t: int) -> bool:
        i = bisect.bisect_right(self._starts.get(tid, []), t) - 1
        return i >= 0 and t <= self._ranges[tid][i][1]


def cpu_peak_bytes(fn: Callable[[], Any], exclude: Collection[str] = ()) -> tuple[int, Any]:
    """(peak bytes allocated above the level at the call's start, fn's result). ``exclude``: the
    names of ``torch.profiler.record_function`` ranges whose own allocations do not count, from
    when they are made until they are freed (work a GPU run does in host memory, such as an
    offloaded optimizer's step, which on a CPU lands in the one memory there is). Only the
    range's thread's allocations are its own; frees of memory allocated before it still count."""
    if isinstance(exclude, str):
        raise TypeError("exclude is a collection of range names, not one name")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = _events(prof)
    allocations = (e for e in events if e.tag == _EventType.Allocation)
    mem = sorted(
        (e for e in allocations if e.extra_fields.device.type == "cpu"), key=lambda e: e.start_time_ns
    )
    if not mem:
        return 0, result
    windows = _Windows(
        (e.start_tid, e.start_time_ns, e.end_time_ns)
        for e in events
        if e.tag == _EventType.TorchOp and e.name in exclude
    )
    first = mem[0].extra_fields
    start = first.total_allocated - first.alloc_size
    excluded, peak, excluded_addresses = 0, 0, set()
    for e in mem:
        size, address = e.extra_fields.alloc_size, e.extra_fields.ptr
        if size > 0 and windows.contain(e.start_tid, e.start_time_ns):
            excluded += size
            excluded_addresses.add(address)
        elif size < 0 and address in excluded_addresses:  # an excluded allocation freed
            excluded += size
            excluded_addresses.discard(address)
        peak = max(peak, e.extra_fields.total_allocated - excluded - start)
    return peak, result


def device_peak_bytes(fn: Callable[[], Any], device, exclude: Collection[str] = ()) -> tuple[int, Any]:
    """``cpu_peak_bytes`` on a CPU (``exclude`` as there); on a GPU (``device`` of type cuda) the
    CUDA allocator's peak above what it held as the call began (every allocation counts: nothing
    a GPU run does on the host is in it)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return cpu_peak_bytes(fn, exclude=exclude)
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start, result
