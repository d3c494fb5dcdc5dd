"""The seed sweep (tests/sweep.py) names every instance that fails as it fails, so a sweep stopped
before pytest's summary still says which test and seed failed (a 200-seed sweep was once stopped
with two failures it never named)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# one case that passes under every seed, one that fails under every seed
_TESTS = """
import pytest

@pytest.mark.parametrize("case", ["good", "bad"])
def test_case(case, sweep_seed):
    assert case == "good", f"the bad case, seed {sweep_seed}"
"""


def _sweep(folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # under xdist, as nox -s seed_sweep runs it: the controller writes the records off workers' reports
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.sweep"]
    command += ["--sweep", "inventory.json", "--seeds", "3", "-n", "1", "test_cases.py"]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_each_failure_is_recorded_with_its_seed_and_replay(tmp_path):
    (tmp_path / "test_cases.py").write_text(_TESTS)
    entry = {"draws_random": True, "slow": False, "seconds": 0.01}
    inventory = {"tests": {f"test_cases.py::test_case[{c}]": entry for c in ("good", "bad")}}
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))

    first = _sweep(tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "3 instances failed this run" in first.stdout
    records = [json.loads(line) for line in (tmp_path / "inventory.json.failures").read_text().splitlines()]
    passed = (tmp_path / "inventory.json.progress").read_text().splitlines()[1:]
    base = json.loads((tmp_path / "inventory.json.progress").read_text().splitlines()[0])["base"]
    assert sorted(r["test"] for r in records) == ["test_cases.py::test_case[bad]"] * 3
    assert all(r["base"] == base and r["phase"] == "call" for r in records)
    assert all("the bad case, seed" in r["error"] for r in records)
    assert {f"seed={r['seed']}" in r["instance"] for r in records} == {True}
    assert len({r["seed"] for r in records}) == 3  # three distinct seeds, each named
    assert {r["replay"] for r in records} == {
        f"TEST_SEED={r['seed']} python -m pytest 'test_cases.py::test_case[bad]'" for r in records
    }
    assert len(passed) == 3 and all("good" in p and "bad" not in p for p in passed)  # passes: progress

    # resumed: only the failed instances run again, and their records are appended, not replaced
    second = _sweep(tmp_path)
    assert second.returncode == 1
    assert "3 failures recorded before" in second.stdout
    assert "3 failed" in second.stdout and "passed" not in second.stdout.splitlines()[-1]
    again = (tmp_path / "inventory.json.failures").read_text().splitlines()
    assert len(again) == 6 and [json.loads(line) for line in again[:3]] == records
