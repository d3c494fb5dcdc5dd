"""measure.fork_launch: ranks forked from one warm process behave as torchrun's do (environment,
one thread each, output captured), one failed rank stops the others and sets the status, a run
past its timeout is killed, and no rank outlives the server."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from measure.fork_launch import ForkLauncher


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_ranks_run_fail_and_time_out_as_under_torchrun():
    launcher = ForkLauncher("tests.measure.fork_target:preload")
    try:
        nproc = 3
        done = launcher.run(nproc, "tests.measure.fork_target", ["sum"], timeout=60)
        assert done.returncode == 0, done.stderr
        lines = sorted(done.stdout.splitlines())
        assert lines == [f"rank {r} of {nproc}: sum {sum(range(nproc))}, threads 1" for r in range(nproc)], (
            lines
        )

        t0 = time.monotonic()
        failed = launcher.run(2, "tests.measure.fork_target", ["fail1"], timeout=60)
        assert failed.returncode == 2 and "rank 1 gives up" in failed.stderr  # rank 0 was stopped
        assert time.monotonic() - t0 < 30

        with pytest.raises(subprocess.TimeoutExpired):
            launcher.run(2, "tests.measure.fork_target", ["sleep"], timeout=2)
        assert _children(launcher._server.pid) == []  # the sleeping ranks were killed
        again = launcher.run(2, "tests.measure.fork_target", ["sum"], timeout=60)  # the server goes on
        assert again.returncode == 0, again.stderr
    finally:
        launcher.close()
    assert launcher._server.returncode == 0
