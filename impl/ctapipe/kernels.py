"""Triton kernels for CTA-pipelined GEMMs (after arXiv 2607.07862, "CTA-Pipelining").

Every kernel computes C = act(A @ B) tile by tile (BLOCK_M x BLOCK_N, fp32 accumulation). The
pipelining lives in two per-row-block counters:

* a producer, after storing a tile (possibly into another GPU's buffer), waits for all its
  threads' stores (barrier) and release-increments ``ready_out[row block]`` at system scope:
  whoever acquires the counter then sees the tile;
* a consumer tile needs a whole row block of its input A (all of the producer's N tiles of
  that row block), so it acquire-polls ``ready_in[row block]`` until it reaches ``wait_target``.
  Who owns the counters picks the target: the single-GPU MLPs (gemm.py) zero theirs before each
  call (stream-ordered, so no signal of an earlier call can land after it) and wait for this
  call's producer tiles per row block; the multi-GPU chain (chain.py), whose peer may still be
  signalling, never resets them and waits for epoch x producer tiles instead.

``stage_kernel`` is one stage (one GEMM, one device); tiles are ordered row block by row block,
so the consumer's first CTAs wait on the producer's first row blocks. With fewer programs than
tiles it is persistent: two such kernels on two streams, each on its share of the SMs, emulate
two devices on one GPU (neither can take the SMs the other needs to make progress).

Every wait is bounded (``_acquire``), so a lost signal is an error, never a hang. A wait gives up
when, measured from its first poll,

* ``timeout_us`` microseconds of wall-clock time have passed: on a GPU the clock is the
  ``%globaltimer`` register (nanoseconds; ``tl.extra.cuda.globaltimer``), read by the CTA's
  thread 0 and passed to the other threads through an atomic exchange on the program's slot of
  ``clock`` (the loop's exit must be the same for every thread: each poll has a barrier); under
  the interpreter the kernel is Python on the host and the clock is ``time.monotonic_ns``;
* or ``max_spins`` polls were made (0: no bound on polls; the time bound always holds);
* or another tile of the same launch already gave up (``status[0] != 0``): after one give-up
  the others stop at once instead of each waiting out the bound.

The clock and the status are read every ``CLOCK_EVERY`` polls (a poll is then one load of the
counter), so a wait may overrun its bound by that many polls: microseconds on a GPU.

A tile that gives up writes nothing and signals nothing; it counts itself in ``status[0]``, and
the first one records itself in ``status[1:6]``: its tile (or ticket) index + 1, the counter value
it saw, its target, its row block and column block. The host reads them after the launch and
raises ``gemm.StageTimeout``.

``ticket_mlp_kernel`` is the single-GPU form for Y = act(X W1) W2: a persistent grid whose
programs take work tickets in order from an atomic counter; ticket t names a tile of layer 0
or layer 1, and the schedule puts every layer-1 tile after the layer-0 tiles it reads. A
program only waits on tickets taken before its own, by programs already running, so it cannot
deadlock whatever the number of programs.
"""

from __future__ import annotations

import time

import triton
import triton.language as tl

from .reference import ACTIVATION_NAMES

# The kernels' activation codes (gelu: the tanh form), in the references' order: one list of names
ACTIVATIONS = {name: code for code, name in enumerate(ACTIVATION_NAMES)}
RELU: tl.constexpr = tl.constexpr(ACTIVATIONS["relu"])
GELU: tl.constexpr = tl.constexpr(ACTIVATIONS["gelu"])
# status: [tiles that gave up, then the first one's tile (or ticket) + 1, counter seen, target,
# row block, column block]
STATUS_WORDS = 6
CLOCK_EVERY: tl.constexpr = tl.constexpr(8)  # a wait reads the clock and the status every 8 polls

# The wait's clock, chosen as triton.jit chooses compiled or interpreted kernels (at definition).
if triton.knobs.runtime.interpret:

    def _now_ns():
        """Interpreted kernels are Python on the host: the host's monotonic clock."""
        return time.monotonic_ns()

else:

    @triton.jit
    def _now_ns():
        """The GPU's global nanosecond timer (per thread: broadcast it before branching on it)."""
        return tl.extra.cuda.globaltimer()


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == RELU:
        x = tl.maximum(x, 0.0)
    elif ACT == GELU:  # 0.5 x (1 + tanh u) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        u = (x + x * x * x * 0.044715) * 1.5957691216057308
        x = x / (1.0 + tl.exp(-u))
    return x


@triton.jit
def _tile(
    a_ptr,
    b_ptr,
    c_ptr,
    pid_m,
    pid_n,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[tile] = act(A[row block] @ B[:, column block]), masked at the edges."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=(rm[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + ks[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=(ks[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        acc = tl.dot(a, b, acc)
    out = _activation(acc, ACT)
    tl.store(
        c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
        out.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def _acquire(counter_ptr, target, status, clock_ptr, timeout_us, max_spins):
    """Poll ``counter_ptr`` (acquire, system scope) until it reaches ``target``, or give up (see the
    module docstring: time, polls, or another tile's give-up). Returns the last value seen: the
    wait succeeded iff it is >= ``target``. ``clock_ptr``: this program's int64 scratch slot."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="sys")
    if seen < target:  # (a tile whose input is ready pays one load, not the clock's)
        limit_ns = timeout_us.to(tl.int64) * 1000
        # Thread 0's clock, the same for every thread: an exchange returns what the last one wrote.
        tl.atomic_xchg(clock_ptr, _now_ns(), sem="relaxed")
        start = tl.atomic_xchg(clock_ptr, _now_ns(), sem="relaxed")
        elapsed = start - start
        others = tl.atomic_add(status, 0, sem="relaxed")
        spins = 0
        waiting = others == 0
        while waiting:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="sys")
            spins += 1
            if spins % CLOCK_EVERY == 0:  # the clock and the other tiles every few polls only
                elapsed = tl.atomic_xchg(clock_ptr, _now_ns(), sem="relaxed") - start
                others = tl.atomic_add(status, 0, sem="relaxed")
            waiting = (seen < target) & (elapsed < limit_ns) & (others == 0)
            waiting = waiting & ((max_spins == 0) | (spins < max_spins))
    tl.debug_barrier()  # every thread of the CTA reads A only after the acquire
    return seen


@triton.jit
def _give_up(status, tile, pid_m, pid_n, seen, target):
    """Report a tile that gave up: the first one names itself, every one counts (and stops the rest)."""
    first = tl.atomic_cas(status + 1, 0, tile + 1)
    if first == 0:
        tl.atomic_xchg(status + 2, seen)
        tl.atomic_xchg(status + 3, target)
        tl.atomic_xchg(status + 4, pid_m)
        tl.atomic_xchg(status + 5, pid_n)
    tl.atomic_add(status, 1)


@triton.jit
def _release(counter_ptr):
    tl.debug_barrier()  # all threads' stores of the tile are done before the signal
    tl.atomic_add(counter_ptr, 1, sem="release", scope="sys")


# Per-call values are not specialised on: a warm-up launch compiles exactly what the pipelined
# launches run (Triton would otherwise compile again for, e.g., a target of 1 or a multiple of 16).
# One Triton program, its length its 25 arguments and a tile call's 18, one a line: the rest is in helpers
@triton.jit(do_not_specialize=["wait_target", "timeout_us", "max_spins"])
def stage_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    ready_in,
    ready_out,
    status,
    clock,
    wait_target,
    timeout_us,
    max_spins,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    WAIT: tl.constexpr,
    SIGNAL: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    # One tile per program, or persistent (fewer programs than tiles, e.g. an SM partition):
    # either way tiles go in row-major order, row block 0 first.
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        pid_m = tile // tiles_n
        pid_n = tile % tiles_n
        seen = wait_target
        if WAIT:
            seen = _acquire(
                ready_in + pid_m, wait_target, status, clock + tl.program_id(0), timeout_us, max_spins
            )
        if seen >= wait_target:
            _tile(
                a_ptr,
                b_ptr,
                c_ptr,
                pid_m,
                pid_n,
                M,
                N,
                K,
                stride_am,
                stride_ak,
                stride_bk,
                stride_bn,
                stride_cm,
                stride_cn,
                ACT,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            if SIGNAL:
                _release(ready_out + pid_m)
        else:
            _give_up(status, tile, pid_m, pid_n, seen, wait_target)  # write nothing, signal nothing


# One Triton program, its length its 23 arguments and a tile call's 18, one a line: the rest is in helpers
@triton.jit(do_not_specialize=["n_tickets", "wait_target", "timeout_us", "max_spins"])
def ticket_mlp_kernel(
    x_ptr,
    w1_ptr,
    h_ptr,
    w2_ptr,
    y_ptr,
    ready,
    status,
    clock,
    ticket,
    schedule,
    n_tickets,
    wait_target,
    timeout_us,
    max_spins,
    M,
    D,
    F,
    ACT: tl.constexpr,
    WAIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Y = act(X W1) W2 with contiguous row-major X [M, D], W1 [D, F], H [M, F], W2 [F, D], Y [M, D]."""
    t = tl.atomic_add(ticket, 1)
    while t < n_tickets:
        layer = tl.load(schedule + 3 * t)
        pid_m = tl.load(schedule + 3 * t + 1)
        pid_n = tl.load(schedule + 3 * t + 2)
        if layer == 0:
            _tile(
                x_ptr, w1_ptr, h_ptr, pid_m, pid_n, M, F, D, D, 1, F, 1, F, 1, ACT, BLOCK_M, BLOCK_N, BLOCK_K
            )
            _release(ready + pid_m)
        else:
            seen = wait_target
            if WAIT:
                seen = _acquire(
                    ready + pid_m, wait_target, status, clock + tl.program_id(0), timeout_us, max_spins
                )
            if seen >= wait_target:
                _tile(
                    h_ptr,
                    w2_ptr,
                    y_ptr,
                    pid_m,
                    pid_n,
                    M,
                    D,
                    F,
                    F,
                    1,
                    D,
                    1,
                    D,
                    1,
                    0,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                )
            else:
                _give_up(status, t, pid_m, pid_n, seen, wait_target)
        t = tl.atomic_add(ticket, 1)
