"""Wall-clock timing of a callable on CPU (perf_counter) or CUDA (events), for benchmarks only."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .parallel import raise_if_interrupted


@dataclass
class Timing:
    median_s: float
    mean_s: float
    stdev_s: float
    repeats: int


def select_cuda_device(device: str) -> str | None:
    """Make ``device`` (``cuda`` or ``cuda:N``) the current CUDA device, or say in one line why it
    cannot be (None: done). Timing's events and synchronisation, and Triton's launches, are the
    current device's: with another's tensors they time the wrong GPU or read its memory from this
    one's stream."""
    index = torch.device(device).index or 0
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return f"--device {device}: no such CUDA device here (--device cpu runs on the CPU)"
    torch.cuda.set_device(index)
    return None


def time_fn(fn: Callable[[], object], device: str = "cpu", warmup: int = 2, repeats: int = 5) -> Timing:
    for _ in range(warmup):
        fn()  # the first call may compile: a Ctrl-C swallowed there stops the timing here
        raise_if_interrupted()
    samples: list[float] = []
    cuda = device.startswith("cuda")
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        raise_if_interrupted()
    return Timing(
        statistics.median(samples),
        statistics.fmean(samples),
        statistics.stdev(samples) if len(samples) > 1 else 0.0,
        len(samples),
    )
