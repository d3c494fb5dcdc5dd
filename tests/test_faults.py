"""Killed runs: no process outlives its parent, and the same command resumes where it stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries ``tag`` (the run under test and everything it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"FAULT_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return pids


def _wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def _start(tag: str, results: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "artifacts.mist_vs_megatron.run", "--parts", "comparison", "--jobs", "2",
               "--results", str(results)]  # fmt: skip
    env = {**os.environ, "FAULT_TEST_TAG": tag, "PYTHONPATH": f"{REPO}:{REPO / 'impl'}"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _until_workers(tag: str, proc: subprocess.Popen) -> None:
    # the parent and its two pool workers (and multiprocessing's resource tracker) are up
    assert _wait_until(lambda: len(_tagged(tag)) >= 3 or proc.poll() is not None, 120), (
        "workers never started"
    )
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(3)  # into a point


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_run_leaves_no_process_and_resumes(tmp_path, sig):
    tag = uuid.uuid4().hex
    results = tmp_path / "results"
    proc = _start(tag, results)
    _until_workers(tag, proc)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert _wait_until(lambda: not _tagged(tag), 20), f"left behind after {sig.name}: {_tagged(tag)}"
    run = json.loads((results / "run.json").read_text())
    assert run["finished_utc"] is None, run  # interrupted: the next same command resumes it
    if sig == signal.SIGTERM:  # unwound like Ctrl-C: one line says so, and how to resume
        last = proc.stderr.read().decode().strip().splitlines()[-1]
        assert proc.returncode == 130 and last.startswith("interrupted: the points finished so far"), last
    # the same command again starts (the lock is not held by a dead run) and resumes this run
    again = _start(tag, results)
    _until_workers(tag, again)
    assert json.loads((results / "run.json").read_text())["run_id"] == run["run_id"]
    again.send_signal(signal.SIGTERM)
    again.wait(timeout=60)
    assert _wait_until(lambda: not _tagged(tag), 20)
