"""The GPU check's two Mist parts (artifacts.mist_vs_megatron.engine and .measured) run in two
processes on one GPU; with ``--profiles DIR`` the second fits the profile the first kept instead of
profiling the device again, but only one made for the same setup, on the same machine, at the same
clean commit. The profile, the speed probe and the fit are stubbed: what is checked is when a
profile is made and when one is reused."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest

from artifacts.mist_vs_megatron import engine


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


def _fit(tmp_path, kept, setup=engine.CPU_ENGINE, processes=1):
    return engine.RuntimeFits(tmp_path / "scratch", setup, kept)(processes)


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
def test_profiles_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, script):
    main = importlib.import_module(f"artifacts.mist_vs_megatron.{script}").main
    not_a_folder = tmp_path / "profiles"
    not_a_folder.write_text("")
    results = tmp_path / "results"
    with pytest.raises(SystemExit) as stop:
        main(["--cpu-dry-run", "--profiles", str(not_a_folder), "--results", str(results)])
    assert stop.value.code == 2 and not results.exists()
    assert f"--profiles {not_a_folder}: not a folder" in capsys.readouterr().err
