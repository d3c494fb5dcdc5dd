"""Thin Python interface to the kernels: checked launches of one stage, and the two single-GPU
MLPs, ticketed (one persistent kernel) and SM-partitioned (two kernels as two devices).
kernels.py says how the pipelining works."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .kernels import ACTIVATIONS, stage_kernel, ticket_mlp_kernel


@dataclass(frozen=True)
class Tiling:
    """Tile shape of every kernel. GPU default: 128 x 128 x 64 (H100/H200-class tensor cores)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {v}")

    def launch_options(self) -> dict:
        """Warps and pipeline stages: 8 warps for 128 x 128 tiles and up (tensor-core GEMM practice)."""
        return {"num_warps": 8 if self.block_m * self.block_n >= 128 * 128 else 4, "num_stages": 3}

    def tiles(self, m: int, n: int) -> tuple[int, int]:
        return triton.cdiv(m, self.block_m), triton.cdiv(n, self.block_n)


DEFAULT_TILING = Tiling()
INTERPRETER_TILING = Tiling(16, 16, 16)  # small tiles: many CTAs even at test sizes


def _check_act(act: str) -> int:
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} unknown; accepted: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def _check_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or c.dim() != 2:
        raise ValueError(f"a, b, c must be matrices, got {a.dim()}-d, {b.dim()}-d, {c.dim()}-d")
    if a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
        raise ValueError(
            f"shapes do not chain: a {tuple(a.shape)} @ b {tuple(b.shape)} -> c {tuple(c.shape)}"
        )
    if not (a.dtype == b.dtype == c.dtype):
        raise ValueError(f"a, b, c must share a dtype, got {a.dtype}, {b.dtype}, {c.dtype}")


def _counter(t: torch.Tensor | None, rows: int, name: str, device: torch.device) -> torch.Tensor:
    if t is None:  # an unused pointer argument still needs a tensor
        return torch.zeros(1, dtype=torch.int32, device=device)
    if t.dtype != torch.int32 or t.numel() < rows:
        raise ValueError(
            f"{name} must be int32 with one counter per row block ({rows}), got {t.dtype} {t.numel()}"
        )
    return t


def launch_stage(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    ready_in: torch.Tensor | None = None,
    ready_out: torch.Tensor | None = None,
    wait_target: int = 0,
    act: str = "none",
    status: torch.Tensor | None = None,
    max_spins: int = 0,
    tiling: Tiling = DEFAULT_TILING,
    wait: bool | None = None,
    programs: int | None = None,
) -> None:
    """C = act(A @ B) as one stage of a CTA pipeline.

    ``ready_in``: wait, per row block of A, for the counter to reach ``wait_target`` before reading
    it (the upstream stage signals it). ``ready_out``: signal C's row blocks as their tiles are
    stored (C may live on another GPU). ``wait=False`` with ``ready_in`` given launches the same
    stage without its wait (tests' negative control only). ``programs``: a persistent grid of that
    many programs instead of one per tile.
    """
    _check_matmul(a, b, c)
    act_id = _check_act(act)
    m, n = c.shape
    tiles_m, tiles_n = tiling.tiles(m, n)
    do_wait = ready_in is not None if wait is None else wait
    if do_wait and ready_in is None:
        raise ValueError("wait=True needs ready_in")
    signal = ready_out is not None
    ready_in = _counter(ready_in, tiles_m, "ready_in", a.device)
    ready_out = _counter(ready_out, tiles_m, "ready_out", c.device)
    if status is None:
        status = torch.zeros(1, dtype=torch.int32, device=a.device)
    if programs is not None and programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    stage_kernel[(min(programs or tiles_m * tiles_n, tiles_m * tiles_n),)](
        a, b, c, ready_in, ready_out, status, wait_target, max_spins, m, n, a.shape[1],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        WAIT=do_wait, SIGNAL=signal, ACT=act_id,
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, **tiling.launch_options(),
    )  # fmt: skip


def ticket_schedule(tiles_m: int, tiles_n1: int, tiles_n2: int, lag: int = 1) -> torch.Tensor:
    """Work tickets (layer, row block, column block) for the ticketed MLP, int32 [n, 3].

    Row block i's layer-0 tiles come before row block (i - lag)'s layer-1 tiles: every consumer
    tile depends only on earlier tickets, and a lag of one row block gives the producers of the
    block it reads time to finish before it is taken.
    """
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    rows = []
    for i in range(tiles_m + lag):
        if i < tiles_m:
            rows += [(0, i, j) for j in range(tiles_n1)]
        if i >= lag:
            rows += [(1, i - lag, j) for j in range(tiles_n2)]
    return torch.tensor(rows, dtype=torch.int32)


class ReadyCounters:
    """One ready counter per row block, kept across passes: each pass raises the epoch instead of
    resetting them (a peer may still be signalling). New counters only for a new shape or device."""

    def __init__(self) -> None:
        self.counters: torch.Tensor | None = None
        self.epoch = 0

    def next_pass(self, rows: int, device: torch.device) -> tuple[torch.Tensor, int]:
        c = self.counters
        if c is None or c.numel() < rows or c.device != device:
            self.counters, self.epoch = torch.zeros(rows, dtype=torch.int32, device=device), 0
        self.epoch += 1
        return self.counters, self.epoch


class TicketMLP:
    """Y = act(X W1) W2 on one GPU, both GEMMs in one persistent kernel (CTA-pipelined).

    Holds the ready counters across calls (epoch counters: never reset) and the schedule per M.
    ``programs``: the persistent grid size (default: the GPU's SM count; 4 under the interpreter).
    """

    def __init__(self, act: str = "gelu", tiling: Tiling = DEFAULT_TILING, programs: int | None = None,
                 lag: int = 1, max_spins: int = 0) -> None:  # fmt: skip
        self.act = _check_act(act)
        self.tiling, self.lag, self.max_spins = tiling, lag, max_spins
        self.programs = programs
        self.ready = ReadyCounters()
        self._schedules: dict[tuple, torch.Tensor] = {}

    def __call__(
        self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, wait: bool = True
    ) -> torch.Tensor:
        m, d = x.shape
        f = w1.shape[1]
        if w1.shape != (d, f) or w2.shape != (f, d):
            raise ValueError(f"need x [M, D], w1 [D, F], w2 [F, D]; got {tuple(x.shape)}, {tuple(w1.shape)}, "
                             f"{tuple(w2.shape)}")  # fmt: skip
        if not (x.dtype == w1.dtype == w2.dtype):
            raise ValueError(f"x, w1, w2 must share a dtype, got {x.dtype}, {w1.dtype}, {w2.dtype}")
        x, w1, w2 = x.contiguous(), w1.contiguous(), w2.contiguous()
        tiles_m, tiles_n1 = self.tiling.tiles(m, f)
        _, tiles_n2 = self.tiling.tiles(m, d)
        key = (tiles_m, tiles_n1, tiles_n2, x.device)
        if key not in self._schedules:
            self._schedules[key] = ticket_schedule(tiles_m, tiles_n1, tiles_n2, self.lag).to(x.device)
        schedule = self._schedules[key]
        ready, epoch = self.ready.next_pass(tiles_m, x.device)
        h = torch.empty(m, f, dtype=x.dtype, device=x.device)
        y = torch.empty(m, d, dtype=x.dtype, device=x.device)
        status = torch.zeros(1, dtype=torch.int32, device=x.device)
        ticket = torch.zeros(1, dtype=torch.int32, device=x.device)
        programs = self.programs or _default_programs(x.device)
        ticket_mlp_kernel[(programs,)](
            x, w1, h, w2, y, ready, status, ticket, schedule, schedule.shape[0],
            epoch * tiles_n1, self.max_spins, m, d, f,
            ACT=self.act, WAIT=wait, BLOCK_M=self.tiling.block_m, BLOCK_N=self.tiling.block_n,
            BLOCK_K=self.tiling.block_k, **self.tiling.launch_options(),
        )  # fmt: skip
        self.status = status
        return y


def _default_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class PartitionedMLP:
    """Y = act(X W1) W2 with the GPU's SMs split in two 'devices': the producer stage kernel
    persistent on ``producer_sms`` programs on one stream, the consumer on the rest on another,
    linked by ready counters exactly as across GPUs. On a CPU the two run one after the other."""

    def __init__(self, act: str = "gelu", tiling: Tiling = DEFAULT_TILING, producer_share: float = 0.5,
                 max_spins: int = 0) -> None:  # fmt: skip
        if not 0 < producer_share < 1:
            raise ValueError(f"producer_share must be in (0, 1), got {producer_share}")
        self.act, self.tiling, self.share, self.max_spins = act, tiling, producer_share, max_spins
        self.ready = ReadyCounters()
        self._streams = None

    def __call__(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        m, f = x.shape[0], w1.shape[1]
        tiles_m, tiles_n1 = self.tiling.tiles(m, f)
        ready, epoch = self.ready.next_pass(tiles_m, x.device)
        h = torch.empty(m, f, dtype=x.dtype, device=x.device)
        y = torch.empty(m, w2.shape[1], dtype=x.dtype, device=x.device)
        self.status = torch.zeros(1, dtype=torch.int32, device=x.device)
        sms = _default_programs(x.device)
        producer = max(1, int(sms * self.share))
        consumer = max(1, sms - producer)
        produce = dict(ready_out=ready, act=self.act, tiling=self.tiling, programs=producer)
        consume = dict(ready_in=ready, wait_target=epoch * tiles_n1, status=self.status,
                       max_spins=self.max_spins, tiling=self.tiling, programs=consumer)  # fmt: skip
        if x.device.type != "cuda":
            launch_stage(x, w1, h, **produce)
            launch_stage(h, w2, y, **consume)
            return y
        if self._streams is None:
            self._streams = (torch.cuda.Stream(x.device), torch.cuda.Stream(x.device))
        main = torch.cuda.current_stream(x.device)
        for s in self._streams:
            s.wait_stream(main)
        with torch.cuda.stream(self._streams[0]):  # the producer first: it never waits
            launch_stage(x, w1, h, **produce)
        with torch.cuda.stream(self._streams[1]):
            launch_stage(h, w2, y, **consume)
        for s in self._streams:
            main.wait_stream(s)
        return y
