"""1F1B pipeline simulator: iteration time of a plan from per-stage, per-micro-batch times.

Each stage runs its micro-batches in the 1F1B order (warm-up forwards, then one forward / one
backward alternately, then the cool-down backwards). An op starts when its stage is free and
its dependency is done: forward m on stage i needs forward m on stage i-1; backward m on stage
i needs backward m on stage i+1 (the last stage's backward needs its own forward). Per-stage
extras run before the first forward (``first``: e.g. gathering sharded weights) and after the
last backward (``last``: gradient synchronisation, optimizer step).

Gradient clipping (Megatron-LM's and torchtitan's default, and mist.engine.run's) puts a global
barrier between the two halves of ``last``: the step needs the norm of every stage's gradients,
an all-reduce over all ranks once each has synchronised its own. So each stage's ``last`` is
split into the part before the barrier (``sync``: the DP gradient reduction, the local norm) and
the ``step`` after it (the optimizer step, ZeRO's all-gather of the updated weights), and no
stage's step hides behind another stage's backward any more.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import numpy as np

from ..plan import MAX_MICRO_BATCHES


def in_flight(stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` of ``stages`` holds at once under 1F1B: its
    warm-up forwards plus the one in steady state, at most the iteration's micro-batches."""
    return min(stages - stage, micro_batches)


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> Iterator[tuple[str, int]]:
    """The op order of ``stage``: ("F", m) or ("B", m), generated (not stored)."""
    warmup = min(stages - stage - 1, micro_batches)
    yield from (("F", m) for m in range(warmup))
    f = warmup
    for bwd in range(micro_batches):
        if f < micro_batches:
            yield ("F", f)
            f += 1
        yield ("B", bwd)


def simulate_1f1b(
    fwd: Sequence[float],
    bwd: Sequence[float],
    micro_batches: int,
    first: Sequence[float] | None = None,
    last: Sequence[float] | None = None,
    p2p: float = 0.0,
    step: Sequence[float] | None = None,
    barrier_s: float = 0.0,
) -> float:
    """Makespan of one iteration; ``p2p`` is the send time between neighbouring stages. ``last``:
    each stage's work after its last backward; of it, ``step`` (default none) comes after the
    gradient-clipping barrier, which itself takes ``barrier_s``.

    Each finish time is kept only until the one op that waits for it has read it, so memory is
    O(stages) (a stage runs at most ``stages`` forwards ahead of its backwards), work
    O(stages x micro-batches)."""
    stages = len(fwd)
    if len(bwd) != stages or stages < 1:
        raise ValueError("need one forward and one backward time per stage")
    if not 1 <= micro_batches <= MAX_MICRO_BATCHES:
        raise ValueError(
            f"micro-batches per iteration must be in [1, {MAX_MICRO_BATCHES}], got {micro_batches}"
        )
    first = first or [0.0] * stages
    last = last or [0.0] * stages
    orders = [one_f_one_b_order(i, stages, micro_batches) for i in range(stages)]
    nxt = [next(o) for o in orders]  # every stage has at least one op
    done: dict[tuple[str, int, int], float] = {}
    clock = list(first)
    remaining = 2 * stages * micro_batches
    while remaining:
        progressed = False
        for i in range(stages):
            while nxt[i] is not None:
                kind, m = nxt[i]
                if kind == "F":
                    key = ("F", i - 1, m) if i > 0 else None
                    delay = p2p if i > 0 else 0.0
                else:
                    key = ("B", i + 1, m) if i < stages - 1 else ("F", i, m)
                    delay = p2p if i < stages - 1 else 0.0
                if key is not None and key not in done:
                    break
                dep = 0.0 if key is None else done.pop(key) + delay
                clock[i] = max(clock[i], dep) + (fwd[i] if kind == "F" else bwd[i])
                # keep what a later op waits for: the next stage's forward, the previous stage's
                # backward, the last stage's own backward
                if kind == "F" or i > 0:
                    done[(kind, i, m)] = clock[i]
                nxt[i] = next(orders[i], None)
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked (a bug: the order is always feasible)")
    step = step or [0.0] * stages
    synced = max(c + extra - s for c, extra, s in zip(clock, last, step, strict=True))
    return synced + barrier_s + max(step)


def pipeline_objective(
    steady: Sequence,
    extra: Sequence,
    micro_batches: int,
    step: Sequence | None = None,
    barrier_s: float = 0.0,
):
    """The planner's closed form:

        (G-1) max_i T_i + sum_i T_i + max(0, max_i (D_i - P_i - sum_{j<i} T_j)) + B + max_i P_i

    T_i = forward + backward of one micro-batch on stage i; D_i = its first + last extras, of which
    P_i (``step``, default none) comes after the gradient-clipping barrier, which takes B
    (``barrier_s``). Any T_i, D_i or P_i may be an array (candidates for that stage): the result
    is then an array too.
    """
    step = [0.0] * len(steady) if step is None else step
    total = (micro_batches - 1) * functools.reduce(np.maximum, steady) + sum(steady)
    before = 0.0
    worst_sync = -np.inf
    for t_i, d_i, p_i in zip(steady, extra, step, strict=True):
        worst_sync = np.maximum(worst_sync, d_i - p_i - before)
        before = before + t_i
    out = total + np.maximum(worst_sync, 0.0) + barrier_s + functools.reduce(np.maximum, step)
    return float(out) if np.ndim(out) == 0 else out
