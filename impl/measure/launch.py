"""Launching local multi-process jobs: a free port, and torchrun as every experiment runs it."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys

from .parallel import die_with_parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for a rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(nproc: int, module: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N -m module args`` on this machine, one thread per process (the
    processes share its cores), output captured, killed with the caller and after ``timeout``
    seconds (subprocess.TimeoutExpired)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "-m", module, *args]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=functools.partial(die_with_parent, os.getpid()),
    )  # fmt: skip
