"""The wheels of what the lent GPU machine lacks, fetched here for ``python3 -m artifacts.gpu_check``
there (it has no network): ``nox -s gpu_wheels`` (or ``python -m artifacts.gpu_wheels`` in the
project's environment, ``.nox/shared``) downloads them into ``.whl/`` (git-ignored), cp312
manylinux x86_64, one version of each, at the versions pyproject.toml pins.

That machine's Python 3.12 has torch 2.11, triton 3.6, transformers 5.17 (with tokenizers), numpy,
scipy, sympy, matplotlib, PyYAML, tqdm, pytest, pytest-benchmark, pytest-timeout and hypothesis,
but not megatron-core, highspy or liger-kernel (the peer of tempo_llama's GPU row). Their own needs
(megatron-core: torch, numpy, packaging; highspy: numpy; liger-kernel: torch, triton) are all there,
so these three are the whole list (about 6 MB).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "impl") not in sys.path:  # run here as python3 -m, the project not installed
    sys.path.insert(0, str(ROOT / "impl"))

from measure.cli import OneLineParser  # noqa: E402

WHEELS_DIR = ROOT / ".whl"
MISSING_ON_DEVICE = ("megatron-core", "highspy", "liger-kernel")
PYTHON_VERSION = "3.12"  # the GPU machine's python3
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
DOWNLOAD_TIMEOUT_S = 600


def canonical(name: str) -> str:
    """A distribution's name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(name: str, pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The version pyproject.toml pins ``name`` to (``name==X``)."""
    for found, version in re.findall(r'"([A-Za-z0-9_.\-]+)==([^";\s]+)', pyproject.read_text()):
        if canonical(found) == canonical(name):
            return version
    raise LookupError(f"{pyproject} pins no version of {name}")


def wheel_dist(path: Path) -> tuple[str, str]:
    """(canonical name, version) from a wheel's file name (PEP 427: NAME-VERSION-...-TAGS.whl)."""
    parts = path.name.split("-")
    if not path.name.endswith(".whl") or len(parts) < 5:
        raise ValueError(f"{path}: not a wheel's file name (NAME-VERSION-[BUILD-]PY-ABI-PLATFORM.whl)")
    return canonical(parts[0]), parts[1]


def wheels_in(folder: Path) -> list[Path]:
    """The wheels in ``folder`` (none if it does not exist; files only: the repository root holds the
    folder ``.whl``); two versions of one distribution are an error (pip would refuse the whole
    install)."""
    wheels = sorted(p for p in folder.glob("*.whl") if p.is_file()) if folder.is_dir() else []
    seen: dict[str, Path] = {}
    for wheel in wheels:
        name, _ = wheel_dist(wheel)
        if name in seen:
            raise ValueError(f"{folder}: two wheels of {name} ({seen[name].name}, {wheel.name}); keep one")
        seen[name] = wheel
    return wheels


def download(names: tuple[str, ...], dest: Path) -> list[Path]:
    """Fetch each of ``names`` at its pinned version into ``dest``, dropping its other versions."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = [f"{name}=={pinned(name)}" for name in names]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(dest),
        *specs,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pip download {' '.join(specs)} failed: {last}")
    wanted = {canonical(name): pinned(name) for name in names}
    for wheel in sorted(dest.glob("*.whl")):
        name, version = wheel_dist(wheel)
        if name in wanted and version != wanted[name]:
            wheel.unlink()  # another version: two would stop the install there
    return wheels_in(dest)


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(
        prog="python -m artifacts.gpu_wheels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--dest", type=Path, default=WHEELS_DIR, help=f"where (default: {WHEELS_DIR})")
    args = ap.parse_args(argv)
    # before the download: a file there, or a place no folder can be made (/proc), was a raw
    # "[Errno 17] File exists" after pip had been started
    if args.dest.exists() and not args.dest.is_dir():
        ap.error(f"--dest {args.dest}: not a folder; give the folder to put the wheels in")
    try:
        args.dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--dest {args.dest}: cannot be made a folder of wheels ({e.strerror or e})")
    try:
        wheels = download(MISSING_ON_DEVICE, args.dest)
    except (OSError, LookupError, ValueError, RuntimeError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"error: {e}") from None
    total = 0
    for wheel in wheels:
        size = wheel.stat().st_size
        total += size
        print(f"{size / 2**20:6.1f} MiB  {wheel.name}")
    print(f"{total / 2**20:6.1f} MiB  in {args.dest} (the GPU machine takes 64 MiB with the working tree)")


if __name__ == "__main__":
    main()
