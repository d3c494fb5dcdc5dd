"""The GPU check, each call at most 9 minutes: ``python3 -m artifacts.gpu_check``.

Parts, in priority order; each runs as its own process group with its own time budget (seconds
on the GPU, in the dry run) and is killed at it, or when this process dies. A session lent a GPU
has 15 minutes of device time, the machine's start and the transfers included (about 11 minutes of
calls), so not every part fits one session (1050 s of budgets): the open issues' parts come first
(#24's kernels, mist and mist_measured, #27's compile). A first call runs kernels and mist and
gives mist_measured the rest (it fits the profile mist kept, and resumes case by case); a second
call on the still-warm machine (``--parts mist_measured compile tempo cta llama``: a part that
failed is not run again) finishes it and goes on with compile; the GPU claims the CPU cannot
measure (tempo, cta, llama) mostly fall to a later session:

  kernels  90 / 120  the GPU tests and micro-benchmarks: tests/test_gpu.py, the OOM detector, Tempo's
                     kernels and op benchmarks (pytest-benchmark JSON), CTA-pipelining's kernels with
                     the concurrent chain and its negative control (the dry run leaves those
                     multi-process tests to the suite), Mist's offloading on its copy stream
  mist    135 / 150  artifacts.mist_vs_megatron.engine: `mist profile` on the device, then
                     single-GPU plans trained by megatron-core, measured against the prediction
  mist_measured      artifacts.mist_vs_megatron.measured: Mist, the Megatron-LM grid, the Aceso-style
          360 / 150  search and ZeRO-3 plan GPT-3 1.3B and 2.7B for one GPU under a memory cap (32 and
                     64 GiB), every winner trained by megatron-core and measured; resumes case by case,
                     the device's profile made once for it and mist, its launches kept (--keep under --out)
  compile 150 /  90  artifacts.tempo_layer.run --compile-only --device cuda: the BERT-Large layer (seq
                     512, bf16) eager, compiled, compiled at Tempo's bytes, Tempo and Tempo compiled:
                     bytes kept and a training step's time each (issue #27's time at equal bytes)
  tempo   165 /  90  artifacts.tempo_bert.run throughput: BERT-Large/512, RoBERTa-large/512 and GPT-2
                     medium/1024 under an emulated 16 GB, HF eager/SDPA vs Tempo(+SDPA), each at its
                     measured max batch
  cta     120 /  90  artifacts.cta_mlp.run --parts kernels gpu: the kernels at GPU sizes, the
                     single-GPU emulation, throughput vs cuBLAS, the simulator's measured parameters
  llama    30 /  30  artifacts.tempo_llama.run --parts peers: Liger-Kernel's RMSNorm, SwiGLU and rotary
                     on a Llama decoder layer (Triton only: the one row tempo_llama cannot measure on
                     a CPU; the dry run says why it did not run)

It runs as it is on the lent GPU machine (python3 with torch, no nox, no network): the repo's
packages are put on the path (impl/ and the root, here and in every subprocess), and the wheels in
``.whl/`` (``nox -s gpu_wheels`` fetches them here) of packages not installed are
installed into a temporary folder first, which the subprocesses also get on their path.

Writes into ``--out`` (default artifacts/gpu_check/results/, git-ignored): ``status.json``, each
part's outcome (passed, failed, timed_out, interrupted, not_run), seconds, time budget, command and
the provenance (device, driver, package versions, commit, date), and ``logs/<part>.log``. The
parts write their results where their experiments keep them (artifacts/<experiment>/results/,
which ``nox -s claims`` reads). A second call does the parts not yet passed (``--redo``: all
again); each experiment itself resumes an interrupted run point by point (where the commit is
known). ``--archive FILE.tar.gz`` packs all of it after every part (to bring it back).
``--dry-run``: the same on CPU at tiny sizes (CUDA hidden), results under
``--out`` (default: a new temp dir each call, kept; an interrupted dry run names it: that folder as
``--out`` resumes it).

Exit status: 0 every selected part passed, 1 one did not, 2 bad input (one line, before any work),
130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import json
import math
import os
import platform
import re
import reprlib
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
IMPL = ROOT / "impl"
for _path in (IMPL, ROOT):  # the repo's packages, without installing it
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from artifacts import gpu_wheels  # noqa: E402
from artifacts.experiment import Experiment  # noqa: E402
from measure.checks import finite, whole  # noqa: E402
from measure.cli import OneLineParser  # noqa: E402
from measure.parallel import die_with_parent, interrupt_handled, sigterm_as_interrupt  # noqa: E402
from measure.results import (  # noqa: E402
    SOURCE_COMMIT_ENV,
    RunLockedError,
    atomic_path,
    git_state,
    lock_folder,
    tracked_files,
    utc_now,
    write_json_atomic,
)
from measure.strict import read_json_file  # noqa: E402

DEFAULT_OUT = ROOT / "artifacts" / "gpu_check" / "results"
STATUS = "status.json"
FORMAT = 1
DEFAULT_BUDGET_S = 540.0
# The most --budget-s takes: a GPU call fits the lent machine's 10-minute command with a minute for
# the transfers (the "at most 9 minutes" above); the dry run, on a machine of one's own, an hour
MAX_BUDGET_S = {"cuda": DEFAULT_BUDGET_S, "dry-run": 3600.0}
KILL_GRACE_S = 10.0  # SIGTERM, then this long to unwind (results stay resumable), then SIGKILL
MIN_PART_S = 5.0  # a part given less than this is not started (not_run: the next call does it)
SETUP_TIMEOUT_S = 180.0  # installing the wheels; the probe
PIP = (sys.executable, "-m", "pip")  # the installer (a test puts a slow one in its place)
DONE = "passed"

TEST_FILES = (
    "tests/test_gpu.py",
    "tests/measure/test_oom.py",
    "tests/tempo/test_kernels.py",
    "tests/tempo/test_bench_ops.py",
    "tests/ctapipe/test_ctapipe_kernels.py",
    "tests/mist/test_mist_offload_mechanisms.py",  # offload.py's copy stream (seconds)
    "tests/mist/test_mist_flat_host_grads.py",  # host gradients' DP sum through the GPU
)
# The dry run tests the command (pytest-benchmark's JSON, the JUnit report), not the kernels: the
# suite runs every file above; here the GPU tests (skipped on a CPU) and the benchmarks only
DRY_TEST_FILES = ("tests/test_gpu.py", "tests/tempo/test_bench_ops.py")
# The GPU part of tempo_bert that fits the time: three models on an emulated 16 GB GPU.
GPU_THROUGHPUT = (
    "--parts",
    "throughput",
    "--scale",
    "paper",
    "--cases",
    "bert-large/512",
    "roberta-large/512",
    "gpt2-medium/1024",
    "--configs",
    "hf-eager",
    "hf-sdpa",
    "tempo",
    "tempo+sdpa",
)
DRY_THROUGHPUT = (
    "--parts",
    "throughput",
    "--cases",
    "bert-mini/32",
    "--configs",
    "hf-eager",
    "tempo",
    "--gpu-mem",
    "48MiB",
)
# The packages the parts import, checked before any part runs (a missing one: fetch its wheel).
IMPORTS = (
    "torch",
    "triton",
    "transformers",
    "numpy",
    "scipy",
    "sympy",
    "yaml",
    "tqdm",
    "megatron.core",
    "highspy",
    "pytest",
    "pytest_benchmark",
    "hypothesis",
)


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: float  # on the GPU
    dry_budget_s: float  # in the dry run (2 CPU cores)
    experiment: str  # where its results go

    def budget(self, dry: bool) -> float:
        return self.dry_budget_s if dry else self.budget_s


# The open issues' parts first (#24, #27), then the GPU claims of closed ones: a session's device
# time holds about 690 s of these 1050 (the module's docstring)
PARTS = (
    Part("kernels", 90, 120, "tempo_layer"),
    Part("mist", 135, 150, "mist_vs_megatron"),
    Part("mist_measured", 360, 150, "mist_vs_megatron"),
    Part("compile", 150, 90, "tempo_layer"),
    Part("tempo", 165, 90, "tempo_bert"),
    Part("cta", 120, 90, "cta_mlp"),
    Part("llama", 30, 30, "tempo_llama"),
)
BY_NAME = {p.name: p for p in PARTS}


def results_dir(part: Part, out: Path, dry: bool) -> Path:
    """Where ``part`` writes: under --out in the dry run, else its experiment's results folder."""
    return out / part.experiment if dry else Experiment(part.experiment).results_dir


def benchmarks_dir(part: Part, out: Path, dry: bool) -> Path:
    """Where the kernels part's pytest-benchmark JSON goes: its format is not a result file's, so
    in a subfolder of its own."""
    return results_dir(part, out, dry) / "pytest-benchmark"


def kernels_junit(out: Path) -> Path:
    """The kernels part's JUnit report (its test counts)."""
    return out / "logs" / "kernels.xml"


def command(part: Part, out: Path, dry: bool) -> list[str]:
    """The part's command line (this interpreter)."""
    results = results_dir(part, out, dry)
    device = "cpu" if dry else "cuda"
    if part.name == "kernels":
        # not the slow tests: each runs on the CPU (the chain's processes under Triton's
        # interpreter, the throughput path at a toy size), as CI's suite does
        quick = (
            ["--benchmark-min-rounds=1", "--benchmark-max-time=0", "--benchmark-warmup=off"] if dry else []
        )
        files = DRY_TEST_FILES if dry else TEST_FILES
        return [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *files,
            "--benchmark-enable",
            f"--benchmark-json={benchmarks_dir(part, out, dry) / 'gpu.json'}",
            *quick,
            "-m",
            "not slow",
            f"--junitxml={kernels_junit(out)}",
        ]
    if part.name == "tempo":
        throughput = DRY_THROUGHPUT if dry else GPU_THROUGHPUT
        return [
            sys.executable,
            "-m",
            "artifacts.tempo_bert.run",
            *throughput,
            "--device",
            device,
            "--results",
            str(results),
        ]
    if part.name == "cta":
        dry_flag = ["--gpu-dry-run"] if dry else []
        return [
            sys.executable,
            "-m",
            "artifacts.cta_mlp.run",
            "--parts",
            "kernels",
            "gpu",
            "--device",
            device,
            *dry_flag,
            "--results",
            str(results),
        ]
    if part.name == "compile":
        seq = "32" if dry else "512"
        return [
            sys.executable,
            "-m",
            "artifacts.tempo_layer.run",
            "--compile-only",
            "--device",
            device,
            "--seq",
            seq,
            "--results",
            str(results),
        ]
    if part.name == "llama":
        peers = ["--parts", "peers", "--results", str(results)]
        return [sys.executable, "-m", "artifacts.tempo_llama.run", *peers]
    assert part.name in ("mist", "mist_measured"), part
    dry_flag = ["--cpu-dry-run"] if dry else []
    module = {"mist": "engine", "mist_measured": "measured"}[part.name]
    script = f"artifacts.mist_vs_megatron.{module}"
    # kept under --out: one profile of the device for both Mist parts (and a second call), and the
    # measured part's finished launches, so that a case its time budget cut resumes launch by launch
    keep = ["--keep", str(out / "kept")]
    return [sys.executable, "-m", script, *dry_flag, "--results", str(results), *keep]


# ---------------------------------------------------------------- processes


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's process group, KILL_GRACE_S to unwind, then SIGKILL to whatever is
    left of it (also when the leader has already exited)."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        if wait_s is not None and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)
    proc.wait(timeout=60)  # SIGKILLed: bounded in practice, bounded here in any case


def _start_logged(
    cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None
) -> subprocess.Popen:
    """``cmd`` started in a process group of its own (``_kill_group`` stops all of it) that dies with
    this process, no input, its output (both streams) into ``log``."""
    with open(log, "wb") as sink:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )


def run_bounded(
    cmd: list[str], env: dict[str, str], timeout_s: float, log: Path, echo: bool
) -> tuple[str, int]:
    """Run ``cmd`` in a process group of its own that dies with this process; output to ``log``
    (and, with ``echo``, to stdout as it comes). Returns (outcome, return code); killed at
    ``timeout_s`` ("timed_out"); an interruption kills it and is raised."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = _start_logged(cmd, env, log, cwd=ROOT)
    try:
        with open(log, "rb") as source:
            while True:
                try:
                    proc.wait(timeout=0.5)
                    finished = True
                except subprocess.TimeoutExpired:
                    finished = False
                if echo:
                    while chunk := source.read(1 << 16):
                        sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                if finished:
                    _kill_group(proc)  # nothing it started outlives it
                    return (DONE if proc.returncode == 0 else "failed"), proc.returncode
                if time.monotonic() - start > timeout_s:
                    _kill_group(proc)
                    return "timed_out", proc.returncode
    except BaseException:
        _kill_group(proc)
        raise


# ---------------------------------------------------------------- setup


def install_wheels(folder: Path, deadline: float) -> tuple[str | None, list[str]]:
    """Install the wheels in ``folder`` of distributions not installed at that version into a
    temporary folder; returns (that folder or None, the wheels installed)."""
    todo = []
    for wheel in gpu_wheels.wheels_in(folder):
        name, version = gpu_wheels.wheel_dist(wheel)
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != version:
            todo.append(wheel)
    if not todo:
        return None, []
    target = Path(tempfile.mkdtemp(prefix="gpu_check_site_"))
    try:  # any way out but success (pip failed, the time limit, SIGINT/SIGTERM): it goes
        _pip_install(target, todo, folder, deadline)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return str(target), [w.name for w in todo]


def _pip_install(target: Path, wheels: list[Path], folder: Path, deadline: float) -> None:
    """pip into ``target``, in a process group of its own that is killed at the time limit or an
    interruption. Its TMPDIR and log are ``target/.pip``, removed after it: what a killed pip
    leaves there goes with ``target``."""
    scratch = target / ".pip"
    scratch.mkdir()
    cmd = [
        *PIP,
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--target",
        str(target),
        *map(str, wheels),
    ]
    left = deadline - time.monotonic()
    timeout = max(1.0, min(SETUP_TIMEOUT_S, left))
    log = scratch / "pip.log"
    proc = _start_logged(cmd, {**os.environ, "TMPDIR": str(scratch)}, log)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        limit = "what --budget-s left for it" if left < SETUP_TIMEOUT_S else "the setup's limit"
        raise SetupError(
            f"installing {len(wheels)} wheel(s) from {folder} took over {timeout:.0f} s ({limit}); "
            f"give a larger --budget-s, or install them beforehand (pip install {folder}/*.whl)"
        ) from None
    finally:
        _kill_group(proc)  # nothing it started outlives it (a no-op where all of it has exited)
    if proc.returncode:
        lines = log.read_text(errors="replace").strip().splitlines()
        raise SetupError(f"installing the wheels in {folder} failed: {(lines or ['no output'])[-1]}")
    shutil.rmtree(scratch)


class SetupError(RuntimeError):
    """The machine cannot run the check (no CUDA, a package missing): one line, before any part."""


PROBE = """
import importlib, json, sys
missing = {}
for name in sys.argv[1].split(","):
    try:
        importlib.import_module(name)
    except Exception as e:
        missing[name] = f"{type(e).__name__}: {e}"
import torch
from measure.results import device_description, package_versions
device = "cuda" if torch.cuda.is_available() else "cpu"
described = device_description(device)
if device == "cuda":
    props = torch.cuda.get_device_properties(0)
    described.update(sms=props.multi_processor_count, capability=list(torch.cuda.get_device_capability(0)))
print(json.dumps({"missing": missing, "device": described, "packages": package_versions()}))
"""


def probe(env: dict[str, str], deadline: float) -> dict[str, Any]:
    """What the parts will see: the device, the package versions, any package they import that is
    missing (in a subprocess: this process loads no torch)."""
    timeout = max(1.0, min(SETUP_TIMEOUT_S, deadline - time.monotonic()))
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, ",".join(IMPORTS)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
    except subprocess.TimeoutExpired:
        raise SetupError(f"probing the machine (import torch) took over {timeout:.0f} s") from None
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SetupError(f"probing the machine failed: {last}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        found["device"]["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        found["device"]["driver"] = None
    return found


# ---------------------------------------------------------------- status and archive


# what a part's record may say (run_bounded's outcomes, and a part started or skipped)
OUTCOMES = ("passed", "failed", "timed_out", "interrupted", "running", "not_run")


def _record_problem(record: dict[str, Any]) -> str | None:
    """What is wrong with the times and the return code of a part's record (None: nothing). A part
    that ran has its seconds (finite, >= 0) and the timeout it ran under (finite, > 0): the summary
    printed "nan s of 30 s" and "-5.0 s of -1 s" from a status that said so."""
    seconds, timeout = record.get("seconds"), record.get("timeout_s")
    if seconds is not None and not (finite(seconds) and seconds >= 0):
        return f"seconds must be a finite number >= 0 (or null: not run), got {reprlib.repr(seconds)}"
    if seconds is not None and not (finite(timeout) and timeout > 0):
        return f"timeout_s must be a finite number > 0 for a part that ran, got {reprlib.repr(timeout)}"
    finished = record.get("finished_utc")
    if finished is not None:
        try:
            _dt.datetime.fromisoformat(finished)
        except (TypeError, ValueError):
            return f"finished_utc must be an ISO date and time (or null), got {reprlib.repr(finished)}"
    if record.get("returncode") is not None and not whole(record["returncode"]):
        return f"returncode must be an integer (or null: none), got {reprlib.repr(record['returncode'])}"
    return None


def read_status(path: Path, mode: str) -> dict[str, Any]:
    """The status of earlier calls in this folder; a fresh one if none or from the other mode.
    Read strictly: one line naming the file and what is wrong, before any part runs."""
    if not path.exists():
        return {"format": FORMAT, "mode": mode, "parts": {}}
    try:
        status = read_json_file(path)  # a FIFO of the name: refused, not waited on
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError: a ValueError
        raise SetupError(f"{path}: not readable ({e}); move it aside to start afresh") from None
    if (
        not isinstance(status, dict)
        or type(status.get("format")) is not int  # not true, not 1.0
        or status.get("format") != FORMAT
        or status.get("mode") not in ("dry-run", "cuda")
        or not isinstance(status.get("parts"), dict)
    ):
        raise SetupError(f"{path}: not a gpu_check status of format {FORMAT}; move it aside to start afresh")
    names = [p.name for p in PARTS]
    for name, record in status["parts"].items():
        if name not in names:
            raise SetupError(f"{path}: unknown part {name!r} (parts: {', '.join(names)}); move it aside")
        if not isinstance(record, dict) or record.get("outcome") not in OUTCOMES:
            raise SetupError(
                f"{path}: part {name}'s record needs an outcome of {', '.join(OUTCOMES)}; "
                "move it aside to start afresh"
            )
        if record["outcome"] == DONE and record.get("finished_utc") is None:
            raise SetupError(f"{path}: part {name} passed but has no finished_utc time; move it aside")
        if (problem := _record_problem(record)) is not None:
            raise SetupError(f"{path}: part {name}'s {problem}; move it aside to start afresh")
    if status.get("mode") != mode:
        print(f"{path} is from a {status.get('mode')} run: starting afresh for this {mode} run", flush=True)
        return {"format": FORMAT, "mode": mode, "parts": {}}
    return status


def write_archive(archive: Path, out: Path, folders: list[Path]) -> None:
    """``out`` and the parts' result folders as one .tar.gz (paths relative to the repo root, or
    under gpu_check/ for an --out outside it), written atomically."""

    def arcname(path: Path) -> str:
        path = path.resolve()
        if path.is_relative_to(ROOT):
            return str(path.relative_to(ROOT))
        return str(Path("gpu_check") / path.relative_to(out.resolve()))

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if Path(info.name).name == ".lock" else info

    with atomic_path(archive) as tmp, tarfile.open(tmp, "w:gz") as tar:
        inside = [f for f in folders if f.resolve().is_relative_to(out.resolve())]
        for folder in dict.fromkeys([out, *(f for f in folders if f not in inside)]):
            if folder.exists():
                tar.add(folder, arcname=arcname(folder), filter=keep)


# ---------------------------------------------------------------- the check


def _timeouts(items: list[str], selected: list[str]) -> dict[str, float]:
    """--timeout's PART=SECONDS items, each of a part in ``selected`` (--parts; one not run was
    silently a bound on nothing)."""
    out = {}
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in BY_NAME:
            raise ValueError(f"--timeout {item!r}: unknown part {name!r}; parts: {', '.join(BY_NAME)}")
        if name not in selected:
            raise ValueError(f"--timeout {item!r}: part {name!r} is not run (--parts {' '.join(selected)})")
        if name in out:
            raise ValueError(f"--timeout {item!r}: part {name!r} given twice")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not 0 < value < math.inf:  # an infinite bound is no bound
            raise ValueError(f"--timeout {item!r}: PART=SECONDS with finite SECONDS > 0")
        out[name] = value
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = OneLineParser(
        prog="gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=list(BY_NAME),
        default=list(BY_NAME),
        help="these parts only (run in priority order; default: all)",
    )
    ap.add_argument("--dry-run", action="store_true", help="on CPU at tiny sizes, results to a temp dir")
    ap.add_argument("--out", type=Path, help=f"status and logs (default: {DEFAULT_OUT}; dry run: a temp dir)")
    ap.add_argument("--redo", action="store_true", help="run the selected parts even if they passed before")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"the call's time in seconds, setup included: at most {MAX_BUDGET_S['cuda']:.0f} on the GPU, "
        f"{MAX_BUDGET_S['dry-run']:.0f} in the dry run (default: {DEFAULT_BUDGET_S:.0f})",
    )
    ap.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="a part's own budget instead of its default (repeatable)",
    )
    ap.add_argument("--archive", type=Path, help="also pack --out and the results into this .tar.gz")
    ap.add_argument(
        "--wheels",
        type=Path,
        help=f"a folder of wheels of missing packages (default: {gpu_wheels.WHEELS_DIR}, if there)",
    )
    ap.add_argument("--quiet", action="store_true", help="parts' output to their logs only")
    ap.add_argument(
        "--commit",
        help="the commit this copy of the tree is at, where there is no git (the GPU machine): "
        "recorded as the results' commit, so an interrupted experiment resumes",
    )
    args = ap.parse_args(argv)
    mode = "dry-run" if args.dry_run else "cuda"
    if not 0 < args.budget_s <= MAX_BUDGET_S[mode]:  # NaN fails too
        ap.error(
            f"--budget-s takes seconds > 0 and at most {MAX_BUDGET_S[mode]:.0f} "
            f"{'in the dry run' if args.dry_run else 'on the GPU (each call at most 9 minutes)'}, "
            f"got {args.budget_s:g}"
        )
    try:
        args.timeouts = _timeouts(args.timeout, args.parts)
        _check_wheels(args)
    except ValueError as e:
        ap.error(str(e))
    if args.commit is not None and not re.fullmatch(r"[0-9a-f]{40}", args.commit):
        ap.error(f"--commit must be a full 40-digit hexadecimal commit id, got {args.commit!r}")
    _check_out_and_archive(ap, args)
    return args


def _check_out_and_archive(ap: OneLineParser, args: argparse.Namespace) -> None:
    """Exit 2 (``ap.error``) unless --out is a folder gpu_check may write (new, empty or its own)
    and --archive a .tar.gz file apart from what it packs, in a folder this user can write in."""
    if args.archive is not None and not args.archive.name.endswith((".tar.gz", ".tgz")):
        ap.error(f"--archive must name a .tar.gz or .tgz file, got {args.archive}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out}: not a folder")
    if args.out is not None and args.out.is_dir() and (tracked := tracked_files(args.out)):
        # as an experiment's --results (measure.results): status, logs and lock never among them
        ap.error(
            f"--out {args.out} holds files of the repository (e.g. {tracked[0]}, tracked by git): give "
            "a new or empty folder, or one gpu_check wrote"
        )
    if args.archive is not None:  # before any part runs: the archive is written after each
        if args.archive.is_dir():
            ap.error(f"--archive {args.archive}: a folder; give the archive file's name")
        _check_archive_apart(ap, args)
        # written beside itself and renamed (write_archive), its folders made: the nearest existing
        # one must be a writable folder
        existing = next(
            p for p in [args.archive.parent.resolve(), *args.archive.parent.resolve().parents] if p.exists()
        )
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            ap.error(f"--archive {args.archive}: {existing} is not a folder this user can write in")


def _check_wheels(args: argparse.Namespace) -> None:
    """``args.wheels`` set to the folder of wheels to install from: the default may be absent (no
    wheels fetched: a missing package is then named by the probe), a folder given must exist and
    hold wheels (a path mistyped was silently no wheels). ValueError otherwise, or for two versions
    of one package (pip would refuse the install there, after the setup)."""
    if args.wheels is None:
        args.wheels = gpu_wheels.WHEELS_DIR
        gpu_wheels.wheels_in(args.wheels)  # absent: none; two versions of one package: refused now
    elif not args.wheels.is_dir():
        raise ValueError(f"--wheels {args.wheels}: not a folder; give the folder gpu_wheels fetched into")
    elif not gpu_wheels.wheels_in(args.wheels):
        raise ValueError(f"--wheels {args.wheels}: holds no wheels (*.whl); nox -s gpu_wheels fetches them")


def _check_archive_apart(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--archive is neither in nor above a folder it packs: inside, each archive packed the one
    before it (and, in an experiment's results folder, a file that is not a result); the same path
    as --out, the part ran and its archive then failed on the folder --out had made."""
    archive = args.archive.resolve()
    out = args.out.resolve() if args.out is not None else None if args.dry_run else DEFAULT_OUT
    packed = [out] if out is not None else []  # a dry run's own new folder: apart from any path
    if not args.dry_run:
        packed += [Experiment(p.experiment).results_dir for p in PARTS if p.name in args.parts]
    for folder in packed:
        if archive.is_relative_to(folder) or folder.is_relative_to(archive):
            what = "--out" if folder == out else "the results folder"
            ap.error(
                f"--archive {args.archive}: in or above {what} {folder}, which it packs; give a path "
                "outside it"
            )


def _lock_out(out: Path) -> TextIO:
    """``out`` made and locked for this call (``measure.results.lock_folder``: the open lock file);
    SetupError where it cannot be made or another gpu_check holds it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        return lock_folder(out, f"another gpu_check is writing to {out}; wait for it or use another --out")
    except RunLockedError as e:
        raise SetupError(str(e)) from None
    except OSError as e:  # a read-only or pseudo file system, a name too long: said without errno
        raise SetupError(
            f"--out {out}: cannot hold the check's status ({e.strerror or e}); give a folder in a "
            "writable place"
        ) from None


def _parts_env(args: argparse.Namespace, site: str | None) -> dict[str, str]:
    """The parts' environment: the installed wheels and the project on the path, the commit."""
    env = dict(os.environ)
    path = [site] if site else []
    env["PYTHONPATH"] = os.pathsep.join([*path, str(IMPL), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    if args.commit:
        env[SOURCE_COMMIT_ENV] = args.commit
    if args.dry_run:  # the CPU even where a GPU is (the parts then pick Triton's interpreter)
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _probe_checked(env: dict[str, str], deadline: float, dry_run: bool) -> dict:
    """What ``probe`` found; SetupError without a CUDA device (unless a dry run) or a package."""
    found = probe(env, deadline)
    # no GPU first: on a machine without one, the missing packages are not what to fix
    if not dry_run and found["device"]["device"] != "cuda":
        raise SetupError("no CUDA device here (torch sees none); --dry-run: the same on CPU at tiny sizes")
    if found["missing"]:
        names = "; ".join(f"{k} ({v})" for k, v in found["missing"].items())
        raise SetupError(
            f"missing here: {names}; nox -s gpu_wheels fetches the wheels (where there is a network)"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    deadline = started + args.budget_s
    mode = "dry-run" if args.dry_run else "cuda"
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu_check_dry_run_")) if args.dry_run else DEFAULT_OUT)
    out = out.resolve()
    try:
        lock = _lock_out(out)
    except SetupError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    sigterm_as_interrupt()
    site = None
    try:
        status_path = out / STATUS
        status = read_status(status_path, mode)
        selected = [p for p in PARTS if p.name in args.parts]  # priority order
        todo = [p for p in selected if args.redo or status["parts"].get(p.name, {}).get("outcome") != DONE]
        for p in selected:
            if p not in todo:
                print(
                    f"[gpu_check] {p.name}: passed earlier ({status['parts'][p.name]['finished_utc']}); "
                    "--redo runs it again",
                    flush=True,
                )
        if not todo:
            if args.archive:
                write_archive(args.archive, out, [results_dir(p, out, args.dry_run) for p in selected])
            return _summary(status, selected, out)
        if args.commit:  # this process's provenance too (git_state): the machine may have no git
            os.environ[SOURCE_COMMIT_ENV] = args.commit
        site, installed = install_wheels(args.wheels, deadline)
        env = _parts_env(args, site)
        found = _probe_checked(env, deadline, args.dry_run)
        provenance = {
            "date_utc": utc_now(),
            "host": platform.node(),
            "python": sys.executable,
            "git": git_state(ROOT),
            "device": found["device"],
            "packages": found["packages"],
            "wheels_installed": installed,
        }
        where = found["device"].get("gpu") or found["device"]["cpu"]
        print(
            f"[gpu_check] {mode} on {where}, torch {found['packages'].get('torch')}, "
            f"commit {provenance['git']['commit']}; out: {out}",
            flush=True,
        )
        return _run_parts(args, todo, selected, status, status_path, out, env, deadline, provenance)
    except SetupError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM unwound as one: a line, not a traceback
        interrupt_handled()
        print(f"[gpu_check] interrupted: {_resume_hint(args, out)}", file=sys.stderr)
        return 130
    finally:
        if site:
            shutil.rmtree(site, ignore_errors=True)
        lock.close()


def _resume_hint(args: argparse.Namespace, out: Path) -> str:
    """What an interrupted call kept and how the next resumes it. A dry run without --out makes a
    new folder each call: only ``--out`` with this call's folder resumes it."""
    kept = f"the status so far is kept in {out}"
    if args.out is None and not args.dry_run:
        return f"{kept}; the next call runs the parts not yet passed"
    again = f"the same command with --out {out}" if args.out is None else "the same command"
    return f"{kept}; {again} runs the parts not yet passed"


def _run_parts(args, todo, selected, status, status_path, out, env, deadline, provenance) -> int:
    dry = args.dry_run
    folders = [results_dir(p, out, dry) for p in selected]
    try:
        for part in todo:
            budget = args.timeouts.get(part.name, part.budget(dry))
            left = deadline - time.monotonic() - KILL_GRACE_S
            timeout = min(budget, left)
            cmd = command(part, out, dry)
            record: dict[str, Any] = {
                "outcome": "running",
                "budget_s": budget,
                "timeout_s": round(timeout, 1),
                "command": cmd,
                "log": f"logs/{part.name}.log",
                "results": str(results_dir(part, out, dry)),
                "started_utc": utc_now(),
                "finished_utc": None,
                "seconds": None,
                "returncode": None,
                "provenance": provenance,
            }
            if left < MIN_PART_S:
                record.update(
                    outcome="not_run", reason=f"{left:.0f} s left of --budget-s {args.budget_s:.0f}"
                )
                status["parts"][part.name] = record
                write_json_atomic(status_path, status)
                print(
                    f"[gpu_check] {part.name}: not run ({record['reason']}); the next call does it",
                    flush=True,
                )
                continue
            status["parts"][part.name] = record
            write_json_atomic(status_path, status)  # a killed call leaves "running": not done
            if part.name == "kernels":  # pytest-benchmark does not create its folder; no stale counts
                benchmarks_dir(part, out, dry).mkdir(parents=True, exist_ok=True)
                kernels_junit(out).unlink(missing_ok=True)
            print(f"[gpu_check] {part.name}: up to {timeout:.0f} s: {' '.join(cmd[1:])}", flush=True)
            t0 = time.monotonic()
            outcome, rc = "interrupted", None  # unless it returns
            try:
                outcome, rc = run_bounded(cmd, env, timeout, out / record["log"], echo=not args.quiet)
            finally:
                record.update(
                    outcome=outcome,
                    returncode=rc,
                    seconds=round(time.monotonic() - t0, 1),
                    finished_utc=utc_now(),
                )
                if part.name == "kernels":
                    record["tests"] = _junit_counts(kernels_junit(out))
                write_json_atomic(status_path, status)
                if args.archive:
                    write_archive(args.archive, out, folders)
            print(f"[gpu_check] {part.name}: {outcome} in {record['seconds']:.0f} s", flush=True)
    finally:
        if args.archive:
            write_archive(args.archive, out, folders)
    return _summary(status, selected, out)


def _junit_counts(path: Path) -> dict[str, int] | None:
    """pytest's counts from its JUnit XML (tests, failures, errors, skipped), None if unreadable."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _summary(status: dict[str, Any], selected: list[Part], out: Path) -> int:
    print(f"\n[gpu_check] status: {out / STATUS}")
    ok = True
    for part in selected:
        r = status["parts"].get(part.name, {})
        seconds = "" if r.get("seconds") is None else f"{r['seconds']:7.1f} s of {r['timeout_s']:.0f} s"
        print(f"  {part.name:8} {r.get('outcome', 'not_run'):12} {seconds}")
        ok &= r.get("outcome") == DONE
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
