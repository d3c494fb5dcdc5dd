"""Sessions: tests, smoke, claims, lint, figures, gpu_check, and one per experiment.

All sessions share one virtualenv (``.nox/shared``), installed from ``pyproject.toml`` and
re-installed only when that file changes, so a second run starts in seconds.

An experiment session computes every point into ``artifacts/<experiment>/results/`` (git-ignored;
an interrupted run resumes when rerun), draws its figures into ``figures/results/`` and ends with
its slice of the claims table (paper | reference | this run | verdict); it fails if a claim is
outside its tolerance. ``-- --update-reference`` makes the run the committed reference.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
VENV = ROOT / ".nox" / "shared"
STAMP = VENV / "installed-from.sha256"

nox.options.default_venv_backend = "none"
nox.options.sessions = ["tests"]


def _venv_python() -> str:
    """Create/refresh the shared env when pyproject.toml changed; return its python."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    py = VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if not STAMP.exists() or STAMP.read_text().strip() != digest:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test,lint]"], check=True)
        STAMP.write_text(digest)
    return str(py)


def _run(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    session.run(_venv_python(), *args, external=True, env=env or {})


def _claims(session: nox.Session, *experiments: str) -> None:
    """The experiment's slice of the claims table; fails if a claim that ran is outside its tolerance."""
    _run(session, "-m", "artifacts.claims", *experiments)


def _figures(session: nox.Session, experiment: str) -> None:
    """This run's figures; with ``--update-reference`` also the committed reference figures."""
    _run(session, f"figures/plot_{experiment}.py")
    if "--update-reference" in session.posargs:
        _run(session, f"figures/plot_{experiment}.py", "--reference")


@nox.session
def tests(session: nox.Session) -> None:
    """Whole CPU test suite (Triton kernels run under TRITON_INTERPRET=1).
    ``-- -m "not slow"``: the quick part (no processes started, no test over ~10 s)."""
    args = list(session.posargs)
    marks = "not gpu"
    if "-m" in args:  # combine with the caller's marker expression instead of replacing it
        i = args.index("-m")
        marks = f"({args[i + 1]}) and not gpu"
        del args[i : i + 2]
    _run(session, "-m", "pytest", "-m", marks, *args)


@nox.session
def smoke(session: nox.Session) -> None:
    """Kick the tires in a few minutes: a Tempo-patched model's training step, a Mist plan and its
    prediction, a CTA kernel and the latency model; fails loudly if anything is off."""
    _run(session, "-m", "artifacts.smoke")


@nox.session
def claims(session: nox.Session) -> None:
    """Every claim: paper | reference | this machine's run | verdict. Fails if a claim that ran is
    outside its tolerance. ``-- --against reference`` checks the committed reference itself;
    ``-- tempo_bert`` one experiment's slice."""
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


# The GPU part of tempo_bert that fits gpu_check's time: three models on an emulated 16 GB GPU.
GPU_THROUGHPUT = (
    "--parts", "throughput", "--scale", "paper",
    "--cases", "bert-large/512", "roberta-large/512", "gpt2-medium/1024",
    "--configs", "hf-eager", "hf-sdpa", "tempo", "tempo+sdpa",
)  # fmt: skip


@nox.session
def gpu_check(session: nox.Session) -> None:
    """Every GPU test and micro-benchmark, then Tempo's measured max batch and throughput,
    Mist's single-GPU engine check and CTA-pipelining's single-GPU part, in one run (needs CUDA).
    Results with machine and commit info go under artifacts/*/results/, resumable: a rerun
    skips the points already measured. GPU_CHECK_PARTS=tests,tempo,mist,cta (default: all) runs
    some of them, to split the check over calls. GPU_CHECK_DRY_RUN=1: the same on CPU at tiny
    scale, results to a temp dir."""
    parts = set(os.environ.get("GPU_CHECK_PARTS", "tests,tempo,mist,cta").split(","))
    if parts - {"tests", "tempo", "mist", "cta"}:
        session.error(f"GPU_CHECK_PARTS: unknown {sorted(parts - {'tests', 'tempo', 'mist', 'cta'})}; "
                      "accepted: tests, tempo, mist, cta")  # fmt: skip
    probe = "import sys, torch; sys.exit(not torch.cuda.is_available())"
    if subprocess.run([_venv_python(), "-c", probe]).returncode != 0:
        if not os.environ.get("GPU_CHECK_DRY_RUN"):
            session.error(
                "gpu_check needs a CUDA device (GPU_CHECK_DRY_RUN=1: a CPU dry run, results to a temp dir)"
            )
        tmp = Path(tempfile.mkdtemp())
        bench, tempo_results, device = tmp / "pytest-benchmark" / "gpu.json", tmp, "cpu"
        throughput = ("--parts", "throughput", "--cases", "bert-mini/32", "--configs", "hf-eager", "tempo",
                      "--gpu-mem", "48MiB")  # fmt: skip
    else:
        # git-ignored; in a subfolder: pytest-benchmark's format is not a result file's
        bench = ROOT / "artifacts" / "tempo_layer" / "results" / "pytest-benchmark" / "gpu.json"
        tempo_results = ROOT / "artifacts" / "tempo_bert" / "results"
        device, throughput = "cuda", GPU_THROUGHPUT
    if "tests" in parts:
        bench.parent.mkdir(parents=True, exist_ok=True)  # pytest-benchmark does not create it
        _run(
            session, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "tests/test_gpu.py", "tests/measure/test_oom.py", "tests/tempo/test_kernels.py",
            "tests/tempo/test_bench_ops.py", "tests/ctapipe/test_ctapipe_kernels.py",
            "--benchmark-enable", f"--benchmark-json={bench}", *session.posargs,
        )  # fmt: skip
    if "tempo" in parts:
        _run(
            session, "-m", "artifacts.tempo_bert.run", *throughput,
            "--device", device, "--results", str(tempo_results),
        )  # fmt: skip
    if "mist" in parts:
        # `mist profile` on the device, then single-GPU plans (no/half/full recompute, optimizer or
        # activation offloading) trained by megatron-core, memory and time against the prediction.
        engine = ["--cpu-dry-run", "--results", str(tempo_results)] if device == "cpu" else []
        _run(session, "-m", "artifacts.mist_vs_megatron.engine", *engine)
    if "cta" in parts:
        # CTA-pipelining: kernels at GPU sizes, single-GPU emulation, throughput vs cuBLAS, measured
        # simulator parameters (its kernel tests ran with the other tests).
        cta = ["--gpu-dry-run", "--results", str(tempo_results)] if device == "cpu" else []
        _run(session, "-m", "artifacts.cta_mlp.run", "--parts", "kernels", "gpu", "--device", device, *cta)


@nox.session
def mist_vs_megatron(session: nox.Session) -> None:
    """Mist vs Megatron-LM grid, Aceso-style search and ZeRO-3 on the paper's cases, the ablation,
    the cost models' held-out errors, plans trained by megatron-core; figures; claims."""
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
    technique; the GELU backward against autograd; claims."""
    _run(session, "-m", "artifacts.tempo_layer.run", *session.posargs)
    _claims(session, "tempo_layer")


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
