"""Predictions against measured end-to-end runs: the accuracy report of the cost model.

``python -m mist validate [DIR]`` reads every measured run in ``DIR`` (default: the vendored
``data/mist-artifact/measured-runs``), rebuilds the exact plan that ran, predicts it with the
shipped presets, and reports predicted vs measured iteration time and per-stage peak memory.
Nothing is fitted to these runs, but the two vendored sets (Mist's L4 plans, the A10G Megatron-LM
runs) guided changes to the model while it was developed: they are development sets, not held
out. A model's generality is shown by runs it has never been checked against (see
data/README.md).

Two formats are read (both described in the folder's README):

* ``mist-*.json``: plans tuned by Mist (``cases``): layers, recomputed layers and the strategy
  tuple (micro_batch, dp, tp, zero_weights, zero_grads, zero_opt, offload_w, offload_g,
  offload_opt, offload_act) per stage and of the embedding/head (``pre_post``: the plan's
  ``pre_post``), measured time and per-stage peak allocated MiB.
* ``megatron-*.json``: Megatron-LM runs in Aceso's format (``runs``): operators per stage (13 per
  layer, + the embedding on the first stage, + final norm and head on the last), full
  recomputation per stage, measured time only. Megatron-LM's defaults apply where the record is
  silent: dropout 0.1, no FlashAttention, 16-bit model with fp32 Adam.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from measure.checks import real, whole
from measure.strict import read_json_file
from measure.units import MiB

from ..model.profile_data import ARTIFACT_DATA
from ..model.specs import GRAD_ACCUMULATION, ClusterSpec, GradAccumulation, ModelSpec, cluster
from ..plan import Plan, PrePostPlan, StagePlan

MEASURED_RUNS = ARTIFACT_DATA / "measured-runs"
OPS_PER_LAYER = 13  # Aceso's operators of one transformer layer
# The measured records name GPUs their own way.
GPU_NAMES = {"L4-24GB": "l4", "l4": "l4", "A10G": "a10g", "a10g": "a10g"}
# The records' MLP kinds: gated (SwiGLU) or not; the activations each is priced as (GELU's
# tanh approximation is GELU's cost; a ReLU MLP would be priced as GELU's).
GATED = {"mlp": False, "swiglu": True}
ACTIVATIONS = {"mlp": {"gelu", "gelu_fast"}, "swiglu": {"silu", "swiglu"}}


@dataclass(frozen=True)
class MeasuredRun:
    name: str
    source: str  # the file it came from
    model: ModelSpec
    cluster: ClusterSpec
    plan: Plan
    iteration_s: float
    stage_memory_bytes: tuple[float, ...] | None  # peak allocated per stage, when measured
    grad_accumulation: GradAccumulation  # how the engine that ran it accumulates gradients
    notes: str = ""

    def __post_init__(self) -> None:
        # a measured time or peak of zero, below zero or not a number cannot be compared with
        # (a zero one divided by zero; the others gave percentages that meant nothing)
        measured = [("iteration time", self.iteration_s)]
        measured += [(f"stage {i} peak memory", m) for i, m in enumerate(self.stage_memory_bytes or ())]
        for what, value in measured:
            if not _positive(value):
                raise ValueError(
                    f"run {self.name}: its measured {what} must be a positive number, got {value!r}"
                )


@dataclass(frozen=True)
class Validation:
    run: MeasuredRun
    predicted_s: float
    simulated_s: float
    predicted_memory_bytes: tuple[int, ...]  # the plan's, whole bytes

    @property
    def time_error(self) -> float:
        return self.simulated_s / self.run.iteration_s - 1

    @property
    def memory_errors(self) -> tuple[float, ...]:
        if self.run.stage_memory_bytes is None:
            return ()
        pairs = zip(self.predicted_memory_bytes, self.run.stage_memory_bytes, strict=True)
        return tuple(p / m - 1 for p, m in pairs)


def _gpu(name: str, path: Path) -> str:
    if name not in GPU_NAMES:
        raise ValueError(f"{path}: GPU {name!r} unknown; known: {', '.join(sorted(GPU_NAMES))}")
    return GPU_NAMES[name]


def _field(record: dict, key: str, ok, accepted: str, where: str):
    """``record[key]`` where ``ok(value)``; else a ValueError naming ``where`` (the file and the
    record), the field and what it accepts, before the value is used (a list's length and its
    items' kinds were found by zip's or unpacking's errors, or not at all)."""
    value = record[key]
    if not ok(value):
        raise ValueError(f"{where}: {key} must be {accepted}, got {value!r:.60}")
    return value


def _list_of(item_ok, length: int | None = None):
    """A check of a list of items that each pass ``item_ok`` (``length`` of them where given, else
    at least one)."""
    return lambda v: (
        isinstance(v, list) and (len(v) == length if length is not None else bool(v)) and all(map(item_ok, v))
    )


def _flag(value: object) -> bool:
    """A record's yes/no: true/false, or the 0/1 the strategy tuples write."""
    return isinstance(value, bool) or (whole(value) and value in (0, 1))


def _positive(value: object) -> bool:
    return real(value) and 0 < value < math.inf


# a strategy tuple: (micro_batch, dp, tp) whole, three ZeRO flags, four offloaded fractions
# (the fractions' range is the rebuilt plan's check, which names the stage and field)
_STRATEGY = (lambda v: whole(v, 1),) * 3 + (_flag,) * 3 + (real,) * 4
_STRATEGY_ACCEPTED = "a list of (micro_batch, dp, tp) >= 1, three 0/1 ZeRO flags and four offloaded fractions"


def _strategy(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) == len(_STRATEGY)
        and all(ok(v) for ok, v in zip(_STRATEGY, value, strict=True))
    )


def _zero(strategy: list) -> int:
    """The ZeRO stage of a strategy tuple's (zero_weights, zero_grads, zero_opt) flags."""
    return 3 if strategy[3] else 2 if strategy[4] else 1 if strategy[5] else 0


def _mist_stages(plan: dict, path: Path, name: str) -> tuple[int, int, int, list[StagePlan], PrePostPlan]:
    """(micro-batch, DP, TP, stages, embedding/head strategy) of a Mist artifact plan."""
    where = f"{path}: {name}"
    strategies = _field(
        plan, "stage_strategies", _list_of(_strategy), f"{_STRATEGY_ACCEPTED}, per stage", where
    )
    count = f"a list of one whole number per stage ({len(strategies)})"
    layers = _field(plan, "layers_per_stage", _list_of(lambda v: whole(v, 1), len(strategies)), count, where)
    recomputed = _field(
        plan, "checkpointed_layers_per_stage", _list_of(lambda v: whole(v, 0), len(strategies)), count, where
    )
    _field(plan, "pre_post", _strategy, _STRATEGY_ACCEPTED, where)
    micro, dp, tp = strategies[0][:3]
    if any(tuple(s[:3]) != (micro, dp, tp) for s in (*strategies, plan["pre_post"])):
        raise ValueError(f"{path}: {name}: stages with their own micro-batch/DP/TP are not read yet")
    stages = []
    devices = _field(
        plan,
        "devices_per_stage_nodes_x_gpus",
        _list_of(_list_of(lambda v: whole(v, 1), 2), len(strategies)),
        f"a list of [nodes, gpus] per stage ({len(strategies)})",
        where,
    )
    if any(n * g != dp * tp for n, g in devices):  # the strategies' DP x TP devices, each stage
        raise ValueError(
            f"{where}: devices_per_stage_nodes_x_gpus {devices} is not DP x TP = {dp * tp} a stage"
        )
    for n, recompute, s in zip(layers, recomputed, strategies, strict=True):
        weights, grads, optimizer, activations = map(float, s[6:10])
        stages.append(
            StagePlan(
                n,
                recompute,
                _zero(s),
                offload_weights=weights,
                offload_grads=grads,
                offload_optimizer=optimizer,
                offload_activations=activations,
            )
        )
    edge = plan["pre_post"]  # the embedding/head's strategy tuple; its activations offload is moot
    return micro, dp, tp, stages, PrePostPlan(_zero(edge), *map(float, edge[6:9]))


def _mist_model(case: dict, path: Path) -> ModelSpec:
    """The ModelSpec of a Mist artifact case (bias-free layers only)."""
    m = case["model"]
    where = f"{path}: {case['case']}"
    if not isinstance(m, dict):
        raise ValueError(f"{where}: model must be a mapping of its shape, got {m!r:.60}")
    _field(m, "mlp", lambda v: isinstance(v, str) and v in GATED, f"one of {', '.join(GATED)}", where)
    for key in ("flash_attn", "bias"):
        _field(m, key, lambda v: isinstance(v, bool), "true or false", where)
    if m["bias"]:
        raise ValueError(f"{where}: bias true is not modelled (bias-free layers only)")
    accepted = ACTIVATIONS[m["mlp"]]
    _field(
        m,
        "activation",
        lambda v: isinstance(v, str) and v in accepted,
        f"one of {', '.join(sorted(accepted))} for mlp {m['mlp']}",
        where,
    )
    return ModelSpec(
        f"gpt3-{case['case']}",
        m["hidden"],
        m["layers"],
        m["heads"],
        m["vocab"],
        m["seq"],
        ffn=m["ffn"],
        flash=m["flash_attn"],
        dropout=m["dropout"],
        norm=m["norm"],
        gated_mlp=GATED[m["mlp"]],
    )


def _records(data: dict, key: str, name: str, path: Path) -> list[dict]:
    """The file's ``key`` list of records, each named once by its ``name`` field: an empty list
    compared nothing (an empty table, exit 0) and a record given twice counted twice in the means."""
    records = data[key]
    if not isinstance(records, list) or not records or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: {key} must be a non-empty list of measured records (mappings)")
    seen = set()
    for i, record in enumerate(records):
        label = record.get(name)
        if not isinstance(label, str) or not label:  # before the set: a list is no key of one
            raise ValueError(f"{path}: {key}[{i}]: {name} must be a non-empty string, got {label!r:.60}")
        if label in seen:
            raise ValueError(f"{path}: {name} {label!r} is listed twice")
        seen.add(label)
    return records


def _checked(plan: Plan, model: ModelSpec, path: Path, name: str) -> Plan:
    """``plan`` checked as ``predict`` will check it, so that what is wrong names the file and
    the record (``offload_weights is a fraction in [0, 1], got 2.0`` named neither)."""
    try:
        plan.check()
        plan.check_model(model)
    except ValueError as e:
        raise ValueError(f"{path}: {name}: {e}") from None
    return plan


def _stage_memory(measured: dict, stages: int, path: Path, name: str) -> tuple[float, ...]:
    """The measured peak allocated bytes of each of the ``stages`` stages, from MiB: one number
    per stage, each checked to be a number before any arithmetic (``"big" * MiB`` built a
    megabyte-long string that the check then printed). Their range is MeasuredRun's check."""
    mib = measured["stage_peak_allocated_MB"]
    if not isinstance(mib, list) or len(mib) != stages:
        got = f"{len(mib)} entries" if isinstance(mib, list) else f"a {type(mib).__name__}"
        raise ValueError(
            f"{path}: {name}: stage_peak_allocated_MB must be a list of one number per stage "
            f"({stages}), got {got}"
        )
    for i, value in enumerate(mib):
        if not real(value):
            raise ValueError(
                f"{path}: {name}: stage_peak_allocated_MB[{i}] must be a number of MiB, "
                f"got a {type(value).__name__}"
            )
    return tuple(value * MiB for value in mib)


def _mist_cases(data: dict, path: Path) -> list[MeasuredRun]:
    out = []
    for case in _records(data, "cases", "case", path):
        plan, gpu = case["plan"], _gpu(case["gpu"], path)
        micro, dp, tp, stages, pre_post = _mist_stages(plan, path, case["case"])
        model = _mist_model(case, path)
        for field in ("nodes", "gpus_per_node"):  # true is no count (it was read as 1)
            if not whole(case[field], 1):
                raise ValueError(
                    f"{path}: {case['case']}: {field} must be a whole number >= 1, got {case[field]!r:.60}"
                )
        gpus = case["nodes"] * case["gpus_per_node"]
        p = Plan(
            model=model.name,
            gpu=gpu,
            gpus=gpus,
            gpus_per_node=case["gpus_per_node"],
            global_batch=case["global_batch"],
            tp=tp,
            dp=dp,
            micro_batch=micro,
            stages=stages,
            sequence_parallel=False,
            pre_post=pre_post,
        )
        _checked(p, model, path, case["case"])
        if p.grad_accum != plan["grad_accum_steps"]:
            raise ValueError(
                f"{path}: {case['case']}: gradient accumulation {plan['grad_accum_steps']} does not match "
                f"global batch / (dp x micro-batch) = {p.grad_accum}"
            )
        memory = _stage_memory(case["measured"], len(stages), path, case["case"])
        out.append(
            MeasuredRun(
                case["case"],
                path.name,
                model,
                cluster(gpu, gpus, case["gpus_per_node"]),
                p,
                case["measured"]["iteration_s"],
                memory,
                GRAD_ACCUMULATION["mist"],
            )
        )
    return out


def _megatron_runs(data: dict, path: Path) -> list[MeasuredRun]:
    out = []
    for run in _records(data, "runs", "config", path):
        where = f"{path}: {run['config']}"
        gpu = _gpu(run["gpu"], path)
        stages_n = _field(run, "num_stages", lambda v: whole(v, 1), "a whole number >= 1", where)
        per_stage = f"a list of one {{}} per stage ({stages_n})"
        for key in ("tp_first_op_per_stage", "dp_first_op_per_stage", "num_gpus", "ops_per_stage"):
            _field(
                run,
                key,
                _list_of(lambda v: whole(v, 1), stages_n),
                per_stage.format("whole number >= 1"),
                where,
            )
        checkpointed = _field(
            run, "checkpoint_activations", _list_of(_flag, stages_n), per_stage.format("true or false"), where
        )
        _field(
            run, "measured_iteration_ms", _list_of(_positive), "a non-empty list of times (ms) above 0", where
        )
        if set(run["tp_first_op_per_stage"]) != {1} or set(run["dp_first_op_per_stage"]) != {1}:
            raise ValueError(f"{where}: TP/DP > 1 is not read yet")
        stages = []
        for i, (ops, ckpt) in enumerate(zip(run["ops_per_stage"], checkpointed, strict=True)):
            extra = (1 if i == 0 else 0) + (2 if i == stages_n - 1 else 0)  # embedding; final norm + head
            layers, rest = divmod(ops - extra, OPS_PER_LAYER)
            if rest:
                raise ValueError(
                    f"{path}: {run['config']}: stage {i} holds {ops} operators, not whole layers"
                )
            stages.append(StagePlan(layers, layers if ckpt else 0))
        model = ModelSpec(
            f"gpt3-{run['model_size']}",
            run["hidden_size"],
            run["num_layers"],
            run["num_attention_heads"],
            seq=run["seq_length"],
            flash=False,
            dropout=0.1,
        )
        gpus = sum(run["num_gpus"])
        plan = Plan(
            model=model.name,
            gpu=gpu,
            gpus=gpus,
            gpus_per_node=8,
            global_batch=run["global_batch_size"],
            tp=1,
            dp=1,
            micro_batch=run["micro_batch_size"],
            stages=stages,
            sequence_parallel=False,
        )
        _checked(plan, model, path, run["config"])
        seconds = statistics.fmean(run["measured_iteration_ms"]) / 1e3
        out.append(
            MeasuredRun(
                run["config"],
                path.name,
                model,
                cluster(gpu, gpus, 8),
                plan,
                seconds,
                None,
                GRAD_ACCUMULATION["megatron-lm"],
                "Megatron-LM defaults assumed: dropout 0.1, no FlashAttention",
            )
        )
    return out


def load_measured_runs(folder: str | Path = MEASURED_RUNS) -> list[MeasuredRun]:
    """Every measured run in ``folder``; a file that is neither format is a clear error."""
    folder = Path(folder)
    files = sorted(folder.glob("*.json"))
    if not files:
        raise ValueError(f"{folder}: no measured runs (*.json) here")
    out = []
    for path in files:
        try:
            data = read_json_file(path)
        except (OSError, ValueError) as e:  # the JSON's errors, a key twice, no regular file
            raise ValueError(f"{path}: not readable as JSON ({e})") from None
        if not isinstance(data, dict) or not ({"cases", "runs"} & set(data)):
            raise ValueError(f"{path}: neither measured-run format (expected a 'cases' or 'runs' list)")
        try:
            out += _mist_cases(data, path) if "cases" in data else _megatron_runs(data, path)
        except KeyError as e:
            raise ValueError(
                f"{path}: a record lacks {e} (see data/mist-artifact/measured-runs/README.md)"
            ) from None
        except (TypeError, IndexError) as e:
            raise ValueError(f"{path}: a record is malformed ({e})") from None
        except ValueError as e:  # a record's own check (MeasuredRun, the plan it rebuilds)
            raise ValueError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
    return out


def validate(runs: list[MeasuredRun]) -> list[Validation]:
    from .planner import predict

    out = []
    for run in runs:
        plan = predict(run.plan, run.model, run.cluster, grad_accumulation=run.grad_accumulation)
        memory = tuple(s.memory_bytes for s in plan.stages)
        out.append(Validation(run, plan.predicted_iteration_s, plan.simulated_iteration_s, memory))
    return out


def summary(rows: list[Validation]) -> dict[str, dict[str, float]]:
    """Per source file: mean and worst |time error|, mean |memory error| (where measured)."""
    out = {}
    for source in sorted({r.run.source for r in rows}):
        mine = [r for r in rows if r.run.source == source]
        times = [abs(r.time_error) for r in mine]
        memory = [abs(e) for r in mine for e in r.memory_errors]
        out[source] = {
            "runs": len(mine),
            "mean_abs_time_error": statistics.fmean(times),
            "max_abs_time_error": max(times),
            "mean_time_error": statistics.fmean(r.time_error for r in mine),
        }
        if memory:
            out[source]["mean_abs_memory_error"] = statistics.fmean(memory)
            out[source]["max_abs_memory_error"] = max(memory)
    return out


def report(rows: list[Validation]) -> dict:
    """Every run's prediction and errors, and the summary: ``mist validate --json``'s schema."""
    runs = [
        {
            "run": r.run.name,
            "source": r.run.source,
            "measured_s": r.run.iteration_s,
            "predicted_s": r.simulated_s,
            "time_error": r.time_error,
            "measured_stage_memory_bytes": r.run.stage_memory_bytes,
            "predicted_stage_memory_bytes": r.predicted_memory_bytes,
            "memory_errors": r.memory_errors,
            "notes": r.run.notes,
        }
        for r in rows
    ]
    return {"runs": runs, "summary": summary(rows)}


def table(rows: list[Validation]) -> str:
    head = f"{'run':<52} {'measured s':>10} {'predicted s':>11} {'error':>7}"
    lines = [f"{head}  memory per stage: measured -> predicted GiB (error)"]
    for r in rows:
        measured = r.run.stage_memory_bytes
        mem = "not measured"
        if measured is not None:
            pairs = zip(measured, r.predicted_memory_bytes, r.memory_errors, strict=True)
            mem = ", ".join(f"{m / 2**30:.1f} -> {p / 2**30:.1f} ({e:+.0%})" for m, p, e in pairs)
        row = f"{r.run.name[:52]:<52} {r.run.iteration_s:>10.2f} {r.simulated_s:>11.2f} {r.time_error:>+7.1%}"
        lines.append(f"{row}  {mem}")
    return "\n".join(lines)
