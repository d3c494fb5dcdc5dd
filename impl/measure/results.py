"""Result files for every experiment: provenance, atomic writes, resume.

A result file is one JSON object ``{"provenance": {...}, "points": {key: result, ...}}``.
Each finished point is written at once (temp file + fsync + rename, so an interrupted run never
leaves a torn file); a rerun skips keys already present unless asked to recompute (``force``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "triton", "transformers", "megatron-core", "numpy", "scipy", "sympy", "highspy")
REPO_ROOT = Path(__file__).resolve().parents[2]


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()

    # Experiment outputs (result files, figures) do not make the code dirty: runs rewrite them.
    outputs = (":(exclude)artifacts/*/results/*", ":(exclude)figures/*.png")
    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs)),
        }
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def device_description(device: str = "cpu") -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "device": device,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return out


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance(config: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """Everything needed to tell where a result came from."""
    return {
        "git": git_state(),
        "packages": package_versions(),
        "device": device_description(device),
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "config": config,
    }


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a result file is for everyone to read
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ResultFile:
    """Resumable set of result points with provenance, e.g.

    >>> store = ResultFile(path, provenance(config))
    >>> for key in keys:
    ...     store.compute(key, lambda: measure(key))   # skipped when already done
    """

    def __init__(self, path: str | os.PathLike, prov: dict[str, Any], force: bool = False) -> None:
        self.path = Path(path)
        self.points: dict[str, Any] = {}
        # Compare configs as they are stored (tuples become lists in JSON).
        prov = json.loads(json.dumps(prov, default=str))
        if self.path.exists() and not force:
            old = json.loads(self.path.read_text())
            if old.get("provenance", {}).get("config") == prov.get("config"):
                self.points = old.get("points", {})
        self.provenance = prov

    def done(self, key: str) -> bool:
        return key in self.points

    def add(self, key: str, result: Any) -> None:
        self.points[key] = result
        write_json_atomic(self.path, {"provenance": self.provenance, "points": self.points})

    def compute(self, key: str, fn: Callable[[], Any]) -> Any:
        if key not in self.points:
            self.add(key, fn())
        return self.points[key]


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """A result file's content; figures are made only from these."""
    return json.loads(Path(path).read_text())
