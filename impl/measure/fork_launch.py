"""Local multi-process runs forked from one warm process: torchrun's job without its start-up.

``torchrun -m module`` starts every rank as a new Python that imports torch and the module's
libraries again (megatron-core: ~3 s a process, ~5 s of a 6-7 s test run on 2 cores). A
``ForkLauncher`` starts one server process that imports them once (``preload``), then forks each
run's ranks from it: same environment variables as torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one thread a rank, output captured, and torchrun's
rule that one failed rank stops the others. The server must not have started threads or run torch
ops before forking (the preload only imports): it forks a run's ranks first, then serves their
rendezvous store (a thread, gone when the run ends) and sends each rank the store's port. Every
process dies with its parent: ranks with the server, the server with its client; a run past its
timeout is killed and raises TimeoutExpired. The server ends on SIGTERM (what it gets when its
client dies, even by SIGKILL) by killing its ranks and removing the folder of their output, so
that a killed run leaves neither processes nor files.

Used where the same module runs many times on a CPU: the engine's tests and mist_vs_megatron's
CPU launches; on a GPU the experiments launch with torchrun, as a user would.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .launch import agent_store_env, serve_rendezvous
from .parallel import die_with_parent

GRACE_S = 30  # what a run may take beyond its own timeout before the client gives up on the server
FAILURE_GRACE_S = 10  # how long the other ranks may go on after one failed


class ForkLauncher:
    """``run(nproc, module, args, timeout)`` as ``run_torchrun`` does it, forked from a process that
    called ``preload`` ("package.module:function") once."""

    def __init__(self, preload: str) -> None:
        self._preload = preload
        self._server = self._start()
        self._in_flight = False  # a run was sent and not answered (the server is not reading stdin)

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "measure.fork_launch", self._preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            # SIGTERM, not SIGKILL: the server then removes its ranks' output folder (_end_on_sigterm)
            preexec_fn=functools.partial(die_with_parent, os.getpid(), sig=signal.SIGTERM),
        )

    def run(self, nproc: int, module: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        if self._server.poll() is not None or self._server.stdin.closed:  # it died or gave up: a new one
            self._server = self._start()
        request = {"nproc": nproc, "module": module, "args": args, "timeout": timeout}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        self._in_flight = True
        ready, _, _ = select.select([self._server.stdout], [], [], timeout + GRACE_S)
        line = self._server.stdout.readline() if ready else ""
        self._in_flight = not line
        if not line:
            self.close()
            raise RuntimeError(f"the fork server gave no answer within {timeout + GRACE_S:.0f} s (it died?)")
        reply = json.loads(line)
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired([module, *args], timeout, reply["stdout"], reply["stderr"])
        return subprocess.CompletedProcess(
            [module, *args], reply["returncode"], reply["stdout"], reply["stderr"]
        )

    def close(self) -> None:
        """End the server: at once where a run is in flight (this process was interrupted while it
        waited), else once it has read the end of its requests."""
        with contextlib.suppress(OSError):
            self._server.stdin.close()
        if self._in_flight:
            self._server.terminate()  # it kills the run's ranks and removes their output
        for stop in (self._server.terminate, self._server.kill):
            try:
                self._server.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                stop()
        self._server.wait()


def shared(preload: str) -> ForkLauncher:
    """This process's launcher for ``preload``, started on first use and closed at exit (several
    callers in one process share one warm server)."""
    if preload not in _SHARED:
        _SHARED[preload] = ForkLauncher(preload)
        atexit.register(_SHARED[preload].close)
    return _SHARED[preload]


_SHARED: dict[str, ForkLauncher] = {}


def _rank(
    module: str, args: list[str], env: dict[str, str], out: Path, err: Path, server: int, port_pipe: int
) -> None:
    """A forked rank: never returns. It reads the rendezvous store's port from ``port_pipe`` (nothing:
    the server ended before it wrote one)."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's cleanup is not a rank's
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, as a torchrun rank takes it
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # held by the server's fork
        die_with_parent(server)
        port = os.read(port_pipe, 16).decode()
        if not port:
            os._exit(1)
        os.environ.update(env, **agent_store_env(int(port)))
        with open(out, "w") as o, open(err, "w") as e:
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
        import torch

        torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a fresh process
        code = importlib.import_module(module).main(args) or 0
    except SystemExit as e:  # as the interpreter ends: None is 0, a message is printed and 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # what a rank raised: printed, as a fresh interpreter would
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


@contextlib.contextmanager
def _sigterm_held():
    """SIGTERM (the server's cleanup, _end_on_sigterm) held off for a few statements that must not
    be cut between: it runs as soon as they are done."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _serve(request: dict) -> dict:
    """Fork the request's ranks, wait for them (one failing stops the rest, as under torchrun),
    and say what they printed and how they ended. Their output folder goes however this ends."""
    with _sigterm_held():  # made and recorded together: the cleanup never misses a folder
        folder = _IN_FLIGHT["folder"] = Path(tempfile.mkdtemp(prefix="fork_launch_"))
    try:
        return _run_ranks(request, folder)
    finally:
        with _sigterm_held():
            shutil.rmtree(folder, ignore_errors=True)
            _IN_FLIGHT.clear()


def _run_ranks(request: dict, folder: Path) -> dict:
    nproc, server = request["nproc"], os.getpid()
    pids: dict[int, int] = {}
    running = _IN_FLIGHT["running"] = set()  # forked, not yet reaped: what the cleanup may kill
    pipes = [os.pipe() for _ in range(nproc)]  # (read, write): each rank's store port
    sys.stdout.flush()
    sys.stderr.flush()  # else a rank's copy of an unwritten buffer is written twice
    # SIGTERM held while forking: a rank is recorded as running before the cleanup can run, and a
    # rank's cleanup is its default (it would run the server's until _rank resets it)
    with _sigterm_held():
        for rank in range(nproc):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0",
            }
            pid = os.fork()
            if pid == 0:
                for _, write in pipes:
                    os.close(write)
                out, err = folder / f"{rank}.out", folder / f"{rank}.err"
                _rank(request["module"], request["args"], env, out, err, server, pipes[rank][0])
            pids[pid] = rank
            running.add(pid)
    store = serve_rendezvous()  # only now: forking must not copy a process with the store's thread
    for read, write in pipes:
        os.close(read)
        os.write(write, str(store.port).encode())
        os.close(write)
    codes: dict[int, int] = {}
    first_failure = 0  # the exit code of the rank that failed first (the rest were then killed)
    deadline, timed_out = time.monotonic() + request["timeout"], False
    while len(codes) < nproc:
        with _sigterm_held():  # reaped and forgotten together: the cleanup never kills a reused pid
            pid, status = os.waitpid(-1, os.WNOHANG)
            running.discard(pid)
        if pid == 0:
            if time.monotonic() > deadline:
                timed_out = timed_out or not first_failure
                _kill(list(running))
            time.sleep(0.05)
            continue
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and not first_failure:
            # the others may wait in a collective forever, or be writing what they report on the way
            # out (every rank of an over-the-cap run exits 3): they get a grace period, then are killed
            first_failure = codes[pids[pid]]
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    # a rank killed before it opened its files said nothing
    said = lambda path: path.read_text() if path.exists() else ""
    text = {kind: "".join(said(folder / f"{r}.{kind}") for r in range(nproc)) for kind in ("out", "err")}
    del store  # its thread ends before the next run forks
    return {"returncode": first_failure, "stdout": text["out"], "stderr": text["err"], "timed_out": timed_out}


# the run being served: its output folder and its ranks not yet reaped (for _end_on_sigterm)
_IN_FLIGHT: dict = {}


def _end_on_sigterm(signum: int, frame) -> None:
    """The server's SIGTERM (its client ended it, or died): the run's ranks killed, their output
    removed, then exit."""
    _kill(list(_IN_FLIGHT.get("running", ())))
    if "folder" in _IN_FLIGHT:
        shutil.rmtree(_IN_FLIGHT["folder"], ignore_errors=True)
    os._exit(128 + signum)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    """The server: ``python -m measure.fork_launch package.module:function``; one JSON request a
    line on stdin, one JSON reply a line on stdout; ends when stdin closes."""
    (preload,) = argv if argv is not None else sys.argv[1:]
    module, function = preload.split(":")
    signal.signal(signal.SIGTERM, _end_on_sigterm)
    # Ctrl-C reaches the whole process group: the client, interrupted, ends this server by SIGTERM
    # (close), which cleans up; a KeyboardInterrupt here would leave the folder and a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the preload or a rank prints must not mix into the replies
    getattr(importlib.import_module(module), function)()
    for line in sys.stdin:
        replies.write(json.dumps(_serve(json.loads(line))) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
