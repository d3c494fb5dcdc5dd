"""Measured maximum batch: try real steps, catch out-of-memory, go on.

``largest_fitting`` is the search (any monotone "does batch b fit?" oracle); ``device_fits``
turns a step into such an oracle on a GPU; ``emulate_gpu_memory`` makes a large GPU behave
like a smaller one (allocator cap), so one H200 measures what fits 16 or 40 GB cards.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def largest_fitting(
    fits: Callable[[int], bool], start: int = 1, limit: int = 1 << 16
) -> tuple[int, list[int]]:
    """Largest b in [0, limit] with ``fits(b)``, for a monotone oracle (fits(b) => fits(b-1)).

    Starts at ``start`` (e.g. the estimate) and gallops away from it, doubling the stride,
    then bisects; an exact estimate costs two trials. Returns (b, batches tried in order).
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    tried: list[int] = []

    def check(b: int) -> bool:
        tried.append(b)
        return fits(b)

    start = min(max(start, 1), limit)
    lo, hi = 0, limit + 1  # invariant: lo fits (0 trivially), hi does not (limit + 1 by assumption)
    stride = 1
    if check(start):
        lo = start
        while lo < limit:
            b = min(lo + stride, limit)
            if not check(b):
                hi = b
                break
            lo, stride = b, stride * 2
        else:
            return lo, tried
    else:
        hi = start
        while hi > 1:
            b = max(hi - stride, 1)
            if check(b):
                lo = b
                break
            hi, stride = b, stride * 2
        else:
            return 0, tried
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def device_fits(run: Callable[[], object], device: torch.device | str) -> bool:
    """True if ``run()`` completes on ``device``; False if it runs out of memory (then cleaned up)."""
    device = torch.device(device)
    ok = True
    try:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        ok = False  # leaving the except drops the traceback and with it the step's tensors
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ok


@contextmanager
def emulate_gpu_memory(capacity_bytes: int, context_bytes: int, device: torch.device | str) -> Iterator[int]:
    """Cap torch's allocator at what a ``capacity_bytes`` GPU leaves after its CUDA context.

    Yields the cap in bytes. Fragmentation is real here (unlike the estimator's 5% slack).
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"emulating a GPU's memory needs a CUDA device, got {device}")
    total = torch.cuda.get_device_properties(device).total_memory
    cap = capacity_bytes - context_bytes
    if not 0 < cap <= total:
        raise ValueError(
            f"cannot emulate a {capacity_bytes / 2**30:.1f} GiB GPU on one with {total / 2**30:.1f} GiB"
        )
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        yield cap
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
