"""The latency model: closed forms where there are any, orderings that must hold, and a control
showing the CTA schedule really waits on the upstream row blocks."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from ctapipe import sim
from ctapipe.sim import Chain

H200, B200 = sim.hardware("h200"), sim.hardware("b200")


def _draw() -> tuple[sim.Hardware, Chain]:
    hw = (H200, B200)[int(torch.randint(0, 2, ()))]
    m = 128 * int(torch.randint(1, 80, ()))
    layers = int(torch.randint(1, 5, ()))
    return hw, Chain(m, width=1024 * int(torch.randint(1, 9, ())), layers=layers)


def test_back_to_back_closed_form():
    hw, chain = _draw()
    d, b = chain.width, chain.dtype_bytes
    kernel = math.ceil(chain.row_blocks * chain.col_tiles(d) / hw.sms) * hw.tile_s(
        d, chain.block_m, chain.block_n
    )
    hop = hw.transfer_s(chain.m * d * b) + hw.p2p_latency_s + hw.kernel_gap_s
    expected = hw.launch_s + chain.layers * kernel + (chain.layers - 1) * hop
    assert sim.microbatched(hw, chain, chain.m) == pytest.approx(expected, rel=1e-12)


def test_one_layer_cta_is_one_kernel_in_waves():
    """With nothing to wait for, the event engine must reduce to waves of tiles over the SMs."""
    hw, chain = _draw()
    chain = dataclasses.replace(chain, layers=1)
    d = chain.width
    waves = math.ceil(chain.row_blocks * chain.cta_col_tiles(d) / hw.sms)
    expected = hw.launch_s + waves * hw.tile_s(d, chain.cta.block_m, chain.cta.block_n)
    assert sim.cta_pipelined(hw, chain) == pytest.approx(expected, rel=1e-12)


def test_orderings_that_must_hold():
    hw, chain = _draw()
    chain = dataclasses.replace(chain, layers=max(2, chain.layers))
    back_to_back = sim.microbatched(hw, chain, chain.m)
    best, chunk = sim.best_microbatched(hw, chain)
    assert best <= back_to_back and chunk in sim.candidate_chunks(chain.m, chain.block_m)
    assert all(best <= sim.microbatched(hw, chain, c) for c in sim.candidate_chunks(chain.m, chain.block_m))
    cta = sim.cta_pipelined(hw, chain)
    assert cta < back_to_back  # overlap can only help when every layer has the same shape
    # no schedule beats the busiest GPU's own work
    per_gpu = math.ceil(chain.row_blocks * chain.col_tiles(chain.width) / hw.sms)
    assert cta >= per_gpu * hw.tile_s(chain.width, chain.block_m, chain.block_n)


def test_cta_waits_for_upstream_row_blocks():
    """Control: a slower signal must delay the consumer (a model that ignored the dependency
    would not notice), by at least the extra latency once per layer boundary."""
    hw, chain = _draw()
    chain = dataclasses.replace(chain, layers=max(2, chain.layers))
    slow = dataclasses.replace(hw, flag_latency_s=1e-3)
    base = sim.cta_pipelined(hw, chain)
    delayed = sim.cta_pipelined(slow, chain)
    assert delayed >= base + (chain.layers - 1) * (1e-3 - hw.flag_latency_s) * 0.999


def test_latency_grows_with_rows():
    hw, chain = _draw()
    chain = dataclasses.replace(chain, layers=2)
    bigger = dataclasses.replace(chain, m=chain.m * 2)
    assert sim.cta_pipelined(hw, bigger) >= sim.cta_pipelined(hw, chain)
    assert sim.tensor_parallel(hw, bigger, 2) >= sim.tensor_parallel(hw, chain, 2)
    assert sim.best_microbatched(hw, bigger)[0] >= sim.best_microbatched(hw, chain)[0]


def test_tensor_parallel_closed_form_and_all_reduce_choice():
    hw = H200
    chain = Chain(4096, 8192, layers=2)
    d, m = 8192, 4096
    col = math.ceil(32 * 16 / hw.sms) * hw.tile_s(d, 128, 256)
    row = math.ceil(32 * 32 / hw.sms) * hw.tile_s(d // 2, 128, 256)
    ar = hw.all_reduce_s(m * d * 2, 2)
    expected = hw.launch_s + hw.kernel_gap_s + col + row + ar
    assert sim.tensor_parallel(hw, chain, 2) == pytest.approx(expected, rel=1e-12)
    ring_only = dataclasses.replace(hw, nvls=False)
    nbytes = float(torch.randint(1, 1 << 30, ()))
    for n in (2, 4, 8):
        ring = 2 * (n - 1) * hw.ring_step_latency_s + 2 * (n - 1) / n * hw.transfer_s(nbytes)
        assert ring_only.all_reduce_s(nbytes, n) == pytest.approx(ring)
        assert hw.all_reduce_s(nbytes, n) == pytest.approx(
            min(ring, hw.nvls_latency_s + hw.transfer_s(nbytes))
        )


def test_cta_with_tp_is_between_bounds():
    chain = Chain(8192, 8192, layers=4)
    for hw in (H200, B200):
        both = sim.cta_with_tp(hw, chain)
        assert 0 < both < sim.microbatched(hw, chain, chain.m)


def test_cta_with_tp_sends_each_stage_output_to_the_next_stage():
    """One row block through two stages, every tile of a kind on its own SM: the stages' tiles,
    all-reduces and flag in sequence, and the block's hop from the first pair to the second (the
    all-reduce leaves it on the first pair's GPUs; a review found it missing, CTA + TP priced
    without the link time CTA alone pays)."""
    for hw in (H200, B200):
        cta = sim.DEFAULT_TILING
        chain = Chain(cta.block_m, 8192, layers=4)
        d, b = chain.width, chain.dtype_bytes
        assert max(chain.cta_col_tiles(d // 2), chain.cta_col_tiles(d)) <= hw.sms  # one wave each
        pair = hw.cta_tile_s(d, cta, chain.m) + hw.cta_tile_s(d // 2, cta, chain.m)
        pair += hw.all_reduce_s(cta.block_m * d * b, 2)
        hop = hw.transfer_s(cta.block_m * d * b)
        expected = hw.launch_s + 2 * pair + hop + hw.flag_latency_s
        assert sim.cta_with_tp(hw, chain) == pytest.approx(expected, rel=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="m must be a whole number >= 1"):
        Chain(0)
    with pytest.raises(ValueError, match="does not split over 3 GPUs"):
        sim.tensor_parallel(H200, Chain(1024, 8192, 2), 3)
    with pytest.raises(ValueError, match="pairs of layers on 2 GPUs"):
        sim.cta_with_tp(H200, Chain(1024, 8192, 3))
    with pytest.raises(ValueError, match="chunk must be a whole number of rows >= 1"):
        sim.microbatched(H200, Chain(1024), 0)


def test_measured_efficiency_by_rows():
    """Interpolated in log2(rows) and clamped; a flat curve at gemm_efficiency changes nothing;
    a curve that is worse for small kernels slows micro-batching but not one full-size kernel."""
    hw = dataclasses.replace(H200, efficiency_by_rows=((128, 0.4), (512, 0.6), (8192, 0.8)))
    assert hw.efficiency(64) == 0.4 and hw.efficiency(16384) == 0.8
    assert hw.efficiency(256) == pytest.approx(0.5) and hw.efficiency(None) == H200.gemm_efficiency
    _, chain = _draw()
    chain = dataclasses.replace(chain, layers=2, m=4096)
    flat = dataclasses.replace(H200, efficiency_by_rows=((128, 0.7), (8192, 0.7)))
    assert sim.compare(flat, chain.m, 2, chain.width) == sim.compare(H200, chain.m, 2, chain.width)
    small_worse = dataclasses.replace(H200, efficiency_by_rows=((128, 0.35), (4096, 0.7)))
    assert sim.microbatched(small_worse, chain, 512) > sim.microbatched(H200, chain, 512)
    assert sim.microbatched(small_worse, chain, chain.m) == pytest.approx(
        sim.microbatched(H200, chain, chain.m)
    )


def test_the_model_prices_the_chunkings_the_baseline_runs():
    """One chunking rule: the latency model sweeps exactly the chunks the micro-batching baseline
    can run (divisors of M), and falls back to back-to-back below one row block."""
    import random

    m = random.choice([96, 384, 1000, 3 * 1024, 4096])
    chunks = sim.candidate_chunks(m, 128)
    assert all(m % c == 0 and (c >= 128 or c == m) for c in chunks) and chunks[0] == m
    small = sim.Chain(m=64)
    latency, chunk = sim.best_microbatched(H200, small)
    assert chunk == 64 and latency == sim.microbatched(H200, small, 64)


def test_cta_tiles_are_priced_at_the_kernels_tile_size():
    """One tile configuration: the latency model's CTA tiles are the kernels' (``ctapipe.tiling``),
    library GEMMs keep cuBLAS's. Negative control: a model with another CTA tile prices otherwise."""
    from ctapipe import Tiling
    from ctapipe.tiling import DEFAULT_TILING

    _, chain = _draw()
    assert sim.Chain(chain.m).cta == DEFAULT_TILING
    assert (chain.block_m, chain.block_n) == (128, 256)
    # one row block, fewer tiles than SMs: one wave, so the latency is one tile's time
    narrow = sim.Chain(128, 8192, layers=1)
    wider = dataclasses.replace(narrow, cta=Tiling(128, 256, 64))
    assert narrow.cta_col_tiles(8192) == 2 * wider.cta_col_tiles(8192) == 64 < H200.sms
    one_tile = sim.cta_pipelined(H200, narrow) - H200.launch_s
    assert one_tile == pytest.approx(H200.tile_s(8192, 128, 128, 128), rel=1e-12)
    assert sim.cta_pipelined(H200, wider) - H200.launch_s == pytest.approx(2 * one_tile, rel=1e-12)


def test_cta_tiles_priced_at_their_own_efficiency_where_known(rng):
    """A CTA tile shape with a measured (or assumed) efficiency is priced at it, every other
    shape and cuBLAS's kernels at the GEMM efficiency: halving the CTA tiles' efficiency slows
    CTA-pipelining and nothing else (negative control: another shape's entry changes nothing)."""
    from ctapipe.tiling import DEFAULT_TILING

    m = int(rng.choice([1024, 4096, 16384]))
    base = sim.compare(H200, m, 2)
    shape = (DEFAULT_TILING.block_m, DEFAULT_TILING.block_n)
    slow = dataclasses.replace(H200, cta_efficiency=((shape, H200.gemm_efficiency / 2),))
    other = dataclasses.replace(H200, cta_efficiency=(((64, 64), H200.gemm_efficiency / 2),))
    slowed = sim.compare(slow, m, 2)
    assert slowed["cta_s"] > base["cta_s"] * 1.2
    assert (slowed["microbatch_s"], slowed["tp_s"], slowed["back_to_back_s"]) == (
        base["microbatch_s"],
        base["tp_s"],
        base["back_to_back_s"],
    )
    assert sim.compare(other, m, 2) == base


def test_band_spans_the_stated_assumptions():
    """The band's ends hold the result at the model's stated assumptions when those are inside
    the band's ranges, and each end names the corner that gives it."""
    rows = [1024, 8192]
    band = sim.band(H200, 2, rows)
    stated = max(sim.compare(H200, m, 2)["cta_vs_microbatch"] for m in rows)
    assert sim.BAND["gemm_efficiency"][0] <= H200.gemm_efficiency <= sim.BAND["gemm_efficiency"][1]
    assert band["microbatch_low"] <= stated <= band["microbatch_high"]
    assert band["tp_low"] <= band["tp_high"]
    assert set(band["microbatch_low_at"]) == set(sim.BAND)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sms": 0}, "sms must be a whole number >= 1"),
        ({"sms": 132.5}, "sms must be a whole number >= 1"),
        ({"link_bw": 0.0}, "link_bw must be a positive number"),
        ({"flops": float("nan")}, "flops must be a positive number"),
        ({"gemm_efficiency": 1.5}, "gemm_efficiency must be in (0, 1]"),
        ({"flag_latency_s": -1e-6}, "flag_latency_s must be a number of seconds >= 0"),
        (
            {"cta_efficiency": (((128, 128), 0.0),)},
            "cta_efficiency rows are ((block_m, block_n), efficiency)",
        ),
        ({"cta_efficiency": (((0, 128), 0.5),)}, "cta_efficiency rows are"),
        ({"cta_efficiency": (((128, 128), 0.5), ((128, 128), 0.6))}, "gives size (128, 128) twice"),
        ({"nvls": "no"}, "nvls must be true or false, got 'no'"),
        ({"nvls": 0}, "nvls must be true or false"),
        ({"efficiency_by_rows": ((0, 0.5), (4096, 0.7))}, "efficiency_by_rows rows are (rows, efficiency)"),
        ({"efficiency_by_rows": ((-64, 0.5), (4096, 0.7))}, "efficiency_by_rows rows are"),
        ({"efficiency_by_rows": ((64.0, 0.5),)}, "efficiency_by_rows rows are"),
        ({"efficiency_by_rows": ((64, float("nan")),)}, "efficiency_by_rows rows are"),
        ({"efficiency_by_rows": ((64, 0.5, 1),)}, "efficiency_by_rows rows are"),
        ({"efficiency_by_rows": ((64, 0.5), (64, 0.6))}, "gives size 64 twice"),
        ({"efficiency_by_rows": 0.5}, "efficiency_by_rows must be a sequence"),
    ],
)
def test_impossible_hardware_is_refused_in_one_line(change, message):
    """The latency model divides by SMs and bandwidths: what no GPU has is refused when the
    hardware is made, before any simulation (it used to divide by zero)."""
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        dataclasses.replace(H200, **change)
    assert "\n" not in str(caught.value)


def test_control_measured_rows_and_nvls_off_are_taken():
    """The checks above refuse only what is wrong: measured rows (an efficiency above 1 included,
    as a small GEMM measures) and nvls off still simulate."""
    hw = dataclasses.replace(
        H200, nvls=False, efficiency_by_rows=((128, 1.2), (4096, 0.7)), cta_efficiency=(((128, 128), 0.6),)
    )
    assert sim.compare(hw, 1024, 2)["cta_s"] > 0


def test_bad_sizes_and_names_are_refused_in_one_line():
    with pytest.raises(ValueError, match="m must be a whole number >= 1"):
        Chain(1024.5)
    with pytest.raises(ValueError, match="gpus must be a whole number >= 1"):
        sim.compare(H200, 1024, 0)
    with pytest.raises(ValueError, match="the latency model has: b200, h200"):
        sim.hardware("a100")
    assert sim.hardware("h200") is H200


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Chain(1024, dtype_bytes=0), "dtype_bytes must be a whole number >= 1"),
        (lambda: Chain(1024, dtype_bytes=-2), "dtype_bytes must be a whole number >= 1"),
        (lambda: Chain(1024, block_m=0), "block_m must be a whole number >= 1"),
        (lambda: Chain(1024, block_n=2.5), "block_n must be a whole number >= 1"),
        (lambda: Chain(1024, cta="128x128"), "cta must be a ctapipe.tiling.Tiling"),
        (lambda: sim.tensor_parallel(H200, Chain(1024), 0), "a whole number of GPUs >= 1, got 0"),
        (lambda: sim.tensor_parallel(H200, Chain(1024), -2), "a whole number of GPUs >= 1, got -2"),
        (lambda: sim.band(H200, 2, []), "rows must be a non-empty list"),
        (lambda: sim.candidate_chunks(1024, 0), "whole numbers >= 1, got 1024, 0"),
        (lambda: sim.candidate_chunks(0, 128), "whole numbers >= 1, got 0, 128"),
        (lambda: sim.Tiling(16.0, 16, 16), "block_m must be a whole power of two >= 16 (tl.dot), got 16.0"),
        (lambda: sim.Tiling("16", 16, 16), "block_m must be a whole power of two >= 16"),
        (lambda: sim.Tiling().tiles(-5, 10), "m must be a whole number >= 0, got -5"),
        (lambda: sim.Tiling().tiles(1.5, 10), "m must be a whole number >= 0, got 1.5"),
        (
            lambda: sim.microbatched(H200, Chain(1024), 2.5),
            "chunk must be a whole number of rows >= 1, got 2.5",
        ),
    ],
)
def test_impossible_sizes_are_refused_not_priced(call, message):
    """The latency model priced a chain of 0- or negative-byte elements, a tensor-parallel run on
    -2 GPUs (-9.3e-05 s) and negative tile counts; tile sizes of 0 divided by zero. One line each."""
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_numpy_integers_are_sizes_as_python_integers_are():
    """The checks take numpy's integers (a shape read from an array), as the model did before them."""
    import numpy as np

    assert sim.Tiling(np.int64(64), 64, 64) == sim.Tiling(64, 64, 64)
    assert sim.Tiling().tiles(np.int64(1000), 512) == sim.Tiling().tiles(1000, 512)
    assert sim.candidate_chunks(np.int64(4096), 128) == sim.candidate_chunks(4096, 128)
    assert sim.tensor_parallel(H200, Chain(1024), np.int64(2)) == sim.tensor_parallel(H200, Chain(1024), 2)


def test_a_data_sheet_the_model_cannot_use_is_one_line(monkeypatch):
    """The latency model divides by SMs and NVLink: a data sheet without them (null, or no sheet) is
    one line naming the file, not Hardware's error naming none or a KeyError. Control: as shipped."""
    sheets = sim.datasheets()
    assert sim.from_sheet("h200") == H200
    for changed in ({**sheets, "h200": dataclasses.replace(sheets["h200"], sms=None)}, {}):
        monkeypatch.setattr(sim, "datasheets", lambda changed=changed: changed)
        with pytest.raises(
            ValueError, match=r"datasheets.json: h200: the latency model needs its data sheet"
        ):
            sim.from_sheet("h200")
