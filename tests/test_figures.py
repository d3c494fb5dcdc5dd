"""The figure scripts on missing or broken results: one line saying so, never a traceback or a
silent exit (run on a copy of the scripts whose artifacts/ is a temporary folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _draw(root: Path, script: str, how: str = "file") -> subprocess.CompletedProcess:
    """``script`` run as a file (as nox runs it), or with ``-m`` from ``root`` (how="module")."""
    if how == "file":
        command = [sys.executable, str(root / "figures" / script)]
    else:
        command = [sys.executable, "-m", f"figures.{script.removesuffix('.py')}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # they find the packages themselves
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def copy(tmp_path) -> Path:
    shutil.copytree(REPO / "figures", tmp_path / "figures", ignore=shutil.ignore_patterns("reference"))
    (tmp_path / "impl").symlink_to(REPO / "impl")
    (tmp_path / "artifacts" / "cta_mlp" / "results").mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize("how", ["file", "module"])
def test_no_results_is_said_in_one_line(copy, how):
    """Run either way: with ``-m`` the scripts failed with a ModuleNotFoundError traceback
    (``_common`` is found beside the script only when run as a file)."""
    done = _draw(copy, "plot_cta_mlp.py", how)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.strip().splitlines() == [
        "nothing to draw: artifacts/cta_mlp/results/ has no results; run nox -s cta_mlp first, or draw "
        "the committed reference with --reference"
    ]


@pytest.mark.parametrize("broken", ["truncated", "a point of another shape"])
def test_broken_results_are_one_line(copy, broken):
    reference = (REPO / "artifacts" / "cta_mlp" / "reference" / "sim.json").read_text()
    path = copy / "artifacts" / "cta_mlp" / "results" / "sim.json"
    if broken == "truncated":  # a write cut short
        path.write_text(reference[: len(reference) // 2])
    else:  # well-formed, but a field the figure reads is gone
        data = json.loads(reference)
        for p in data["points"]:
            p["result"] = {"renamed": p["result"]}
        path.write_text(json.dumps(data))
    done = _draw(copy, "plot_cta_mlp.py")
    err = done.stderr.strip()
    last = err.splitlines()[-1]  # (matplotlib may warn first, about a panel left empty)
    assert done.returncode == 1 and last.startswith("error: ") and "Traceback" not in err, err
    assert "sim.json" in last or "artifacts/cta_mlp/results/" in last
