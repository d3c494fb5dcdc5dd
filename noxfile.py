"""Sessions: tests, isa_tests, megatron_lm_args, seed_sweep, smoke, claims, lint, figures, gpu_check,
gpu_wheels, compat, and one per experiment (mist_vs_megatron, cta_mlp, tempo_layer, tempo_llama, tempo_bert).

All sessions share one virtualenv (``.nox/shared``), installed from ``pyproject.toml`` and
re-installed only when that file changes, so a second run starts in seconds.

An experiment session computes every point into ``artifacts/<experiment>/results/`` (git-ignored;
an interrupted run resumes when rerun), draws its figures into ``figures/results/`` and ends with
its slice of the claims table (paper | reference | this run | verdict) and its regression pins; it
fails if a bound is broken without a known cause or a pinned number moved (a paper claim that does
not reproduce is a finding, never a failure). ``-- --update-reference`` makes the run the
committed reference.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nox

ROOT = Path(__file__).parent
VENV = ROOT / ".nox" / "shared"
STAMP = VENV / "installed-from.sha256"

nox.options.default_venv_backend = "none"
nox.options.sessions = ["tests"]


# Installed without their dependencies: the tests use torchtitan's config loader only (it needs
# torch and tyro, both installed), not its datasets, tokenizers or TensorBoard
NO_DEPS = ("torchtitan==0.2.2",)


def _venv_python() -> str:
    """Create/refresh the shared env when pyproject.toml (or NO_DEPS) changed; return its python."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + " ".join(NO_DEPS).encode()).hexdigest()
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if not STAMP.exists() or STAMP.read_text().strip() != digest:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test,lint]"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", *NO_DEPS], check=True)
        STAMP.write_text(digest)
    return str(py)


def _run(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    session.run(_venv_python(), *args, external=True, env=env or {})


def _claims(session: nox.Session, *experiments: str) -> None:
    """The experiment's claims (fails if a bound is broken without a known cause), then its
    regression pins against the committed reference (fails if a pinned number moved)."""
    _run(session, "-m", "artifacts.claims", *experiments)
    _run(session, "-m", "artifacts.claims", "--pins", *experiments)


def _figures(session: nox.Session, experiment: str) -> None:
    """This run's figures; with ``--update-reference`` also the committed reference figures."""
    _run(session, f"figures/plot_{experiment}.py")
    if "--update-reference" in session.posargs:
        _run(session, f"figures/plot_{experiment}.py", "--reference")


# Test workers: one a core, at most 4 (each imports torch; the multi-process tests start up to 4 more)
TEST_WORKERS = max(1, min(os.cpu_count() or 1, 4))


@nox.session
def tests(session: nox.Session) -> None:
    """Whole CPU test suite (Triton kernels run under TRITON_INTERPRET=1), one pytest worker a core
    (at most 4; one thread each), the longest tests started first (tests/conftest.py).
    ``-- -m "not slow"``: the quick part (no processes started, no test over ~10 s); ``-- -n 0``:
    in this process, one test at a time."""
    _suite(session, session.posargs, {})


def _suite(session: nox.Session, args: list[str], env: dict[str, str]) -> None:
    """The CPU suite with the caller's pytest arguments, under ``env`` besides one thread a worker."""
    args = list(args)  # the caller's list stays whole: isa_tests passes one list to every level
    marks = "not gpu"
    if "-m" in args:  # combine with the caller's marker expression instead of replacing it
        i = args.index("-m")
        marks = f"({args[i + 1]}) and not gpu"
        del args[i : i + 2]
    chosen = any(a.startswith(("-n", "--numprocesses")) for a in args)  # the caller's worker count
    # worksteal: a worker that runs out takes tests queued behind another's long one
    workers = [] if chosen else ["-n", str(TEST_WORKERS), "--dist", "worksteal"]
    # one thread a worker: two workers of two OpenMP threads on two cores spin against each other;
    # --durations: the slowest tests, for the suite's time budget
    _run(
        session,
        "-m",
        "pytest",
        "-m",
        marks,
        *workers,
        "--durations=15",
        *args,
        env={"OMP_NUM_THREADS": "1", **env},
    )


@dataclass(frozen=True)
class IsaLevel:
    """A narrower x86 vector instruction set than this machine's, as another processor (CI's may lack
    AVX-512) gives it: ``caps`` hold torch, oneDNN, MKL (on Intel processors only: Intel's MKL
    ignores the cap elsewhere), numpy and numpy's OpenBLAS to it. A result that moves with the vector
    width (a reduction's order, a vectorised exp) must stay inside a test's bound."""

    caps: dict[str, str]
    torch_accepts: tuple[str, ...]  # torch's dispatch under the caps: the level, or an older CPU's less


ISA_LEVELS = {
    "avx2": IsaLevel(
        {
            "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
            "OPENBLAS_CORETYPE": "Haswell",
        },
        ("AVX2", "DEFAULT"),
    ),
    "baseline": IsaLevel(  # x86-64-v2: SSE4.2, no AVX
        {
            "ATEN_CPU_CAPABILITY": "default",
            "ONEDNN_MAX_CPU_ISA": "SSE41",  # oneDNN's narrowest level; it has none at SSE4.2
            "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
            "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
            "OPENBLAS_CORETYPE": "Nehalem",
        },
        ("DEFAULT",),
    ),
}

# Says what torch, numpy and its OpenBLAS dispatch to under a level's caps, and stops if torch's
# kernels are wider than the level: a cap that did not take would test nothing. (oneDNN says its ISA
# only when one of its kernels runs; MKL says it on Intel processors only.)
_ISA_PROBE = """
import ctypes, pathlib, sys, torch, numpy, numpy._core._multiarray_umath as m
level, allowed, cap = sys.argv[1], sys.argv[2:], torch.backends.cpu.get_cpu_capability()
simd = [f for f in m.__cpu_dispatch__ if m.__cpu_features__.get(f)]
blas = [ctypes.CDLL(str(p)) for p in pathlib.Path(numpy.__file__).parent.parent.glob("numpy.libs/*openblas*")]
core = getattr(blas[0], "scipy_openblas_get_corename64_", None) if blas else None
if core is not None:
    core.restype = ctypes.c_char_p
print(f"isa {level}: torch {cap}, numpy {simd}, OpenBLAS {core().decode() if core else 'not found'}")
sys.exit(None if cap in allowed else f"isa {level}: torch dispatches to {cap}, wider than the level")
"""


def _isa_levels(session: nox.Session) -> tuple[list[str], list[str]]:
    """The levels ``--isa=LEVEL`` names in the session's arguments (in order, each once) and the other
    arguments; an unknown or bare ``--isa`` ends the session with a one-line error."""
    isa_args = [a for a in session.posargs if a == "--isa" or a.startswith("--isa=")]
    unknown = [a for a in isa_args if a.removeprefix("--isa=") not in ISA_LEVELS]
    if unknown:  # named as given: a bare --isa, --isa= and --isa=foo each say which it was
        session.error(f"{unknown[0]!r}: --isa=LEVEL takes one of {', '.join(ISA_LEVELS)}")
    levels = [a.removeprefix("--isa=") for a in isa_args]
    return list(dict.fromkeys(levels)), [a for a in session.posargs if a not in isa_args]


def _isa_env(session: nox.Session, name: str) -> dict[str, str]:
    """The environment that holds the libraries to level ``name``, once the probe has shown the caps
    took."""
    level = ISA_LEVELS[name]
    # Inductor's cache does not key on the instruction set: kernels another level compiled fail to
    # build or run (measured: compile errors and segfaults), so each level has its own
    env = {**level.caps, "TORCHINDUCTOR_CACHE_DIR": str(VENV.parent / f"inductor-{name}")}
    session.run(_venv_python(), "-c", _ISA_PROBE, name, *level.torch_accepts, external=True, env=env)
    return env


@nox.session
def isa_tests(session: nox.Session) -> None:
    """The CPU suite with torch, oneDNN, MKL, numpy and OpenBLAS held to narrower vector instruction
    sets than this CPU's, once a level (not in CI). ``-- --isa=avx2`` or ``--isa=baseline``
    (SSE4.2) picks one (default: both); other arguments go to pytest."""
    levels, args = _isa_levels(session)
    for name in levels or list(ISA_LEVELS):
        _suite(session, args, _isa_env(session, name))


@nox.session
def megatron_lm_args(session: nox.Session) -> None:
    """Megatron-LM's own parse_args/validate_args on every plan `mist export --to megatron-lm`
    writes from the committed comparison and the grid (~2 min). Megatron-LM's training code is not
    on PyPI: ``-- PATH`` (or MEGATRON_LM) names a checkout at tag core_v0.16.1, e.g.
    ``git clone -b core_v0.16.1 --depth 1 https://github.com/NVIDIA/Megatron-LM``. Not in CI."""
    checkout = session.posargs[0] if session.posargs else os.environ.get("MEGATRON_LM")
    if not checkout:
        session.error("needs a Megatron-LM checkout at core_v0.16.1: nox -s megatron_lm_args -- PATH")
    python = _venv_python()
    session.run(python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[megatron-lm]", external=True)
    _run(
        session,
        "-m",
        "pytest",
        "-q",
        "-s",
        "tests/mist/test_mist_export.py",
        "-k",
        "megatron_lm_accepts",
        env={"MEGATRON_LM": str(Path(checkout).resolve())},
    )


SWEEP_DIR = ROOT / ".sweep"  # the seed sweep's inventories and progress (git-ignored)


def _sources_digest() -> str:
    """Of every Python file the tests run (the tests and the code under them): a change starts a new
    inventory, and so a new sweep."""
    digest = hashlib.sha256()
    for folder in ("impl", "baselines", "artifacts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != ROOT / "tests" / "sweep.py":  # the sweep itself: no test's outcome
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


@nox.session
def seed_sweep(session: nox.Session) -> None:
    """Every test that draws random inputs, under many seeds (not in CI; hours on 2 cores: docs/results.md).
    First the suite once, writing which tests draw random inputs (tests/sweep.py), then each of
    those under 200 seeds if it took under 1 s, else 20; both one pytest worker a core (xdist; one
    thread each). Rerun, it resumes where it stopped (for the same sources); every failure is
    recorded as it happens, with its seed and replay command, in ``.sweep/<inventory>.failures``;
    ``-- --sweep-restart`` starts again with fresh seeds; ``-- --isa=avx2`` sweeps with the libraries
    held to a narrower instruction set (``isa_tests``; one level a sweep, with its own inventory);
    other arguments go to the sweep's pytest (``-- --seeds 50 --slow-seeds 5``, ``-- tests/tempo``)."""
    levels, args = _isa_levels(session)
    if len(levels) > 1:
        session.error(f"seed_sweep sweeps one --isa level at a time, not {len(levels)}: {', '.join(levels)}")
    level_env = _isa_env(session, levels[0]) if levels else {}
    SWEEP_DIR.mkdir(exist_ok=True)
    # a level has its own inventory, and so its own progress and failures (tests/sweep.py names them)
    level = f"-{levels[0]}" if levels else ""
    inventory = SWEEP_DIR / f"inventory-{_sources_digest()}{level}.json"
    pytest = ("-m", "pytest", "-q", "-p", "tests.sweep", "-m", "not gpu")
    # the inventory's seconds (which tests count as fast) are taken as the sweep runs: a worker a core
    workers = ("-n", str(os.cpu_count() or 1))
    env = {"OMP_NUM_THREADS": "1", **level_env}
    if not inventory.exists():
        inventory_run = (*workers, "--dist", "worksteal", f"--random-inventory={inventory}")
        _run(session, *pytest, *inventory_run, env=env)
    # a failure's replay command sets what the sweep ran under: the thread count and the caps
    replay_env = [f"--replay-env={name}={value}" for name, value in env.items()]
    _run(session, *pytest, *workers, f"--sweep={inventory}", *replay_env, *args, env=env)


@nox.session
def smoke(session: nox.Session) -> None:
    """Kick the tires in a few minutes: a Tempo-patched model's training step, a Mist plan and its
    prediction, a CTA kernel and the latency model; fails loudly if anything is off."""
    _run(session, "-m", "artifacts.smoke")


@nox.session
def claims(session: nox.Session) -> None:
    """Every claim, grouped by system: paper claims judged against the paper, bounds, numbers
    shown; a summary line per system. Fails if a bound is broken without a known cause.
    ``-- --against reference`` judges the committed reference; ``-- tempo_bert`` one experiment;
    ``-- --pins`` this run's regression pins against the reference."""
    _run(session, "-m", "artifacts.claims", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over everything."""
    _run(session, "-m", "ruff", "check", ".")
    _run(session, "-m", "ruff", "format", "--check", ".")


@nox.session
def figures(session: nox.Session) -> None:
    """Every figure from result files only (no experiment is re-run): this machine's results into
    figures/results/, or with ``-- --reference`` the committed reference into figures/reference/."""
    for script in sorted((ROOT / "figures").glob("plot_*.py")):
        _run(session, str(script), *session.posargs)


@nox.session
def gpu_check(session: nox.Session) -> None:
    """The GPU check (needs CUDA; docs/gpu-check.md): the GPU tests and micro-benchmarks, Mist's
    single-GPU engine plans, Mist against the baselines measured on one GPU, torch.compile against
    Tempo, Tempo's measured max batch and throughput, CTA-pipelining and Liger-Kernel's Llama row on
    one GPU, in priority order, at most 9 minutes a call: ``python -m artifacts.gpu_check``, which
    this wraps (it also runs without nox: the GPU machine has none). Each part has its own time
    budget and a hard timeout; a status file records each part's outcome and a rerun does the parts
    not yet passed. ``-- --dry-run``: the same on CPU at tiny sizes, results to a temp dir;
    ``-- --parts mist compile``, ``-- --redo``, ``-- --help``."""
    _run(session, "-m", "artifacts.gpu_check", *session.posargs)


@nox.session
def gpu_wheels(session: nox.Session) -> None:
    """The wheels the GPU machine lacks (megatron-core, highspy, liger-kernel; cp312 manylinux),
    downloaded here into ``.whl/`` for the GPU check to carry: ``python -m artifacts.gpu_wheels``."""
    _run(session, "-m", "artifacts.gpu_wheels", *session.posargs)


# What the lent GPU machine has (artifacts/gpu_check.py's docstring): the tests run against these
# before a GPU round. The other pins come from pyproject.toml.
COMPAT_PINS = {
    "torch": "2.11.0",
    "triton": "3.6.0",
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "numpy": "2.5.2",
}
COMPAT_PYTHON = "3.12"  # the GPU machine's
COMPAT_VENV = ROOT / ".nox" / "compat"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _compat_requirements() -> list[str]:
    """pyproject.toml's pins (dependencies and the test extra), the GPU machine's versions instead
    where they differ."""
    import tomllib  # Python 3.11+, only here

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = []
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        spec, _, marker = requirement.partition(";")
        name = re.split(r"[=<>!~\[ ]", spec, maxsplit=1)[0].strip().lower()
        if name in COMPAT_PINS:
            spec = f"{name}=={COMPAT_PINS[name]}"
        out.append(f"{spec.strip()}; {marker.strip()}" if marker else spec.strip())
    return out


def _compat_interpreter(session: nox.Session) -> str:
    """Python 3.12 as on the GPU machine (COMPAT_PYTHON_EXE=path to choose), else this one."""
    pyenv = glob.glob(os.path.expanduser(f"~/.pyenv/versions/{COMPAT_PYTHON}*/bin/python3"))
    candidates = [os.environ.get("COMPAT_PYTHON_EXE"), shutil.which(f"python{COMPAT_PYTHON}"), *sorted(pyenv)]
    for exe in filter(None, candidates):
        probe = subprocess.run([exe, "-c", "pass"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return exe
    session.warn(f"no working python{COMPAT_PYTHON}: the compat venv uses {sys.executable} instead")
    return sys.executable


@nox.session
def compat(session: nox.Session) -> None:
    """The fast CPU tests (``-m "not gpu and not slow"``) against the GPU machine's versions
    (torch 2.11.0, triton 3.6.0, transformers 5.17.0, ...; COMPAT_PINS), in their own venv
    (.nox/compat, reinstalled only when the pins change). torch comes from its CPU index where that
    is reachable, else from PyPI (a CUDA build: several GB, once). ``-- ARGS`` go to pytest."""
    requirements = _compat_requirements()
    python = COMPAT_VENV / "bin" / "python"
    stamp = COMPAT_VENV / "installed-from.sha256"
    if not python.exists():
        session.run(_compat_interpreter(session), "-m", "venv", str(COMPAT_VENV), external=True)
    digest = hashlib.sha256("\n".join(requirements).encode()).hexdigest()
    if not stamp.exists() or stamp.read_text().strip() != digest:
        try:
            urllib.request.urlopen(f"{TORCH_CPU_INDEX}/torch/", timeout=15).close()
            index = ["--extra-index-url", TORCH_CPU_INDEX]  # 2.11.0+cpu sorts above PyPI's 2.11.0
        except OSError as e:
            session.warn(f"{TORCH_CPU_INDEX} not reachable ({e}): torch from PyPI (a CUDA build)")
            index = []
        torch = f"torch=={COMPAT_PINS['torch']}"  # first, alone: the index decides its build
        session.run(str(python), "-m", "pip", "install", "-q", *index, torch, external=True)
        session.run(str(python), "-m", "pip", "install", "-q", *requirements, external=True)
        stamp.write_text(digest)
    versions = "import sys, torch, triton, transformers as t, numpy as n; print('compat:', sys.version[:6], "
    versions += "torch.__version__, triton.__version__, t.__version__, n.__version__)"
    session.run(str(python), "-c", versions, external=True)
    env = {"PYTHONPATH": f"{ROOT / 'impl'}{os.pathsep}{ROOT}"}  # the repo's packages, uninstalled, as there
    session.run(
        str(python),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-m",
        "not gpu and not slow",
        *session.posargs,
        external=True,
        env=env,
    )


@nox.session
def mist_vs_megatron(session: nox.Session) -> None:
    """Mist vs Megatron-LM grid, Aceso-style search and ZeRO-3 on the paper's cases, the ablation,
    Mist with and without Tempo's layers, the cost models' held-out errors, plans trained by
    megatron-core, every winner trained under a memory cap; figures; claims."""
    _run(session, "-m", "artifacts.mist_vs_megatron.run", *session.posargs)
    _figures(session, "mist_vs_megatron")
    _claims(session, "mist_vs_megatron")


@nox.session
def cta_mlp(session: nox.Session) -> None:
    """CTA-pipelining: the latency model's sweep (H200/B200, 2/4/8 GPUs), the kernels under the
    interpreter with the concurrent negative control, the distributed baselines on gloo; figures;
    claims. ``-- --device cuda --parts kernels gpu`` measures on a GPU."""
    _run(session, "-m", "artifacts.cta_mlp.run", *session.posargs)
    _figures(session, "cta_mlp")
    _claims(session, "cta_mlp")


@nox.session
def tempo_layer(session: nox.Session) -> None:
    """Saved-for-backward bytes of one BERT-Large encoder layer: HF eager vs Tempo and each
    technique, and against torch.compile (default, at Tempo's bytes, Tempo compiled; fp32, with a
    step's time); the GELU backward against autograd; claims."""
    _run(session, "-m", "artifacts.tempo_layer.run", *session.posargs)
    _figures(session, "tempo_layer")
    _claims(session, "tempo_layer")


@nox.session
def tempo_llama(session: nox.Session) -> None:
    """Tempo on Llama-family decoders (beyond the paper): bytes a decoder layer keeps against their
    closed forms and against torch.compile, max batch of Llama-3.2-1B / Llama-3-8B at seq 4096 and
    8192 on 80 / 141 GB, same training of a small Llama; figures; claims. Liger-Kernel's row needs a
    GPU (nox -s gpu_check)."""
    _run(session, "-m", "artifacts.tempo_llama.run", *session.posargs)
    _figures(session, "tempo_llama")
    _claims(session, "tempo_llama")


@nox.session
def tempo_bert(session: nox.Session) -> None:
    """Tempo's evaluation: the layer comparison, activation memory and max batch of BERT-Large,
    RoBERTa-large and GPT-2 per configuration and GPU size, same training, CPU throughput; figures;
    claims. Options after ``--`` go to artifacts.tempo_bert.run (``--update-reference`` to both)."""
    layer = ["--fresh", "--update-reference"]
    _run(session, "-m", "artifacts.tempo_layer.run", *[a for a in session.posargs if a in layer])
    _run(session, "-m", "artifacts.tempo_bert.run", *session.posargs)
    _figures(session, "tempo_bert")
    _claims(session, "tempo_layer", "tempo_bert")
