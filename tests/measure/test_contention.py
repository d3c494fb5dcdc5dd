"""measure.contention: the cores' busy time other processes took while a timing ran, its own
processes' (descendants ended in between included) taken off."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from measure import contention
from measure.contention import Contention, OtherWork

# a process that uses SECONDS of CPU time (its own clock: however busy the machine is), then
# writes the file named by its first argument
_BURN = (
    "import sys, time\nt = time.process_time()\n"
    "while time.process_time() - t < {s}: pass\nopen(sys.argv[1], 'w').close()"
)

linux_proc = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc")


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < end, f"{path} not written within {timeout_s} s"
        time.sleep(0.05)


class _Readings:
    """Scripted readings for OtherWork: two samples of the cores' (busy, steal) ticks, of every
    process's (parent, ticks) and of the clock."""

    def __init__(self, monkeypatch, cores, processes, clock):
        self.cores, self.processes, self.clock = list(cores), list(processes), list(clock)
        monkeypatch.setattr(contention, "_core_ticks", lambda _: self.cores.pop(0))
        monkeypatch.setattr(contention, "_process_ticks", lambda: self.processes.pop(0))
        monkeypatch.setattr(contention, "_now", lambda: self.clock.pop(0))
        monkeypatch.setattr(contention, "_ticks_per_second", lambda: 100)
        monkeypatch.setattr(contention, "_usable_cores", lambda: {0, 1})


def test_own_work_is_taken_off_and_the_rest_is_other(monkeypatch):
    me, parent = os.getpid(), os.getppid()
    stranger = me + 1000
    _Readings(
        monkeypatch,
        # 2 s: the cores ran 500 ticks, 30 of them stolen by the hypervisor
        cores=[(1000, 10), (1500, 40)],
        processes=[
            # at the start: a child of 5 ticks with a child of 7, a child of 10 that will end, the
            # stranger at 50
            {me: (parent, 100), me + 1: (me, 5), me + 2: (me + 1, 7), me + 4: (me, 10), stranger: (1, 50)},
            # at the end the ending child is gone, its 10 + 20 ticks in this process's waited-for
            # time (+30) beside 30 of its own; the others ran 20 and 60 more; a new child ran 40
            {me: (parent, 160), me + 1: (me, 25), me + 2: (me + 1, 67), me + 3: (me, 40), stranger: (1, 250)},
        ],
        clock=[10.0, 12.0],
    )
    with OtherWork() as other:
        pass
    # own: (160 + 25 + 67 + 40) - (100 + 5 + 7 + 10) = 170 ticks; other: 500 - 170 = 330 over 2 s
    assert dataclasses.astuple(other.result) == pytest.approx((2.0, 2, 0.85, 1.65, 0.15))
    assert not other.result.quiet


def test_a_machine_with_nothing_else_running_is_quiet(monkeypatch):
    me = os.getpid()
    _Readings(
        monkeypatch,
        cores=[(1000, 0), (1201, 0)],  # 201 ticks: this process's 200 and one of housekeeping
        processes=[{me: (1, 0)}, {me: (1, 200)}],
        clock=[0.0, 1.0],
    )
    with OtherWork() as other:
        pass
    assert other.result.other_cores == pytest.approx(0.01)
    assert other.result.quiet
    assert "other processes used 0.01 and other machines 0.00 of its 2 cores" in other.result.line("x")


def test_other_work_beside_a_spare_core_is_quiet():
    # 2 cores: 2 ranks and a fifth of a core of other work share them
    assert not Contention(5.0, 2, 1.9, 0.2, 0.0).quiet
    assert not Contention(5.0, 2, 1.9, 0.0, 0.2).quiet  # the hypervisor's steal alike
    # 16 cores: 3 cores of other work leave 11 idle beside the 2 ranks
    assert Contention(5.0, 16, 1.9, 3.0, 0.1).quiet
    assert not Contention(5.0, 16, 1.9, 13.5, 0.0).quiet  # no whole core to spare
    assert Contention(5.0, 1, 1.0, 0.05, 0.0).quiet  # housekeeping, however few the cores


def test_nothing_is_known_without_proc(monkeypatch):
    monkeypatch.setattr(contention, "_core_ticks", lambda _: None)
    with OtherWork() as other:
        pass
    assert other.result is None


@linux_proc
def test_this_process_and_its_waited_for_child_are_read_from_proc(tmp_path):
    ticks = contention._process_ticks()
    assert ticks[os.getpid()][0] == os.getppid()
    before = contention._tree_ticks(os.getpid(), ticks)[os.getpid()]
    done = tmp_path / "done"
    subprocess.run([sys.executable, "-c", _BURN.format(s=0.5), str(done)], check=True)
    after = contention._tree_ticks(os.getpid(), contention._process_ticks())[os.getpid()]
    # the child's 0.5 s (50 ticks at 100 Hz), less a few ticks of sampling
    assert after - before >= 0.4 * os.sysconf("SC_CLK_TCK")


@linux_proc
@pytest.mark.timeout(150)
def test_a_process_that_is_not_ours_counts_as_other(tmp_path):
    done = tmp_path / "done"
    burn = [sys.executable, "-c", _BURN.format(s=0.5), str(done)]
    with OtherWork() as other:
        # started by a shell that exits at once: the burner is no descendant of this process
        subprocess.run(["sh", "-c", '"$@" &', "sh", *burn], check=True)
        _wait_for(done)
    # its 0.5 s of CPU time are other work (whatever else the machine ran only adds)
    assert other.result.other_cores * other.result.seconds >= 0.4
