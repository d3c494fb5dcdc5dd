"""The GPU check's two Mist parts (artifacts.mist_vs_megatron.engine and .measured) run in two
processes on one GPU, each call cut at its time budget; with ``--keep DIR`` the second fits the
profile the first kept instead of profiling the device again (only one made for the same setup, on
the same machine, with the same code and packages), and a measured case cut mid-way resumes launch by
launch (only within the same run, only the same plan). The profile, the speed probe, the fit and
the launches are stubbed: what is checked is when work is done again and when it is reused."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import tempfile
import time

import pytest

from artifacts.experiment import Experiment, experiment_run
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
    keep = tmp_path / "kept"
    first = _fit(tmp_path, keep)
    second = _fit(tmp_path, keep)  # a new RuntimeFits: another process, as the second part is
    assert len(profiling) == 1 and profiling[0].is_relative_to(keep)
    assert first["profile_kept"] == {**second["profile_kept"], "reused": False}  # each says which
    assert second["profile_kept"]["reused"] and second["probe_s"] == first["probe_s"] == [0.25] * 2
    assert second["model"] == first["model"]


def _other_world(monkeypatch, world: dict) -> None:
    if "git" in world:
        monkeypatch.setattr(engine, "git_state", lambda: world["git"])
    if "host" in world:
        monkeypatch.setattr(engine.platform, "node", lambda: world["host"])
    if "machine" in world:
        monkeypatch.setattr(engine, "device_description", lambda device: world["machine"])
    if "packages" in world:
        monkeypatch.setattr(engine, "package_versions", lambda: world["packages"])


SETUP = engine.CPU_ENGINE
CHANGES = {  # what the second fit differs in: its arguments, the world it runs in
    "model": ({"setup": dataclasses.replace(SETUP, model_overrides={"hidden": 128})}, {}),
    "processes": ({"processes": 2}, {}),
    "micro-batch": ({"setup": dataclasses.replace(SETUP, micro_batch=SETUP.micro_batch + 1)}, {}),
    "launches": ({"setup": dataclasses.replace(SETUP, launches=SETUP.launches + 1)}, {}),
    "profile": ({"setup": dataclasses.replace(SETUP, profile={**SETUP.profile, "micro_batches": [1]})}, {}),
    "commit": ({}, {"git": {"commit": "b" * 40, "dirty": False}}),
    "host": ({}, {"host": "another-machine"}),
    "machine": ({}, {"machine": {"device": "cpu", "cpu": "another processor", "cpus": 64}}),
    "packages": ({}, {"packages": {"torch": "0.0"}}),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_profile_is_reused_only_for_the_same_setup_machine_and_code(
    profiling, tmp_path, monkeypatch, change
):
    keep = tmp_path / "kept"
    _fit(tmp_path, keep)
    fit_args, world = CHANGES[change]
    _other_world(monkeypatch, world)
    _fit(tmp_path, keep, **fit_args)
    assert len(profiling) == 2  # profiled again, and kept beside the first
    assert len({p.parent for p in profiling}) == 2


def test_a_dirty_tree_profiles_every_time_and_keeps_nothing(profiling, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(engine, "git_state", lambda: {"commit": "a" * 40, "dirty": True})
    keep = tmp_path / "kept"
    fits = [_fit(tmp_path, keep) for _ in range(2)]
    assert len(profiling) == 2 and not keep.exists() and all("profile_kept" not in f for f in fits)
    assert "not clean at a known commit" in capsys.readouterr().out


@pytest.mark.parametrize("record", ["{not json", '{"key": null}', "[]"])
def test_a_broken_profile_record_is_profiled_again(profiling, tmp_path, record):
    keep = tmp_path / "kept"
    _fit(tmp_path, keep)
    (profiling[0].parent / engine.PROFILE_RECORD).write_text(record)
    second = _fit(tmp_path, keep)
    assert len(profiling) == 2 and not second["profile_kept"]["reused"]


def test_an_interrupted_profile_is_made_again(profiling, tmp_path):
    keep = tmp_path / "kept"
    _fit(tmp_path, keep)
    (profiling[0].parent / engine.PROFILE_RECORD).unlink()  # as a kill before the record leaves it
    _fit(tmp_path, keep)
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
    # each plan says which of its launches an earlier call made (when), the others None
    kept = {name: t.pop("launches_kept_utc") for name, t in resumed[0].items()}
    assert sum(made is not None for plan in kept.values() for made in plan) == 4
    # the rounds went mist, megatron, oom; megatron, mist; mist, megatron: cut after round 2's first
    assert [made is None for made in kept["megatron"]] == [False, False, True]
    assert [made is None for made in kept["mist"]] == [False, True, True]
    assert resumed == whole  # the same step times, reports, rounds and contention


def test_kept_launches_serve_only_the_same_plan(tmp_path, monkeypatch):
    journal = tmp_path / "kept" / "launches"
    _train(tmp_path, monkeypatch, Launches(), journal)
    again = Launches()
    _train(tmp_path, monkeypatch, again, journal, plans={**PLANS, "mist": "tp: 1\nrecompute: 2"})
    assert again.made == ["mist"] * 3  # mist's plan changed: launched again; the others kept


@pytest.mark.parametrize("entry", ["{not json", '{"identity": null}', '{"launch": [], "made_utc": "x"}'])
def test_a_broken_kept_launch_is_launched_again(tmp_path, monkeypatch, entry):
    journal = tmp_path / "kept" / "launches"
    _train(tmp_path, monkeypatch, Launches(), journal)
    (journal / "mist-round0.json").write_text(entry)
    again = Launches()
    _train(tmp_path, monkeypatch, again, journal)
    assert again.made == ["mist"]


def test_without_a_journal_nothing_is_kept(tmp_path, monkeypatch):
    _train(tmp_path, monkeypatch, Launches(), None)
    again = Launches()
    _train(tmp_path, monkeypatch, again, None)
    assert len(again.made) == 7 and not (tmp_path / "kept").exists()


def test_a_runs_launches_are_its_own(profiling, tmp_path, monkeypatch):
    fits = engine.RuntimeFits(tmp_path / "work", SETUP, tmp_path / "kept")
    point = {"case": "gpt3", "cap": 1}
    here = fits.launches_folder("run-a", point)
    assert here == fits.launches_folder("run-a", dict(point))
    assert here != fits.launches_folder("run-b", point)  # --fresh: a new run
    assert here != fits.launches_folder("run-a", {**point, "cap": 2})
    assert engine.RuntimeFits(tmp_path / "work", SETUP).launches_folder("run-a", point) is None
    for change in ("host", "machine", "packages", "commit"):  # the run carried to another machine or code
        with monkeypatch.context() as m:
            _other_world(m, CHANGES[change][1])
            assert fits.launches_folder("run-a", point) != here, change
    monkeypatch.setattr(engine, "git_state", lambda: {"commit": "a" * 40, "dirty": True})
    assert fits.launches_folder("run-a", point) is None  # a tree that differs from its commit keeps nothing


def _interrupted_run(args, command: str) -> str:
    with pytest.raises(SystemExit), experiment_run(args, Experiment("mist_vs_megatron"), command) as run:
        raise KeyboardInterrupt  # the GPU check's budget, as SIGTERM unwinds
    return run.run_id


def test_the_two_mist_parts_never_resume_each_others_run(tmp_path, monkeypatch):
    """They share the experiment's results folder and their options are the same (--cpu-dry-run,
    --keep): a run of one is not the other's to resume, and a resumed run keeps its run_id (its
    kept launches are found by it)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    args = argparse.Namespace(
        results=tmp_path / "results", fresh=False, update_reference=False, cpu_dry_run=False, keep=None
    )
    measured = _interrupted_run(args, "measured")
    with experiment_run(args, Experiment("mist_vs_megatron"), "measured") as run:
        assert run.resumed and run.run_id == measured  # the second call's mist_measured
    interrupted = _interrupted_run(args, "measured")
    with experiment_run(args, Experiment("mist_vs_megatron"), "engine") as run:
        assert not run.resumed and run.run_id != interrupted
