"""The GPU check's two Mist parts (artifacts.mist_vs_megatron.engine and .measured) run in two
processes on one GPU, each call cut at its time budget; with ``--keep DIR`` the second fits the
profile the first kept instead of profiling the device again (only one made for the same setup, on
the same machine, at the same clean commit), and a measured case cut mid-way resumes launch by
launch (only within the same run, only the same plan). The profile, the speed probe, the fit and
the launches are stubbed: what is checked is when work is done again and when it is reused."""

from __future__ import annotations

import dataclasses
import importlib
import json
import time

import pytest

from artifacts.mist_vs_megatron import engine
from measure.contention import Contention


@pytest.fixture
def profiling(monkeypatch):
    """Counts the profiles made; the tree clean at one commit unless a test says otherwise."""
    made = []

    def write_fit_inputs(setup, folder):
        folder.mkdir(parents=True)
        (folder / "layer.json").write_text(json.dumps({"processes": setup.processes}))
        made.append(folder)

    def calibrate(folder):
        assert (folder / "layer.json").is_file()  # fitted to a finished profile only
        return {"fit": {"model": f"fitted to {folder}", "mean_abs_error": 0.05}}

    monkeypatch.setattr(engine, "_write_fit_inputs", write_fit_inputs)
    monkeypatch.setattr(engine, "speed_probe", lambda setup: 0.25)
    # the module, not mist.model's function of the same name
    monkeypatch.setattr(importlib.import_module("mist.model.calibrate"), "calibrate", calibrate)
    monkeypatch.setattr(engine, "git_state", lambda: {"commit": "a" * 40, "dirty": False})
    return made


def _fit(tmp_path, keep, setup=engine.CPU_ENGINE, processes=1):
    return engine.RuntimeFits(tmp_path / "scratch", setup, keep)(processes)


def test_a_second_process_fits_the_kept_profile_instead_of_profiling(profiling, tmp_path):
    kept = tmp_path / "profiles"
    first = _fit(tmp_path, kept)
    second = _fit(tmp_path, kept)  # a new RuntimeFits: another process, as the second part is
    assert len(profiling) == 1 and profiling[0].is_relative_to(kept)
    assert (
        second["profile_kept"] == first["profile_kept"]
        and second["probe_s"] == first["probe_s"] == [0.25] * 2
    )
    assert second["model"] == first["model"]


@pytest.mark.parametrize(
    "change",
    [
        lambda setup: ({"setup": dataclasses.replace(setup, model_overrides={"hidden": 128})}, {}),
        lambda setup: ({"processes": 2}, {}),
        lambda setup: ({}, {"git": {"commit": "b" * 40, "dirty": False}}),
        lambda setup: ({}, {"host": "another-machine"}),
    ],
    ids=["model", "processes", "commit", "host"],
)
def test_a_profile_is_reused_only_for_the_same_setup_machine_and_commit(
    profiling, tmp_path, monkeypatch, change
):
    kept = tmp_path / "profiles"
    _fit(tmp_path, kept)
    fit_args, world = change(engine.CPU_ENGINE)
    if "git" in world:
        monkeypatch.setattr(engine, "git_state", lambda: world["git"])
    if "host" in world:
        monkeypatch.setattr(engine.platform, "node", lambda: world["host"])
    _fit(tmp_path, kept, **fit_args)
    assert len(profiling) == 2  # profiled again, and kept beside the first
    assert len({p.parent for p in profiling}) == 2


def test_a_dirty_tree_profiles_every_time_and_keeps_nothing(profiling, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(engine, "git_state", lambda: {"commit": "a" * 40, "dirty": True})
    kept = tmp_path / "profiles"
    fits = [_fit(tmp_path, kept) for _ in range(2)]
    assert len(profiling) == 2 and not kept.exists() and all("profile_kept" not in f for f in fits)
    assert "not clean at a known commit" in capsys.readouterr().out


def test_an_interrupted_profile_is_made_again(profiling, tmp_path):
    kept = tmp_path / "profiles"
    _fit(tmp_path, kept)
    (profiling[0].parent / engine.PROFILE_RECORD).unlink()  # as a kill before the record leaves it
    _fit(tmp_path, kept)
    assert len(profiling) == 2 and profiling[0] == profiling[1]  # the half-made folder replaced


@pytest.mark.parametrize("script", ["engine", "measured"])
def test_keep_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, script):
    main = importlib.import_module(f"artifacts.mist_vs_megatron.{script}").main
    not_a_folder = tmp_path / "kept"
    not_a_folder.write_text("")
    results = tmp_path / "results"
    with pytest.raises(SystemExit) as stop:
        main(["--cpu-dry-run", "--keep", str(not_a_folder), "--results", str(results)])
    assert stop.value.code == 2 and not results.exists()
    assert f"--keep {not_a_folder}: not a folder" in capsys.readouterr().err


class StubPlan:
    def __init__(self, text: str, tuning_s: float = 0.0) -> None:
        self.text, self.tuning_s = text, tuning_s

    def save(self, path) -> None:
        path.write_text(f"{self.text}\ntuning_s: {self.tuning_s}")  # a file holds the search's time too

    def what_runs(self) -> dict:
        return {"fields": self.text}


class Launches:
    """_launch_once stubbed: each plan's step time from its name and how often it ran; ``cut_after``
    launches, the budget's kill (KeyboardInterrupt, as SIGTERM arrives)."""

    def __init__(self, cut_after: int | None = None) -> None:
        self.made: list[str] = []
        self.cut_after = cut_after

    def __call__(self, plan, processes, args, out, name):
        if self.cut_after is not None and len(self.made) == self.cut_after:
            raise KeyboardInterrupt
        self.made.append(name)
        if name == "oom":
            return {"out_of_memory": True, "report": {"ranks": [{"out_of_memory": True}]}}
        step_s = 0.1 * len(name)  # the same in every launch: a resumed case must equal an uncut one
        contention = Contention(seconds=1.0, cores=2, own_cores=1.0, other_cores=0.0, steal_cores=0.0)
        return {"step_s": step_s, "report": {"plan": plan.text}, "contention": contention}


PLANS = {"mist": "tp: 1", "megatron": "tp: 2", "oom": "tp: 4"}


def _train(tmp_path, monkeypatch, launches, journal, plans=PLANS):
    monkeypatch.setattr(engine, "_launch_once", launches)
    work = tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    # each search takes its own time: no launch of a plan is kept for its file, only for what runs
    stubs = {name: StubPlan(text, tuning_s=time.monotonic()) for name, text in plans.items()}
    return engine.train_plans(stubs, 1, 5, 3, work, journal=journal)


def test_a_case_cut_mid_way_resumes_launch_by_launch_as_if_never_cut(tmp_path, monkeypatch):
    whole = _train(tmp_path / "whole", monkeypatch, Launches(), None)
    journal = tmp_path / "kept" / "launches"
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path, monkeypatch, cut := Launches(cut_after=4), journal)
    rest = Launches()
    resumed = _train(tmp_path, monkeypatch, rest, journal)
    # the 4 launches the cut call finished are not made again; the other 3 are (oom ran once: ended)
    assert len(cut.made) == 4 and len(rest.made) == 7 - 4
    assert resumed == whole  # the same step times, reports, rounds and contention


def test_kept_launches_serve_only_the_same_plan(tmp_path, monkeypatch):
    journal = tmp_path / "kept" / "launches"
    _train(tmp_path, monkeypatch, Launches(), journal)
    again = Launches()
    _train(tmp_path, monkeypatch, again, journal, plans={**PLANS, "mist": "tp: 1\nrecompute: 2"})
    assert again.made == ["mist"] * 3  # mist's plan changed: launched again; the others kept


def test_without_a_journal_nothing_is_kept(tmp_path, monkeypatch):
    _train(tmp_path, monkeypatch, Launches(), None)
    again = Launches()
    _train(tmp_path, monkeypatch, again, None)
    assert len(again.made) == 7 and not (tmp_path / "kept").exists()


def test_a_runs_launches_are_its_own(tmp_path):
    fits = engine.RuntimeFits(tmp_path / "work", engine.CPU_ENGINE, tmp_path / "kept")
    point = {"case": "gpt3", "cap": 1}
    assert fits.launches_folder("run-a", point) == fits.launches_folder("run-a", dict(point))
    assert fits.launches_folder("run-a", point) != fits.launches_folder("run-b", point)  # --fresh: a new run
    assert fits.launches_folder("run-a", point) != fits.launches_folder("run-a", {**point, "cap": 2})
    assert engine.RuntimeFits(tmp_path / "work", engine.CPU_ENGINE).launches_folder("run-a", point) is None
