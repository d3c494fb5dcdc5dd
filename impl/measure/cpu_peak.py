"""Real peak of CPU allocations during a call, from the profiler's allocator events.

Independent of the fake-tensor estimator's bookkeeping, so the two can be checked against each
other. The profiler's "Total Allocated" counter carries over between profiling sessions (frees
made while it was off are never subtracted), so the peak is taken relative to the counter's
value just before the first event of this session.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def cpu_peak_bytes(fn: Callable[[], Any], exclude: str | None = None) -> tuple[int, Any]:
    """(peak bytes allocated above the level at the call's start, fn's result). ``exclude``: the
    name of ``torch.profiler.record_function`` ranges whose own allocations do not count, from
    when they are made until they are freed (work a GPU run does in host memory, such as an
    offloaded optimizer's step, which on a CPU lands in the one memory there is). Only the
    range's thread's allocations are its own; frees of memory allocated before it still count."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                 key=lambda e: e["ts"])  # fmt: skip
    if not mem:
        return 0, result
    windows = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events
               if exclude and e.get("name") == exclude and "dur" in e]  # fmt: skip
    start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    excluded, peak, excluded_addresses = 0, 0, set()
    for e in mem:
        size, address = e["args"]["Bytes"], e["args"]["Addr"]
        if size > 0 and any(tid == e["tid"] and lo <= e["ts"] <= hi for tid, lo, hi in windows):
            excluded += size
            excluded_addresses.add(address)
        elif size < 0 and address in excluded_addresses:  # an excluded allocation freed
            excluded += size
            excluded_addresses.discard(address)
        peak = max(peak, e["args"]["Total Allocated"] - excluded - start)
    return peak, result
