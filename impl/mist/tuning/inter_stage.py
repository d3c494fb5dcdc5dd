"""Imbalance-aware hierarchical tuning (Mist §5): intra-stage Pareto frontiers, inter-stage MILP.

Intra-stage: for a stage of l layers with k micro-batches in flight, every strategy is evaluated
at once (stage_cost.evaluate_stage); those over the memory budget are dropped and the exact
Pareto frontier of (steady micro-batch time T, extra time before the gradient-clipping barrier
D - P, optimizer step after it P) is kept, for each first-forward wait W apart (ZeRO-1/2's
weights gathered in forward: stage_cost's ``wait``, one value a stage or none).

Inter-stage: a mixed-integer linear program picks each stage's layer count and one frontier
point per stage to minimise the 1F1B iteration time

    (G - 1) max_i T_i + sum_i (T_i + W_i) + max(0, max_i (D_i - P_i - sum_{j<i} T_j)) + B + max_i P_i

(the slowest stage paces the steady state; the first micro-batch crosses every stage, waiting
at each for its weights where they are gathered in forward; a
stage's gradient sync is hidden behind the stages before it finishing their last backward; the
clipping barrier B, then the slowest stage's step).

A stage's options are keyed by (layers, devices): with ``total_devices`` the program also picks
each stage's device count (Mist §5.3: stages with their own devices and (TP, DP)), the counts
adding up to the cluster's and never growing along the pipeline. That order is what lets stages
placed in rank order keep each one inside an aligned block: with counts that are powers of two
up to a node, or whole nodes, every stage then starts at a multiple of its own size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pipeline_sim import pipeline_objective

# "Optimal" means within this relative gap of the best bound (HiGHS's default, stated here):
# the objective is at most this far above the true optimum.
MIP_REL_GAP = 1e-4


def pareto_frontier(steady: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """Indices of the exact non-dominated points (minimising both), sorted by steady time.

    A point is kept unless another is no worse in both and better in one; of exact
    duplicates one is kept.
    """
    order = np.lexsort((extra, steady))
    e = extra[order]
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], e[:-1]]))
    return order[e < best_before]


def pareto_frontier_3d(steady: np.ndarray, sync: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Indices of the exact non-dominated points of three times minimised together.

    By ``step`` value, ascending: a group's own 2-D frontier of (steady, sync), less the points
    that an earlier group (a smaller step) matches or beats in both; the staircase of those
    earlier points is kept sorted by steady (sync strictly falling), so each check is one binary
    search. Few distinct steps (the optimizer's placement) make this a handful of passes."""
    kept: list[np.ndarray] = []
    stair_t, stair_s = np.empty(0), np.empty(0)
    for value in np.unique(step):
        group = np.flatnonzero(step == value)
        group = group[pareto_frontier(steady[group], sync[group])]
        # the earlier point with the largest steady <= each one's has the least sync among those
        at = np.searchsorted(stair_t, steady[group], side="right")
        beaten = np.concatenate([[np.inf], stair_s])[at] <= sync[group]
        group = group[~beaten]
        kept.append(group)
        both_t, both_s = np.concatenate([stair_t, steady[group]]), np.concatenate([stair_s, sync[group]])
        stair = pareto_frontier(both_t, both_s)
        stair_t, stair_s = both_t[stair], both_s[stair]
    out = np.concatenate(kept) if kept else np.empty(0, int)
    return out[np.lexsort((sync[out], steady[out]))]


@dataclass(frozen=True)
class Frontier:
    steady: np.ndarray
    extra: np.ndarray  # after the last backward: sync + step
    step: np.ndarray  # of extra, the part after the gradient-clipping barrier
    wait: np.ndarray  # before the first forward (on the pipeline's fill path)
    index: np.ndarray  # into the strategy grid it came from
    memory: np.ndarray

    def __len__(self) -> int:
        return len(self.steady)


def held_and_fits(
    memory: np.ndarray,
    per_flight: np.ndarray,
    host_memory: np.ndarray | None,
    host_per_flight: np.ndarray | None,
    in_flight: float,
    budget: float,
    host_budget: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(device bytes held with ``in_flight`` micro-batches, whether they fit ``budget`` and the host
    bytes ``host_budget``): ``memory`` and ``host_memory`` at one in flight, each affine in the
    count (``per_flight``, ``host_per_flight``: what one more adds); no host rule where
    ``host_memory`` is None. The one rule a frontier keeps strategies by
    (``stage_cost.fitting_rows`` prunes by it too)."""
    held = memory + (in_flight - 1) * per_flight
    fits = held <= budget
    if host_memory is not None:
        fits &= host_memory + (in_flight - 1) * host_per_flight <= host_budget
    return held, fits


def frontier_for(
    values: dict[str, np.ndarray],
    in_flight: int,
    budget: float,
    act_per_flight: np.ndarray,
    host_budget: float = float("inf"),
) -> Frontier:
    """Frontier of a stage whose memory is values['memory'] at ``in_flight`` = 1 plus
    (in_flight - 1) * act_per_flight (activations of the extra in-flight micro-batches), among
    the strategies whose offloaded bytes (values['host_memory'], likewise affine) fit
    ``host_budget``."""
    memory, fits = held_and_fits(
        values["memory"],
        act_per_flight,
        values.get("host_memory"),
        values.get("host_per_flight"),
        in_flight,
        budget,
        host_budget,
    )
    ok = np.flatnonzero(fits)
    wait = values["wait"] if "wait" in values else np.zeros_like(values["steady"])
    keep: list[np.ndarray] = []
    for value in np.unique(wait[ok]):  # one or two (the gather in forward or not): a frontier each
        group = ok[wait[ok] == value]
        steady, sync, step = (values[k][group] for k in ("steady", "sync", "step"))
        group = group[pareto_frontier_3d(steady, sync, step)]
        if keep:  # less a point that an earlier group (waiting less) matches or beats in all three
            group = group[~_dominated(values, group, np.concatenate(keep))]
        keep.append(group)
    keep = np.concatenate(keep) if keep else np.empty(0, int)
    return Frontier(
        values["steady"][keep], values["extra"][keep], values["step"][keep], wait[keep], keep, memory[keep]
    )


def _dominated(values: dict[str, np.ndarray], points: np.ndarray, by: np.ndarray) -> np.ndarray:
    """Which of ``points`` one of ``by`` matches or beats in steady time, sync and step (both
    frontiers: small)."""
    times = [values["steady"], values["sync"], values["step"]]
    return np.logical_and.reduce([t[by][None, :] <= t[points][:, None] for t in times]).any(axis=1)


@dataclass(frozen=True)
class InterStageSolution:
    objective: float
    layers: tuple[int, ...]
    devices: tuple[int, ...]  # each stage's device count (its key's second part)
    points: tuple[int, ...]  # chosen frontier point per stage
    optimal: bool


def _highs_model(cost: np.ndarray, a: np.ndarray, lo: np.ndarray, hi: np.ndarray, integers: int):
    """HiGHS's model of: minimise cost . x subject to lo <= a x <= hi, x >= 0, the first
    ``integers`` columns binary, the others continuous (a's rows stored sparse, row by row)."""
    import highspy

    n = len(cost)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, len(a)
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(n)
    lp.col_upper_ = np.concatenate([np.ones(integers), [highspy.kHighsInf] * (n - integers)])
    lp.row_lower_ = np.where(np.isinf(lo), -highspy.kHighsInf, lo)
    lp.row_upper_ = np.where(np.isinf(hi), highspy.kHighsInf, hi)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum((a != 0).sum(axis=1))]).astype(np.int32)
    nz_rows, nz_cols = np.nonzero(a)
    lp.a_matrix_.index_ = nz_cols.astype(np.int32)
    lp.a_matrix_.value_ = a[nz_rows, nz_cols]
    kinds = highspy.HighsVarType
    lp.integrality_ = [kinds.kInteger] * integers + [kinds.kContinuous] * (n - integers)
    return lp


@dataclass(frozen=True)
class _Program:
    """The inter-stage MILP: one binary column per (stage, (layers, devices), frontier point),
    then M (the largest steady time), E (the largest exposed sync) and P (the largest step);
    minimise cost . x subject to lo <= rows x <= hi."""

    cols: list[tuple[int, tuple[int, int], int]]  # (stage, (layers, devices), point)
    cost: np.ndarray
    rows: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def _formulate(
    frontiers: list[dict[tuple[int, int], Frontier]],
    total_layers: int,
    micro_batches: int,
    total_devices: int | None,
) -> _Program | None:
    """The MILP of ``solve_inter_stage`` (None: no stage has a point)."""
    stages = len(frontiers)
    cols: list[tuple[int, tuple[int, int], int]] = []
    for i, options in enumerate(frontiers):
        for key, fr in options.items():
            cols.extend((i, key, p) for p in range(len(fr)))
    if not cols:
        return None
    n = len(cols) + 3  # + M (max steady) + E (max exposed sync) + P (max step)
    m_col, e_col, p_col = len(cols), len(cols) + 1, len(cols) + 2
    steady = np.array([frontiers[i][key].steady[p] for i, key, p in cols])
    step = np.array([frontiers[i][key].step[p] for i, key, p in cols])
    wait = np.array([frontiers[i][key].wait[p] for i, key, p in cols])
    sync = np.array([frontiers[i][key].extra[p] for i, key, p in cols]) - step
    stage_of = np.array([c[0] for c in cols])
    layers_of = np.array([c[1][0] for c in cols])
    devices_of = np.array([c[1][1] for c in cols])

    rows, lo, hi = [], [], []

    def add(coefficients: np.ndarray, low: float, high: float, col: int | None = None) -> None:
        r = np.zeros(n)
        r[:m_col] = coefficients
        if col is not None:
            r[col] = -1
        rows.append(r), lo.append(low), hi.append(high)

    for i in range(stages):  # one choice per stage
        add(stage_of == i, 1, 1)
    add(layers_of, total_layers, total_layers)  # layers add up
    if total_devices is not None:
        add(devices_of, total_devices, total_devices)  # devices add up
        for i in range(stages - 1):  # n_i >= n_{i+1}: stages placed in rank order stay aligned
            on = np.where(stage_of == i, devices_of, 0) - np.where(stage_of == i + 1, devices_of, 0)
            add(on, 0, np.inf)
    # the maxima over stages: M >= T_i, E >= (D_i - P_i) - sum_{j<i} T_j, P >= P_i
    for i in range(stages):
        add(np.where(stage_of == i, steady, 0.0), -np.inf, 0, m_col)
    for i in range(stages):
        add(np.where(stage_of == i, sync, 0.0) - np.where(stage_of < i, steady, 0.0), -np.inf, 0, e_col)
    for i in range(stages):
        add(np.where(stage_of == i, step, 0.0), -np.inf, 0, p_col)
    cost = np.concatenate([steady + wait, [micro_batches - 1, 1.0, 1.0]])
    return _Program(cols, cost, np.array(rows), np.array(lo, float), np.array(hi, float))


def solve_inter_stage(
    frontiers: list[dict[tuple[int, int], Frontier]],
    total_layers: int,
    micro_batches: int,
    time_limit: float = 10.0,
    cutoff: float = float("inf"),
    barrier_s: float = 0.0,
    total_devices: int | None = None,
) -> InterStageSolution | None:
    """frontiers[i][(l, n)]: stage i's frontier when it holds l layers on n devices;
    ``barrier_s``: the clipping barrier's seconds; ``total_devices``: the devices the stages share
    (None: each stage's count is fixed by its options, not chosen). None when nothing fits, or
    when HiGHS proves that no solution beats ``cutoff`` (a plan already found elsewhere)."""
    import highspy

    program = _formulate(frontiers, total_layers, micro_batches, total_devices)
    if program is None:
        return None
    cols = program.cols
    solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    solver.setOptionValue("time_limit", float(time_limit))
    solver.setOptionValue("mip_rel_gap", MIP_REL_GAP)
    solver.setOptionValue("threads", 1)
    if np.isfinite(cutoff):  # the barrier is a constant, left out of the program's objective
        solver.setOptionValue("objective_bound", float(cutoff) - barrier_s)
    solver.passModel(_highs_model(program.cost, program.rows, program.lo, program.hi, integers=len(cols)))
    solver.run()
    status = solver.getModelStatus()
    if status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
        return None  # infeasible, or cut off by the bound
    x = np.array(solver.getSolution().col_value)
    if x.size != len(cols) + 3 or not np.isfinite(x).all():
        return None
    chosen = sorted(cols[j] for j in np.flatnonzero(x[: len(cols)] > 0.5))
    if len(chosen) != len(frontiers):
        return None
    t, d, ps, w = (
        [getattr(frontiers[i][key], f)[p] for i, key, p in chosen]
        for f in ("steady", "extra", "step", "wait")
    )
    optimal = status == highspy.HighsModelStatus.kOptimal
    objective = pipeline_objective(t, d, micro_batches, ps, barrier_s, wait=w)
    layers, devices = (tuple(key[k] for _, key, _ in chosen) for k in (0, 1))
    return InterStageSolution(objective, layers, devices, tuple(p for _, _, p in chosen), optimal)
