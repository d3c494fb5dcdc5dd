"""What one search (or one prediction) is asked, resolved once, and the points it tries.

``Problem`` holds every per-search constant: the model and cluster, the global batch, the cost
models actually used (the given ones or the GPU's shipped presets), the memory budgets of one GPU
and the engine's gradient accumulation. The planner resolved these per candidate setting and per
stage before; resolving them here once keeps every candidate priced against the same numbers and
the search's loops free of loose positional arguments.

``Candidate`` is one point of the outer search (TP, pipeline stages, DP, micro-batch); the
micro-batches per iteration and each stage's in-flight count are derived in it, nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.budget import gpu_budget_bytes, host_budget_bytes
from ..model.calibrate import RateAbovePeakError, check_rates
from ..model.interference import Interference, read_interference_preset
from ..model.runtime import RuntimeModel, load_runtime_model
from ..model.specs import (
    CPU_PRESET,
    GRAD_ACCUMULATION,
    ClusterSpec,
    GradAccumulation,
    ModelSpec,
    check_grad_accumulation,
)
from ..plan import Plan, grad_accum
from .pipeline_sim import in_flight
from .stage_cost import Setting


def cost_models(
    cluster: ClusterSpec, runtime: RuntimeModel | None = None, interference: Interference | None = None
) -> tuple[RuntimeModel, Interference]:
    """The given runtime and interference models, or the shipped presets for the cluster's GPU;
    a ValueError where the runtime model is another GPU's, RateAbovePeakError where one prices
    faster than the hardware can go (``within_peaks``)."""
    runtime = runtime or load_runtime_model(cluster.gpu.name)
    interference = interference or load_interference(cluster.gpu.name)
    if runtime.gpu != cluster.gpu.name:  # another GPU's rates, checked against its own peaks
        raise ValueError(
            f"{runtime.source}: a runtime model of {runtime.gpu} for a cluster of {cluster.gpu.name}: "
            f"give one fitted to {cluster.gpu.name}'s profiles (mist calibrate), or none for its preset"
        )
    within_peaks(cluster, runtime, interference)
    return runtime, interference


def within_peaks(cluster: ClusterSpec, runtime: RuntimeModel, interference: Interference) -> None:
    """Raises RateAbovePeakError where a cost model prices faster than its GPU's data sheet allows:
    a fitted compute rate above the half-precision FLOP/s peak or a memory-bound one above the HBM
    bandwidth (``check_rates``, as the fit checks its own), or a host copy rate above the PCIe
    bandwidth. Checked wherever a model enters a search or a prediction, a preset read from a file
    or one built in code: the fit's check alone left both unchecked (review 2026-12-07: a GEMM at
    826x L4's peak halved a prediction). The ``cpu`` device's numbers are nominal: not checked."""
    check_rates(runtime, "bf16")
    if cluster.gpu.name == CPU_PRESET:
        return
    for direction, rate in interference.host_rates.items():
        if rate > cluster.gpu.host_bw:
            raise RateAbovePeakError(
                f"{interference.source}: host copies {direction} at {rate:.3g} B/s, above "
                f"{cluster.gpu.name}'s data-sheet PCIe bandwidth {cluster.gpu.host_bw:.3g} B/s"
            )


def load_interference(gpu: str) -> Interference:
    """The shipped interference preset of ``gpu`` (a serial model for the CPU "device"; none:
    channels that do not slow each other)."""
    from ..model.runtime import PRESETS

    path = PRESETS / f"interference_{gpu}.json"
    if path.exists():
        return read_interference_preset(path)
    if gpu == CPU_PRESET:  # the CPU "device" of mist.engine.run's checks
        return Interference.serial(
            "cpu: the same cores run compute and gloo's collectives, which mist.engine.run issues "
            "synchronously (ZeRO-2's reductions in backward hooks, FSDP's gathers): they take turns"
        )
    return Interference()


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``: the TP sizes (and Megatron-LM's grid's stage counts) searched."""
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def divisors(n: int) -> list[int]:
    """Every whole number dividing ``n``, ascending: the micro-batch sizes and counts searched."""
    return [divisor for divisor in range(1, n + 1) if n % divisor == 0]


@dataclass(frozen=True)
class Problem:
    """Everything a search or a prediction is asked, resolved once (see the module's note)."""

    model: ModelSpec
    cluster: ClusterSpec
    global_batch: int
    runtime: RuntimeModel  # the model actually used: the caller's or the GPU's preset
    interference: Interference
    gpu_budget: int  # usable bytes per GPU (whole bytes)
    host_budget: float  # host bytes one GPU may fill with offloaded state
    grad_accumulation: GradAccumulation  # how the engine running the plans accumulates gradients
    sequence_parallel: bool = True  # with TP > 1 (Megatron's default; what the search plans)
    # setting()'s answers by its arguments: an exhaustive search asks for the same few settings
    # a million times (building each took a tenth of its time); Settings are frozen, so shared
    _settings: dict[tuple, Setting] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def resolve(
        cls,
        model: ModelSpec,
        cluster: ClusterSpec,
        global_batch: int,
        runtime: RuntimeModel | None = None,
        interference: Interference | None = None,
        grad_accumulation: GradAccumulation = GRAD_ACCUMULATION["megatron-core"],
        sequence_parallel: bool = True,
    ) -> Problem:
        """The problem ``search`` is given (cost models None: the presets of the cluster's GPU)."""
        check_grad_accumulation(grad_accumulation)
        runtime, interference = cost_models(cluster, runtime, interference)
        return cls(
            model=model,
            cluster=cluster,
            global_batch=global_batch,
            runtime=runtime,
            interference=interference,
            gpu_budget=gpu_budget_bytes(cluster),
            host_budget=host_budget_bytes(cluster),
            grad_accumulation=grad_accumulation,
            sequence_parallel=sequence_parallel,
        )

    @classmethod
    def of_plan(
        cls,
        plan: Plan,
        model: ModelSpec,
        cluster: ClusterSpec,
        runtime: RuntimeModel | None = None,
        interference: Interference | None = None,
        grad_accumulation: GradAccumulation = GRAD_ACCUMULATION["megatron-core"],
    ) -> Problem:
        """The problem ``plan`` answers, as ``predict`` receives it."""
        return cls.resolve(
            model,
            cluster,
            plan.global_batch,
            runtime,
            interference,
            grad_accumulation,
            sequence_parallel=plan.sequence_parallel,
        )

    def setting(
        self,
        tp: int,
        dp: int,
        micro_batch: int,
        stages: int,
        virtual: int = 1,
        overlap_grad_reduce: bool = False,
        grad_bucket_params: int | None = None,
    ) -> Setting:
        """The stage-cost setting of a (tp, dp, micro-batch) stage in a pipeline of ``stages``, with
        ``virtual`` model chunks a rank and its gradient reduction as the plan fields say."""
        key = (tp, dp, micro_batch, stages, virtual, overlap_grad_reduce, grad_bucket_params)
        made = self._settings.get(key)
        if made is None:
            made = self._settings[key] = self._new_setting(*key)
        return made

    def _new_setting(
        self,
        tp: int,
        dp: int,
        micro_batch: int,
        stages: int,
        virtual: int,
        overlap_grad_reduce: bool,
        grad_bucket_params: int | None,
    ) -> Setting:
        return Setting(
            self.model,
            self.cluster,
            self.runtime,
            self.interference,
            tp,
            dp,
            micro_batch,
            stages,
            sp=self.sequence_parallel,
            grad_accumulation=self.grad_accumulation,
            virtual_stages=virtual,
            overlap_grad_reduce=overlap_grad_reduce,
            grad_bucket_params=grad_bucket_params,
        )

    def plan_setting(self, plan: Plan, stage: int) -> Setting:
        """The setting of ``plan``'s stage ``stage`` (its own TP/DP where it has them)."""
        return self.setting(
            *plan.stage_parallelism(stage),
            len(plan.stages),
            plan.virtual_stages,
            plan.overlap_grad_reduce,
            plan.grad_bucket_params,
        )


# the searches overlap the DP gradient reduction with backward, as the trainers they plan for do
# (Megatron-LM with --overlap-grad-reduce, torch DDP and FSDP by default)
SEARCH_OVERLAPS_GRAD_REDUCE = True


@dataclass(frozen=True)
class Candidate:
    """One point of the outer search: every stage has TP ``tp`` and DP ``dp``."""

    tp: int
    stages: int
    dp: int
    micro_batch: int
    global_batch: int
    virtual: int = 1  # model chunks a pipeline rank (interleaved 1F1B)
    overlap_grad_reduce: bool = SEARCH_OVERLAPS_GRAD_REDUCE
    grad_bucket_params: int | None = None

    @classmethod
    def of_plan(cls, plan: Plan) -> Candidate:
        """The plan's (uniform) point; per-stage TP/DP of a plan are not part of it."""
        return cls(
            plan.tp,
            len(plan.stages),
            plan.dp,
            plan.micro_batch,
            plan.global_batch,
            plan.virtual_stages,
            plan.overlap_grad_reduce,
            plan.grad_bucket_params,
        )

    @property
    def grad_accum(self) -> int:
        """Micro-batches per iteration (G), as ``Plan.grad_accum`` counts them."""
        return grad_accum(self.global_batch, self.dp, self.micro_batch)

    def in_flight(self, stage: int) -> float:
        """Micro-batches' worth of activations ``stage`` holds at once (``pipeline_sim.in_flight``)."""
        return in_flight(stage, self.stages, self.grad_accum, self.virtual)

    def setting(self, problem: Problem) -> Setting:
        return problem.setting(
            self.tp,
            self.dp,
            self.micro_batch,
            self.stages,
            self.virtual,
            self.overlap_grad_reduce,
            self.grad_bucket_params,
        )
