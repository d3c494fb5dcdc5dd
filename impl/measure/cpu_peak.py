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


def cpu_peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes allocated above the level at the call's start, fn's result)."""
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
    start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem) - start, result
