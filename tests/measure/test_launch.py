"""measure.launch.run_torchrun: torchrun's ranks run as the experiments start them, and a launch
leaves nothing in TMPDIR (torchrun on its own leaves a log folder there per launch)."""

from __future__ import annotations

import os
import random
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


def test_each_rank_gets_the_threads_asked_for_and_bad_counts_are_refused(monkeypatch):
    """One thread a rank by default (the CPU runs: the ranks share the cores); a GPU launch gives its
    ranks the host's cores (an offloaded optimizer steps there). A count that is no thread count
    is refused before torchrun starts."""
    seen = []

    class Started:  # what run_torchrun reads of a process that exits at once
        def __init__(self, command, env, **kwargs):
            seen.append(env["OMP_NUM_THREADS"])
            self.returncode = 0

        def communicate(self, timeout=None):
            return "", ""

    monkeypatch.setattr(subprocess, "Popen", Started)
    threads = random.randint(2, 64)
    for asked, expected in ((None, "1"), (threads, str(threads))):
        done = run_torchrun(1, "json.tool", ["--help"], 10, **({} if asked is None else {"threads": asked}))
        assert done.returncode == 0 and seen[-1] == expected
    for bad in (0, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"^run_torchrun: threads is a whole number >= 1"):
            run_torchrun(1, "json.tool", ["--help"], 10, threads=bad)
    assert len(seen) == 2
