"""measure.parallel.sigterm_as_interrupt: the first SIGINT or SIGTERM unwinds the run as Ctrl-C
does, and the ones after it are ignored while it cleans up (two Ctrl-C's 10 ms apart raised the
second inside the cleanup: a traceback after the run's one-line message)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys, time
from measure.parallel import sigterm_as_interrupt
if sys.argv[1] == "installed":
    sigterm_as_interrupt()
try:
    print("ready", flush=True)  # inside: the first signal may come as soon as it is read
    for _ in range(6000):  # a minute, in sleeps short enough that each return runs the handler
        time.sleep(0.01)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("cleaning", flush=True)  # the cleanup: the second signal arrives while it waits
    sys.stdin.readline()  # the parent's line, written once it has sent the second signal
    print("cleaned up", flush=True)
"""

# No wait here counts on a signal breaking a long system call: one taken just before the call
# begins (after Python's last check for pending handlers) leaves it unbroken, and the child once
# slept out a whole sleep(60) so (a CI run, stop 67). Python runs a pending handler as the next call
# returns: the first wait is short sleeps; the second, a line the parent writes after its signal,
# so the signal is taken before the read returns it: no sleep to time against.


def as_from_a_terminal() -> None:
    # a suite started in the background (a script's `cmd &`) passes SIGINT on ignored, and Python
    # then leaves it ignored (see tests/mist/test_mist_faults.py): the child gets a terminal's
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _interrupted_twice(mode: str, second: signal.Signals) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, mode],
        cwd=REPO,
        env={"PYTHONPATH": f"{REPO / 'impl'}"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == "cleaning"
        proc.send_signal(second)
        out, err = proc.communicate(input="sent\n", timeout=30)
    finally:
        proc.kill()  # a no-op once it has ended; never left running by a failed test
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


_LATER_CHILD = """
import signal, subprocess, sys
from measure.parallel import sigterm_as_interrupt
sigterm_as_interrupt()
try:
    signal.raise_signal(signal.SIGTERM)
except KeyboardInterrupt:
    pass
# a process started after the interrupt: its SIGTERM is the default one, not inherited as ignored
child = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)"]
print(subprocess.run(child, capture_output=True, text=True, timeout=30).stdout.strip())
"""


@pytest.mark.timeout(60)
def test_a_process_started_after_the_interrupt_gets_default_signals():
    done = subprocess.run(
        [sys.executable, "-c", _LATER_CHILD],
        cwd=REPO,
        env={"PYTHONPATH": f"{REPO / 'impl'}"},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0 and done.stdout.strip() == "True", (done.stdout, done.stderr)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_during_the_cleanup_is_ignored(second):
    done = _interrupted_twice("installed", second)
    assert done.returncode == 0 and done.stdout.strip() == "cleaned up", (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_control_without_it_the_second_signal_breaks_the_cleanup():
    done = _interrupted_twice("default", signal.SIGINT)
    assert "cleaned up" not in done.stdout and "KeyboardInterrupt" in done.stderr, (done.stdout, done.stderr)


_EVALUATED = """
import sys
from measure.parallel import interrupt_handled

def interrupted():
    raise KeyboardInterrupt("signal 15")

try:
    eval("interrupted()")  # a KeyboardInterrupt that leaves an evaluated string (sympy's parser)
except KeyboardInterrupt:
    print("interrupted: one line", file=sys.stderr)
    if sys.argv[1] == "handled":
        interrupt_handled()
sys.exit(130)
"""


@pytest.mark.parametrize(("mode", "status"), [("handled", 130), ("control", -signal.SIGINT)])
def test_an_interrupt_that_left_an_evaluated_string_keeps_the_exit_status(tmp_path, mode, status):
    """The smoke's kill test saw the smoke print its one line and then end by SIGINT (-2) instead
    of exiting 130: CPython records a KeyboardInterrupt that left an ``eval`` of a string as
    unhandled, caught or not, and a ``python -m`` process then ends by SIGINT at exit. A command's
    one-line handler calls ``interrupt_handled``, which clears the record; the control, which does
    not, ends by SIGINT."""
    (tmp_path / "evaluated_interrupt.py").write_text(_EVALUATED)
    proc = subprocess.run(
        [sys.executable, "-m", "evaluated_interrupt", mode],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "impl")},
        preexec_fn=as_from_a_terminal,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == status, proc.stderr.decode()[-2000:]
    assert proc.stderr.decode().strip() == "interrupted: one line"


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux's (>= 5.3)")
def test_launcher_gone_sees_a_launcher_ended_but_not_yet_reaped(monkeypatch):
    """A benchmark rank whose collective fails as a killed run's peers go exits quietly when its
    launcher has ended (mist.engine.profiler.ranks). A killed launcher its parent has not reaped
    is a zombie, which kill(pid, 0) still finds (the control); its pidfd says it has ended."""
    import time

    from measure import parallel

    sleeper = subprocess.Popen(["sleep", "60"])
    fd = os.pidfd_open(sleeper.pid)
    try:
        monkeypatch.setattr(parallel, "_watched", (sleeper.pid, fd))
        assert not parallel.launcher_gone()
        sleeper.kill()  # not waited for: a zombie until wait() below
        deadline = time.monotonic() + 10
        while not parallel.launcher_gone():
            assert time.monotonic() < deadline, "the killed process never showed as ended"
            time.sleep(0.01)
        assert parallel._alive(sleeper.pid)  # the control: signal 0 still reaches the zombie
        monkeypatch.setattr(parallel, "_watched", None)
        assert not parallel.launcher_gone()  # nothing watched: nothing gone
    finally:
        sleeper.kill()
        sleeper.wait()
        os.close(fd)
