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


def _sweep(folder: Path, *options: str, seeds: int = 3) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # under xdist, as nox -s seed_sweep runs it: the controller writes the records off workers' reports
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.sweep"]
    command += ["--sweep", "inventory.json", f"--seeds={seeds}", "-n", "1", *options, "test_cases.py"]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def _write_cases(folder: Path) -> None:
    (folder / "test_cases.py").write_text(_TESTS)
    entry = {"draws_random": True, "slow": False, "seconds": 0.01}
    inventory = {"tests": {f"test_cases.py::test_case[{c}]": entry for c in ("good", "bad")}}
    (folder / "inventory.json").write_text(json.dumps(inventory))


@pytest.mark.slow
def test_each_failure_is_recorded_with_its_seed_and_replay(tmp_path):
    _write_cases(tmp_path)
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


@pytest.mark.slow
def test_a_failure_replays_in_the_environment_the_sweep_ran_in(tmp_path):
    """A sweep under ISA caps (``nox -s seed_sweep -- --isa=avx2``) gives each failure's replay command
    the caps, quoted for the shell: the same seed on the machine's own kernels may pass."""
    _write_cases(tmp_path)
    caps = {"ATEN_CPU_CAPABILITY": "avx2", "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL"}
    run = _sweep(tmp_path, *(f"--replay-env={name}={value}" for name, value in caps.items()), seeds=1)
    assert run.returncode == 1, run.stdout + run.stderr
    [record] = [json.loads(line) for line in (tmp_path / "inventory.json.failures").read_text().splitlines()]
    assert record["replay"] == (
        "ATEN_CPU_CAPABILITY=avx2 NPY_DISABLE_CPU_FEATURES='X86_V4 AVX512_ICL' "
        f"TEST_SEED={record['seed']} python -m pytest 'test_cases.py::test_case[bad]'"
    )


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["ATEN_CPU_CAPABILITY", "=avx2", "1X=avx2", "X-Y=1"])
def test_a_bad_replay_setting_is_refused_before_anything_runs(tmp_path, setting):
    _write_cases(tmp_path)
    run = _sweep(tmp_path, f"--replay-env={setting}")
    assert run.returncode == 4, run.stdout + run.stderr  # pytest's usage error: nothing ran
    assert f"{setting!r}: --replay-env takes NAME=VALUE" in run.stderr
    assert not (tmp_path / "inventory.json.progress").exists()
