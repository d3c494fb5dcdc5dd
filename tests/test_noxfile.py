"""The noxfile's sessions that take options of their own (``isa_tests``, ``seed_sweep``): what each
runs for its arguments, and bad arguments refused before anything runs. nox itself is not in the
test environment, so it is stubbed: a session's commands are recorded, not run."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class Refused(Exception):
    """``session.error``: nox ends the session with the message."""


class RecordingSession:
    def __init__(self, *posargs: str) -> None:
        self.posargs = list(posargs)
        self.runs: list[tuple[tuple[str, ...], dict[str, str]]] = []

    def run(self, *args: str, external: bool = False, env: dict[str, str] | None = None) -> None:
        self.runs.append((args, env or {}))

    def error(self, message: str) -> None:
        raise Refused(message)


@pytest.fixture
def noxfile(monkeypatch, tmp_path):
    stub = types.ModuleType("nox")
    stub.session = lambda function: function
    stub.options = types.SimpleNamespace()
    stub.Session = RecordingSession
    monkeypatch.setitem(sys.modules, "nox", stub)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_venv_python", lambda: "python")  # never build the shared env here
    monkeypatch.setattr(module, "SWEEP_DIR", tmp_path)
    return module


def _option(args: tuple[str, ...], prefix: str) -> list[str]:
    return [a.removeprefix(prefix) for a in args if a.startswith(prefix)]


def test_a_sweep_at_a_level_probes_it_and_keeps_its_own_files_and_replays(noxfile, tmp_path):
    session = RecordingSession("--isa=avx2", "--slow-seeds", "5")
    noxfile.seed_sweep(session)
    (probe, probe_env), (inventory_run, inventory_env), (sweep, sweep_env) = session.runs
    caps = noxfile.ISA_LEVELS["avx2"].caps
    assert probe[1:4] == ("-c", noxfile._ISA_PROBE, "avx2") and caps.items() <= probe_env.items()
    [inventory] = _option(inventory_run, "--random-inventory=")
    assert inventory == str(tmp_path / f"inventory-{noxfile._sources_digest()}-avx2.json")
    assert _option(sweep, "--sweep=") == [inventory]  # and so its own .progress and .failures
    for env in (inventory_env, sweep_env):
        assert caps.items() <= env.items() and env["OMP_NUM_THREADS"] == "1"
        assert env["TORCHINDUCTOR_CACHE_DIR"].endswith("inductor-avx2")
    # a failure replays under everything the sweep ran under
    assert _option(sweep, "--replay-env=") == [f"{name}={value}" for name, value in sweep_env.items()]
    assert sweep[-2:] == ("--slow-seeds", "5") and not any(a.startswith("--isa") for a in sweep)


def test_a_sweep_at_the_machines_own_level_runs_uncapped(noxfile, tmp_path):
    session = RecordingSession()
    noxfile.seed_sweep(session)
    (inventory_run, inventory_env), (sweep, sweep_env) = session.runs  # no probe
    assert _option(inventory_run, "--random-inventory=") == [
        str(tmp_path / f"inventory-{noxfile._sources_digest()}.json")
    ]
    assert inventory_env == sweep_env == {"OMP_NUM_THREADS": "1"}
    assert _option(sweep, "--replay-env=") == ["OMP_NUM_THREADS=1"]


def test_isa_tests_runs_the_suite_once_a_level_with_the_callers_marks(noxfile):
    session = RecordingSession("-m", "not slow")
    noxfile.isa_tests(session)
    runs = session.runs
    assert len(runs) == 2 * len(noxfile.ISA_LEVELS)  # a probe and a suite a level
    for (probe, _), (suite, env), name in zip(runs[::2], runs[1::2], noxfile.ISA_LEVELS, strict=True):
        assert probe[3] == name and noxfile.ISA_LEVELS[name].caps.items() <= env.items()
        # each level's suite combines the caller's marks with "not gpu" once (a second level once
        # ran the whole suite: the caller's arguments had been changed in place)
        assert [suite[i + 1] for i, a in enumerate(suite) if a == "-m"][1:] == ["(not slow) and not gpu"]


@pytest.mark.parametrize(
    ("session_name", "args", "message"),
    [
        ("seed_sweep", ["--isa=avx2", "--isa=baseline"], "one --isa level at a time, not 2: avx2, baseline"),
        ("seed_sweep", ["--isa=avx512"], "'--isa=avx512': --isa=LEVEL takes one of avx2, baseline"),
        ("seed_sweep", ["--isa"], "'--isa': --isa=LEVEL takes one of"),
        ("isa_tests", ["--isa="], "'--isa=': --isa=LEVEL takes one of"),
        ("isa_tests", ["--isa", "avx2"], "'--isa': --isa=LEVEL takes one of"),
    ],
)
def test_bad_isa_arguments_are_refused_before_anything_runs(noxfile, tmp_path, session_name, args, message):
    session = RecordingSession(*args)
    with pytest.raises(Refused, match=re.escape(message)):
        getattr(noxfile, session_name)(session)
    assert session.runs == [] and list(tmp_path.iterdir()) == []
