"""The seed sweep: every test that draws random inputs, run under many seeds (``nox -s seed_sweep``).

A pytest plugin (``-p tests.sweep``), never loaded by the plain suite. Two runs of pytest:

1. ``--random-inventory FILE`` runs the suite once and writes, for each test that ran, whether it
   drew random inputs (tests/conftest.py's ``fresh_seed`` decides: it asked for the seed or ``rng``,
   is a Hypothesis test, or moved torch's, numpy's or Python's global generator), whether it is
   marked ``slow`` and its seconds.
2. ``--sweep FILE`` runs each test the inventory marks random under ``--seeds`` seeds (default 200)
   if it is fast (not marked slow, and under ``--fast-under`` seconds in the inventory, default 1),
   else under ``--slow-seeds`` (default 20). The seeds are derived from one base (printed; give it
   with ``--sweep-base`` to replay a whole sweep), and a failing instance's id holds its seed:
   ``TEST_SEED=<seed> pytest <id without the seed>`` replays it alone (after the settings the sweep
   ran under, ``--replay-env NAME=VALUE``: the thread count, a narrower instruction set's caps).

The sweep resumes: every instance that passes is appended to ``FILE.progress`` (a header line with
the base and counts, then a node id a line), and a rerun with the same options skips what passed.
``--sweep-restart`` starts again with fresh seeds.

Every instance that fails is appended to ``FILE.failures`` as it fails (a JSON object a line: the
test, its seed, the sweep's base, the phase, the error's first line and the command that replays
it), so a sweep stopped early, or a failure that passes when the sweep resumes (a failure by load,
not by its seed), still names what failed. The file is never truncated: each line carries its base.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("seed sweep", "run every test that draws random inputs under many seeds")
    group.addoption("--random-inventory", metavar="FILE", help="write which tests drew random inputs")
    group.addoption("--sweep", metavar="FILE", help="an inventory: sweep the tests it marks random")
    group.addoption("--seeds", type=int, default=200, help="seeds a fast test runs under (default 200)")
    group.addoption("--slow-seeds", type=int, default=20, help="seeds a slow test runs under (default 20)")
    group.addoption(
        "--fast-under", type=float, default=1.0, help="a test is fast under this many seconds (default 1)"
    )
    group.addoption("--sweep-base", type=int, help="derive the seeds from this base (default: fresh)")
    group.addoption("--sweep-restart", action="store_true", help="forget a previous sweep's progress")
    group.addoption(
        "--replay-env",
        action="append",
        default=[],
        type=_environment_setting,
        metavar="NAME=VALUE",
        help="set first in each failure's replay command: what the sweep runs under (threads, ISA caps)",
    )


def _environment_setting(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):  # a shell variable's name
        raise argparse.ArgumentTypeError(f"{text!r}: --replay-env takes NAME=VALUE")
    return name, value


def pytest_configure(config: pytest.Config) -> None:
    inventory = config.getoption("random_inventory")
    if inventory is not None and not _is_xdist_worker(config):
        config.pluginmanager.register(Inventory(Path(inventory)), "random-inventory")
    if config.getoption("sweep") is not None:
        config.pluginmanager.register(Sweep.from_options(config), "seed-sweep")


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class Inventory:
    """Writes, at the end, which tests drew random inputs, are marked slow, and took how long: read
    off the tests' reports, so it works under xdist too (the controller sees every report)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.tests.setdefault(report.nodeid, {"seconds": 0.0, "slow": "slow" in report.keywords})
        entry["seconds"] += report.duration
        properties = dict(report.user_properties)
        if report.when == "teardown" and "draws_random" in properties:  # set by conftest.py's fresh_seed
            entry["draws_random"] = properties["draws_random"]

    def pytest_sessionfinish(self) -> None:
        import torch  # here, not at import: a sweep of tests that never import torch need not

        tests = {
            nodeid: {**entry, "seconds": round(entry["seconds"], 3)}
            for nodeid, entry in self.tests.items()
            if "draws_random" in entry  # else not run (skipped) or its setup failed before the seed
        }
        body = {
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "tests": tests,
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
        os.replace(tmp, self.path)  # atomic: an interrupted run leaves the previous inventory whole


def _positive(config: pytest.Config, name: str) -> float:
    value = config.getoption(name)
    if not value > 0:
        raise pytest.UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    return value


def _read_inventory(path: Path) -> tuple[dict, str]:
    """The inventory's tests and the digest of its text (a sweep resumes only on the same one)."""
    try:
        text = path.read_text()
        tests = json.loads(text)["tests"]
        for entry in tests.values():
            (entry["draws_random"], entry["slow"], float(entry["seconds"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise pytest.UsageError(
            f"--sweep {path}: not an inventory written by --random-inventory ({type(e).__name__}: {e})"
        ) from None
    return tests, hashlib.sha256(text.encode()).hexdigest()


def _resume(progress: Path, header: dict, restart: bool) -> tuple[dict, list[str]]:
    """The header and passed ids (the file's lines) of a previous sweep with these options, else a
    fresh header (written, with a fresh base unless one was given) and none."""
    if progress.exists() and not restart:
        lines = progress.read_text().splitlines()
        try:
            previous = json.loads(lines[0])
        except (IndexError, ValueError):
            previous = None
        same = previous is not None and all(previous.get(k) == v for k, v in header.items() if k != "base")
        if same and header["base"] in (None, previous["base"]):
            return previous, lines[1:]  # a torn last line names no test: harmless
    if header["base"] is None:
        header = {**header, "base": int.from_bytes(os.urandom(4), "little")}
    progress.write_text(json.dumps(header) + "\n")
    return header, []


GC_EVERY_BYTES = 1 << 30


def _resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere, where the sweep then never collects)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Sweep:
    """Runs the inventory's random tests, each under its count of seeds, and records what passed."""

    def __init__(
        self,
        counts: dict[str, int],
        seconds: dict[str, float],
        seeds: list[int],
        header: dict,
        progress: Path,
        failures: Path,
        passed: list[str],
        writes: bool,
        replay_env: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.counts = counts  # inventory node id -> seeds it runs under
        self.seconds = seconds  # inventory node id -> its seconds in the inventory's run
        self.seeds = seeds
        self.header = header  # the progress file's first line: the options and the base
        self.base = header["base"]
        self.progress = progress
        self.passed = set(passed)  # instance node ids a previous run of this sweep passed
        self.passed_lines = len(passed)  # the progress file's lines after the header, at the start
        self.writes = writes  # the progress file: by one process (under xdist the controller)
        self.collected_at = _resident_bytes()
        self.failed: set[str] = set()
        self.failures = failures
        self.replay_env = replay_env  # (name, value): what a failure's replay command sets first
        self.functions = {nodeid.split("[", 1)[0] for nodeid in counts}

    @classmethod
    def from_options(cls, config: pytest.Config) -> Sweep:
        path = Path(config.getoption("sweep"))
        tests, digest = _read_inventory(path)
        fast, slow = int(_positive(config, "seeds")), int(_positive(config, "slow_seeds"))
        fast_under = _positive(config, "fast_under")
        header = {
            "inventory": digest,
            "seeds": fast,
            "slow_seeds": slow,
            "fast_under": fast_under,
            "base": config.getoption("sweep_base"),
        }
        progress, failures = path.with_name(path.name + ".progress"), path.with_name(path.name + ".failures")
        if _is_xdist_worker(config):  # the controller's sweep: same seeds, same instances left to run
            header, known = config.workerinput["seed_sweep_header"], config.workerinput["seed_sweep_passed"]
            # the controller's passed ids are the file's first lines (it only appends); a worker that
            # replaces a crashed one must collect the same items as the others did
            passed = progress.read_text().splitlines()[1 : 1 + known]
        else:
            header, passed = _resume(progress, header, config.getoption("sweep_restart"))
        counts, seconds = {}, {}
        for nodeid, entry in tests.items():
            if entry["draws_random"]:
                is_fast = not entry["slow"] and entry["seconds"] < fast_under
                counts[nodeid] = fast if is_fast else slow
                seconds[nodeid] = entry["seconds"]
        seeds = [int(s) for s in np.random.SeedSequence(header["base"]).generate_state(max(fast, slow))]
        return cls(
            counts,
            seconds,
            seeds,
            header,
            progress,
            failures,
            passed,
            writes=not _is_xdist_worker(config),
            replay_env=tuple(config.getoption("replay_env")),
        )

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """What this sweep runs, printed even under -q (which hides pytest's header)."""
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and self.writes:
            reporter.write_line(self._summary())

    def _failures_before(self) -> int:
        """Failures this sweep (its base) recorded in earlier runs."""
        try:
            lines = self.failures.read_text().splitlines()
        except OSError:
            return 0
        count = 0
        for line in lines:
            with contextlib.suppress(ValueError, AttributeError):  # a torn last line
                count += json.loads(line).get("base") == self.base
        return count

    def _summary(self) -> str:
        tiers: dict[int, int] = {}
        for count in self.counts.values():
            tiers[count] = tiers.get(count, 0) + 1
        total = sum(self.counts.values())
        minutes = sum(self.counts[i] * self.seconds[i] for i in self.counts) / 60
        left = minutes * (1 - len(self.passed) / max(total, 1))
        return (
            f"seed sweep: {' + '.join(f'{n} tests x {c} seeds' for c, n in sorted(tiers.items())[::-1])} = "
            f"{total} runs, {len(self.passed)} passed before; about {left:.0f} min of test time left at the "
            f"inventory's speed; base {self.base} (--sweep-base {self.base} replays the sweep); "
            f"{self._failures_before()} failures recorded before in {self.failures}"
        )

    @pytest.fixture
    def sweep_seed(self, request: pytest.FixtureRequest) -> int:
        """The seed this instance runs under (conftest.py's fresh_seed reads it off the callspec)."""
        return request.param

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if metafunc.definition.nodeid not in self.functions:
            return
        metafunc.fixturenames.append("sweep_seed")
        metafunc.parametrize("sweep_seed", self.seeds, indirect=True, ids=[f"seed={s}" for s in self.seeds])

    @staticmethod
    def _inventory_id(item: pytest.Item) -> str:
        """A swept instance's id in the inventory: its own parameters, the sweep's seed taken off."""
        head, _, params = item.nodeid.partition("[")
        kept = [p for p in params[:-1].split("-") if p != f"seed={item.callspec.params['sweep_seed']}"]
        return f"{head}[{'-'.join(kept)}]" if kept else head

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        index = {seed: i for i, seed in enumerate(self.seeds)}
        keep, drop = [], []
        for item in items:
            callspec = getattr(item, "callspec", None)
            wanted = (
                callspec is not None
                and "sweep_seed" in callspec.params
                and index[callspec.params["sweep_seed"]] < self.counts.get(self._inventory_id(item), 0)
                and item.nodeid not in self.passed
            )
            (keep if wanted else drop).append(item)
            if wanted:  # reports carry them (xdist too): what a failure's record names
                item.user_properties.append(("sweep_seed", callspec.params["sweep_seed"]))
                item.user_properties.append(("swept_test", self._inventory_id(item)))
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        """xdist: each worker sweeps with the controller's header (its base)."""
        node.workerinput["seed_sweep_header"] = self.header
        node.workerinput["seed_sweep_passed"] = self.passed_lines

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self) -> None:
        """Collect cyclic garbage once this process has grown GC_EVERY_BYTES since it last did. HF
        models hold reference cycles, which only the cyclic collector frees, and it counts objects,
        not bytes: a worker that built a model 180 times grew to 20 GB and was killed for memory."""
        rss = _resident_bytes()
        if rss - self.collected_at > GC_EVERY_BYTES:
            gc.collect()
            self.collected_at = _resident_bytes()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.writes:
            return
        if report.failed:
            self.failed.add(report.nodeid)
            self._record_failure(report)
        elif report.when == "teardown" and report.nodeid not in self.failed:
            with open(self.progress, "a") as f:  # one short line: a torn write loses this instance only
                f.write(report.nodeid + "\n")

    def _replay(self, seed: int, test: str) -> str:
        """The shell command that runs ``test`` alone under ``seed``, in the sweep's environment."""
        settings = [f"{name}={shlex.quote(value)}" for name, value in self.replay_env]
        return " ".join([*settings, f"TEST_SEED={seed}", "python", "-m", "pytest", shlex.quote(test)])

    def _record_failure(self, report: pytest.TestReport) -> None:
        """Append the failed instance to the failures file now: a sweep stopped before pytest's
        summary still names it."""
        properties = dict(report.user_properties)
        seed, test = properties.get("sweep_seed"), properties.get("swept_test", report.nodeid)
        crash = getattr(report.longrepr, "reprcrash", None)  # the exception's line, where pytest has one
        error = (crash.message if crash is not None else report.longreprtext).strip().splitlines()
        record = {
            "test": test,
            "seed": seed,
            "base": self.base,
            "phase": report.when,
            "instance": report.nodeid,
            "error": error[0][:300] if error else "",
            "replay": self._replay(seed, test) if seed is not None else None,
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(self.failures, "a") as f:  # one line: a torn write loses this record only
            f.write(json.dumps(record) + "\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.writes and self.failed:
            terminalreporter.write_line(
                f"seed sweep: {len(self.failed)} instances failed this run, recorded with the "
                f"commands that replay them in {self.failures}"
            )
