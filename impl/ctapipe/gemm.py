"""Thin Python interface to the kernels: checked launches of one stage, and the two single-GPU
MLPs, ticketed (one persistent kernel) and SM-partitioned (two kernels as two devices).
kernels.py says how the pipelining works.

Waits are bounded in time: a tile gives up after ``timeout_s`` seconds without its ready counter
reaching the target (default ``WAIT_TIMEOUT_S``, overridable per call or object), and the host
then raises ``StageTimeout`` naming the stage and the tile. ``max_spins`` (default 0: no bound on
polls) adds a bound on the number of polls. The single-GPU MLPs zero their counters at the start
of every call, so any sequence of shapes (M and the hidden width F changing between calls) keeps
them in step: a wait target can only be met by the call's own producer tiles.
"""

from __future__ import annotations

import torch

from measure.checks import real, whole

from .kernels import ACTIVATIONS, STATUS_WORDS, stage_kernel, ticket_mlp_kernel
from .tiling import DEFAULT_TILING, Tiling
from .triton_compat import interpreter_compat

WAIT_TIMEOUT_S = 5.0
"""Default bound, in seconds of wall-clock time, on one consumer tile's wait for its ready counter.
On a GPU a legitimate wait lasts microseconds to milliseconds (a producer tile or a kernel launch);
under the interpreter, a producer process's start-up and the tests' deliberate delays (<= 1 s).
On a GPU it is measured by the kernel with the ``%globaltimer`` clock; under the interpreter with
the host's ``time.monotonic_ns`` (kernels.py)."""

_MAX_TIMEOUT_S = (2**31 - 1) / 1e6  # the kernels take the bound in int32 microseconds (~35 min)

# What the kernels multiply (tl.dot, float32 accumulation, the output rounded to the inputs' dtype).
# Under Triton's interpreter (CPU tensors) bfloat16 is read wrongly (relative errors ~1e9 measured:
# numpy has no bfloat16) and float64 is not computed (the output is left unwritten), so the CPU
# takes float16 and float32; a GPU bfloat16 too.
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRETER_DTYPES = (torch.float16, torch.float32)


class StageTimeout(RuntimeError):
    """A consumer tile gave up waiting for its ready counter (its producer never signalled, or not
    within the bound). The tiles that gave up wrote nothing: the output is incomplete."""

    def __init__(
        self,
        stage: str,
        tile: int,
        row_block: int,
        column_block: int,
        seen: int,
        target: int,
        gave_up: int,
        timeout_s: float,
        max_spins: int,
        tile_kind: str = "tile",
    ) -> None:
        self.stage, self.tile, self.row_block, self.column_block = stage, tile, row_block, column_block
        self.seen, self.target, self.gave_up = seen, target, gave_up
        self.timeout_s, self.max_spins = timeout_s, max_spins
        bound = f"{timeout_s:g} s" + (f" or {max_spins} polls" if max_spins else "")
        super().__init__(
            f"{stage}: {tile_kind} {tile} (row block {row_block}, column block {column_block}) gave up "
            f"waiting for its ready counter (bound {bound}): it saw {seen}, needed {target}; {gave_up} "
            "tile(s) gave up and wrote nothing"
        )


def _timeout_us(timeout_s: float | None) -> int:
    t = WAIT_TIMEOUT_S if timeout_s is None else timeout_s
    # also refuses nan and inf (a wait is never unbounded), True (a bool is no time) and "1"
    if not real(t) or not 1e-6 <= t <= _MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be in [1e-6, {_MAX_TIMEOUT_S:.0f}] seconds, got {t}")
    return round(t * 1e6)


def check_flags(optional: tuple[str, ...] = (), **flags: object) -> None:
    """Each of ``flags`` True or False, or None for one of ``optional`` (it has a default): "no"
    would be taken as true, and None as false where the flag reaches a kernel as it is."""
    for name, value in flags.items():
        if not (isinstance(value, bool) or (value is None and name in optional)):
            accepted = "True or False" + (" (or None: its default)" if name in optional else "")
            raise ValueError(f"{name} must be {accepted}, got {value!r}")


def _check_spins(max_spins: int) -> int:
    if not whole(max_spins, 0) or max_spins >= 2**31:
        raise ValueError(
            f"max_spins must be a whole number in [0, 2**31) (0: no bound on polls), got {max_spins!r}"
        )
    return int(max_spins)


def _check_wait_target(wait_target: int) -> int:
    """A count an int32 ready counter can reach: a float, a bool or a negative count would be
    compared with it as something else inside the kernel, and a larger one never reached."""
    if not whole(wait_target, 0) or wait_target >= 2**31:
        raise ValueError(f"wait_target must be a whole number of signals in [0, 2**31), got {wait_target!r}")
    return int(wait_target)


def new_status(device: torch.device | str) -> torch.Tensor:
    """A zeroed status buffer for the kernels (see kernels.py): int32 [6]."""
    return torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)


def raise_if_gave_up(
    status: torch.Tensor, stage: str, timeout_s: float | None, max_spins: int, tile_kind: str = "tile"
) -> None:
    """Raise ``StageTimeout`` if the kernels reported a give-up in ``status`` since it was zeroed
    (reading it waits for them), naming ``stage`` and the first tile that gave up; the buffer is
    zeroed first, so the object that owns it can be called again. ``timeout_s``, ``max_spins``: the
    bounds the launches had (for the message)."""
    if not isinstance(status, torch.Tensor):
        raise ValueError(f"status must be the status buffer of new_status(), got {type(status).__name__}")
    status = _status(status, status.device)  # the buffer a launch takes, or one line
    gave_up, tile, seen, target, row, col = status[:STATUS_WORDS].tolist()
    if not gave_up:
        return
    status.zero_()
    timeout = WAIT_TIMEOUT_S if timeout_s is None else timeout_s
    raise StageTimeout(stage, tile - 1, row, col, seen, target, gave_up, timeout, max_spins, tile_kind)


def _check_act(act: str) -> int:
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} unknown; accepted: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def _check_programs(programs: int | None) -> int | None:
    if programs is not None and not whole(programs, 1):
        raise ValueError(f"programs must be a whole number >= 1 (or None: the default), got {programs!r}")
    return programs


def check_tiling(tiling: Tiling) -> Tiling:
    if not isinstance(tiling, Tiling):
        raise ValueError(f"tiling must be a ctapipe.tiling.Tiling, got {tiling!r}")
    return tiling


def check_operands(**matrices: torch.Tensor) -> None:
    """The kernels' operands, before any launch, each fault in one line saying what is accepted:
    tensors, non-empty matrices on one device, of one dtype the kernels compute there
    (``GPU_DTYPES`` on a GPU, ``INTERPRETER_DTYPES`` on the CPU)."""
    names = ", ".join(matrices)
    for name, t in matrices.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided or t.device.type == "meta":
            raise TypeError(f"{name} must be a dense tensor with data, got layout {t.layout} on {t.device}")
        if t.requires_grad and torch.is_grad_enabled():  # the kernels have no backward
            raise ValueError(f"{name} requires grad: the kernels compute no gradient (use torch.no_grad())")
    if any(t.dim() != 2 for t in matrices.values()):
        got = ", ".join(f"{n} {t.dim()}-d" for n, t in matrices.items())
        raise ValueError(f"{names} must be matrices (2-d), got {got}")
    if any(t.numel() == 0 for t in matrices.values()):
        got = ", ".join(f"{n} {tuple(t.shape)}" for n, t in matrices.items())
        raise ValueError(f"{names} must not be empty, got {got}")
    if len({t.device for t in matrices.values()}) > 1:
        got = ", ".join(f"{n} on {t.device}" for n, t in matrices.items())
        raise ValueError(f"{names} must be on one device, got {got}")
    dtypes = {t.dtype for t in matrices.values()}
    device = next(iter(matrices.values())).device
    accepted = GPU_DTYPES if device.type == "cuda" else INTERPRETER_DTYPES
    if len(dtypes) > 1 or not dtypes <= set(accepted):
        where = "a GPU" if device.type == "cuda" else "the CPU (Triton's interpreter)"
        got = ", ".join(f"{n} {t.dtype}" for n, t in matrices.items())
        raise TypeError(
            f"{names} must share one dtype of {', '.join(str(d) for d in accepted)} on {where}; got {got}"
        )


def _check_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    check_operands(a=a, b=b, c=c)
    if a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
        raise ValueError(
            f"shapes do not chain: a {tuple(a.shape)} @ b {tuple(b.shape)} -> c {tuple(c.shape)}"
        )
    # the kernel stores C's tiles while later tiles still read A and B: C must be memory of its own
    # (measured: C over A's memory 11.8 relative error, C expanded from one row 1.45)
    # (a dimension of size 1 never steps: its stride says nothing; expanded from one element, a
    # column or a row was accepted)
    steps = sorted((st, sz) for st, sz in zip(c.stride(), c.shape, strict=True) if sz > 1)
    if any(st == 0 for st, _ in steps) or (len(steps) == 2 and steps[1][0] < steps[0][0] * steps[0][1]):
        raise ValueError(f"c must not overlap itself (strides {tuple(c.stride())}): give a fresh tensor")
    for name, t in (("a", a), ("b", b)):
        if _spans_overlap(c, t):
            raise ValueError(f"c overlaps {name} in memory: the kernel writes C while it reads {name}")


def _spans_overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the byte ranges the two tensors span intersect (conservative: interleaved views
    that touch no common element count too)."""

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (x0, x1), (y0, y1) = span(x), span(y)
    return x.device == y.device and x0 < y1 and y0 < x1


def _check_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
    check_operands(x=x, w1=w1, w2=w2)
    d, f = x.shape[1], w1.shape[1]
    if w1.shape != (d, f) or w2.shape != (f, d):
        raise ValueError(
            f"need x [M, D], w1 [D, F], w2 [F, D]; got {tuple(x.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)}"
        )


def _counter(t: torch.Tensor | None, rows: int, name: str, device: torch.device) -> torch.Tensor:
    if t is None:  # an unused pointer argument still needs a tensor
        return torch.zeros(1, dtype=torch.int32, device=device)
    if t.dtype != torch.int32 or t.numel() < rows:
        raise ValueError(
            f"{name} must be int32 with one counter per row block ({rows}), got {t.dtype} {t.numel()}"
        )
    return t


def _status(status: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if status is None:
        return new_status(device)
    if status.dtype != torch.int32 or status.numel() < STATUS_WORDS or not status.is_contiguous():
        raise ValueError(
            f"status must be a contiguous int32 buffer of {STATUS_WORDS} (new_status), got {status.dtype} "
            f"{status.numel()}"
        )
    return status


# Long for its docstring and the kernel's 25 launch arguments, one a line; its checks are helpers
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
    timeout_s: float | None = None,
    max_spins: int = 0,
    tiling: Tiling = DEFAULT_TILING,
    wait: bool | None = None,
    programs: int | None = None,
    check: bool = True,
    name: str = "stage",
) -> None:
    """C = act(A @ B) as one stage of a CTA pipeline.

    ``ready_in``: wait, per row block of A, for the counter to reach ``wait_target`` before reading
    it (the upstream stage signals it). ``ready_out``: signal C's row blocks as their tiles are
    stored (C may live on another GPU). ``wait=False`` with ``ready_in`` given launches the same
    stage without its wait (tests' negative control only). ``programs``: a persistent grid of that
    many programs instead of one per tile.

    A wait gives up after ``timeout_s`` seconds (None: ``WAIT_TIMEOUT_S``) or ``max_spins`` polls
    (0: no bound on polls); the tiles that gave up write nothing. ``check`` (default): wait for the
    launch and raise ``StageTimeout`` (``name``, the tile) on a give-up. ``check=False`` returns at
    once (asynchronous, e.g. the other stage must still be launched): the kernel reports in
    ``status`` (``new_status``; a launch whose status already holds a give-up does not wait), and
    the caller checks it with ``raise_if_gave_up``."""
    _check_matmul(a, b, c)
    check_flags(("wait",), check=check, wait=wait)
    act_id = _check_act(act)
    timeout_us, max_spins = _timeout_us(timeout_s), _check_spins(max_spins)
    wait_target = _check_wait_target(wait_target)
    m, n = c.shape
    tiles_m, tiles_n = tiling.tiles(m, n)
    do_wait = ready_in is not None if wait is None else wait
    if do_wait and ready_in is None:
        raise ValueError("wait=True needs ready_in")
    signal = ready_out is not None
    ready_in = _counter(ready_in, tiles_m, "ready_in", a.device)
    ready_out = _counter(ready_out, tiles_m, "ready_out", c.device)
    status = _status(status, a.device)
    _check_programs(programs)
    grid = min(programs or tiles_m * tiles_n, tiles_m * tiles_n)
    clock = torch.empty(grid if do_wait else 1, dtype=torch.int64, device=a.device)
    interpreter_compat()
    stage_kernel[(grid,)](
        a,
        b,
        c,
        ready_in,
        ready_out,
        status,
        clock,
        wait_target,
        timeout_us,
        max_spins,
        m,
        n,
        a.shape[1],
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        WAIT=do_wait,
        SIGNAL=signal,
        ACT=act_id,
        BLOCK_M=tiling.block_m,
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        **tiling.launch_options(),
    )
    if check and do_wait:  # (a stage that does not wait cannot give up: no sync for it)
        raise_if_gave_up(status, name, timeout_s, max_spins)


def ticket_schedule(tiles_m: int, tiles_n1: int, tiles_n2: int, lag: int = 1) -> torch.Tensor:
    """Work tickets (layer, row block, column block) for the ticketed MLP, int32 [n, 3].

    Row block i's layer-0 tiles come before row block (i - lag)'s layer-1 tiles: every consumer
    tile depends only on earlier tickets, and a lag of one row block gives the producers of the
    block it reads time to finish before it is taken.
    """
    for name, value in (("tiles_m", tiles_m), ("tiles_n1", tiles_n1), ("tiles_n2", tiles_n2)):
        if not whole(value, 0):
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    if not whole(lag, 0):
        raise ValueError(f"lag must be a whole number >= 0, got {lag!r}")
    rows = []
    for i in range(tiles_m + lag):
        if i < tiles_m:
            rows += [(0, i, j) for j in range(tiles_n1)]
        if i >= lag:
            rows += [(1, i - lag, j) for j in range(tiles_n2)]
    return torch.tensor(rows, dtype=torch.int32)


class ReadyCounters:
    """One ready counter per row block (plus ``extra`` int32 words after them, e.g. the ticket
    counter), kept across calls and zeroed at the start of each: on one GPU the reset is
    stream-ordered after every kernel of the previous call, so no late signal can land after it,
    and the target is this call's producer tiles per row block whatever earlier calls' shapes were
    (epoch counters fall out of step when M or the hidden width changes between calls)."""

    def __init__(self, extra: int = 0) -> None:
        self.extra = extra
        self.buffer: torch.Tensor | None = None

    def next_pass(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(counters [rows], the extra words), all zero, on the current stream."""
        b = self.buffer
        if b is None or b.numel() < rows + self.extra or b.device != device:
            self.buffer = b = torch.zeros(rows + self.extra, dtype=torch.int32, device=device)
        else:
            b.zero_()  # one memset per call, counters and extra words together
        return b[:rows], b[b.numel() - self.extra :]


class _Waits:
    """The wait bound, status buffer and give-up check an MLP object shares across its calls."""

    def __init__(self, timeout_s: float | None, max_spins: int, check: bool) -> None:
        _timeout_us(timeout_s)  # refuse a bad bound when the object is made
        check_flags(check=check)
        self.timeout_s, self.max_spins, self.check = timeout_s, _check_spins(max_spins), check
        self.status: torch.Tensor | None = None

    def status_on(self, device: torch.device) -> torch.Tensor:
        if self.status is None or self.status.device != device:
            self.status = new_status(device)
        return self.status

    def raise_if_gave_up(self, stage: str, tile_kind: str = "tile") -> None:
        if self.status is not None:
            raise_if_gave_up(self.status, stage, self.timeout_s, self.max_spins, tile_kind)


class TicketMLP:
    """Y = act(X W1) W2 on one GPU, both GEMMs in one persistent kernel (CTA-pipelined).

    Holds the ready counters (zeroed per call: any sequence of shapes) and the schedule per shape.
    ``programs``: the persistent grid size (default: the GPU's SM count; 4 under the interpreter).
    ``timeout_s`` / ``max_spins``: the wait bounds (launch_stage). ``check`` (default): every call
    waits for its kernel and raises ``StageTimeout`` on a give-up; with ``check=False`` calls stay
    asynchronous and ``raise_if_gave_up()`` checks every call since the last check (after a give-up
    later calls do not wait, so a lost signal costs one timeout, not one per call).
    """

    def __init__(
        self,
        act: str = "gelu",
        tiling: Tiling = DEFAULT_TILING,
        programs: int | None = None,
        lag: int = 1,
        max_spins: int = 0,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> None:
        self.act = _check_act(act)
        if not whole(lag, 0):
            raise ValueError(f"lag must be a whole number of row blocks >= 0, got {lag!r}")
        self.tiling, self.lag = check_tiling(tiling), lag
        self.programs = _check_programs(programs)
        self.waits = _Waits(timeout_s, max_spins, check)
        self.ready = ReadyCounters(extra=1)  # + the ticket counter
        self._schedules: dict[tuple, torch.Tensor] = {}

    @property
    def status(self) -> torch.Tensor | None:
        return self.waits.status

    def __call__(
        self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, wait: bool = True
    ) -> torch.Tensor:
        check_flags(wait=wait)  # the kernel's WAIT takes it as it is: None would be no wait
        _check_mlp(x, w1, w2)
        m, d = x.shape
        f = w1.shape[1]
        x, w1, w2 = x.contiguous(), w1.contiguous(), w2.contiguous()
        tiles_m, tiles_n1 = self.tiling.tiles(m, f)
        _, tiles_n2 = self.tiling.tiles(m, d)
        key = (tiles_m, tiles_n1, tiles_n2, x.device)
        if key not in self._schedules:
            self._schedules[key] = ticket_schedule(tiles_m, tiles_n1, tiles_n2, self.lag).to(x.device)
        schedule = self._schedules[key]
        ready, ticket = self.ready.next_pass(tiles_m, x.device)
        h = torch.empty(m, f, dtype=x.dtype, device=x.device)
        y = torch.empty(m, d, dtype=x.dtype, device=x.device)
        status = self.waits.status_on(x.device)
        programs = self.programs or _default_programs(x.device)
        clock = torch.empty(programs, dtype=torch.int64, device=x.device)
        interpreter_compat()
        ticket_mlp_kernel[(programs,)](
            x,
            w1,
            h,
            w2,
            y,
            ready,
            status,
            clock,
            ticket,
            schedule,
            schedule.shape[0],
            tiles_n1,
            _timeout_us(self.waits.timeout_s),
            self.waits.max_spins,
            m,
            d,
            f,
            ACT=self.act,
            WAIT=wait,
            BLOCK_M=self.tiling.block_m,
            BLOCK_N=self.tiling.block_n,
            BLOCK_K=self.tiling.block_k,
            **self.tiling.launch_options(),
        )
        if self.waits.check:
            self.raise_if_gave_up()
        return y

    def raise_if_gave_up(self) -> None:
        """Raise ``StageTimeout`` if a call since the last check gave up (naming the first ticket
        that did); then the object is usable again."""
        self.waits.raise_if_gave_up("TicketMLP layer 1", "ticket")


def _default_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class PartitionedMLP:
    """Y = act(X W1) W2 with the GPU's SMs split in two 'devices': the producer stage kernel
    persistent on ``producer_sms`` programs on one stream, the consumer on the rest on another,
    linked by ready counters exactly as across GPUs (zeroed per call). On a CPU the two run one
    after the other. ``timeout_s``, ``max_spins``, ``check``, ``raise_if_gave_up``: as TicketMLP."""

    def __init__(
        self,
        act: str = "gelu",
        tiling: Tiling = DEFAULT_TILING,
        producer_share: float = 0.5,
        max_spins: int = 0,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> None:
        if not (real(producer_share) and 0 < producer_share < 1):
            raise ValueError(f"producer_share must be a number in (0, 1), got {producer_share!r}")
        _check_act(act)  # here, not at the first call
        self.act, self.tiling, self.share = act, check_tiling(tiling), producer_share
        self.waits = _Waits(timeout_s, max_spins, check)
        self.ready = ReadyCounters()
        self._streams: dict[torch.device, tuple] = {}  # a device's two side streams (the counters' too)

    @property
    def status(self) -> torch.Tensor | None:
        return self.waits.status

    def __call__(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        _check_mlp(x, w1, w2)
        m, f = x.shape[0], w1.shape[1]
        tiles_m, tiles_n1 = self.tiling.tiles(m, f)
        ready, _ = self.ready.next_pass(tiles_m, x.device)
        h = torch.empty(m, f, dtype=x.dtype, device=x.device)
        y = torch.empty(m, w2.shape[1], dtype=x.dtype, device=x.device)
        status = self.waits.status_on(x.device)
        sms = _default_programs(x.device)
        producer = max(1, int(sms * self.share))
        consumer = max(1, sms - producer)
        # (the producer never waits: it gets the status buffer only to allocate none of its own)
        produce = dict(
            ready_out=ready, act=self.act, status=status, tiling=self.tiling, programs=producer, check=False
        )
        consume = dict(
            ready_in=ready,
            wait_target=tiles_n1,
            status=status,
            timeout_s=self.waits.timeout_s,
            max_spins=self.waits.max_spins,
            tiling=self.tiling,
            programs=consumer,
            check=False,
        )
        if x.device.type != "cuda":
            launch_stage(x, w1, h, **produce)
            launch_stage(h, w2, y, **consume)
        else:
            if x.device not in self._streams:
                self._streams[x.device] = (torch.cuda.Stream(x.device), torch.cuda.Stream(x.device))
            streams = self._streams[x.device]
            main = torch.cuda.current_stream(x.device)
            for s in streams:
                s.wait_stream(main)  # after the counters' reset
            with torch.cuda.stream(streams[0]):  # the producer first: it never waits
                launch_stage(x, w1, h, **produce)
            with torch.cuda.stream(streams[1]):
                launch_stage(h, w2, y, **consume)
            for s in streams:
                main.wait_stream(s)
        if self.waits.check:
            self.raise_if_gave_up()
        return y

    def raise_if_gave_up(self) -> None:
        """As TicketMLP.raise_if_gave_up: the consumer stage's first tile that gave up."""
        self.waits.raise_if_gave_up("PartitionedMLP consumer")
