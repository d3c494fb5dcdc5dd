"""measure.launch.run_torchrun: torchrun's ranks run as the experiments start them, and a launch
leaves nothing in TMPDIR (torchrun on its own leaves a log folder there per launch)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from measure.launch import run_torchrun


@pytest.fixture
def own_tmpdir(tmp_path, monkeypatch):
    """TMPDIR for this process (``tempfile``'s cached choice included) and the ones it starts."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_launch_runs_its_ranks_and_leaves_nothing_in_tmpdir(own_tmpdir):
    done = run_torchrun(2, "tests.measure.fork_target", ["sum"], timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    # both ranks joined one gloo group (their lines may interleave: torchrun merges their output)
    assert all(f"rank {r} of 2: sum 1, threads 1" in done.stdout for r in range(2)), done.stdout
    assert list(own_tmpdir.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_control_torchrun_alone_leaves_its_log_folder(own_tmpdir):
    """Negative control: the check above sees what torchrun leaves without run_torchrun's log folder
    (run_torchrun before this fix left one such folder a launch in /tmp)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    done = subprocess.run(
        [*command, "-m", "tests.measure.fork_target", "sum"],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name.startswith("torchelastic_") for p in own_tmpdir.iterdir()] == [True]


@pytest.mark.parametrize(
    ("nproc", "timeout", "error"),
    [
        (0, 10, ValueError),
        (-1, 10, ValueError),
        (True, 10, TypeError),
        ("2", 10, TypeError),
        (1.0, 10, TypeError),
        (1, -1, ValueError),
        (1, 0, ValueError),
        (1, float("nan"), ValueError),
        (1, float("inf"), ValueError),
        (1, None, TypeError),
        (1, "10", TypeError),
    ],
)
def test_bad_counts_and_timeouts_are_refused_before_torchrun_starts(nproc, timeout, error, monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(error, match=r"^run_torchrun: (nproc|timeout) is") as caught:
        run_torchrun(nproc, "json.tool", ["--help"], timeout)
    assert "\n" not in str(caught.value)
    assert started == []  # refused before anything was launched
