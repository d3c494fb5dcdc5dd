"""Mist from the command line.

python -m mist plan --model gpt3-7b --gpus 8 --gpu l4 --global-batch 128 [--out plan.yaml] [--explain]
python -m mist predict plan.yaml
python -m mist export plan.yaml --to megatron-lm [--data-path P --tokenizer-type T ...]
python -m mist calibrate [DATA] [--write]      (default DATA: the vendored data/mist-artifact)
python -m mist validate [RUNS]      (default RUNS: the vendored data/mist-artifact/measured-runs)
python -m mist profile-host [--write]     (the host's CPU Adam step, for optimizer offloading)
python -m mist list
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from measure.checks import device_name, machine_memory_bytes, usable_cores
from measure.cli import OneLineParser, check_writable_file, reader_gone, repeated_value
from measure.units import format_bytes

from .model.profile_data import ARTIFACT_DATA, PRESET_NAME_RULE, is_preset_name
from .model.specs import CPU_PRESET, GRAD_ACCUMULATION, TARGET_ENGINES, cluster, gpus, hosts, model, models

if TYPE_CHECKING:  # for the annotations only: each command imports what it uses when it runs
    from .model.specs import GradAccumulation
    from .plan import Plan

# ModelSpec fields `mist plan` can set over the preset: (flag, type, help)
MODEL_FIELDS = (
    ("seq", int, "sequence length (default: the preset's, 2048)"),
    ("hidden", int, "hidden size"),
    ("layers", int, "transformer layers"),
    ("heads", int, "attention heads"),
    ("kv_heads", int, "key/value heads (grouped-query attention; default: heads)"),
    ("ffn", int, "MLP hidden size (default: 4h; Llama 8h/3 rounded up to 256)"),
    ("vocab", int, "vocabulary size"),
    ("dropout", float, "hidden and attention dropout (default: 0.1; Llama 0)"),
    ("norm", str, "layernorm or rmsnorm"),
    ("positions", str, "learned or rotary"),
)
# Yes/no ModelSpec fields: --X / --no-X
MODEL_SWITCHES = (
    ("gated_mlp", "SwiGLU MLP (gate, up, down) instead of GELU (up, down)"),
    ("parallel_block", "attention and MLP in parallel on one shared norm (Falcon)"),
    ("tempo", "Tempo's layers (keep less for backward; mist.engine.run builds tempo.megatron's spec)"),
)


def _model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help=f"a preset: {', '.join(models())}")
    for name, kind, text in MODEL_FIELDS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, help=text)
    for name, text in MODEL_SWITCHES:
        ap.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction, help=text)
    ap.add_argument("--no-flash", action="store_true", help="attention without FlashAttention")


def _overrides(args) -> dict:
    """The model fields given on the command line (0 is a value, not 'unset')."""
    names = [name for name, _, _ in MODEL_FIELDS] + [name for name, _ in MODEL_SWITCHES]
    out = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.no_flash:
        out["flash"] = False
    return out


def _build_model(args):
    return model(args.model, **_overrides(args))


def _check_writable(path: Path) -> None:
    """Before the search: the plan can be written where asked (a .yaml, .yml or .json file)."""
    try:
        check_writable_file(path, (".yaml", ".yml", ".json"))
    except ValueError as e:
        raise ValueError(f"--out {e}") from None


def _engine_argument(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--engine",
        choices=list(GRAD_ACCUMULATION),
        help="the engine that runs the plan, for how it accumulates and reduces gradients and in how "
        f"many bytes, written into the plan (default: {default}; megatron-core: its 16-bit buffer, "
        "as mist.engine.run and as `mist export --to megatron-lm` runs Megatron-LM; megatron-lm: "
        "Megatron-LM's bf16 default, fp32 main grads, which the export then keeps; torchtitan: "
        "fp32 reductions)",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def host_memory_bytes(size: str | None) -> int | None:
    """``--host-mem`` in bytes: a bare number is GiB (as people give a node's DRAM), or a size with
    a unit as ``--gpu-mem`` takes ('512GiB', '768GB'); the one conversion, since the cluster and the
    plan file hold bytes; whole bytes down, as a capacity. inf, nan, 0: refused in one line."""
    if size is None:
        return None
    try:
        gib = float(size)
    except ValueError:  # a unit: the one parser of memory sizes
        from measure.budget import GpuBudget

        try:
            return GpuBudget.parse(size).capacity_bytes
        except ValueError:  # its message offers a byte count, which here would be GiB
            raise ValueError(
                f"--host-mem {size!r} not understood: use a number of GiB (e.g. 256) or a positive "
                "size with a unit (e.g. '256GiB', '768GB', '2TB')"
            ) from None
    if not math.isfinite(gib) or gib <= 0:
        raise ValueError(f"--host-mem must be a finite number of GiB above 0, got {size}")
    return int(gib * 2**30)


def gpu_memory_bytes(size: str | None) -> int | None:
    """``--gpu-mem`` ('24GiB', '40GB', '3MiB' or bytes; GB as GPUs are sold, binary) in bytes."""
    if size is None:
        return None
    from measure.budget import GpuBudget

    return GpuBudget.parse(size).capacity_bytes  # a bad size: one line saying what is accepted


def plan_engine(args: argparse.Namespace) -> str:
    """The engine ``mist plan`` prices for: ``--engine``, or its target's default; one the target
    cannot run is refused."""
    engines = TARGET_ENGINES.get(args.target, tuple(GRAD_ACCUMULATION))  # mist: any
    if args.engine is None:
        return engines[0]
    if args.engine not in engines:
        raise ValueError(
            f"--target {args.target}: it accumulates gradients as --engine {' or '.join(engines)} does"
        )
    return args.engine


def _search_target(args, m, c, accumulation: GradAccumulation, progress) -> Plan:
    """``mist plan --target megatron-lm|torchtitan``: only what that trainer runs (every plan exports),
    priced for ``accumulation`` (plan_engine's)."""
    from .tuning import megatron_lm, torchtitan
    from .tuning.planner import predict

    if args.no_imbalance:
        raise ValueError(f"--no-imbalance is an ablation of Mist's own search, not of --target {args.target}")
    if args.stage_devices:
        raise ValueError(f"--stage-devices: {args.target} runs one TP and DP for all stages (drop --target)")
    if args.target == "torchtitan":
        if args.no_offload or args.no_recompute:
            raise ValueError(
                "--target torchtitan searches its own two choices of each: drop --no-offload/--no-recompute"
            )
        plan = torchtitan.search_torchtitan(m, c, args.global_batch, progress=progress)
    else:
        megatron_lm.check_model(m)
        space = megatron_lm.MegatronLMSpace(recompute=not args.no_recompute)
        if args.no_offload:
            space = dataclasses.replace(space, offload_fractions=(0.0,))
        plan = megatron_lm.search_megatron_lm(
            m, c, args.global_batch, space, progress=progress, grad_accumulation=accumulation
        )
    tuning_s = plan.tuning_s
    predict(plan, m, c)  # the 1F1B simulation beside the closed form the search ranked by
    plan.tuning_s = tuning_s
    return plan


def cmd_plan(args) -> int:
    from measure.budget import GpuBudget

    from .model.budget import gpu_budget_bytes
    from .tuning.planner import NoFeasiblePlan, PlannerOptions, search
    from .tuning.stage_cost import SearchSpace

    m = _build_model(args)  # a bad value: main() reports it in one line
    if args.out:
        _check_writable(Path(args.out))
    host = host_memory_bytes(args.host_mem)  # bytes from here on
    device_cap = gpu_memory_bytes(args.gpu_mem)
    c = cluster(args.gpu, args.gpus, args.gpus_per_node, host_memory=host, gpu_memory=device_cap)
    if device_cap is not None and gpu_budget_bytes(c) <= 0:  # before the search, not after it
        no_unit = args.gpu_mem.strip().replace(".", "", 1).isdigit()  # bytes: say so
        raise ValueError(
            f"--gpu-mem {args.gpu_mem}: {device_cap} bytes leave nothing to plan with once the reserve "
            f"({GpuBudget(device_cap).reserve}) is taken"
            + ("; a size without a unit is bytes (e.g. 24GiB)" if no_unit else "")
        )
    space = SearchSpace(offload=not args.no_offload, recompute=not args.no_recompute)
    options = PlannerOptions(
        space=space,
        imbalance_aware=not args.no_imbalance,
        grad_accumulation=GRAD_ACCUMULATION[plan_engine(args)],
        stage_devices=args.stage_devices,
    )

    def progress(line: str) -> None:
        if not args.quiet:
            print("  " + line, file=sys.stderr, flush=True)

    try:
        if args.target != "mist":
            plan = _search_target(args, m, c, options.grad_accumulation, progress)
        else:
            plan = search(m, c, args.global_batch, options, progress=progress)
    except NoFeasiblePlan as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plan.host_memory_per_node_bytes, plan.gpu_memory_bytes = host, device_cap
    print(plan.table())
    if args.explain:
        print(explain(plan))
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    return 0


def explain(plan: Plan) -> str:
    b = plan.breakdown
    lines = [
        "why this plan:",
        f"  one layer: forward {b['layer_fwd_ms']:.1f} ms, backward {b['layer_bwd_ms']:.1f} ms, "
        f"keeps {b['layer_saved_bytes'] / 2**20:.0f} MiB for backward; "
        f"{format_bytes(b['usable_memory_bytes'])} usable per GPU",
    ]
    slowest = max(range(len(plan.stages)), key=lambda i: plan.stages[i].steady_s)
    lines.append(
        f"  stage {slowest} paces the pipeline ({plan.stages[slowest].steady_s * 1e3:.1f} ms a micro-batch); "
        f"{plan.grad_accum} micro-batches per iteration"
    )
    for i, s in enumerate(plan.stages):
        parts = []
        if s.recompute:
            parts.append(f"recomputes {s.recompute}/{s.layers} layers")
        if s.zero:
            parts.append(f"ZeRO-{s.zero}")
        for name in ("weights", "grads", "optimizer", "activations"):
            r = getattr(s, f"offload_{name}")
            if r:
                parts.append(f"offloads {r:.0%} of its {name}")
        gib = s.memory_bytes / 2**30  # shown in GiB, held in bytes
        lines.append(f"  stage {i}: {', '.join(parts) or 'no memory saving needed'} -> {gib:.1f} GiB")
    lines.append(f"  models: {b['runtime_model']}; interference: {b['interference_model']}")
    return "\n".join(lines)


def cmd_predict(args) -> int:
    from .plan import Plan
    from .tuning.planner import predict

    try:
        plan = Plan.load(args.plan)
        engine = None if args.engine is None else GRAD_ACCUMULATION[args.engine]
        predict(plan, plan.model_spec(), plan.cluster(), grad_accumulation=engine)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(prediction_json(plan), indent=1))
        return 0
    print(plan.table())
    if not plan.breakdown["fits"]:
        print("warning: a stage needs more memory than the GPU has usable", file=sys.stderr)
    print(json.dumps(plan.breakdown, indent=1))
    return 0


def cmd_export(args) -> int:
    from .export import (
        CannotExport,
        JobInputs,
        megatron_lm_command,
        nodes_and_processes,
        priced_otherwise_note,
        toml_text,
        torchtitan_config,
    )
    from .plan import Plan

    given = _other_target_options(args)
    if given:
        print(
            f"python -m mist export: error: {', '.join(given)} not taken by --to {args.to}", file=sys.stderr
        )
        return 2
    try:
        megatron = {"script": args.script, "transformer_impl": args.transformer_impl}  # None: the default
        inputs = JobInputs(
            data_path=args.data_path,
            tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            train_iters=args.train_iters,
            lr=args.lr,
            **{k: v for k, v in megatron.items() if v is not None},
        )
        plan = Plan.load(args.plan)
        if args.to == "torchtitan":
            text = toml_text(torchtitan_config(plan, plan.model_spec(), args.flavor, inputs))
        else:
            text = megatron_lm_command(plan, plan.model_spec(), inputs)
    except CannotExport as e:  # one line per part, so a user sees each thing to change
        for part in e.parts:
            print(f"python -m mist export: {e.target} cannot express: {part}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"python -m mist export: error: {e}", file=sys.stderr)
        return 2
    print(text)
    if (note := priced_otherwise_note(plan, args.to)) is not None:
        print(f"# note: {note}", file=sys.stderr)
    if args.to == "torchtitan":
        nodes, per_node = nodes_and_processes(plan)
        print(
            f"# the plan was priced for {plan.model_spec().name}: flavor {args.flavor} must be its shape; "
            f"launch: torchrun --nnodes {nodes} --nproc-per-node {per_node} -m torchtitan.train "
            "--job.config_file THIS.toml",
            file=sys.stderr,
        )
    else:
        _megatron_export_notes(plan, inputs)
    return 0


def _other_target_options(args) -> list[str]:
    """The options of the other target ``export --to`` was given (refused, not ignored)."""
    other = {
        "torchtitan": {
            "--tokenizer-type": args.tokenizer_type,
            "--script": args.script,
            "--transformer-impl": args.transformer_impl,
        },
        "megatron-lm": {"--flavor": args.flavor},
    }[args.to]
    return [flag for flag, value in other.items() if value is not None]  # '' was taken as not given


def _megatron_export_notes(plan, inputs) -> None:
    """The notes on stderr under a Megatron-LM command: its placeholders, and the vocabulary the
    plan was priced at where a tokenizer is given."""
    # only what is a placeholder: with --data-path given, the data is real (the footer said otherwise)
    placeholders = [
        *(["synthetic data (--mock-data; --data-path names real data)"] if inputs.data_path is None else []),
        *(
            ["a null tokenizer (--tokenizer-type/--tokenizer-model name a real one)"]
            if inputs.tokenizer_type is None
            else []
        ),
    ]
    if placeholders:
        print(f"# placeholders: {' and '.join(placeholders)}", file=sys.stderr)
    if inputs.tokenizer_type is not None:
        print(
            f"# the plan was priced at a vocabulary of {plan.model_spec().vocab}: a tokenizer whose padded "
            "vocabulary differs changes the embedding's and head's memory",
            file=sys.stderr,
        )


PREDICTION_FORMAT = 2  # 2: the breakdown's memory keys in bytes, the embedded plan format 2


def prediction_json(plan: Plan) -> dict:
    """``mist predict --json``: a stable document (``prediction_format`` 2). Times in seconds, memory
    in whole bytes per GPU of each stage (``host_memory_bytes``: what each of its GPUs offloads to the
    host); ``iteration_s`` is the 1F1B simulator's, ``closed_form_s`` the objective the search
    ranks by; ``fits``: every stage within the usable GPU and host memory; ``breakdown`` as in the
    text output. Fields are only ever added within a format."""
    return {
        "prediction_format": PREDICTION_FORMAT,
        "iteration_s": plan.simulated_iteration_s,
        "closed_form_s": plan.predicted_iteration_s,
        "fits": plan.breakdown["fits"],
        "usable_memory_bytes": plan.breakdown["usable_memory_bytes"],
        "usable_host_memory_bytes_per_gpu": plan.breakdown["usable_host_memory_bytes_per_gpu"],
        "stages": [
            {
                "layers": s.layers,
                "memory_bytes": s.memory_bytes,
                "host_memory_bytes": s.host_memory_bytes,
                "steady_s": s.steady_s,
                "extra_s": s.extra_s,
                "step_s": s.step_s,
                "wait_s": s.wait_s,
            }
            for s in plan.stages
        ],
        "breakdown": plan.breakdown,
        "plan": plan.to_dict(),
    }


def cmd_calibrate(args) -> int:
    from measure.results import write_json_atomic

    from .model.calibrate import calibrate
    from .model.interference import Interference, fit_interference
    from .model.profile_data import PROFILE_GPU
    from .model.runtime import PRESETS, RuntimeModel

    data = Path(args.data)
    profiles = data / "gpu-op-profiles" if (data / "gpu-op-profiles").is_dir() else data
    report = calibrate(profiles) if profiles.is_dir() else {}
    if not report:
        layouts = "the layout of data/mist-artifact, or `mist profile` output"
        print(f"error: no layer profiles under {data} ({layouts})", file=sys.stderr)
        return 2
    unknown = sorted({r["gpu"] for r in report.values()} - set(gpus()))
    if args.write and unknown:  # a preset no plan could use: `mist plan --gpu` takes gpus() only
        print(
            f"error: no GPU preset named {', '.join(unknown)} (profiles' --name); presets are written for "
            f"{', '.join(gpus())}",
            file=sys.stderr,
        )
        return 2
    bandwidth = _bandwidth_files(data)
    if args.write and (
        unmapped := [f"{p.name} ({name!r})" for p, (name, gpu) in bandwidth.items() if gpu is None]
    ):
        print(
            f"error: {', '.join(unmapped)}: measured a GPU with no preset; gpu-bandwidth files are "
            f"fitted for the GPUs named {', '.join(sorted(PROFILE_GPU))}",
            file=sys.stderr,
        )
        return 2
    written: dict[Path, dict] = {}  # preset file -> what goes in it, written once all are fitted
    for name, r in report.items():
        print(
            f"{name}: per-layer error, {r['held_out_cases']} held-out cases: "
            f"mean {r['mean_abs_error']:.1%}, median {r['median_abs_error']:.1%}, "
            f"max {r['max_abs_error']:.1%}"
            + (f"; head + loss mean {r['head_mean_abs_error']:.1%}" if "head_mean_abs_error" in r else "")
        )
        if constants := _constant_lines(r["model"]):  # priced by their time alone: said, not hidden
            print(f"{name}: did not grow with the work where measured, fitted as constants: {constants}")
        path = PRESETS / f"runtime_{r['gpu']}.json"
        if args.write and path not in written:  # the first directory per GPU type (sorted) is the preset
            written[path] = _readable_preset(
                name, r["model"].to_json(), RuntimeModel.from_json, path, r["gpu"]
            )
    for path, (_, gpu) in bandwidth.items():
        inter, rep = fit_interference(path)
        print(
            f"{path.name}: overlapped runs {rep['runs']}, error without interference "
            f"{rep['no_interference_mean_abs_error']:.1%}, fitted {rep['fitted_mean_abs_error']:.1%} "
            f"(held out: {rep['held_out_mean_abs_error']:.1%})"
        )
        preset = PRESETS / f"interference_{gpu}.json"
        if args.write and preset in written:  # the first file per GPU (sorted) is the preset, as above
            print(f"{path.name}: not written: {preset.name} is fitted to an earlier file of {gpu}")
        elif args.write:
            written[preset] = _readable_preset(path.name, inter.to_json(), Interference.from_json, preset)
    if args.write:
        for path, d in written.items():  # each whole or not at all: a kill never leaves half a preset
            write_json_atomic(path, d)
        print(f"presets written to {PRESETS}")
    return 0


def _bandwidth_files(data: Path) -> dict[Path, tuple[str, str | None]]:
    """Each gpu-bandwidth file under ``data`` (sorted) with the GPU it names inside and that GPU's
    preset name (PROFILE_GPU; None where it has none)."""
    from .model.interference import bandwidth_file_gpu
    from .model.profile_data import PROFILE_GPU

    named = {path: bandwidth_file_gpu(path) for path in sorted(data.glob("gpu-bandwidth/*.json"))}
    return {path: (name, PROFILE_GPU.get(name)) for path, name in named.items()}


def _constant_lines(model) -> str:
    """The curves and collectives of a fitted runtime model that are constants (``Line``), a TP
    size's own curves (a CPU's: ``RuntimeModel.tp_curves``) named with their size."""
    sets = [("", model.curves)] + [(f"TP {tp} ", curves) for tp, curves in sorted(model.tp_curves.items())]
    curves = [
        f"{size}{cls} {direction}"
        for size, of_size in sets
        for cls, lines in of_size.items()
        for direction, line in zip(("forward", "backward"), lines, strict=True)
        if line.rate is None
    ]
    collectives = [f"{kind} over {n}" for (kind, n), line in model.collectives.items() if line.rate is None]
    return ", ".join(curves + collectives)


def _readable_preset(fitted: str, d: dict, reader, path: Path, *args) -> dict:
    """``d``, a preset fitted to ``fitted``, once its reader takes it: a preset is written only if
    the planner can read it back (e.g. a fit without one of the layer's curves is not)."""
    try:
        reader(d, path, *args)
    except ValueError as e:
        raise ValueError(
            f"{fitted}: the fit is not a preset the planner reads; nothing written ({e})"
        ) from None
    return d


PROFILE_FILES = ("profile.json", "*.csv", "collectives*.json", "zero*.json", "tp*.json")


def _claim_profile_folder(out: Path, replace: bool) -> TextIO:
    """Before any measurement: ``out`` can be a profile folder (a folder, or a new one in a folder
    that exists and is writable), no other `mist profile` is writing it (its lock, held until the
    returned file is closed: two runs on one folder would delete each other's files and leave a
    mix of both), and it holds no profile already unless ``replace`` (then its profile's files go
    first: a new profile mixed with an old one would be fitted as one)."""
    from measure.results import RunLockedError, lock_folder, unlock_folder

    from .model.profile_data import profile_meta

    try:
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out}: a file; a profile is written into a folder")
        parent = out if out.exists() else out.parent
        if not parent.is_dir():
            raise ValueError(f"--out {out}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise ValueError(f"--out {out}: not writable")
        out.mkdir(exist_ok=True)
    except OSError as e:  # a name too long, /sys or /proc (os.access says yes to root there)
        raise ValueError(f"--out {out}: cannot hold a profile ({e.strerror or e})") from None
    try:
        lock = lock_folder(
            out,
            f"--out {out}: another `mist profile` is writing to it (refused even with --replace); "
            "wait for it to end, or choose another folder",
        )
    except RunLockedError as e:
        raise ValueError(str(e)) from None
    try:
        old = sorted({f for pattern in PROFILE_FILES for f in out.glob(pattern)})
        if old and not replace:
            try:
                what = "an incomplete profile" if not profile_meta(out).get("complete", True) else "a profile"
            except ValueError:  # a profile.json it cannot read: a profile still, of unknown state
                what = "a profile"
            raise ValueError(
                f"--out {out}: holds {what} already ({len(old)} files); choose another folder, or pass "
                "--replace to remove them first"
            )
        for f in old:
            f.unlink()
    except BaseException:
        unlock_folder(lock)
        raise
    return lock


def _check_profile_fits(args) -> None:
    """Refuse a layer too big for the device before profiling it (it would fail in the allocator,
    after the folder is claimed): a lower bound on what the profile holds at once, the layer's
    weights and gradients (12 h^2 parameters each) and the 16-bit activations megatron-core's layer
    keeps for backward at the largest micro-batch, 32sbh + 4as^2b bytes (Korthikanti et al. 2022,
    their 34sbh + 5as^2b less the one-byte dropout masks), in the profile's dtype; all of it divided
    by the smallest --tp, since the profile times one rank's share (their per-rank activations,
    sbh(10 + 24/t) + 5as^2b/t, are at least the whole's divided by t)."""
    import torch

    from measure.training import DTYPES

    elem, t = DTYPES[args.dtype].itemsize, min(args.tp)
    h, a, s, b = args.hidden, args.heads, args.seq, max(args.micro_batches)
    need = (2 * 12 * h * h * elem + (32 * s * b * h + 4 * a * s * s * b) * elem // 2) // t
    if args.device.startswith("cuda"):
        device = torch.device(args.device)
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"--device {args.device}: this machine has {torch.cuda.device_count()} GPU(s)")
        have, where = torch.cuda.get_device_properties(device).total_memory, "GPU"
    else:
        have, where = machine_memory_bytes(), "machine"
    if need > have:
        raise ValueError(
            f"--hidden {h} --heads {a} --seq {s} --micro-batches {b} --tp {t} ({args.dtype}): the layer "
            f"alone needs at least {format_bytes(need)} a rank (weights, gradients, activations), more "
            f"than this {where}'s {format_bytes(have)}"
        )


def _check_collectives(counts: list[int], device: str) -> None:
    """Process counts the collective benchmarks can run here: at least 2, at most this machine's
    cores (on a CPU, 2 even on one; more oversubscribe them and the benchmark measures the
    scheduler) or GPUs."""
    import torch

    have = torch.cuda.device_count() if device.startswith("cuda") else max(usable_cores(), 2)
    for n in counts:
        if not 2 <= n <= have:
            what = "GPUs" if device.startswith("cuda") else "cores"
            raise ValueError(
                f"--collectives {n}: a count of processes from 2 to the {what} here ({have}; more would "
                "share them and time the scheduler)"
            )


def cmd_profile(args) -> int:
    import torch

    from measure.results import unlock_folder
    from measure.training import DTYPES

    if not device_name(args.device):
        raise ValueError(f"--device {args.device}: the profiler runs on cpu or cuda[:N]")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {args.device}: no CUDA device here", file=sys.stderr)
        return 2
    sizes = {"hidden": args.hidden, "heads": args.heads, "seq": args.seq, "repeats": args.repeats}
    bad = (
        [f"--{k} {v}" for k, v in sizes.items() if v < 1]
        + [f"--micro-batches {v}" for v in args.micro_batches if v < 1]
        + [f"--tp {v}" for v in args.tp if v < 1]
    )
    if bad:
        raise ValueError(f"{', '.join(bad)}: must be >= 1")
    for flag, values in (
        ("--micro-batches", args.micro_batches),
        ("--tp", args.tp),
        ("--collectives", args.collectives),
    ):
        if (problem := repeated_value(flag, values)) is not None:
            raise ValueError(problem)
    _check_collectives(args.collectives, args.device)
    if not is_preset_name(args.name):
        raise ValueError(f"--name {args.name!r}: {PRESET_NAME_RULE}")
    # the preset decides how the profile is fitted and its plans run: a CPU's, or a GPU's
    if args.device == "cpu" and args.name != CPU_PRESET:
        raise ValueError(f"--name {args.name!r} with --device cpu: a CPU's profile is --name {CPU_PRESET}")
    if args.device != "cpu" and args.name == CPU_PRESET:
        raise ValueError(
            f"--name {CPU_PRESET} with --device {args.device}: a GPU's profile takes its GPU's preset name"
        )
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    _check_profile_fits(args)
    for tp in args.tp:
        if args.heads % tp:
            raise ValueError(f"--tp {tp} must divide --heads {args.heads}")
        if args.vocab is not None and args.vocab % tp:
            raise ValueError(f"--tp {tp} must divide --vocab {args.vocab}")
    dtype = DTYPES[args.dtype]
    out = Path(args.out)
    lock = _claim_profile_folder(out, args.replace)  # last: with --replace it removes the old profile
    try:
        files = _measure_profile(args, out, dtype)
    except KeyboardInterrupt:  # what was written is a part of the profile: say so, and how to redo it
        print(
            f"python -m mist profile: interrupted; {out} holds an incomplete profile, which `mist calibrate` "
            "refuses: redo it by rerunning this command with --replace",
            file=sys.stderr,
        )
        return 130
    finally:
        unlock_folder(lock)
    print(f"{len(files)} profiles in {out}; fit them with: python -m mist calibrate {out}")
    return 0


def _measure_profile(args, out: Path, dtype) -> list[Path]:
    """`mist profile`'s measurements into ``out`` (claimed by ``_claim_profile_folder``): the layer,
    then the benchmarks asked for; marked complete last. Returns the layer profiles written."""
    from .engine.profiler import write_profiles, write_rank_benchmarks
    from .model.profile_data import mark_profile_complete

    def say(line: str) -> None:
        print("  " + line, flush=True)

    files = write_profiles(
        out,
        args.device,
        args.hidden,
        args.heads,
        args.seq,
        args.micro_batches,
        args.tp,
        dtype,
        args.name,
        args.repeats,
        progress=say,
        vocab=args.vocab,
        rounds=args.rounds,
        tempo=args.tempo,
        complete=False,  # the benchmarks below are a part of it
    )
    shape = (args.hidden, args.heads, args.seq, args.micro_batches, dtype)
    for n in args.collectives:
        write_rank_benchmarks(
            out, n, args.device, *shape, min(args.micro_batches), repeats=args.repeats, progress=say
        )
    mark_profile_complete(out)
    return files


def cmd_profile_host(args) -> int:
    import os

    from measure.results import write_json_atomic

    from .engine.profiler import profile_cpu_adam
    from .model.runtime import PRESETS, cpu_adam_preset

    threads = tuple(range(1, (os.cpu_count() or 1) + 1))[: args.max_threads]
    need = 16 * args.params  # fp32 weights, gradients and AdamW's two moments
    if need > machine_memory_bytes():
        raise ValueError(
            f"--params {args.params}: AdamW's state for them takes {format_bytes(need)}, more than this "
            f"machine's {format_bytes(machine_memory_bytes())} of memory"
        )
    d = profile_cpu_adam(args.params, threads, args.repeats)
    for n, rate in zip(d["threads"], d["params_per_s"], strict=True):
        moved = rate * d["bytes_moved_per_param"] / 1e9
        print(f"{n} thread(s): {rate:.3g} parameters/s ({moved:.1f} GB/s moved)")
    if args.write:
        path = PRESETS / "host_cpu_adam.json"
        write_json_atomic(path, _readable_preset("the host step measured", d, cpu_adam_preset, path))
        print(f"written to {path}")
    return 0


def cmd_validate(args) -> int:
    from .tuning.validate import MEASURED_RUNS, load_measured_runs, report, summary, table, validate

    try:
        rows = validate(load_measured_runs(args.runs or MEASURED_RUNS))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report(rows), indent=1))
        return 0
    print(table(rows))
    for source, r in summary(rows).items():
        memory = ""
        if "mean_abs_memory_error" in r:
            worst = r["max_abs_memory_error"]
            memory = f", memory mean |error| {r['mean_abs_memory_error']:.1%} (worst {worst:.1%})"
        print(
            f"{source}: {r['runs']} runs, time mean |error| {r['mean_abs_time_error']:.1%} "
            f"(worst {r['max_abs_time_error']:.1%}, mean signed {r['mean_time_error']:+.1%}){memory}"
        )
    return 0


def cmd_list(_args) -> int:
    print("models:", ", ".join(models()))
    print("GPUs:  ", ", ".join(gpus()))
    print("hosts (per node of that GPU type; --host-mem overrides the memory):")
    for gpu, h in hosts().items():
        dram = f"{h.memory / 2**30:.0f} GiB, {h.cores} cores, {h.mem_bw / 1e9:.0f} GB/s DRAM"
        print(f"  {gpu}: {h.name}, {dram}")
    return 0


def _plan_parser(sub) -> None:
    """``mist plan``: the model, the cluster and the search."""
    p = sub.add_parser("plan", help="find the fastest plan")
    _model_args(p)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", required=True, help=f"one of: {', '.join(gpus())}")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--host-mem",
        metavar="SIZE",
        help="DRAM per node, in GiB (e.g. 256) or with a unit (e.g. 256GiB); offloading may use 90%% "
        "(default: the GPU type's usual host, `mist list`)",
    )
    p.add_argument(
        "--gpu-mem",
        metavar="SIZE",
        help="memory each device may use, e.g. 24GiB or, for cpu, 3MiB (a number without a unit is "
        "bytes; default: its data sheet's); written into the plan, mist.engine.run enforces it",
    )
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--out", help="write the plan (.yaml or .json)")
    p.add_argument("--explain", action="store_true", help="say why the plan wins")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--target",
        choices=["mist", "megatron-lm", "torchtitan"],
        default="mist",
        help="mist: Mist's whole search (runs on mist.engine.run); megatron-lm: only plans Megatron-LM "
        "runs (one recompute block and optimizer offload fraction for all stages, ZeRO 0/1, even middle "
        "stages); torchtitan: only plans torchtitan runs (FSDP2 or DDP, recompute none or all, FSDP's "
        "CPU offload); each exportable with `mist export --to TARGET`",
    )
    p.add_argument("--no-offload", action="store_true", help="search without CPU offloading")
    p.add_argument("--no-recompute", action="store_true", help="search without activation recomputation")
    _engine_argument(p, "megatron-core; torchtitan for --target torchtitan")
    p.add_argument(
        "--no-imbalance", action="store_true", help="ignore first/last micro-batch extras (ablation)"
    )
    p.add_argument(
        "--stage-devices",
        action="store_true",
        help="also search stages with their own device count and (TP, DP), as Mist's paper does (only "
        "mist.engine.run runs such plans; the search takes 2-7x longer on 4-8 GPUs, over 40x on 32)",
    )
    p.set_defaults(fn=cmd_plan)


def _export_parser(sub) -> None:
    """``mist export``: the target and what a launch needs that the plan does not decide."""
    p = sub.add_parser("export", help="a plan as Megatron-LM's command line or torchtitan's job config")
    p.add_argument("plan")
    p.add_argument(
        "--to",
        required=True,
        choices=["megatron-lm", "torchtitan"],
        help="megatron-lm: a shell command; torchtitan: a job config (TOML, torchtitan 0.2.2)",
    )
    p.add_argument("--flavor", help="torchtitan: the registered llama3 flavor of the plan's shape (e.g. 8B)")
    p.add_argument(
        "--data-path",
        help="Megatron-LM's --data-path (default: --mock-data, synthetic); torchtitan's dataset_path",
    )
    p.add_argument(
        "--tokenizer-type", help="e.g. GPT2BPETokenizer (default: a NullTokenizer of the priced vocab)"
    )
    p.add_argument("--tokenizer-model", help="the tokenizer's model file (torchtitan: model.hf_assets_path)")
    p.add_argument("--train-iters", type=_positive, default=100, help="placeholder (default 100)")
    p.add_argument("--lr", type=float, default=1e-4, help="placeholder (default 1e-4)")
    p.add_argument("--script", help="Megatron-LM's training script (default: pretrain_gpt.py)")
    p.add_argument(
        "--transformer-impl",
        choices=["transformer_engine", "local"],
        help="Transformer Engine's layers (default; FlashAttention), or megatron-core's own "
        "(as mist.engine.run builds them)",
    )
    p.set_defaults(fn=cmd_export)


def _profile_parser(sub) -> None:
    """``mist profile``: the layer to profile on this machine, and the benchmarks beside it."""
    p = sub.add_parser("profile", help="measure a GPT-3-style layer op by op on this machine")
    p.add_argument("--out", required=True, help="profile directory to write")
    p.add_argument(
        "--replace",
        action="store_true",
        help="remove the profile in --out first (else such a folder is refused)",
    )
    p.add_argument(
        "--name",
        required=True,
        help="the GPU preset these profiles calibrate (e.g. l4, cpu): letters, digits, .-_",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp16", "bf16", "fp32"])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tp", type=int, nargs="+", default=[1])
    p.add_argument(
        "--vocab",
        type=_positive,
        help="also profile megatron-core's embedding, final norm and head + loss at this vocabulary "
        "(what the embedding and loss curves are fitted to)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--tempo",
        action="store_true",
        help="also time the layer with Tempo's ops (tempo.megatron), and a Llama layer of the same size "
        "with and without them: each excess over the plain layer is what a Tempo layer of that kind "
        "adds to its time in `mist plan --tempo` with the fitted model, and the plain Llama layer's "
        "excess over its ops' price what every Llama layer adds",
    )
    p.add_argument(
        "--rounds",
        type=_positive,
        default=1,
        help="passes over every (TP, micro-batch) point, each point's times the median over them (on a "
        "shared CPU, whose speed drifts over seconds: 3)",
    )
    p.add_argument(
        "--collectives",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="also benchmark all-reduce/all-gather/reduce-scatter among N local processes, and ZeRO-2, "
        "ZeRO-3 and TP on the layer as mist.engine.run runs them (TP: where the heads split N ways "
        "and --micro-batches has two or more)",
    )
    p.set_defaults(fn=cmd_profile)


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="python -m mist", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    p = sub.add_parser("predict", help="predict a plan's iteration time and memory")
    p.add_argument("plan")
    p.add_argument("--json", action="store_true", help="one JSON document (prediction_format 2)")
    _engine_argument(p, "the engine the plan was priced for; megatron-core for a plan not priced yet")
    p.set_defaults(fn=cmd_predict)
    _export_parser(sub)
    p = sub.add_parser("calibrate", help="refit the runtime and interference presets from measured data")
    p.add_argument(
        "data",
        nargs="?",
        default=str(ARTIFACT_DATA),
        help="a directory laid out like data/mist-artifact (default: that vendored copy)",
    )
    p.add_argument(
        "--write", action="store_true", help="write the presets shipped in impl/mist/model/presets/"
    )
    p.set_defaults(fn=cmd_calibrate)
    _profile_parser(sub)
    p = sub.add_parser("profile-host", help="measure this host's CPU Adam step (what offloading prices)")
    p.add_argument("--params", type=_positive, default=1 << 24, help="parameters stepped (default 2^24)")
    p.add_argument("--repeats", type=_positive, default=5)
    p.add_argument("--max-threads", type=_positive, default=4, help="thread counts 1..this (and <= cores)")
    p.add_argument("--write", action="store_true", help="write impl/mist/model/presets/host_cpu_adam.json")
    p.set_defaults(fn=cmd_profile_host)
    p = sub.add_parser("validate", help="predict measured end-to-end runs and report the errors")
    p.add_argument(
        "runs",
        nargs="?",
        default=None,
        help="a folder of measured runs (default: data/mist-artifact/measured-runs)",
    )
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(fn=cmd_validate)
    p = sub.add_parser("list", help="list the model and GPU presets")
    p.set_defaults(fn=cmd_list)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        parser = _parser()  # its help lists the presets: a broken preset file is one line here
    except ValueError as e:
        print(f"python -m mist: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:  # bad input: one line, no traceback
        print(f"python -m mist {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped early (``| head``): end quietly, as a shell tool does
        return reader_gone()
    except KeyboardInterrupt:
        from measure.parallel import interrupt_handled

        interrupt_handled()
        print(f"python -m mist {args.command}: interrupted (what was already written stays)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from measure.parallel import sigterm_as_interrupt

    sigterm_as_interrupt()  # `kill` ends a search as Ctrl-C does: one line, status 130
    sys.exit(main())
