"""Triton kernels for CTA-pipelined GEMMs (after arXiv 2607.07862, "CTA-Pipelining").

Every kernel computes C = act(A @ B) tile by tile (BLOCK_M x BLOCK_N, fp32 accumulation). The
pipelining lives in two per-row-block counters:

* a producer, after storing a tile (possibly into another GPU's buffer), waits for all its
  threads' stores (barrier) and release-increments ``ready_out[row block]`` at system scope:
  whoever acquires the counter then sees the tile;
* a consumer tile needs a whole row block of its input A (all of the producer's N tiles of
  that row block), so it acquire-polls ``ready_in[row block]`` until it reaches ``wait_target``
  = epoch x producer tiles per row block. Counters are never reset while a peer may still
  signal: each call of a pipeline raises the epoch instead.

``stage_kernel`` is one stage (one GEMM, one device); tiles are ordered row block by row block,
so the consumer's first CTAs wait on the producer's first row blocks. With fewer programs than
tiles it is persistent: two such kernels on two streams, each on its share of the SMs, emulate
two devices on one GPU (neither can take the SMs the other needs to make progress). Waiting is bounded by
``max_spins`` (0: unbounded): a tile that gives up sets ``status[0]`` and writes nothing, which
turns a lost signal into an error instead of a hang.

``ticket_mlp_kernel`` is the single-GPU form for Y = act(X W1) W2: a persistent grid whose
programs take work tickets in order from an atomic counter; ticket t names a tile of layer 0
or layer 1, and the schedule puts every layer-1 tile after the layer-0 tiles it reads. A
program only waits on tickets taken before its own, by programs already running, so it cannot
deadlock whatever the number of programs.
"""

from __future__ import annotations

import triton
import triton.language as tl

ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2}  # gelu: the tanh form


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:  # 0.5 x (1 + tanh u) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        u = (x + x * x * x * 0.044715) * 1.5957691216057308
        x = x / (1.0 + tl.exp(-u))
    return x


@triton.jit
def _tile(
    a_ptr, b_ptr, c_ptr, pid_m, pid_n, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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
def _acquire(counter_ptr, target, max_spins):
    """Poll ``counter_ptr`` (acquire, system scope) until it reaches ``target``; True if it did."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < target) & ((max_spins == 0) | (spins < max_spins)):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="sys")
        spins += 1
    tl.debug_barrier()  # every thread of the CTA reads A only after the acquire
    return seen >= target


@triton.jit
def _release(counter_ptr):
    tl.debug_barrier()  # all threads' stores of the tile are done before the signal
    tl.atomic_add(counter_ptr, 1, sem="release", scope="sys")


# Per-call values are not specialised on: a warm-up launch compiles exactly what the pipelined
# launches run (Triton would otherwise compile again for, e.g., a target of 1 or a multiple of 16).
@triton.jit(do_not_specialize=["wait_target", "max_spins"])
def stage_kernel(
    a_ptr, b_ptr, c_ptr, ready_in, ready_out, status, wait_target, max_spins, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    WAIT: tl.constexpr, SIGNAL: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    # One tile per program, or persistent (fewer programs than tiles, e.g. an SM partition):
    # either way tiles go in row-major order, row block 0 first.
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        pid_m = tile // tiles_n
        pid_n = tile % tiles_n
        ready = True
        if WAIT:
            ready = _acquire(ready_in + pid_m, wait_target, max_spins)
        if ready:
            _tile(a_ptr, b_ptr, c_ptr, pid_m, pid_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  stride_cm, stride_cn, ACT, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            if SIGNAL:
                _release(ready_out + pid_m)
        else:
            tl.atomic_xchg(status, 1)  # gave up waiting: report, write nothing


@triton.jit(do_not_specialize=["n_tickets", "wait_target", "max_spins"])
def ticket_mlp_kernel(
    x_ptr, w1_ptr, h_ptr, w2_ptr, y_ptr, ready, status, ticket, schedule, n_tickets, wait_target,
    max_spins, M, D, F,
    ACT: tl.constexpr, WAIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Y = act(X W1) W2 with contiguous row-major X [M, D], W1 [D, F], H [M, F], W2 [F, D], Y [M, D]."""
    t = tl.atomic_add(ticket, 1)
    while t < n_tickets:
        layer = tl.load(schedule + 3 * t)
        pid_m = tl.load(schedule + 3 * t + 1)
        pid_n = tl.load(schedule + 3 * t + 2)
        if layer == 0:
            _tile(x_ptr, w1_ptr, h_ptr, pid_m, pid_n, M, F, D, D, 1, F, 1, F, 1,
                  ACT, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            _release(ready + pid_m)
        else:
            ok = True
            if WAIT:
                ok = _acquire(ready + pid_m, wait_target, max_spins)
            if ok:
                _tile(h_ptr, w2_ptr, y_ptr, pid_m, pid_n, M, D, F, F, 1, D, 1, D, 1,
                      0, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            else:
                tl.atomic_xchg(status, 1)
        t = tl.atomic_add(ticket, 1)
