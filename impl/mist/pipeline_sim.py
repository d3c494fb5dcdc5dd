"""1F1B pipeline simulator: iteration time of a plan from per-stage, per-micro-batch times.

Each stage runs its micro-batches in the 1F1B order (warm-up forwards, then one forward / one
backward alternately, then the cool-down backwards). An op starts when its stage is free and
its dependency is done: forward m on stage i needs forward m on stage i-1; backward m on stage
i needs backward m on stage i+1 (the last stage's backward needs its own forward). Per-stage
extras run before the first forward (``first``: e.g. gathering sharded weights) and after the
last backward (``last``: gradient synchronisation, optimizer step).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The op order of ``stage``: [("F", m) | ("B", m)]."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", m) for m in range(warmup)]
    f, bwd = warmup, 0
    while bwd < micro_batches:
        if f < micro_batches:
            order.append(("F", f))
            f += 1
        order.append(("B", bwd))
        bwd += 1
    return order


def simulate_1f1b(
    fwd: Sequence[float],
    bwd: Sequence[float],
    micro_batches: int,
    first: Sequence[float] | None = None,
    last: Sequence[float] | None = None,
    p2p: float = 0.0,
) -> float:
    """Makespan of one iteration; ``p2p`` is the send time between neighbouring stages."""
    stages = len(fwd)
    if len(bwd) != stages or micro_batches < 1 or stages < 1:
        raise ValueError("need one forward and one backward time per stage and >= 1 micro-batch")
    first = first or [0.0] * stages
    last = last or [0.0] * stages
    orders = [one_f_one_b_order(i, stages, micro_batches) for i in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    clock = list(first)
    position = [0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(stages):
            while position[i] < len(orders[i]):
                kind, m = orders[i][position[i]]
                if kind == "F":
                    dep = done.get(("F", i - 1, m)) if i > 0 else 0.0
                    dep = None if dep is None else dep + (p2p if i > 0 else 0.0)
                else:
                    dep = done.get(("B", i + 1, m)) if i < stages - 1 else done.get(("F", i, m))
                    dep = None if dep is None else dep + (p2p if i < stages - 1 else 0.0)
                if dep is None:
                    break
                start = max(clock[i], dep)
                clock[i] = start + (fwd[i] if kind == "F" else bwd[i])
                done[(kind, i, m)] = clock[i]
                position[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked (a bug: the order is always feasible)")
    return max(c + extra for c, extra in zip(clock, last, strict=True))


def pipeline_objective(steady: Sequence, extra: Sequence, micro_batches: int):
    """The planner's closed form: (G-1) max_i T_i + sum_i T_i + max_i (D_i - sum_{j<i} T_j).

    T_i = forward + backward of one micro-batch on stage i; D_i = its first + last extras. Any
    T_i or D_i may be an array (candidates for that stage): the result is then an array too.
    """
    total = (micro_batches - 1) * functools.reduce(np.maximum, steady) + sum(steady)
    before = 0.0
    worst_extra = -np.inf
    for t_i, d_i in zip(steady, extra, strict=True):
        worst_extra = np.maximum(worst_extra, d_i - before)
        before = before + t_i
    out = total + np.maximum(worst_extra, 0.0)
    return float(out) if np.ndim(out) == 0 else out
