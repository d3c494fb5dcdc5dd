"""Run independent, CPU-bound measurement points in worker processes, results as they finish.

No process outlives the run: a worker asks the kernel to be killed when its parent dies (Linux
``PR_SET_PDEATHSIG``), an interrupted or failing map terminates its workers at once, and
``sigterm_as_interrupt`` makes SIGTERM unwind the parent like Ctrl-C (cleanup runs, a result
file's run stays resumable) instead of killing it on the spot.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from tqdm import tqdm

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(
    parent: int, watchdog_s: float | None = None, sig: signal.Signals = signal.SIGKILL
) -> None:
    """Have the kernel send this process ``sig`` (SIGKILL unless it cleans up on another) when
    ``parent`` exits (Linux); exit now if it already has. ``watchdog_s``: also poll the parent
    every that many seconds from a daemon thread (for platforms without the signal, or children
    started by a thread that may end first)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no prctl: the watchdog still holds
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(1)
    if watchdog_s is not None:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(watchdog_s)
            os._exit(1)

        threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


# Set by a launcher (measure.launch.run_torchrun) for the ranks its launcher (torchrun) starts:
# the launching process's pid, so that a rank that arms its guard after torchrun died can tell
LAUNCHER_PID_ENV = "MEASURE_LAUNCHER_PID"


def die_with_launcher(launcher: int | None = None) -> None:
    """For a rank started by a launcher process (torchrun, a forkserver), first thing: die with its
    parent, and with the process that started the launcher (``launcher``, or ``LAUNCHER_PID_ENV``
    where set), now if that is already gone. torchrun starts its ranks in sessions of their own and
    dies with its own parent (``run_torchrun``), so without this a killed run leaves its ranks
    waiting for peers; a rank still importing torch when the run was killed finds its parent
    replaced by init, which never dies; and multiprocessing's forkserver outlives its client for as
    long as the ranks it forked live (they hold its liveness pipe), so only the client's end can
    end them."""
    die_with_parent(os.getppid())
    if launcher is None and LAUNCHER_PID_ENV in os.environ:
        text = os.environ[LAUNCHER_PID_ENV]
        if not text.isdigit():
            raise SystemExit(f"error: {LAUNCHER_PID_ENV}={text!r} must be a process id")
        launcher = int(text)
    if launcher is not None:
        _exit_when_gone(launcher)


# The process die_with_launcher watches: (its pid, its pidfd or None where Linux has none)
_watched: tuple[int, int | None] | None = None


def launcher_gone() -> bool:
    """Whether the process ``die_with_launcher`` watches has ended (its watchdog is about to exit
    this one); False where none is watched. A killed process its parent has not reaped yet has
    ended: its pidfd says so, where ``kill(pid, 0)`` still finds it."""
    if _watched is None:
        return False
    pid, fd = _watched
    if fd is not None:
        return bool(select.select([fd], [], [], 0)[0])
    return not _alive(pid)


def _exit_when_gone(pid: int) -> None:
    """Exit as soon as process ``pid`` has ended (a daemon thread waits on its pidfd, which cannot
    name a later process that reuses the number; polled each second where Linux has no pidfd)."""
    global _watched
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        print(f"error: the process that launched this one (pid {pid}) has ended", file=sys.stderr, flush=True)
        os._exit(1)
    except (AttributeError, OSError):  # not Linux >= 5.3
        fd = None
    _watched = (pid, fd)

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has ended
        else:
            while _alive(pid):
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process under that pid: ours is gone
        return False
    return True


# The signal that asked this process to stop (``sigterm_as_interrupt``'s handler), None before one
_stop_requested: str | None = None


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt a signal asked for, again: where it was raised, code may have
    dropped it. Python drops an exception raised in a weakref callback or a finalizer after
    printing "Exception ignored in ...", and torch.compile runs its code there: about 1 Ctrl-C in 9
    during a compile was dropped so, and the run finished as if never interrupted (M1). Called
    after each measured call and point (``measure.timing``, ``measure.results``)."""
    if _stop_requested is not None:
        raise KeyboardInterrupt(_stop_requested)


def interrupt_handled() -> None:
    """Called by a command's one-line handler once it has reported the interrupt: the request is
    done with, so ``raise_if_interrupted`` raises nothing more in this process (a later run in it,
    such as a test calling ``main`` again, starts clean); and the process exits with the status
    the line goes with. CPython records a KeyboardInterrupt that left an ``eval``/``exec`` of a
    string (sympy's parser runs one) as unhandled, caught or not, and a ``python -m`` process then
    ends by SIGINT (-2) whatever status it exits with: the smoke's kill test saw its one line and
    then -2, three times in loaded suites. The record is cleared as each such evaluation starts,
    so one harmless evaluation here clears it."""
    global _stop_requested
    _stop_requested = None
    eval("None")  # clears CPython's unhandled-KeyboardInterrupt record (above)


def sigterm_as_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, as SIGINT does (cleanup then runs).
    Only the first of them does: the ones after it are dropped while the run cleans up (two
    Ctrl-C's 10 ms apart raised the second inside the cleanup: a traceback after the one-line
    message, or chained tracebacks ending in 'release unlocked lock' and no message at all).
    Dropped by a Python handler, not SIG_IGN, which a process started afterwards would inherit
    through exec. A SIGINT ignored on entry (``nohup``, a script's ``cmd &``) stays ignored. The
    first is also recorded, for ``raise_if_interrupted`` to raise where it was swallowed."""
    global _stop_requested
    _stop_requested = None  # a new run's handlers: nothing asked of it yet

    def drop(signum, frame) -> None:
        pass

    def interrupt(signum, frame):
        global _stop_requested
        for sig in handled:
            signal.signal(sig, drop)
        _stop_requested = f"signal {signum}"
        raise KeyboardInterrupt(_stop_requested)

    handled = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        handled.append(signal.SIGINT)
    for sig in handled:
        signal.signal(sig, interrupt)


@contextlib.contextmanager
def interrupted_in_one_line(prog: str | None = None, kept: str = "what was written stays") -> Iterator[None]:
    """A command's body that Ctrl-C or ``kill`` ends with one line on stderr and status 130, where
    Ctrl-C printed a KeyboardInterrupt traceback and SIGTERM ended it without a word (probe round
    5). ``prog``: the command as argparse names it by default; ``kept``: what the interruption
    leaves behind. A signal that arrives during the imports before it is Python's own."""
    sigterm_as_interrupt()
    try:
        yield
    except KeyboardInterrupt:
        interrupt_handled()
        print(f"{prog or os.path.basename(sys.argv[0])}: interrupted ({kept})", file=sys.stderr)
        raise SystemExit(130) from None


def no_tqdm_semaphore() -> None:
    """For a process multiprocessing started by spawn or forkserver, first thing: tqdm's class-wide
    lock (made by the first bar, torch.compile's among them) without its multiprocessing half.
    There that half is a named semaphore registered with the parent's resource tracker, unlinked
    only when garbage-collected, which a child ended by a signal (an interrupted run terminates
    its children) or by multiprocessing's os._exit never is: the tracker then printed "There
    appear to be 1 leaked semaphore objects" as the run ended. Such a child shares no bar with
    another process: tqdm's thread lock is all it needs."""
    from tqdm.std import TqdmDefaultWriteLock

    TqdmDefaultWriteLock.mp_lock = None  # read by create_mp_lock: no multiprocessing lock made


def _init_worker(parent: int) -> None:
    die_with_parent(parent)
    no_tqdm_semaphore()
    import torch

    torch.set_num_threads(1)  # fake-tensor estimates are Python-bound: one process per core instead
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _timed(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def map_points(
    fn: Callable[..., object], todo: Sequence[tuple], jobs: int, desc: str
) -> Iterator[tuple[tuple, object, float]]:
    """Yield (args, fn(*args), seconds) for each args in ``todo`` as soon as it is done (any order).

    A failure or an interruption cancels the queued points, terminates the running ones and is
    raised at once (not after the whole queue).
    """
    if not todo:
        return
    ctx = multiprocessing.get_context("spawn")  # no fork after torch has started threads
    pool = ProcessPoolExecutor(
        max_workers=max(1, jobs), mp_context=ctx, initializer=_init_worker, initargs=(os.getpid(),)
    )
    try:
        futures = {pool.submit(_timed, fn, *args): args for args in todo}
        for fut in tqdm(as_completed(futures), total=len(futures), desc=desc, unit="point"):
            yield futures[fut], *fut.result()
    except BaseException:
        # A running point may take minutes: do not wait for it. The executor has no public way to
        # stop its workers before Python 3.14 (terminate_workers), hence its process table.
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
