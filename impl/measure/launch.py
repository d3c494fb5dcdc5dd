"""Launching local multi-process jobs: torchrun as every experiment runs it, and a rendezvous store
served by the launching process.

No port is picked free and handed on to be bound later: in between, another process can take it
(gloo's own connections use ephemeral ports), and a rank then fails with EADDRINUSE (a fresh CI run
did). The store's socket is bound to a port the OS assigns as it binds (port 0), by the launcher,
before any rank starts, and the ranks join it as clients.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

from .checks import finite, real, whole
from .parallel import LAUNCHER_PID_ENV, die_with_parent

if TYPE_CHECKING:
    from torch.distributed import TCPStore

HOST = "127.0.0.1"
# the folder of torchrun's logs (run_torchrun): a killed launcher's own, left only by SIGKILL
TORCHRUN_LOGS_PREFIX = "torchrun_logs_"
# how long an interrupted launch's torchrun has to stop its ranks before it is killed
STOP_GRACE_S = 15.0


# what torchrun (or measure.fork_launch) sets for a rank, each a whole number
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def launch_env_problem(module: str) -> str | None:
    """What is wrong with this process's launch as a rank of ``python -m module`` under torchrun,
    in one line, or None: a launch variable that is not a whole number (torch's own error would not
    name it), or none at all (run as a plain script: torch's error names RANK, not the launcher)."""
    for name in LAUNCH_ENV:
        if name in os.environ and not os.environ[name].isdigit():
            return f"{name}={os.environ[name]!r} must be a whole number (torchrun sets it)"
    if "RANK" not in os.environ:
        return f"no RANK in the environment: launch it with torchrun --nproc-per-node N -m {module} ..."
    return None


def serve_rendezvous() -> TCPStore:
    """A rendezvous store served by this process (a thread of its own) on a port the OS assigned as
    it bound it (``.port``); it stops when the object is dropped."""
    from torch.distributed import TCPStore

    return TCPStore(HOST, 0, is_master=True, wait_for_workers=False)


def agent_store_env(port: int) -> dict[str, str]:
    """The environment under which a rank's ``init_process_group`` (env://) joins a store served on
    ``port`` as a client instead of hosting one: torchrun's convention for its agent's store."""
    return {
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def run_torchrun(
    nproc: int, module: str, args: list[str], timeout: float, threads: int = 1
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N -m module args`` on this machine, ``threads``
    threads a process (OMP_NUM_THREADS; default one: the processes share its cores), output
    captured, killed with the caller and after ``timeout`` seconds (subprocess.TimeoutExpired).
    ``--standalone``: torchrun's agent serves the rendezvous on a port it binds as the OS assigns
    it (see the module's docstring). Ranks that call ``measure.parallel.die_with_launcher`` die
    with it. torchrun's log folder is one of this call's own, removed when it returns: by default
    torchrun makes one in TMPDIR per launch and never removes it (the suite left one a launch in
    /tmp). ``nproc`` is a whole number >= 1 and ``timeout`` a finite number of seconds > 0
    (``threads`` a whole number >= 1), checked before anything starts (no wait here is unbounded:
    torchrun's own refusal of a bad count came only after it had started, and ``str()`` let ``"2"``
    and ``True`` through). Raises TypeError or ValueError, one line."""
    if not whole(nproc):
        raise TypeError(f"run_torchrun: nproc is a whole number of processes >= 1, got {nproc!r}")
    if nproc < 1:
        raise ValueError(f"run_torchrun: nproc is a whole number of processes >= 1, got {nproc!r}")
    if not finite(timeout) or timeout <= 0:
        wrong = ValueError if real(timeout) else TypeError  # None, a string: not a number at all
        raise wrong(f"run_torchrun: timeout is a finite number of seconds > 0, got {timeout!r}")
    if not whole(threads, 1):
        raise ValueError(f"run_torchrun: threads is a whole number >= 1, got {threads!r}")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), LAUNCHER_PID_ENV: str(os.getpid())}
    with tempfile.TemporaryDirectory(prefix=TORCHRUN_LOGS_PREFIX) as logs:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--log-dir",
            logs,
            "-m",
            module,
            *args,
        ]
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # the time limit, Ctrl-C, or SIGTERM unwound as one
            _stop(proc)
            raise
        return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _stop(proc: subprocess.Popen) -> None:
    """torchrun stopped before this call returns: SIGTERM, which it passes on to its ranks and waits
    for them (so none outlives the call: killed at once, as subprocess.run does, torchrun left its
    ranks to notice on their own, and they outlived an interrupted run by up to 0.9 s), then
    SIGKILL after ``STOP_GRACE_S``."""
    proc.terminate()
    try:
        proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
