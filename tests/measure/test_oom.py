"""Measured maximum batch: the search, the out-of-memory oracle, the throughput point on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils import logging as hf_logging

from measure.oom import device_fits, emulate_gpu_memory, largest_fitting

hf_logging.set_verbosity_error()


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5000), st.integers(-3, 6000), st.integers(1, 5000))
def test_search_finds_the_largest_fitting_batch(answer, start, limit):
    calls = []

    def fits(b):
        assert 1 <= b <= limit, "the search tried a batch outside [1, limit]"
        calls.append(b)
        return b <= answer

    b, tried = largest_fitting(fits, start, limit)
    assert b == min(answer, limit)
    assert tried == calls and len(set(tried)) == len(tried)  # never the same batch twice
    distance = abs(min(answer, limit) - min(max(start, 1), limit)) + 2
    assert len(tried) <= 2 * math.ceil(math.log2(distance)) + 2


def test_an_exact_estimate_costs_two_trials():
    assert largest_fitting(lambda b: b <= 37, 37) == (37, [37, 38])


def _allocating_step(budget_bytes: int, nbytes: int) -> None:
    """A step that 'runs out of memory' past a budget, the way the CUDA allocator reports it."""
    if nbytes > budget_bytes:
        raise torch.OutOfMemoryError(f"tried to allocate {nbytes} bytes")
    torch.empty(nbytes, dtype=torch.uint8).fill_(1)


def test_device_fits_catches_out_of_memory_only():
    budget = int(torch.randint(1 << 10, 1 << 20, ()).item())
    b, _ = largest_fitting(lambda n: device_fits(lambda: _allocating_step(budget, n * 1000), "cpu"), 7)
    assert b == budget // 1000
    with pytest.raises(ValueError, match="boom"):  # any other failure is a real error
        device_fits(lambda: (_ for _ in ()).throw(ValueError("boom")), "cpu")


def test_emulating_gpu_memory_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"), emulate_gpu_memory(16 << 30, 1 << 30, "cpu"):
        pass


@pytest.mark.slow
def test_throughput_point_runs_on_cpu_at_tiny_scale():
    """The throughput part's code path (build on the device, ready the optimizer, time the ladder)."""
    from artifacts.tempo_bert.throughput import ThroughputSetup, estimate_point, ladder, throughput_point

    setup = ThroughputSetup(
        cases=(("bert-mini", 32),),
        configs=("tempo",),
        precision="fp32",
        gpu="48MiB",
        reserve=False,
        warmup=0,
        repeats=1,
    )
    est = estimate_point("bert-mini", 32, "tempo", setup)
    assert est["estimated_max_batch"] >= 2 and est["estimated_peak_gib"] * 2**30 <= 48 * 2**20
    r = throughput_point("bert-mini", 32, "tempo", setup, "cpu", est)
    assert r["max_batch"] == est["estimated_max_batch"]
    assert [int(b) for b in r["seqs_per_s"]] == ladder(r["max_batch"])
    assert all(v > 0 for v in r["seqs_per_s"].values())
    assert ladder(1) == [1] and ladder(12) == [1, 2, 4, 8, 12] and ladder(0) == []


@pytest.mark.gpu
def test_emulated_gpu_runs_out_of_memory_where_it_should():
    cap_gib = 2
    with emulate_gpu_memory(cap_gib << 30, 0, "cuda") as cap:
        assert cap == cap_gib << 30
        fits = device_fits(lambda: torch.empty(int(1.5 * 2**30), dtype=torch.uint8, device="cuda"), "cuda")
        too_big = device_fits(lambda: torch.empty(int(2.5 * 2**30), dtype=torch.uint8, device="cuda"), "cuda")
    assert fits and not too_big
    assert device_fits(lambda: torch.empty(int(2.5 * 2**30), dtype=torch.uint8, device="cuda"), "cuda")
