"""The planner: search TP, pipeline stages, micro-batch size and every stage's strategy.

Outer loops over TP t (powers of two within a node, dividing the heads), pipeline stages S and
micro-batch size b (DP d = GPUs / (t S), G = global batch / (d b) micro-batches), tried in the
order of a lower bound (perfectly balanced compute, nothing else) that stops the search at the
first setting that cannot beat the best plan so far. For each setting the stage strategies are
evaluated once per stage kind (first / middle / last) and layer count, up to the most layers a
stage can hold in a faster plan than the best so far (the same bound, one stage at a time),
Pareto-filtered per in-flight depth, and the MILP of inter_stage.py places the layers and picks
the strategies. Both cuts are exact: they drop only what no better plan can use. With
``PlannerOptions.stage_devices`` a second phase (``tune_stage_devices``) lets every stage take its
own device count and (TP, DP), as Mist's paper does, the MILP placing devices with the layers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from measure.checks import finite, whole
from measure.units import format_bytes

from ..model.interference import Interference
from ..model.runtime import RuntimeModel, cpu_adam_params_per_s
from ..model.specs import GRAD_ACCUMULATION, ClusterSpec, GradAccumulation, ModelSpec, check_grad_accumulation
from ..plan import (
    MAX_GLOBAL_BATCH,
    Plan,
    PrePostPlan,
    StagePlan,
    bytes_available,
    bytes_needed,
    gather_allowed,
    tp_splits,
)
from .inter_stage import Frontier, frontier_for, solve_inter_stage
from .pipeline_sim import in_flight, pipeline_objective, simulate_1f1b
from .problem import (
    SEARCH_OVERLAPS_GRAD_REDUCE,
    Candidate,
    Problem,
    cost_models,
    divisors,
    load_interference,
    powers_of_two,
)
from .stage_cost import (
    EDGE_FIELDS,
    OFFLOAD_FIELDS,
    STRATEGY_FIELDS,
    LayerNumbers,
    SearchSpace,
    Setting,
    clip_barrier_s,
    evaluate_stage,
    fitting_rows,
    layer_numbers,
    strategy_grid,
)

# kept importable from here, where callers (baselines, tests) have always found them
__all__ = [
    "Candidate",
    "NoFeasiblePlan",
    "PlannerOptions",
    "Problem",
    "cost_models",
    "load_interference",
    "predict",
    "refine",
    "search",
]


class NoFeasiblePlan(RuntimeError):
    pass


# The finest step the second phase takes: 1/32 of a stage's offloadable state is ~3% of it, as
# fine as the memory model tells plans apart (its worst per-stage error on the measured runs:
# 3.1%, `mist validate`), and a stage tries (k + 1)^4 combinations of its four fractions: 1.2M at
# 32 (GPT-3 1.3B on 2 L4s searched in 10 s at 32, 7 s at 8, 60 s at 64; at 10**6 it did not end).
MAX_REFINE_OFFLOAD_STEP = 32
# rounds of the refinement's coordinate descent at most; it stops at the first round that
# improves no stage and not the embedding/head
REFINE_PASSES = 3


# Frozen: each option is checked once, where it is made, and a search takes it as checked (an
# option set afterwards, e.g. ``options.micro_batches = [0]``, reached the search unchecked and
# divided by zero there). Options that differ are made with ``dataclasses.replace``, which checks.
@dataclass(frozen=True)
class PlannerOptions:
    space: SearchSpace = field(default_factory=SearchSpace)
    # None: every divisor of the sequences per replica, as Mist's paper searches them
    micro_batches: tuple[int, ...] | None = None
    milp_time_limit: float = 5.0
    imbalance_aware: bool = True  # False: extras ignored when choosing (the ablation)
    # The second phase (``refine``): offloaded fractions of the best plans in steps of 1/this
    # (the MILP's grid: SearchSpace.grid_steps); None: no second phase. At most
    # MAX_REFINE_OFFLOAD_STEP.
    refine_offload_step: int | None = 8
    # the engine the plans are for: how it accumulates gradients over micro-batches
    grad_accumulation: GradAccumulation = GRAD_ACCUMULATION["megatron-core"]
    # stages with their own device count and (TP, DP) (Mist §5.3), searched after the plans whose
    # stages all have the same (what Megatron-LM and torchtitan can run, and all that is searched
    # when False). Off by default: it multiplies the search's time (``tune_stage_devices``).
    stage_devices: bool = False

    def __post_init__(self) -> None:
        """Each option checked where it is made (a micro-batch of 0 divided by zero in the search)."""
        if not isinstance(self.space, SearchSpace):
            raise ValueError(f"space must be a SearchSpace, got {self.space!r}")
        sizes = self.micro_batches
        if sizes is not None and (
            not isinstance(sizes, tuple | list)
            or not sizes
            or not all(whole(size, least=1) for size in sizes)
        ):
            raise ValueError(
                f"micro_batches must be None or a non-empty list of whole numbers >= 1, got {sizes!r}"
            )
        if sizes is not None:  # a tuple of the same sizes: a list given could be changed after the check
            object.__setattr__(self, "micro_batches", tuple(sizes))
        if not (finite(self.milp_time_limit) and self.milp_time_limit > 0):
            raise ValueError(
                f"milp_time_limit must be a finite number of seconds > 0, got {self.milp_time_limit!r}"
            )
        for name in ("imbalance_aware", "stage_devices"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        step = self.refine_offload_step
        if step is not None and not (whole(step, least=1) and step <= MAX_REFINE_OFFLOAD_STEP):
            raise ValueError(
                f"refine_offload_step must be None or a whole number in [1, {MAX_REFINE_OFFLOAD_STEP}], "
                f"got {step!r:.40}"
            )
        check_grad_accumulation(self.grad_accumulation)


def settings(problem: Problem, options: PlannerOptions) -> Iterator[Candidate]:
    """Every candidate (tp, stages, dp, micro_batch) the search considers."""
    model, cluster, global_batch = problem.model, problem.cluster, problem.global_batch
    for tp in powers_of_two(cluster.gpus_per_node):
        if not tp_splits(model, tp, problem.sequence_parallel) or cluster.gpus % tp:
            continue
        for stages in range(1, min(model.layers, cluster.gpus // tp) + 1):
            if (cluster.gpus // tp) % stages:
                continue
            dp = cluster.gpus // (tp * stages)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            for micro_batch in options.micro_batches or range(1, per_replica + 1):
                if per_replica % micro_batch == 0:
                    yield Candidate(tp, stages, dp, micro_batch, global_batch)


def stage_device_counts(cluster: ClusterSpec, stages: int) -> tuple[int, ...]:
    """The device counts a stage of a ``stages``-stage pipeline may have when stages have their
    own: powers of two that divide a node, then whole nodes (the submesh shapes of Alpa, OSDI'22,
    which Mist's search takes), leaving at least one device to every other stage. Placed in rank
    order with counts that never grow along the pipeline (``solve_inter_stage``), each stage then
    lies in an aligned block: its TP groups inside one node, as the cost model prices them."""
    per_node, most = cluster.gpus_per_node, cluster.gpus - (stages - 1)
    counts = [count for count in powers_of_two(per_node) if per_node % count == 0]
    counts += [nodes * per_node for nodes in range(2, cluster.gpus // per_node + 1)]
    return tuple(count for count in counts if count <= most)


def stage_shapes(
    problem: Problem, devices: int, micro_batches: int, allowed: tuple[int, ...] | None = None
) -> list[tuple[int, int, int]]:
    """(TP, DP, micro-batch) a stage of ``devices`` may take when the global batch is split into
    ``micro_batches``: TP a power of two within a node dividing the devices and the (key/value)
    heads, DP the rest, its replicas splitting each pipeline micro-batch evenly into micro-batches
    of a size in ``allowed`` (None: any)."""
    model, per = problem.model, problem.global_batch // micro_batches
    out = []
    for tp in powers_of_two(min(devices, problem.cluster.gpus_per_node)):
        dp = devices // tp
        divides = devices % tp == 0 and tp_splits(model, tp, problem.sequence_parallel) and per % dp == 0
        if divides and (allowed is None or per // dp in allowed):
            out.append((tp, dp, per // dp))
    return out


def _stage_devices_settings(problem: Problem, options: PlannerOptions) -> list[tuple[float, int, int, dict]]:
    """(bound, stages, micro-batches, {devices: shapes}) of every pipeline whose stages may take
    their own devices, cheapest bound first: 2 to min(L, N) stages, every micro-batch count G
    dividing the global batch."""
    # L layers, N devices, B the global batch; S stages, G micro-batches (the docstring's symbols)
    L, N, B = problem.model.layers, problem.cluster.gpus, problem.global_batch
    out = []
    for S in range(2, min(L, N) + 1):
        for G in divisors(B):
            shapes = {
                devices: stage_shapes(problem, devices, G, options.micro_batches)
                for devices in stage_device_counts(problem.cluster, S)
            }
            shapes = {devices: taken for devices, taken in shapes.items() if taken}
            if shapes and max(shapes) * S >= N >= S * min(shapes):  # the counts can add up to N
                out.append((_stage_devices_bound(problem, S, G, shapes), S, G, shapes))
    return sorted(out, key=lambda pipeline: pipeline[:3])


@dataclass(frozen=True)
class _Fits:
    """What a stage's frontiers will ask of its strategies: the micro-batches in flight at each
    position that shares the evaluation, and the device and host budgets."""

    flights: tuple[float, ...]
    budget: float
    host_budget: float


def stage_space(setting: Setting, space: SearchSpace) -> SearchSpace:
    """The strategies a stage of ``setting`` may take: ``space``, without selective recomputation
    under FlashAttention (it keeps no scores: there is nothing to recompute)."""
    if setting.model.flash and space.selective:
        return dataclasses.replace(space, selective=False)
    return space


def _stage_values(
    setting: Setting,
    layer,
    layers: int,
    first: bool,
    last: bool,
    space: SearchSpace,
    grad_accum: int,
    fits: _Fits | None = None,
):
    """(grid, evaluate_stage's arrays over it at one micro-batch in flight, per_flight). With
    ``fits``, the grid holds only the strategies a frontier at one of its in-flight counts can keep
    (``stage_cost.fitting_rows``): the frontiers at those counts are the same (at others they may
    not be), and found in a fraction of the time."""
    space = stage_space(setting, space)
    grid = strategy_grid(layers, space)
    if fits is not None:
        rows = fitting_rows(
            setting,
            layer,
            layers,
            first,
            last,
            space,
            grad_accum,
            fits.flights,
            fits.budget,
            fits.host_budget,
        )
        grid = {name: column[rows] for name, column in grid.items()}
    one = evaluate_stage(setting, layer, layers, 1, first, last, grid, grad_accum)
    return grid, one, one["per_flight"]


def balanced_bound_s(
    layers: int, stages: int, micro_batches: int, per_layer: float, virtual: int = 1
) -> float:
    """The iteration of a pipeline whose every layer takes ``per_layer`` a micro-batch, its layers
    spread evenly: G micro-batches of the average stage, L p / S, plus the fill and drain of the
    S - 1 others, each 1/V of a stage with V chunks a rank (pipeline_objective's symbols). A lower
    bound where no layer is faster than ``per_layer`` (the slowest stage is at least the average)."""
    per_stage = layers * per_layer / stages
    return micro_batches * per_stage + (stages - 1) * per_stage / virtual  # (G - 1 + S) per_stage at V = 1


def lower_bound_s(problem: Problem, candidate: Candidate) -> float:
    """No plan of ``candidate`` has a shorter iteration (closed form): each stage's micro-batch takes
    at least its layers' forward and backward, and the slowest stage at least the average."""
    layer = layer_numbers(candidate.setting(problem))
    return balanced_bound_s(
        problem.model.layers, candidate.stages, candidate.grad_accum, layer.fwd + layer.bwd, candidate.virtual
    )


def most_layers_a_stage(
    layers: int,
    stages: int,
    micro_batches: int,
    per_layer: float,
    best: float,
    any_per_layer: float | None = None,
) -> int:
    """The most layers one stage can hold in a plan faster than ``best`` (every other stage holds
    one at least). A stage of l layers takes at least l ``per_layer`` a micro-batch (a layer's
    forward and backward on its devices, as ``lower_bound_s`` takes it), the slowest stage runs
    every micro-batch and every stage the first, so in plain 1F1B (one chunk a rank, as Mist's
    search plans; ``pipeline_objective``) the iteration takes at least (G - 1) l p + L q, q
    (``any_per_layer``, default p) the least a layer takes on any stage: the largest l below
    ``best`` by that bound. An exact cut, never a guess; with it alone, Llama 22B on 32 A100s
    without FlashAttention searched in 3.5 s instead of 18.8 s (Intel Xeon VM, 2026-12-06)."""
    most = layers - stages + 1
    if not math.isfinite(best) or micro_batches <= 1 or not per_layer > 0:
        return most
    q = per_layer if any_per_layer is None else any_per_layer
    # (G - 1) l p + L q < best; a relative margin keeps a plan that the bound ties in rounding
    bound = (best * (1 + 1e-9) - layers * q) / ((micro_batches - 1) * per_layer)
    if not math.isfinite(bound):
        return most
    return max(0, min(most, math.ceil(bound) - 1)) if bound > 0 else 0


def tune_setting(
    problem: Problem,
    candidate: Candidate,
    options: PlannerOptions,
    best_so_far: float,
    timed_out: list[str] | None = None,
) -> Plan | None:
    """The best plan of one candidate (layers and stage strategies), or None when nothing fits or
    it cannot beat ``best_so_far``. A try the MILP's time limit stopped before any solution is
    named in ``timed_out`` (where given)."""
    setting = candidate.setting(problem)
    grad_accum = candidate.grad_accum
    layers_in_model, stage_count = setting.model.layers, setting.stages
    if lower_bound_s(problem, candidate) >= best_so_far:
        return None
    frontiers, grids = _setting_frontiers(problem, candidate, setting, options, best_so_far)
    if any(not stage_frontiers for stage_frontiers in frontiers):
        return None
    # Cheaper bound before the MILP: every layer costs at least the cheapest per-layer steady
    # time any stage offers, and the slowest stage is at least the average.
    per_layer = min(
        float(frontier.steady.min()) / layers
        for stage_frontiers in frontiers
        for (layers, _), frontier in stage_frontiers.items()
    )
    if balanced_bound_s(layers_in_model, stage_count, grad_accum, per_layer) >= best_so_far:
        return None
    barrier = clip_barrier_s(setting)
    solution = solve_inter_stage(
        frontiers, layers_in_model, grad_accum, options.milp_time_limit, best_so_far, barrier
    )
    if solution is None:
        if (
            timed_out is not None
            and best_so_far == float("inf")
            and _layers_add_up(frontiers, layers_in_model)
        ):
            timed_out.append(
                f"tp {candidate.tp} pp {candidate.stages} dp {candidate.dp} mb {candidate.micro_batch}"
            )
        return None
    devices = setting.tp * setting.dp
    stages = []
    for i, (layers, point) in enumerate(zip(solution.layers, solution.points, strict=True)):
        grid = grids[(layers, i == 0, i == stage_count - 1)][0]
        row = frontiers[i][layers, devices].index[point]
        stages.append(_stage_plan({name: grid[name][row] for name in STRATEGY_FIELDS}, layers))
    return Plan.of(
        problem.model,
        problem.cluster,
        global_batch=grad_accum * setting.dp * setting.micro_batch,
        tp=setting.tp,
        dp=setting.dp,
        micro_batch=setting.micro_batch,
        stages=stages,
        sequence_parallel=problem.sequence_parallel,
        overlap_grad_reduce=setting.overlap_grad_reduce,
        grad_bucket_params=setting.grad_bucket_params,
    )


def _setting_frontiers(
    problem: Problem,
    candidate: Candidate,
    setting: Setting,
    options: PlannerOptions,
    best_so_far: float = float("inf"),
) -> tuple[list[dict[tuple[int, int], Frontier]], dict[tuple[int, bool, bool], tuple]]:
    """(frontiers, grids) of a candidate's stages: per stage, its Pareto frontier at each layer
    count it may take (keyed (layers, devices); none where nothing fits) up to the most layers a
    stage of a plan faster than ``best_so_far`` can hold (``most_layers_a_stage``), and the
    evaluated strategies by (layers, first, last), each stage kind evaluated once."""
    layer = layer_numbers(setting)
    layers_in_model, stage_count = setting.model.layers, setting.stages
    if candidate.virtual != 1:  # the layer cut's bound is plain 1F1B's: Mist's search plans no other
        raise ValueError(
            f"Mist's search plans plain 1F1B, got a candidate of {candidate.virtual} chunks a rank"
        )
    most = most_layers_a_stage(
        layers_in_model, stage_count, candidate.grad_accum, layer.fwd + layer.bwd, best_so_far
    )
    least = max(1, layers_in_model - (stage_count - 1) * most)  # the others hold the rest
    frontiers: list[dict[tuple[int, int], Frontier]] = [dict() for _ in range(stage_count)]
    grids: dict[tuple[int, bool, bool], tuple] = {}
    devices = setting.tp * setting.dp
    budget = float(problem.gpu_budget)
    # a stage kind's strategies are evaluated once, for the stages of that kind: only those that
    # fit at the micro-batches in flight one of them holds
    flights: dict[tuple[bool, bool], tuple[float, ...]] = {}
    for i in range(stage_count):
        kind = (i == 0, i == stage_count - 1)
        flights[kind] = (*flights.get(kind, ()), candidate.in_flight(i))
    for i in range(stage_count):
        first, last = i == 0, i == stage_count - 1
        flight = candidate.in_flight(i)
        fits = _Fits(flights[first, last], budget, problem.host_budget)
        for layers in range(least, most + 1):
            key = (layers, first, last)
            if key not in grids:
                grids[key] = _stage_values(
                    setting, layer, layers, first, last, options.space, candidate.grad_accum, fits
                )
            _, values, per_flight = grids[key]
            if not options.imbalance_aware:
                values = {**values, **{name: np.zeros_like(values[name]) for name in BLIND_TO}}
            frontier = frontier_for(values, flight, budget, per_flight, problem.host_budget)
            if len(frontier):
                frontiers[i][layers, devices] = frontier
    return frontiers, grids


def _layers_add_up(
    frontiers: list[dict[tuple[int, int], Frontier]], layers: int, devices: int | None = None
) -> bool:
    """Whether the inter-stage program of ``frontiers`` has a solution: one (layers, devices) key a
    stage among those that fit, the layers adding up to ``layers`` and, with ``devices`` (stages
    with their own devices), the devices adding up to it and never growing along the pipeline
    (``solve_inter_stage``'s constraints). With no bound to cut it off, the program returning
    none then means HiGHS stopped at its time limit first: ``solve_inter_stage`` says None for
    that as for an infeasible program, and this tells the two apart without the solver."""
    reached = {(0, 0, devices or 0)}  # (layers so far, devices so far, the last stage's devices)
    for options in frontiers:
        reached = {
            (so_far + n_layers, used + n_devices, n_devices)
            for so_far, used, last in reached
            for n_layers, n_devices in options
            if so_far + n_layers <= layers
            and (devices is None or (used + n_devices <= devices and n_devices <= last))
        }
    return any(so_far == layers and (devices is None or used == devices) for so_far, used, _ in reached)


def _stage_plan(values: dict, layers: int, tp: int | None = None, dp: int | None = None) -> StagePlan:
    """A stage's plan from one strategy (``values``: its STRATEGY_FIELDS)."""
    return StagePlan(
        layers=layers,
        recompute=int(values["recompute"]),
        selective=bool(values["selective"]),
        zero=int(values["zero"]),
        offload_weights=float(values["offload_weights"]),
        offload_grads=float(values["offload_grads"]),
        offload_optimizer=float(values["offload_optimizer"]),
        offload_activations=float(values["offload_activations"]),
        gather_in_forward=bool(values["gather_in_forward"]),
        tp=tp,
        dp=dp,
    )


def layer_s(problem: Problem, tp: int, dp: int, micro_batch: int) -> float:
    """A layer's forward and backward on one (TP, DP, micro-batch) shape: the least time it takes
    in any stage (the searches' bounds stand on it; a layer's numbers do not depend on the stage
    count, so one stage is asked)."""
    layer = layer_numbers(problem.setting(tp, dp, micro_batch, 1))
    return layer.fwd + layer.bwd


def _stage_devices_bound(problem: Problem, stages: int, micro_batches: int, shapes: dict) -> float:
    """No plan whose stages take their devices and (TP, DP) among ``shapes`` ({devices: [(tp, dp,
    micro-batch)]}) beats this (closed form). With T_i >= l_i p (p: the least forward + backward a
    layer takes on any shape) and, in device-seconds, n_i T_i >= l_i w (w: the least n p_n), the
    slowest stage takes at least L p / S and L w / N, and every micro-batch crosses every stage:
    (G - 1) max T + sum T >= (G - 1) max(L p / S, L w / N) + L p."""
    L, N, G = problem.model.layers, problem.cluster.gpus, micro_batches  # the docstring's symbols
    p = w = float("inf")
    for devices, device_shapes in shapes.items():
        for tp, dp, micro_batch in device_shapes:
            layer_seconds = layer_s(problem, tp, dp, micro_batch)
            p, w = min(p, layer_seconds), min(w, devices * layer_seconds)
    return (G - 1) * max(L * p / stages, L * w / N) + L * p


def tune_stage_devices(
    problem: Problem,
    stages: int,
    micro_batches: int,
    shapes: dict,
    options: PlannerOptions,
    best_so_far: float,
    timed_out: list[str] | None = None,
) -> Plan | None:
    """The best plan of ``stages`` stages and ``micro_batches`` micro-batches whose stages each take
    their own device count and (TP, DP) among ``shapes`` ({devices: [(tp, dp, micro-batch)]}), as
    Mist's inter-stage tuning does; None when nothing fits or it cannot beat ``best_so_far``. A try
    the MILP's time limit stopped before any solution is named in ``timed_out`` (where given).

    A stage's frontier at (layers, devices) is the Pareto frontier of every shape's strategies on
    those devices together; the MILP then places layers and devices at once. Its columns are the
    plain search's times the device counts, and HiGHS needs longer for them: with 5 s it stopped
    at 83.5 s where the plain search had found 71.3 s (GPT-3 13B, 16 L4s, 4 stages, G = 64)."""
    # S stages, G micro-batches, L layers, N devices (the MILP's symbols, as inter_stage.py names them)
    S, G, L, N = stages, micro_batches, problem.model.layers, problem.cluster.gpus
    frontiers, points = _stage_devices_frontiers(problem, S, G, shapes, options, best_so_far)
    if any(not stage_frontiers for stage_frontiers in frontiers):
        return None
    barrier = clip_barrier_s(problem.setting(*next(iter(shapes.values()))[0], S))
    solution = solve_inter_stage(
        frontiers, L, G, options.milp_time_limit, best_so_far, barrier, total_devices=N
    )
    if solution is None:
        if timed_out is not None and best_so_far == float("inf") and _layers_add_up(frontiers, L, N):
            timed_out.append(f"pp {S}, {G} micro-batches, stages with their own devices")
        return None
    stage_plans = []
    for i, (layers, devices, point) in enumerate(
        zip(solution.layers, solution.devices, solution.points, strict=True)
    ):
        tp, dp, strategy = points[i, layers, devices][point]
        stage_plans.append(_stage_plan(strategy, layers, tp, dp))
    tp, dp = stage_plans[0].tp, stage_plans[0].dp
    return Plan.of(
        problem.model,
        problem.cluster,
        global_batch=problem.global_batch,
        tp=tp,
        dp=dp,
        micro_batch=problem.global_batch // (G * dp),
        stages=stage_plans,
        sequence_parallel=problem.sequence_parallel,
        overlap_grad_reduce=SEARCH_OVERLAPS_GRAD_REDUCE,
    ).with_stage_parallelism_lifted()


def _stage_devices_frontiers(
    problem: Problem,
    stages: int,
    micro_batches: int,
    shapes: dict,
    options: PlannerOptions,
    best_so_far: float = float("inf"),
) -> tuple[list[dict[tuple[int, int], Frontier]], dict[tuple[int, int, int], list[tuple[int, int, dict]]]]:
    """(frontiers, points) of a pipeline whose stages take their own devices: per stage, its
    Pareto frontier at each (layers, devices) where something fits, every shape on those devices
    together, up to the most layers a stage on those devices can hold in a plan faster than
    ``best_so_far`` (``most_layers_a_stage``); and per (stage, layers, devices) the (tp, dp,
    strategy) of each frontier point (not the evaluated arrays: kept for every key until the MILP
    is solved, those took gigabytes)."""
    layers_in_model = problem.model.layers
    per_layer = {  # the least forward + backward a layer takes on each device count
        devices: min(layer_s(problem, tp, dp, micro_batch) for tp, dp, micro_batch in device_shapes)
        for devices, device_shapes in shapes.items()
    }
    frontiers: list[dict[tuple[int, int], Frontier]] = [dict() for _ in range(stages)]
    points: dict[tuple[int, int, int], list[tuple[int, int, dict]]] = {}
    positions: dict[tuple[bool, bool], list[int]] = {}  # (first, last) -> the stages of that kind
    for i in range(stages):
        positions.setdefault((i == 0, i == stages - 1), []).append(i)
    for devices, device_shapes in shapes.items():
        most = most_layers_a_stage(
            layers_in_model, stages, micro_batches, per_layer[devices], best_so_far, min(per_layer.values())
        )
        for layers in range(1, most + 1):
            for (first, last), stages_of_kind in positions.items():
                flights = tuple(in_flight(i, stages, micro_batches) for i in stages_of_kind)
                merged = _MergedStage.evaluate(
                    problem, stages, micro_batches, device_shapes, layers, first, last, options, flights
                )
                by_flight: dict[float, tuple[Frontier, list]] = {}
                for i in stages_of_kind:
                    flight = in_flight(i, stages, micro_batches)
                    if flight not in by_flight:
                        frontier = merged.frontier(flight, problem)
                        by_flight[flight] = frontier, [merged.strategy(int(row)) for row in frontier.index]
                    frontier, strategies = by_flight[flight]
                    if len(frontier):
                        frontiers[i][layers, devices], points[i, layers, devices] = frontier, strategies
    return frontiers, points


@dataclass
class _MergedStage:
    """A stage's strategies on one device count, every (TP, DP) shape's grid one after another:
    ``values`` concatenated, shape k's rows from ``starts[k]``; of each shape's grid the
    strategies that fit with the micro-batches in flight that its frontiers ask for."""

    shapes: list[tuple[int, int, int]]  # (tp, dp, micro-batch)
    grids: list[dict[str, np.ndarray]]  # each shape's strategies (those that fit)
    values: dict[str, np.ndarray]
    per_flight: np.ndarray
    starts: np.ndarray

    @classmethod
    def evaluate(
        cls,
        problem: Problem,
        stages: int,
        micro_batches: int,
        shapes: list,
        layers: int,
        first: bool,
        last: bool,
        options: PlannerOptions,
        flights: tuple[float, ...],
    ) -> _MergedStage:
        fits = _Fits(flights, float(problem.gpu_budget), problem.host_budget)
        evaluated = []
        for tp, dp, micro_batch in shapes:
            setting = problem.setting(
                tp, dp, micro_batch, stages, overlap_grad_reduce=SEARCH_OVERLAPS_GRAD_REDUCE
            )
            evaluated.append(
                _stage_values(
                    setting, layer_numbers(setting), layers, first, last, options.space, micro_batches, fits
                )
            )
        values = {
            key: np.concatenate([shape_values[key] for _, shape_values, _ in evaluated])
            for key in _FRONTIER_KEYS
        }
        if not options.imbalance_aware:
            values.update({key: np.zeros_like(values[key]) for key in BLIND_TO})
        starts = np.cumsum([0] + [len(shape_values["steady"]) for _, shape_values, _ in evaluated])
        per_flight = np.concatenate([shape_per_flight for _, _, shape_per_flight in evaluated])
        return cls(shapes, [grid for grid, _, _ in evaluated], values, per_flight, starts)

    def frontier(self, flight: float, problem: Problem) -> Frontier:
        return frontier_for(
            self.values, flight, float(problem.gpu_budget), self.per_flight, problem.host_budget
        )

    def strategy(self, row: int) -> tuple[int, int, dict]:
        """(tp, dp, strategy) of a row of ``values``."""
        shape = int(np.searchsorted(self.starts, row, side="right")) - 1
        tp, dp, _ = self.shapes[shape]
        grid = self.grids[shape]
        return tp, dp, {name: grid[name][row - self.starts[shape]] for name in STRATEGY_FIELDS}


# the arrays of a stage's evaluation that its frontier reads
_FRONTIER_KEYS = ("steady", "extra", "sync", "step", "wait", "memory", "host_memory", "host_per_flight")
# what a search that is not imbalance-aware does not see: the first and last micro-batch's extras
BLIND_TO = ("extra", "sync", "step", "wait")


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    options: PlannerOptions | None = None,
    runtime: RuntimeModel | None = None,
    interference: Interference | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The fastest plan found; raises NoFeasiblePlan (with the memory the best try needs, or that
    the MILP's time limit stopped every try that fit)."""
    _check_inputs(model, cluster, global_batch)
    if options is not None and not isinstance(options, PlannerOptions):
        raise ValueError(f"options must be a PlannerOptions or None, got {type(options).__name__}")
    _check_cost_models(runtime, interference)
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be None or a function taking a line of text, got {progress!r}")
    options = options or PlannerOptions()
    # resolved once: every candidate, prediction and the refinement share these numbers
    problem = Problem.resolve(model, cluster, global_batch, runtime, interference, options.grad_accumulation)
    start = time.perf_counter()
    timed_out: list[str] = []  # the tries the MILP's time limit stopped before any solution
    candidates = list(settings(problem, options))
    if not candidates:
        raise ValueError(
            f"no parallel setting divides global batch {global_batch} over {cluster.gpus} GPUs "
            f"(DP must divide the global batch; TP, a power of two within a node, the heads, key/value "
            f"heads and, with sequence parallelism, the sequence of {model.seq}; micro-batches: "
            f"{options.micro_batches or 'every divisor'})"
        )
    found: list[Plan] = []  # each plan that was the best so far, in the order found
    best = _best_of_settings(problem, candidates, options, timed_out, progress, found)
    if options.stage_devices:
        best = _best_with_stage_devices(problem, options, best, timed_out, progress, found)
    if best is None:
        raise _no_plan(problem, options, timed_out)
    if options.space.offload and options.refine_offload_step:
        # every plan that was the best so far, not the winner alone: the refinement is a local
        # search, and a runner-up's start can end faster (GPT-3 13B on 32 A100s with
        # FlashAttention: 29.14 s refined from the runner-up, 29.25 s from the winner). Newest
        # first, so a tie keeps the search's own winner
        refined = [_refine(problem, plan, options) for plan in reversed(found)]
        for plan in refined:
            predict_for(problem, plan)
        best = min(refined, key=lambda plan: plan.predicted_iteration_s)
    best.tuning_s = time.perf_counter() - start
    return best


def _better(
    problem: Problem, plan: Plan | None, best: Plan | None, found: list[Plan] | None = None
) -> Plan | None:
    """``plan`` priced (where there is one) if it beats ``best``, else ``best``; a plan that beats
    it is appended to ``found`` where given (each plan that was the best so far, in order)."""
    if plan is None:
        return best
    predict_for(problem, plan)
    if not plan.predicted_iteration_s < _best_time(best):  # (a NaN never beats it)
        return best
    if found is not None:
        found.append(plan)
    return plan


def _best_time(best: Plan | None) -> float:
    return float("inf") if best is None else best.predicted_iteration_s


def _best_of_settings(
    problem: Problem,
    candidates: list[Candidate],
    options: PlannerOptions,
    timed_out: list[str],
    progress: Callable[[str], None] | None,
    found: list[Plan] | None = None,
) -> Plan | None:
    """The fastest plan of ``candidates`` (every stage on the same devices), or None. Tried in
    the order of their lower bounds (``lower_bound_s``), up to the first that cannot beat the best
    so far: a fast plan found early cuts the later candidates' stages short
    (``most_layers_a_stage``; Llama 22B on 32 A100s without FlashAttention: 2.2 s, 3.5 s in the
    order of their sizes, Intel Xeon VM). ``found``: where given, each plan that was the best so
    far is appended to it, in the order found."""
    best = None
    ranked = sorted((lower_bound_s(problem, candidate), n) for n, candidate in enumerate(candidates))
    for n, (bound, index) in enumerate(ranked):
        if bound >= _best_time(best):  # sorted by bound: no later one can win either
            if progress:
                progress(
                    f"[{n}/{len(candidates)}] the other {len(candidates) - n} candidates' lower bounds "
                    f"cannot beat {_best_time(best):.3f} s"
                )
            break
        candidate = candidates[index]
        plan = tune_setting(problem, candidate, options, _best_time(best), timed_out)
        best = _better(problem, plan, best, found)
        if progress:
            progress(
                f"[{n + 1}/{len(candidates)}] tp {candidate.tp} pp {candidate.stages} dp {candidate.dp} "
                f"mb {candidate.micro_batch}: best {_best_time(best):.3f} s"
            )
    return best


def _best_with_stage_devices(
    problem: Problem,
    options: PlannerOptions,
    best: Plan | None,
    timed_out: list[str],
    progress: Callable[[str], None] | None,
    found: list[Plan] | None = None,
) -> Plan | None:
    """The fastest of ``best`` and the plans whose stages take their own devices, cheapest bound
    first, up to the first whose bound cannot beat the best so far; ``found`` as in
    ``_best_of_settings``."""
    pipelines = _stage_devices_settings(problem, options)
    for n, (bound, stages, micro_batches, shapes) in enumerate(pipelines):
        if bound >= _best_time(best):  # sorted by bound: no later one can win either
            break
        plan = tune_stage_devices(
            problem, stages, micro_batches, shapes, options, _best_time(best), timed_out
        )
        best = _better(problem, plan, best, found)
        if progress:
            progress(
                f"[{n + 1}/{len(pipelines)}] pp {stages}, {micro_batches} micro-batches, stages "
                f"with their own devices: best {_best_time(best):.3f} s"
            )
    return best


def _no_plan(problem: Problem, options: PlannerOptions, timed_out: list[str]) -> NoFeasiblePlan:
    """Why the search found no plan: the MILP's time limit where some tries fit in memory (the
    time limit, not memory, is why), else the least memory any candidate needs (a lower bound)."""
    model, cluster = problem.model, problem.cluster
    if timed_out:
        return NoFeasiblePlan(
            f"no plan for {model.name} on {cluster.gpus} x {cluster.gpu.name} found: the MILP reached its "
            f"time limit (milp_time_limit {options.milp_time_limit:g} s) before any solution in "
            f"{len(timed_out)} tr{'y' if len(timed_out) == 1 else 'ies'} whose stages fit in memory "
            f"({timed_out[0]}{', ...' if len(timed_out) > 1 else ''}); a longer limit may find one"
        )
    need = min_memory_needed(problem, options)
    offloading = (
        f"offloading at most {format_bytes(problem.host_budget)} of host memory per GPU"
        if options.space.offload and options.space.offloadable
        else "no offloading searched"
    )
    return NoFeasiblePlan(
        f"no plan for {model.name} on {cluster.gpus} x {cluster.gpu.name} fits: the leanest candidate "
        f"needs at least {format_bytes(need)} per GPU, {format_bytes(problem.gpu_budget)} usable "
        f"({offloading})"
    )


def refine(
    plan: Plan,
    model: ModelSpec,
    cluster: ClusterSpec,
    options: PlannerOptions,
    runtime: RuntimeModel,
    interference: Interference,
    passes: int = REFINE_PASSES,
) -> Plan:
    """The search's second phase: a plan's offloaded fractions in steps of 1/k
    (k = ``options.refine_offload_step``) where the MILP tried only SearchSpace's grid (the search
    refines each plan that was its best so far).

    Coordinate descent on the closed-form objective: each stage in turn gets the best of all
    (k+1)^4 combinations of its four fractions with the other stages fixed, then the embedding
    and head get their own strategy (``Plan.pre_post``: ZeRO stage and three fractions) if one
    beats treating them as their stages' parameters; every candidate within the GPU's and the
    host's memory. Ranked as the search ranks (extras only when ``options.imbalance_aware``).
    Layers, recomputation and ZeRO stages stay as the MILP placed them. Returns a new plan, priced
    (never slower than ``plan``)."""
    if not isinstance(plan, Plan):
        raise ValueError(f"refine takes a mist Plan, got {type(plan).__name__}")
    if options.refine_offload_step is None:
        raise ValueError("refine needs options.refine_offload_step (None: the search has no refinement)")
    _check_inputs(model, cluster)
    _check_cost_models(runtime, interference)
    _check(plan, model, cluster)
    priced = plan.priced_engine
    if priced is not None and priced != options.grad_accumulation:
        raise ValueError(
            f"refine ranks for options.grad_accumulation ({options.grad_accumulation.engine}); this plan "
            f"was priced for {priced.engine}: pass PlannerOptions(grad_accumulation=plan.priced_engine)"
        )
    problem = Problem.of_plan(plan, model, cluster, runtime, interference, options.grad_accumulation)
    # priced as it now stands: the descent changes fractions, not the input's predictions
    return predict_for(problem, _refine(problem, plan, options, passes))


def _edge_combos(space: SearchSpace, steps: np.ndarray) -> np.ndarray:
    """Every strategy (rows of EDGE_FIELDS: ZeRO stage, offloaded fractions) the embedding/head may
    take in ``space`` with fractions on ``steps``."""
    edge_steps = [space.offload_steps(name, steps) for name in EDGE_FIELDS[1:]]
    return np.array(
        [(zero, *fractions) for zero in space.zero_stages for fractions in itertools.product(*edge_steps)],
        float,
    )


def _offload_candidates(strategy: dict, combos: np.ndarray) -> dict:
    """A stage's grid: its ``strategy`` (one-element arrays) with every row of ``combos`` as its
    offloaded fractions (OFFLOAD_FIELDS), the weights gathered in forward only where they may be
    (not where they are on the host)."""
    grid = {**strategy, **{name: combos[:, j] for j, name in enumerate(OFFLOAD_FIELDS)}}
    allowed = gather_allowed(grid["zero"], grid["offload_weights"])
    grid["gather_in_forward"] = np.broadcast_to(grid["gather_in_forward"] * allowed, (len(combos),))
    return grid


def _refine(problem: Problem, plan: Plan, options: PlannerOptions, passes: int = REFINE_PASSES) -> Plan:
    """``refine`` for a resolved problem (the search's own, so nothing is resolved again)."""
    plan = dataclasses.replace(plan, stages=[dataclasses.replace(stage) for stage in plan.stages])
    refinement = _Refinement(_for_plan(problem, plan), plan, options)
    for _ in range(passes):
        improved = [refinement.refine_stage(i) for i in range(refinement.stages)]  # every stage, in turn
        if not (refinement.refine_edges() or any(improved)):
            break
    return plan


class _Refinement:
    """``refine``'s coordinate descent on one plan (changed in place): each stage's evaluation as
    the plan stands and the best objective so far, which every step reads and improves."""

    def __init__(self, problem: Problem, plan: Plan, options: PlannerOptions) -> None:
        step_count = options.refine_offload_step
        steps = np.arange(step_count + 1) / step_count
        space = options.space
        self.plan, self.options = plan, options
        self.combos = np.array(
            list(itertools.product(*(space.offload_steps(name, steps) for name in OFFLOAD_FIELDS)))
        )
        point = Candidate.of_plan(plan)
        self.point, self.stages, self.micro_batches = point, point.stages, point.grad_accum
        self.budget, self.host_budget = problem.gpu_budget, problem.host_budget
        self.numbers = []
        for i in range(self.stages):
            setting = problem.plan_setting(plan, i)
            self.numbers.append((setting, layer_numbers(setting)))
        self.barrier = clip_barrier_s(self.numbers[0][0])
        # the embedding and head: every (ZeRO stage, three fractions), on the first and last stage
        self.edge_combos = _edge_combos(space, steps)
        self.edge = {name: self.edge_combos[:, j] for j, name in enumerate(EDGE_FIELDS)}
        self.ends = sorted({0, self.stages - 1})
        self.values = [self.evaluate(i, self.current(i), _edge(plan)) for i in range(self.stages)]
        self.best = self.objective({})

    def evaluate(self, i: int, grid: dict, edge: dict | None) -> dict:
        setting, layer = self.numbers[i]
        first, last = i == 0, i == self.stages - 1
        layers, flight = self.plan.stages[i].layers, self.point.in_flight(i)
        return evaluate_stage(setting, layer, layers, flight, first, last, grid, self.micro_batches, edge)

    def current(self, i: int) -> dict:
        return {name: np.array([float(getattr(self.plan.stages[i], name))]) for name in STRATEGY_FIELDS}

    def fits(self, evaluated: dict) -> np.ndarray:
        return (evaluated["memory"] <= self.budget) & (evaluated["host_memory"] <= self.host_budget)

    def ranked(self, evaluated: dict, key: str):
        """What the search ranks by: extras only when it is imbalance-aware."""
        if self.options.imbalance_aware or key not in BLIND_TO:
            return evaluated[key]
        return np.zeros_like(evaluated[key])

    def objective(self, candidates: dict[int, dict]):
        """The closed form with ``candidates``' stages (arrays) and the others as they are now."""
        steady, extra, step, wait = (
            [
                self.ranked(candidates[j], key) if j in candidates else self.ranked(self.values[j], key)[0]
                for j in range(self.stages)
            ]
            for key in ("steady", "extra", "step", "wait")
        )
        return pipeline_objective(steady, extra, self.micro_batches, step, self.barrier, wait=wait)

    def _improves(self, times: np.ndarray) -> int | None:
        """The index of the best of ``times`` where it beats the best so far (which it becomes)."""
        choice = int(np.argmin(times))
        if not times[choice] < self.best * (1 - 1e-9):  # (a NaN never improves)
            return None
        self.best = float(times[choice])
        return choice

    def refine_stage(self, i: int) -> bool:
        """Stage i's best offloaded fractions with the others fixed; whether they beat the best."""
        plan = self.plan
        grid = _offload_candidates(self.current(i), self.combos)
        evaluated = self.evaluate(i, grid, _edge(plan))
        choice = self._improves(np.where(self.fits(evaluated), self.objective({i: evaluated}), np.inf))
        if choice is None:
            return False
        for j, name in enumerate(OFFLOAD_FIELDS):
            setattr(plan.stages[i], name, float(self.combos[choice, j]))
        plan.stages[i].gather_in_forward = bool(grid["gather_in_forward"][choice])
        self.values[i] = self.evaluate(i, self.current(i), _edge(plan))
        return True

    def refine_edges(self) -> bool:
        """The embedding and head's best own strategy; whether it beats the best."""
        at_ends = {i: self.evaluate(i, self.current(i), self.edge) for i in self.ends}
        all_fit = np.logical_and.reduce([self.fits(evaluated) for evaluated in at_ends.values()])
        choice = self._improves(np.where(all_fit, self.objective(at_ends), np.inf))
        if choice is None:
            return False
        combo = self.edge_combos[choice]
        self.plan.pre_post = PrePostPlan(int(combo[0]), *map(float, combo[1:]))
        for i in self.ends:
            self.values[i] = self.evaluate(i, self.current(i), _edge(self.plan))
        return True


def min_memory_needed(problem: Problem, options: PlannerOptions) -> float:
    """A lower bound of the per-GPU peak of any plan of the search's candidates (one TP and DP for
    every stage) within the host memory, for the no-feasible-plan message. Of a candidate of S
    stages: the stage that holds the most layers holds at least ceil(L / S), wherever it stands in
    the pipeline (the least of a first, a middle and a last stage of that many, each at its
    micro-batches in flight: a middle stage holds fewest one before the last), and the first stage
    at least one with the embedding; the least over the candidates."""
    lowest = float("inf")
    for candidate in settings(problem, options):
        S = candidate.stages
        most = -(-problem.model.layers // S)
        bound = min(
            _least_stage_memory(problem, options, candidate, most, i) for i in {0, max(0, S - 2), S - 1}
        )
        if S > 1:
            bound = max(bound, _least_stage_memory(problem, options, candidate, 1, 0))
        lowest = min(lowest, bound)
    return lowest


def _least_stage_memory(
    problem: Problem, options: PlannerOptions, candidate: Candidate, layers: int, stage: int
) -> float:
    """The least per-GPU memory stage ``stage`` of ``candidate`` needs holding ``layers`` layers, at
    its micro-batches in flight, over the strategies within the host memory (inf: none)."""
    setting = candidate.setting(problem)
    first, last = stage == 0, stage == candidate.stages - 1
    _, values, per_flight = _stage_values(
        setting, layer_numbers(setting), layers, first, last, options.space, candidate.grad_accum
    )
    flight = candidate.in_flight(stage)
    host = values["host_memory"] + (flight - 1) * values["host_per_flight"]
    memory = values["memory"] + (flight - 1) * per_flight
    return float(np.min(np.where(host <= problem.host_budget, memory, np.inf)))


def predict(
    plan: Plan,
    model: ModelSpec,
    cluster: ClusterSpec,
    runtime: RuntimeModel | None = None,
    interference: Interference | None = None,
    simulate: bool = True,
    grad_accumulation: GradAccumulation | None = None,
) -> Plan:
    """Fill in the plan's per-stage times and memory and its iteration time (closed form and,
    with ``simulate``, the 1F1B simulation; searches that price many plans skip it), for an
    engine that accumulates gradients as ``grad_accumulation`` says (None: the engine the plan
    was priced for, ``Plan.priced_engine``, or megatron-core's for a plan not priced yet)."""
    # the plan is checked against the model and cluster before any cost model is loaded for them
    if not isinstance(plan, Plan):
        raise ValueError(
            f"predict prices a mist Plan (Plan.of, or a plan file by Plan.load), got {type(plan).__name__}"
        )
    _check_inputs(model, cluster)
    _check_cost_models(runtime, interference)
    _check(plan, model, cluster)
    if grad_accumulation is None:  # the plan's own engine (Problem.resolve checks a given one)
        grad_accumulation = plan.pricing_engine
    problem = Problem.of_plan(plan, model, cluster, runtime, interference, grad_accumulation)
    return _price(problem, plan, simulate)


def _for_plan(problem: Problem, plan: Plan) -> Problem:
    """``problem`` as ``plan`` poses it: a plan may switch sequence parallelism off."""
    if plan.sequence_parallel == problem.sequence_parallel:
        return problem
    return dataclasses.replace(problem, sequence_parallel=plan.sequence_parallel)


def predict_for(problem: Problem, plan: Plan, simulate: bool = True, memo: StageMemo | None = None) -> Plan:
    """``predict`` for a resolved problem (the search prices every plan it finds against its own).
    ``memo``: stage evaluations already made against this problem (``StageMemo``)."""
    _check(plan, problem.model, problem.cluster)
    return _price(problem, plan, simulate, memo)


def _check_cost_models(runtime: object, interference: object) -> None:
    """Raises ValueError unless the cost models given are None (the GPU's presets) or models: a
    falsy wrong value (``interference=0``) meant the preset without a word, a truthy one failed
    deep in the search."""
    for name, value, kind, made_by in (
        ("runtime", runtime, RuntimeModel, "mist.model.runtime.load_runtime_model"),
        ("interference", interference, Interference, "mist.model.interference.read_interference_preset"),
    ):
        if value is not None and not isinstance(value, kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            raise ValueError(
                f"{name} must be None (the GPU's preset) or {article} {kind.__name__} ({made_by}), got "
                f"{type(value).__name__} {value!r:.60}"
            )


def _check_inputs(model: ModelSpec, cluster: ClusterSpec, global_batch: int | None = None) -> None:
    """Raises ValueError unless the public functions' arguments are of the kinds they take (a
    preset's name is not a model: ``mist.model(name)`` makes one)."""
    if not isinstance(model, ModelSpec):
        raise ValueError(
            f"model: a ModelSpec (mist.model(name, **overrides)), got {type(model).__name__} {model!r}"
        )
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(
            f"cluster: a ClusterSpec (mist.cluster(gpu, gpus)), got {type(cluster).__name__} {cluster!r}"
        )
    if global_batch is None:
        return
    if not whole(global_batch, least=1) or global_batch > MAX_GLOBAL_BATCH:
        raise ValueError(
            f"global batch must be a whole number in [1, {MAX_GLOBAL_BATCH}] sequences, got {global_batch!r}"
        )


def _check(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> None:
    """Raises ValueError unless ``plan`` is well-formed and fits ``model`` and ``cluster``."""
    plan.check()
    plan.check_model(model)
    if plan.gpu != cluster.gpu.name or plan.gpus != cluster.gpus:
        raise ValueError(
            f"the plan is for {plan.gpus} x {plan.gpu}, the cluster has {cluster.gpus} x {cluster.gpu.name}"
        )


_strategy_of = operator.attrgetter(*STRATEGY_FIELDS)  # a StagePlan's strategy fields, in order

# A stage's evaluation (evaluate_stage's arrays) by what it depends on besides the problem's
# constants (model, cluster, cost models, budgets, gradient accumulation): its setting's sizes,
# layers, in-flight count, position, strategy, the micro-batch count and the embedding/head's own.
StageMemo = dict[tuple, dict[str, np.ndarray]]


def _memo_key(
    setting: Setting,
    stage: StagePlan,
    in_flight: float,
    first: bool,
    last: bool,
    grad_accum: int,
    edge: dict | None,
) -> tuple[tuple, tuple[float, ...]]:
    """A StageMemo key in its two parts: what the evaluation depends on besides the stage's
    strategy, and the strategy."""
    edge_key = None if edge is None else tuple(edge[name] for name in EDGE_FIELDS)
    sizes = (
        setting.tp,
        setting.dp,
        setting.micro_batch,
        setting.stages,
        setting.virtual_stages,
        setting.overlap_grad_reduce,
        setting.grad_bucket_params,
        setting.sp,
    )
    where = (*sizes, stage.layers, in_flight, first, last, grad_accum, edge_key)
    return where, tuple(map(float, _strategy_of(stage)))


def _evaluate(
    setting: Setting,
    layer: LayerNumbers,
    stage: StagePlan,
    in_flight: float,
    first: bool,
    last: bool,
    grad_accum: int,
    edge: dict | None,
    memo: StageMemo | None,
) -> dict[str, np.ndarray]:
    """evaluate_stage for one stage's strategy, memoised in ``memo`` (exhaustive searches price the
    same stage in many plans: an even split's middle stages, a recompute count beyond a stage's
    layers; the 13B Megatron-LM space priced 32768 stages, 7753 of them distinct)."""
    where, strategy = _memo_key(setting, stage, in_flight, first, last, grad_accum, edge)
    if memo is not None and where + strategy in memo:
        return memo[where + strategy]
    grid = {name: np.array([chosen]) for name, chosen in zip(STRATEGY_FIELDS, strategy, strict=True)}
    values = evaluate_stage(setting, layer, stage.layers, in_flight, first, last, grid, grad_accum, edge)
    if memo is not None:
        memo[where + strategy] = values
    return values


def _edge(plan: Plan) -> dict | None:
    """The embedding/head's own strategy as evaluate_stage takes it; None: the stages' own."""
    return (
        None if plan.pre_post is None else {name: float(getattr(plan.pre_post, name)) for name in EDGE_FIELDS}
    )


def prime(problem: Problem, plans: Iterable[Plan], memo: StageMemo) -> None:
    """Evaluate into ``memo`` every stage of ``plans`` it lacks, all stages that differ only in
    strategy in one array call. An exhaustive search prices 10^4-10^5 plans one at a time, and
    evaluate_stage on a one-strategy grid is numpy's per-call overhead (about 1 ms; the 22B
    Megatron-LM space spent 50 of its 78 s there); the plans of a batch of settings share their
    stages' sizes and positions, so a batch takes a few calls. Every strategy's values are
    computed elementwise: they equal what pricing the plan alone computes."""
    todo: dict[tuple, tuple[tuple, dict[tuple, None]]] = {}  # where -> (evaluate_stage's args, strategies)
    for plan in plans:
        posed = _for_plan(problem, plan)
        point = Candidate.of_plan(plan)
        edge = _edge(plan)
        for i, stage in enumerate(plan.stages):
            setting = posed.plan_setting(plan, i)
            last = i == point.stages - 1
            args = (setting, stage.layers, point.in_flight(i), i == 0, last, point.grad_accum, edge)
            where, strategy = _memo_key(setting, stage, *args[2:])
            if where + strategy not in memo:
                todo.setdefault(where, (args, {}))[1][strategy] = None
    for where, ((setting, layers, flight, first, last, grad_accum, edge), strategies) in todo.items():
        grid = dict(zip(STRATEGY_FIELDS, np.array(list(strategies)).T, strict=True))
        layer = layer_numbers(setting)
        values = evaluate_stage(setting, layer, layers, flight, first, last, grid, grad_accum, edge)
        for n, strategy in enumerate(strategies):
            memo[where + strategy] = {key: column[n : n + 1] for key, column in values.items()}


def _price(problem: Problem, plan: Plan, simulate: bool, memo: StageMemo | None = None) -> Plan:
    """Fill in a checked plan's predictions (``predict``'s work after its checks)."""
    problem = _for_plan(problem, plan)
    point = Candidate.of_plan(plan)
    S, G, V = point.stages, point.grad_accum, point.virtual  # pipeline_objective's symbols
    budget = problem.gpu_budget
    steady, extra, step, wait, fwd, bwd = [], [], [], [], [], []
    fits = True
    edge = _edge(plan)
    for i, stage in enumerate(plan.stages):
        setting = problem.plan_setting(plan, i)
        layer = layer_numbers(setting)
        values = _evaluate(setting, layer, stage, point.in_flight(i), i == 0, i == S - 1, G, edge, memo)
        stage.steady_s, stage.extra_s, stage.step_s, stage.wait_s = (
            float(values[key][0]) for key in ("steady", "extra", "step", "wait")
        )
        memory, host_memory = float(values["memory"][0]), float(values["host_memory"][0])
        stage.memory_bytes, stage.host_memory_bytes = bytes_needed(memory), bytes_needed(host_memory)
        # judged on the model's own numbers, as the search judges its candidates (the whole bytes
        # above agree for the GPU, whose budget is whole bytes, and within a byte for the host)
        fits = fits and memory <= budget and host_memory <= problem.host_budget
        steady.append(stage.steady_s)
        extra.append(stage.extra_s)
        step.append(stage.step_s)
        wait.append(stage.wait_s)
        share = layer.fwd / (layer.fwd + layer.bwd)
        fwd.append(stage.steady_s * share)
        bwd.append(stage.steady_s * (1 - share))
    first = problem.plan_setting(plan, 0)  # the breakdown's layer: the first stage's
    layer = layer_numbers(first)
    barrier = clip_barrier_s(first)
    plan.predicted_iteration_s = pipeline_objective(steady, extra, G, step, barrier, V, wait)
    plan.simulated_iteration_s = (
        simulate_1f1b(fwd, bwd, G, last=extra, step=step, barrier_s=barrier, virtual=V, wait=wait)
        if simulate
        else None
    )
    plan.breakdown = {
        "usable_memory_bytes": problem.gpu_budget,
        "fits": fits,
        "usable_host_memory_bytes_per_gpu": bytes_available(problem.host_budget),
        "host": problem.cluster.host.name,
        "cpu_adam_params_per_s_per_gpu": cpu_adam_params_per_s(problem.cluster),
        "layer_fwd_ms": layer.fwd * 1e3,
        "layer_bwd_ms": layer.bwd * 1e3,
        "layer_saved_bytes": bytes_needed(layer.saved),
        "clip_barrier_ms": barrier * 1e3,
        "runtime_model": problem.runtime.source,
        "interference_model": problem.interference.source,
        "engine": problem.grad_accumulation.engine,
    }
    return plan
