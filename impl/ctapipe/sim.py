"""Discrete-event latency model of a chain of GEMMs on N GPUs: CTA-pipelining against
back-to-back GEMMs, micro-batching and tensor parallelism.

The workload (CTA-pipelining's): L layers Y_{l+1} = Y_l W_l with D x D weights, M rows, one
layer per GPU (L = N). A GEMM is tiles of BLOCK_M x BLOCK_N (cuBLAS's for library GEMMs, the CTA
kernels' own ``ctapipe.tiling`` for CTA tiles); a tile with K-deep inputs takes
2 BLOCK_M BLOCK_N K / (peak x efficiency / SMs) on one SM, and a kernel runs its tiles in waves
over the SMs (wave and tile quantisation included).

* back-to-back: GPU l starts its whole GEMM after GPU l-1's output has arrived (one message).
* micro-batching: the rows in chunks; GPU l runs chunk j after it arrived and after its own
  chunk j-1 (one kernel per chunk, stream order); messages on a link queue. Best chunk swept.
* tensor parallelism: every GPU holds 1/N of every layer (column- then row-parallel pairs, as
  Megatron), one all-reduce per pair (ring or NVLS, whichever is faster, as NCCL picks).
* CTA-pipelining: one kernel per GPU, launched together, one CTA a tile (as ``ChainStage``
  launches it), dispatched in row-block order: an SM takes the next tile and spins until the
  upstream row block it reads is complete and visible (its tiles' bytes through the link
  queue, then the flag latency).
* CTA + TP (N >= 4): N/2 pipeline stages of 2 GPUs; each stage holds a Megatron pair of layers
  sharded over its 2 GPUs and all-reduces each finished row block, then sends it to the next
  stage (each GPU to its peer there, on its link queue), whose tiles wait for it.

Parameters come from data sheets (SMs, peak FLOP/s, NVLink bandwidth) and stated
micro-benchmark-level assumptions (GEMM efficiency, latencies) in ``Hardware``; none is fitted to
the paper's speed-ups. ``nox -s gpu_check`` measures the single-GPU ones when a GPU is lent: the
gap between kernels, and cuBLAS's efficiency by rows (a small micro-batch's GEMM runs less
efficiently than its wave count says), which the model then uses per kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from dataclasses import asdict, dataclass, field

from measure.checks import finite, whole
from measure.datasheets import DATASHEETS_FILE, datasheets

from .tiling import DEFAULT_TILING, Tiling

US = 1e-6


@dataclass(frozen=True)
class Hardware:
    name: str
    sms: int
    flops: float  # dense BF16 peak per GPU, FLOP/s (data sheet)
    link_bw: float  # NVLink bytes/s per direction per GPU (data sheet)
    gemm_efficiency: float = 0.7  # sustained fraction of peak of a full wave of large tiles
    link_efficiency: float = 0.8  # achieved fraction of link bandwidth (NCCL p2p / all-reduce)
    kernel_gap_s: float = 4 * US  # between dependent kernels on a stream: launch, ramp, tail
    launch_s: float = 5 * US  # first kernel's launch to first tile
    p2p_latency_s: float = 6 * US  # one NCCL send/recv, small message
    flag_latency_s: float = 1.5 * US  # a release on one GPU seen by an acquire-poll on a peer
    ring_step_latency_s: float = 2.5 * US  # per ring step of an all-reduce
    nvls_latency_s: float = 10 * US  # NVLink SHARP all-reduce fixed cost (NVSwitch systems)
    nvls: bool = True
    source: str = ""
    # measured (gpu_check): a kernel's tile efficiency by its rows, ((rows, efficiency), ...);
    # empty: gemm_efficiency at every size
    efficiency_by_rows: tuple[tuple[int, float], ...] = ()
    # the CTA kernels' own tile efficiency by tile shape, (((block_m, block_n), efficiency), ...),
    # measured by gpu_check or assumed (the band of sim_band); a shape not in it: cuBLAS's efficiency
    cta_efficiency: tuple[tuple[tuple[int, int], float], ...] = ()

    def __post_init__(self) -> None:
        # the model divides by these: refuse what no GPU has, in one line, before any simulation
        if not whole(self.sms, 1):
            raise ValueError(f"{self.name}: sms must be a whole number >= 1, got {self.sms!r}")
        for name in ("flops", "link_bw"):
            if not _positive(getattr(self, name)):
                raise ValueError(
                    f"{self.name}: {name} must be a positive number, got {getattr(self, name)!r}"
                )
        for name in ("gemm_efficiency", "link_efficiency"):
            value = getattr(self, name)
            if not (_positive(value) and value <= 1):
                raise ValueError(f"{self.name}: {name} must be in (0, 1], got {value!r}")
        for name in (
            "kernel_gap_s",
            "launch_s",
            "p2p_latency_s",
            "flag_latency_s",
            "ring_step_latency_s",
            "nvls_latency_s",
        ):
            value = getattr(self, name)
            if not (_positive(value) or value == 0):
                raise ValueError(f"{self.name}: {name} must be a number of seconds >= 0, got {value!r}")
        if not isinstance(self.nvls, bool):  # "no" would be taken as true
            raise ValueError(f"{self.name}: nvls must be true or false, got {self.nvls!r}")
        # measured ones are the model's time at peak over the measured time: above 1 where a kernel
        # beats the model's wave count (cuBLAS's own tile choice on a small GEMM), never 0 or below;
        # each size once, >= 1 (efficiency() interpolates in log2(rows): rows 0 or -64 failed there
        # with "math domain error", a size given twice divided by zero)
        _check_rows(self.name, "efficiency_by_rows", self.efficiency_by_rows, "(rows, efficiency)")
        _check_rows(
            self.name, "cta_efficiency", self.cta_efficiency, "((block_m, block_n), efficiency)", shape=True
        )

    def efficiency(self, rows: int | None = None) -> float:
        """Tile efficiency of a kernel over ``rows`` rows: interpolated in log2(rows) on the
        measured points, clamped at their ends."""
        if rows is None or not self.efficiency_by_rows:
            return self.gemm_efficiency
        pts = sorted(self.efficiency_by_rows)
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, e0), (r1, e1) in itertools.pairwise(pts):
            if rows <= r1:
                w = (math.log2(rows) - math.log2(r0)) / (math.log2(r1) - math.log2(r0))
                return e0 + w * (e1 - e0)
        return pts[-1][1]

    def tile_s(self, k: int, block_m: int, block_n: int, rows: int | None = None) -> float:
        return 2.0 * block_m * block_n * k / (self.flops * self.efficiency(rows) / self.sms)

    def cta_tile_s(self, k: int, tiling: Tiling, rows: int) -> float:
        """A CTA kernel's tile: at its shape's own efficiency where known, else cuBLAS's."""
        own = dict(self.cta_efficiency).get((tiling.block_m, tiling.block_n))
        if own is None:
            return self.tile_s(k, tiling.block_m, tiling.block_n, rows)
        return 2.0 * tiling.block_m * tiling.block_n * k / (self.flops * own / self.sms)

    def transfer_s(self, nbytes: float) -> float:
        return nbytes / (self.link_bw * self.link_efficiency)

    def all_reduce_s(self, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        ring = 2 * (n - 1) * self.ring_step_latency_s + 2 * (n - 1) / n * self.transfer_s(nbytes)
        nvls = self.nvls_latency_s + self.transfer_s(nbytes) if self.nvls else math.inf
        return min(ring, nvls)

    def all_gather_s(self, nbytes: float, n: int) -> float:
        return (n - 1) * self.ring_step_latency_s + (n - 1) / n * self.transfer_s(nbytes) if n > 1 else 0.0


def _positive(value) -> bool:
    """A finite number above 0 (measure.checks.finite: numpy's too, never a bool)."""
    return finite(value) and value > 0


def _check_rows(hw: str, name: str, rows: object, form: str, shape: bool = False) -> None:
    """``rows`` is a sequence of distinct (size, efficiency) pairs: a size a whole number >= 1 (a
    tile shape, ``shape``: a pair of them), an efficiency a positive finite number. One line
    naming the hardware, the field and the row otherwise."""
    if not isinstance(rows, tuple | list):
        raise ValueError(f"{hw}: {name} must be a sequence of {form} pairs, got {rows!r}")
    sizes = set()
    for row in rows:
        ok = isinstance(row, tuple | list) and len(row) == 2
        size = row[0] if ok else None
        if shape:
            ok = ok and isinstance(size, tuple | list) and len(size) == 2 and all(whole(n, 1) for n in size)
            size = tuple(size) if ok else size
        else:
            ok = ok and whole(size, 1)
        if not (ok and _positive(row[1])):
            raise ValueError(
                f"{hw}: {name} rows are {form} with sizes whole numbers >= 1 and a positive "
                f"efficiency, got {row!r}"
            )
        if size in sizes:
            raise ValueError(f"{hw}: {name} gives size {size!r} twice")
        sizes.add(size)


# The GPUs the latency model has: NVSwitch systems whose data sheets give SMs and NVLink
HARDWARE_NAMES = ("h200", "b200")


def from_sheet(name: str) -> Hardware:
    """The hardware of any data sheet that gives SMs and NVLink's bandwidth (the sweep's are
    HARDWARE_NAMES; a GPU measured in the GPU check may be another)."""
    sheet = datasheets().get(name)
    if sheet is None or sheet.sms is None or sheet.nvlink_bw is None:  # else a KeyError, or no file named
        raise ValueError(
            f"{DATASHEETS_FILE}: {name}: the latency model needs its data sheet, sms and nvlink_bytes_per_s"
        )
    return Hardware(name, sms=sheet.sms, flops=sheet.flops, link_bw=sheet.nvlink_bw, source=sheet.source)


@functools.cache
def hardware_presets() -> dict[str, Hardware]:
    """The data-sheet hardware by name, built on first use (the data sheets are read then)."""
    return {name: from_sheet(name) for name in HARDWARE_NAMES}


@dataclass(frozen=True)
class Chain:
    """The workload, and the tiles each kind of kernel runs: cuBLAS's (back-to-back, micro-batched
    and tensor-parallel GEMMs; 128 x 256, the shape its Hopper BF16 kernels use for large GEMMs) and
    the CTA kernels' own (``ctapipe.tiling``: what ``TicketMLP`` and the chain stages launch)."""

    m: int
    width: int = 8192
    layers: int = 2
    dtype_bytes: int = 2
    block_m: int = 128  # cuBLAS tile
    block_n: int = 256
    cta: Tiling = DEFAULT_TILING

    def __post_init__(self) -> None:
        for name in ("m", "width", "layers", "dtype_bytes", "block_m", "block_n"):
            if not whole(getattr(self, name), 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.cta, Tiling):
            raise ValueError(f"cta must be a ctapipe.tiling.Tiling, got {self.cta!r}")

    @property
    def row_blocks(self) -> int:
        """Row blocks of a CTA kernel: the unit a consumer waits for."""
        return self.cta.tiles(self.m, 1)[0]

    def col_tiles(self, n: int) -> int:
        """Column tiles of a cuBLAS GEMM with n output columns."""
        return -(-n // self.block_n)

    def cta_col_tiles(self, n: int) -> int:
        """Column tiles of a CTA kernel with n output columns."""
        return self.cta.tiles(1, n)[1]


def kernel_s(hw: Hardware, rows: int, n: int, k: int, chain: Chain) -> float:
    """A whole GEMM kernel whose inputs are ready: waves of tiles over the SMs."""
    tiles = -(-rows // chain.block_m) * chain.col_tiles(n)
    return math.ceil(tiles / hw.sms) * hw.tile_s(k, chain.block_m, chain.block_n, rows)


def microbatched(hw: Hardware, chain: Chain, chunk: int) -> float:
    """Latency with row chunks of ``chunk`` pipelined across the chain's GPUs (chunk = M: back-to-back)."""
    if not whole(chunk, 1):
        raise ValueError(f"chunk must be a whole number of rows >= 1, got {chunk!r}")
    d, b = chain.width, chain.dtype_bytes
    sizes = [min(chunk, chain.m - s) for s in range(0, chain.m, chunk)]
    arrive = [hw.launch_s - hw.kernel_gap_s] * len(sizes)  # layer 0's input is there at t=0
    for _layer in range(chain.layers):
        done, busy, link, sent = [], 0.0, 0.0, []
        for j, rows in enumerate(sizes):
            start = max(arrive[j], busy) + hw.kernel_gap_s
            busy = start + kernel_s(hw, rows, d, d, chain)
            done.append(busy)
            link = max(link, busy) + hw.transfer_s(rows * d * b)  # the chunk's message, link queue
            sent.append(link + hw.p2p_latency_s)
        arrive = sent
    return done[-1]


def candidate_chunks(m: int, smallest: int) -> list[int]:
    """The chunkings micro-batching tries (the model prices them, ``baselines.cta.microbatch`` runs
    them): M halved while the chunk divides M and is at least ``smallest`` rows; M itself
    (back-to-back) when nothing smaller qualifies."""
    if not (whole(m, 1) and whole(smallest, 1)):
        raise ValueError(f"m and the smallest chunk must be whole numbers >= 1, got {m!r}, {smallest!r}")
    chunks, c = [], m
    while c >= smallest and m % c == 0:
        chunks.append(c)
        c //= 2
    return chunks or [m]


def best_microbatched(hw: Hardware, chain: Chain) -> tuple[float, int]:
    """(latency, chunk) of the best chunk size: ``candidate_chunks`` down to one row block."""
    return min((microbatched(hw, chain, c), c) for c in candidate_chunks(chain.m, chain.block_m))


def tensor_parallel(hw: Hardware, chain: Chain, n: int) -> float:
    """Every layer over ``n`` GPUs: column/row pairs, one all-reduce per pair (odd tail: all-gather)."""
    d, m, b = chain.width, chain.m, chain.dtype_bytes
    if not whole(n, 1):
        raise ValueError(f"tensor parallelism needs a whole number of GPUs >= 1, got {n!r}")
    if d % n:
        raise ValueError(f"width {d} does not split over {n} GPUs")
    t = hw.launch_s - hw.kernel_gap_s
    for layer in range(chain.layers):
        if layer % 2 == 0:
            t += hw.kernel_gap_s + kernel_s(hw, m, d // n, d, chain)
            if layer == chain.layers - 1:
                t += hw.all_gather_s(m * d * b, n)
        else:
            t += hw.kernel_gap_s + kernel_s(hw, m, d, d // n, chain)
            t += hw.all_reduce_s(m * d * b, n)
    return t


@dataclass
class _Gpu:
    """In-order tile dispatch over the SMs; a tile holds its SM while it waits for its input."""

    sms: int
    start: float
    free: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = [self.start] * self.sms

    def run(self, ready: float, duration: float) -> float:
        sm_free = heapq.heappop(self.free)
        end = max(sm_free, ready) + duration
        heapq.heappush(self.free, end)
        return end


def _visible(hw: Hardware, tile_ends: dict[int, list[float]], tile_bytes: float) -> dict[int, float]:
    """When each row block is readable on the next GPU: its tiles' bytes through the link (FIFO in
    completion order), then the flag."""
    order = sorted((end, i) for i, ends in tile_ends.items() for end in ends)
    link, last = 0.0, {}
    for end, i in order:
        link = max(link, end) + hw.transfer_s(tile_bytes)
        last[i] = link
    return {i: t + hw.flag_latency_s for i, t in last.items()}


def cta_pipelined(hw: Hardware, chain: Chain) -> float:
    """One layer per GPU, every kernel launched at once, tiles waiting on upstream row blocks."""
    d = chain.width
    ready = dict.fromkeys(range(chain.row_blocks), 0.0)  # layer 0 reads X: ready at once
    cta = chain.cta
    tile = hw.cta_tile_s(d, cta, chain.m)  # one kernel over all M rows
    tile_bytes = cta.block_m * cta.block_n * chain.dtype_bytes
    end = 0.0
    for _layer in range(chain.layers):
        gpu = _Gpu(hw.sms, hw.launch_s)
        ends: dict[int, list[float]] = {}
        for i in range(chain.row_blocks):
            ends[i] = [gpu.run(ready[i], tile) for _ in range(chain.cta_col_tiles(d))]
        end = max(max(e) for e in ends.values())
        ready = _visible(hw, ends, tile_bytes)
    return end


def cta_with_tp(hw: Hardware, chain: Chain, tp: int = 2) -> float:
    """``layers / tp`` CTA-pipelined stages; each stage a Megatron pair of layers over ``tp`` GPUs
    (column then row parallel), all-reducing each finished row block and sending it on to the
    next stage's GPUs (the all-reduce leaves it on this stage's)."""
    d, b = chain.width, chain.dtype_bytes
    if tp != 2 or chain.layers % 2 or d % tp:
        raise ValueError(f"CTA + TP models pairs of layers on 2 GPUs; got tp={tp}, {chain.layers} layers")
    cta = chain.cta
    col_tile = hw.cta_tile_s(d, cta, chain.m)
    row_tile = hw.cta_tile_s(d // tp, cta, chain.m)
    ready = dict.fromkeys(range(chain.row_blocks), 0.0)
    end = 0.0
    stages = chain.layers // 2
    for stage in range(stages):
        gpu = _Gpu(hw.sms, hw.launch_s)  # both GPUs of the stage do the same work: simulate one
        col_done, out_done = {}, {}
        # ticket order: row block i's column tiles, then row block i-1's row tiles (local dependency)
        for i in range(chain.row_blocks + 1):
            if i < chain.row_blocks:
                col_done[i] = max(gpu.run(ready[i], col_tile) for _ in range(chain.cta_col_tiles(d // tp)))
            if i >= 1:
                r = i - 1
                out_done[r] = max(gpu.run(col_done[r], row_tile) for _ in range(chain.cta_col_tiles(d)))
        # each row block's partial sums all-reduced over the pair, as its tiles finish, then (but
        # after the last stage) the block to the next stage's GPUs: one link queue
        link = 0.0
        hop = hw.transfer_s(cta.block_m * d * b) if stage < stages - 1 else 0.0
        for r in sorted(out_done, key=out_done.get):
            link = max(link, out_done[r]) + hw.all_reduce_s(cta.block_m * d * b, tp) + hop
            out_done[r] = link
        end = max(out_done.values())
        ready = {r: t + hw.flag_latency_s for r, t in out_done.items()}
    return end


def hardware(name: str) -> Hardware:
    """The data-sheet hardware of ``name`` (HARDWARE_NAMES); one line listing them otherwise."""
    if name not in HARDWARE_NAMES:
        raise ValueError(f"unknown GPU {name!r}; the latency model has: {', '.join(sorted(HARDWARE_NAMES))}")
    return hardware_presets()[name]


def compare(hw: Hardware, m: int, gpus: int, width: int = 8192, cta: Tiling = DEFAULT_TILING) -> dict:
    """Every method's latency for the chain of ``gpus`` layers on ``gpus`` GPUs (CTA kernels with
    ``cta``'s tiles)."""
    if not whole(gpus, 1):
        raise ValueError(f"gpus must be a whole number >= 1, got {gpus!r}")
    chain = Chain(m, width, layers=gpus, cta=cta)
    mb, chunk = best_microbatched(hw, chain)
    out = {
        "gpu": hw.name,
        "gpus": gpus,
        "m": m,
        "width": width,
        "back_to_back_s": microbatched(hw, chain, m),
        "microbatch_s": mb,
        "microbatch_chunk": chunk,
        "tp_s": tensor_parallel(hw, chain, gpus),
        "cta_s": cta_pipelined(hw, chain),
    }
    if gpus >= 4:
        out["cta_tp_s"] = cta_with_tp(hw, chain)
    out["cta_vs_microbatch"] = 1 - out["cta_s"] / mb
    out["cta_vs_tp"] = 1 - out["cta_s"] / out["tp_s"]
    return out


# The assumptions the CTA result moves with most, each over a range a reader could defend: cuBLAS's
# sustained fraction of peak on large bf16 GEMMs; the CTA kernels' tile efficiency as a fraction of
# cuBLAS's (Triton-generated, one persistent kernel); their tile shape (the kernels' 128 x 128, or
# cuBLAS's own 128 x 256); the gap between dependent kernels (launch, ramp, tail); the latency of a
# flag released on one GPU and polled on another.
BAND = {
    "gemm_efficiency": (0.6, 0.8),
    "cta_relative_efficiency": (0.8, 1.0),
    "cta_tiles": ((128, 128), (128, 256)),
    "kernel_gap_s": (2 * US, 8 * US),
    "flag_latency_s": (1 * US, 3 * US),
}


def band(hw: Hardware, gpus: int, rows: list[int], width: int = 8192) -> dict:
    """CTA's best reduction over ``rows`` against the best micro-batching and against TP, at every
    corner of ``BAND`` (the data sheet's SMs, peak and links kept): the lowest and highest of each,
    with the corner that gives it."""
    if not rows or not all(whole(r, 1) for r in rows):
        raise ValueError(f"rows must be a non-empty list of whole numbers >= 1, got {rows!r}")
    out: dict = {}
    names = list(BAND)
    for values in itertools.product(*BAND.values()):
        corner = dict(zip(names, values, strict=True))
        tiles = Tiling(*corner["cta_tiles"])
        at = dataclasses.replace(
            hw,
            gemm_efficiency=corner["gemm_efficiency"],
            kernel_gap_s=corner["kernel_gap_s"],
            flag_latency_s=corner["flag_latency_s"],
            efficiency_by_rows=(),
            cta_efficiency=(
                (
                    (tiles.block_m, tiles.block_n),
                    corner["gemm_efficiency"] * corner["cta_relative_efficiency"],
                ),
            ),
        )
        results = [compare(at, m, gpus, width, tiles) for m in rows]
        for versus in ("microbatch", "tp"):
            best = max(r[f"cta_vs_{versus}"] for r in results)
            low, high = out.get(f"{versus}_low"), out.get(f"{versus}_high")
            if low is None or best < low:
                out[f"{versus}_low"], out[f"{versus}_low_at"] = best, corner
            if high is None or best > high:
                out[f"{versus}_high"], out[f"{versus}_high_at"] = best, corner
    return out


def assumptions(hw: Hardware) -> dict:
    return asdict(hw)
