"""Checks of arguments and of this machine, one home for every package (torch-free, so the
planner and the latency model use them without loading torch)."""

from __future__ import annotations

import math
import numbers
import os
import re


def whole(value: object, least: int | None = None) -> bool:
    """``value`` is a whole number (>= ``least`` where given): a Python or numpy integer, never a
    bool (True is 1) or a float that happens to be whole."""
    # the common case first: the planners check millions of plain ints, and an ABC's isinstance
    # is ten times slower (type() is exact: a bool is not an int here)
    integral = type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))
    return integral and (least is None or value >= least)


def real(value: object) -> bool:
    """``value`` is a real number (Python's or numpy's, NaN and infinities included), never a bool
    or a string that would convert ("0.0")."""
    return type(value) in (float, int) or (isinstance(value, numbers.Real) and not isinstance(value, bool))


def fraction(value: object) -> bool:
    """``value`` is a real number (``real``) in [0, 1]."""
    return real(value) and 0.0 <= value <= 1.0


def finite(value: object) -> bool:
    """``value`` is a real number (``real``) that is neither NaN nor infinite, nor a whole number
    beyond a float's range (every use converts it to a float: math.isfinite raised OverflowError)."""
    try:
        return real(value) and math.isfinite(value)
    except OverflowError:
        return False


def device_name(value: str) -> bool:
    """``value`` names a device the runs take: ``cpu``, ``cuda`` or ``cuda:N`` (a prefix test let
    ``cpux`` and ``cudafoo`` through, to fail in torch after the run had opened)."""
    return re.fullmatch(r"cpu|cuda(:[0-9]+)?", value) is not None


# a container's memory limit: cgroup v2's, then v1's (which says "no limit" as a huge number)
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def machine_memory_bytes(limits: tuple[str, ...] = CGROUP_MEMORY_LIMITS) -> int:
    """The memory this process's machine gives it (what a shape or a state must fit in before any
    work): the physical memory, or a container's limit where that is less (its node's physical
    memory is what the page count says there)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in limits:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(physical, int(text))
    return physical


def usable_cores() -> int:
    """The cores this process may run on: its affinity (a container's or taskset's share), where
    ``os.cpu_count()`` counts the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (not Linux)
        return os.cpu_count() or 1
