"""How much of this process's cores other work took while a timing ran (torch-free).

A time measured on a CPU is this machine's only when nothing else ran: on this 2-core VM a
``nice -n 19`` test run in another session took a whole core (Linux's autogroup, on here, shares the
CPU between sessions equally, whatever their nice) and the scheduler left both ranks of a 2-process
engine launch on the other core: the step took about 2x the quiet launches' (379 ms against
183-202 ms, 2026-12-05, the ranks' cores sampled with ps). So a timing records what it shared the
cores with: ``OtherWork`` reads the busy time of the cores this process may run on (``/proc/stat``)
before and after, takes off what this process and its descendants used (``/proc/<pid>/stat``,
children's time once they are waited for; one whose parent ended first is the init process's child,
and other work), and says how many cores the rest took on average; and how many the hypervisor gave
to other machines (``steal``: a VM's cores running someone else). Where ``/proc`` is not there (not
Linux), nothing is known: ``None``, never a guess.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# /proc/stat's per-core columns after the name: user nice system idle iowait irq softirq steal
_BUSY = (0, 1, 2, 5, 6)  # time a core ran something (guest time is inside user and nice)
_STEAL = 7
# Other work below this many cores on average, over a timing, is the machine's own housekeeping
# (this VM idle: 0.01-0.02 of a core): no contention, however few cores there are.
HOUSEKEEPING_CORES = 0.1


@dataclass(frozen=True)
class Contention:
    """What a timing shared its ``cores`` (the ones this process may use) with, as cores averaged
    over its ``seconds``: other processes' and other machines' (the hypervisor's steal), beside
    what the timed work itself used (``own_cores``: this process and its descendants)."""

    seconds: float
    cores: int
    own_cores: float
    other_cores: float
    steal_cores: float

    @property
    def quiet(self) -> bool:
        """Nothing else ran but housekeeping, or there was a whole core to spare beyond all the
        work together: a many-core machine's other work need not touch a 2-process timing, while
        on 2 cores a third busy process puts two of the three on one core."""
        others = self.other_cores + self.steal_cores
        return others < HOUSEKEEPING_CORES or self.own_cores + others <= self.cores - 1

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def line(self, what: str) -> str:
        """One line saying that ``what`` was timed beside other work (for a run's output)."""
        return (
            f"note: while {what} was timed, other processes used {self.other_cores:.2f} and other machines "
            f"{self.steal_cores:.2f} of its {self.cores} cores on average, beside its own "
            f"{self.own_cores:.2f}: a busy machine's time"
        )


def busiest(records: Iterable[dict | None]) -> float:
    """The most cores other work (processes and other machines) took beside any of ``records``
    (``Contention.as_dict``s; None: nothing known) that was not quiet; 0.0 where every one was."""
    shared = [r["other_cores"] + r["steal_cores"] for r in records if r and not Contention(**r).quiet]
    return max(shared, default=0.0)


def _now() -> float:
    return time.monotonic()


def _ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK")


def _usable_cores() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux: no affinity, no /proc
        return set()


def _core_ticks(cores: set[int]) -> tuple[int, int] | None:
    """(busy, steal) clock ticks summed over ``cores`` since boot; None without /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = steal = 0
    for line in lines:
        name, *columns = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            ticks = [int(c) for c in columns]
            busy += sum(ticks[i] for i in _BUSY)
            steal += ticks[_STEAL]
    return busy, steal


def _process_ticks() -> dict[int, tuple[int, int]]:
    """{pid: (parent pid, user + system ticks of it and of its children it has waited for)} of
    every process readable now."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # it ended between the listing and the read
            continue
        # after the command name, which is in parentheses and may hold spaces and parentheses
        fields = text[text.rindex(")") + 2 :].split()
        # fields[1]: parent pid; [11:15]: utime, stime, cutime, cstime (proc(5), from the state on)
        out[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    return out


def _tree_ticks(root: int, processes: dict[int, tuple[int, int]]) -> dict[int, int]:
    """{pid: ticks} of ``root`` and its descendants among ``processes``."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in processes:
            tree[pid] = processes[pid][1]
            todo += children.get(pid, [])
    return tree


class OtherWork:
    """``with OtherWork() as other: <timed work>``, then ``other.result``: a ``Contention``, or None
    where /proc cannot be read. This process's descendants (ranks, servers, copies) are its own
    work; what a descendant that ended used counts once its parent has waited for it (every
    launcher here waits for its ranks before the block ends)."""

    def __init__(self) -> None:
        self.result: Contention | None = None

    def _sample(self) -> tuple[float, tuple[int, int] | None, dict[int, int]]:
        now = _now()
        ticks = _core_ticks(self._cores)
        tree = _tree_ticks(os.getpid(), _process_ticks()) if ticks is not None else {}
        return now, ticks, tree

    def __enter__(self) -> OtherWork:
        self._cores = _usable_cores()
        self._start = self._sample()
        return self

    def __exit__(self, *exc) -> None:
        t0, ticks0, tree0 = self._start
        t1, ticks1, tree1 = self._sample()
        if ticks0 is None or ticks1 is None or t1 <= t0:
            return
        hz = _ticks_per_second()
        # a descendant alive at the start and gone at the end is in its parent's waited-for time,
        # from its own start: what it had used before the block is taken off with the rest
        own = max(sum(tree1.values()) - sum(tree0.values()), 0)
        other = max((ticks1[0] - ticks0[0]) - own, 0)  # ticks are sampled: never below none
        seconds = t1 - t0
        cores = [ticks / hz / seconds for ticks in (own, other, ticks1[1] - ticks0[1])]
        self.result = Contention(seconds, len(self._cores), *cores)
