"""A `mist profile` folder: one run writes it at a time (its lock), it says whether the profile is
complete, `mist calibrate` fits only a complete one, and its CSV rows give every column."""

from __future__ import annotations

import json
import os

import pytest

from mist.__main__ import main
from mist.model import runtime
from mist.model.profile_data import ARTIFACT_DATA

from .cli_inputs import one_error_line, profile_argv

PROFILE = profile_argv(1, 2)


@pytest.mark.parametrize("locked", [True, False], ids=["locked", "control-unlocked"])
def test_a_profile_folder_in_use_is_refused_even_with_replace(tmp_path, capsys, monkeypatch, locked):
    """A second `mist profile --replace` on a folder a first one is writing deleted the first's
    files mid-run and left a mix of both. Now it is refused at once, in one line, and the first's
    files stay. The control (the lock taken away) shows the test would catch the old behaviour:
    the second run goes ahead and replaces the first's file."""
    from measure import results
    from mist.engine import profiler

    if not locked:
        monkeypatch.setattr(results, "lock_folder", lambda folder, busy: open(os.devnull, "w"))  # noqa: SIM115
    out = tmp_path / "p"
    csv = out / "gpt_h64_mbs1_tp1_algo0.csv"
    second: dict = {}

    def measure(folder, *args, **kwargs):  # a run's measurement, while its folder is held
        run = "first" if not second else "second"
        meta = {"gpu": "cpu", "seq": 16, "sizes": {"h64": [64, 1, 4]}, "complete": False}
        (folder / "profile.json").write_text(json.dumps(meta))
        csv.write_text(run)
        if run == "first":  # the second run starts while the first measures
            second["code"] = None
            second["code"] = main([*PROFILE, "--out", str(out), "--replace"])
            second["err"] = capsys.readouterr().err
            second["first's file"] = csv.read_text()
        return [csv]

    monkeypatch.setattr(profiler, "write_profiles", measure)
    assert main([*PROFILE, "--out", str(out)]) == 0
    if locked:
        assert second["code"] == 2
        one_error_line(second["err"], f"--out {out}: another `mist profile` is writing to it", "--replace")
        assert second["first's file"] == "first"
    else:
        assert second["code"] == 0 and second["first's file"] == "second"
    # either way the folder is free once the runs end: a later run takes it
    assert main([*PROFILE, "--out", str(out), "--replace"]) == 0


def test_an_interrupted_profile_says_how_to_redo_it_and_is_not_fitted(tmp_path, capsys, monkeypatch):
    """Ctrl-C during `mist profile --collectives 2` said "what was already written stays", a rerun
    was refused with no word of why, and `mist calibrate` (and --write) fitted the partial folder
    as if whole. Now the line says the profile is incomplete and to rerun with --replace, the rerun
    without it says the same, and calibrate refuses it (writing nothing). Control: the same folder
    once complete is fitted."""
    from mist.engine import profiler
    from mist.model.profile_data import mark_profile_complete

    def interrupted(
        *args, **kwargs
    ):  # Ctrl-C once the layer is profiled, as the benchmarks among processes start
        raise KeyboardInterrupt

    monkeypatch.setattr(profiler, "write_rank_benchmarks", interrupted)
    out = tmp_path / "p"
    command = [*PROFILE, "--out", str(out), "--collectives", "2"]
    assert main(command) == 130
    one_error_line(capsys.readouterr().err, f"{out} holds an incomplete profile", "rerunning", "--replace")
    assert json.loads((out / "profile.json").read_text())["complete"] is False
    assert len(list(out.glob("gpt_*.csv"))) == 2  # the layer's profiles were written
    assert main(command) == 2
    one_error_line(capsys.readouterr().err, "holds an incomplete profile already", "--replace")
    presets = tmp_path / "presets"
    monkeypatch.setattr(runtime, "PRESETS", presets)
    for write in ([], ["--write"]):
        assert main(["calibrate", str(out), *write]) == 2
        one_error_line(capsys.readouterr().err, f"{out}: an incomplete profile", "with --replace")
    assert not presets.exists()
    mark_profile_complete(out)  # the control: the same files, the profile said to be whole
    assert main(["calibrate", str(out)]) == 0
    assert "p: per-layer error" in capsys.readouterr().out


@pytest.mark.parametrize("held", [True, False], ids=["being-written", "control-abandoned"])
def test_calibrate_tells_a_profile_being_written_from_an_abandoned_one(tmp_path, capsys, held):
    """`mist calibrate` on a folder a `mist profile` is still writing told the user to redo the
    profile with --replace (which the running profile's lock then refuses). Now it says the folder
    is being written, and to calibrate once that run ends; an incomplete folder nobody holds (the
    control) is still the incomplete profile to redo."""
    from measure.results import lock_folder, unlock_folder

    out = tmp_path / "p"
    out.mkdir()
    meta = {"gpu": "cpu", "seq": 16, "sizes": {"h64": [64, 1, 4]}, "complete": False}
    (out / "profile.json").write_text(json.dumps(meta))
    lock = lock_folder(out, "busy")  # as a running `mist profile` holds it
    if not held:
        unlock_folder(lock)
    try:
        assert main(["calibrate", str(out)]) == 2
    finally:
        unlock_folder(lock)
    if held:
        one_error_line(capsys.readouterr().err, f"{out}: being written by a `mist profile` still running")
    else:
        one_error_line(capsys.readouterr().err, f"{out}: an incomplete profile", "--replace")
    assert sorted(p.name for p in out.iterdir()) == [".lock", "profile.json"]  # calibrate wrote nothing


def test_a_finished_profile_is_marked_complete(tmp_path, monkeypatch):
    """profile.json says complete only once every benchmark asked for is written: false while the
    collectives run, true after."""
    from mist.engine import profiler

    out = tmp_path / "p"
    seen = []

    def collectives(folder, *args, **kwargs):
        seen.append(json.loads((folder / "profile.json").read_text())["complete"])
        return []

    monkeypatch.setattr(profiler, "write_rank_benchmarks", collectives)
    assert main([*PROFILE, "--out", str(out), "--collectives", "2"]) == 0
    assert seen == [False] and json.loads((out / "profile.json").read_text())["complete"] is True


@pytest.mark.parametrize(
    ("cut", "said"),
    [
        (2, "has 7 fields, its header 9"),  # the last two fields missing
        (-1, "has 10 fields, its header 9"),  # one run on
        (0, None),  # the control: the row as measured
    ],
)
def test_a_layer_profile_row_gives_every_column(tmp_path, capsys, cut, said):
    """A row missing its last fields was read (they were not the times) and fitted. Now refused,
    naming the file and its line."""
    from mist.model.profile_data import read_layer_profiles

    folder = tmp_path / "data" / "l4"  # known by its name, as the artifact's folders are
    folder.mkdir(parents=True)
    for path in sorted((ARTIFACT_DATA / "gpu-op-profiles" / "l4").glob("gpt_1_3B_*_tp1_*.csv")):
        (folder / path.name).write_text(path.read_text())
    name = "gpt_1_3B_mbs1_tp1_algo0.csv"
    lines = (folder / name).read_text().splitlines()
    fields = lines[3].split(",")
    lines[3] = ",".join(fields[:-cut] if cut > 0 else [*fields, "0.0"] if cut < 0 else fields)
    (folder / name).write_text("\n".join(lines) + "\n")
    if said is None:  # read as before (calibrate fits these: test_mist_costs)
        assert {p.mbs for p in read_layer_profiles(folder)} == {1, 2, 4, 8}
        return
    assert main(["calibrate", str(folder.parent)]) == 2
    one_error_line(capsys.readouterr().err, f"{folder / name}: line 4 {said}")


def test_a_profile_from_before_completeness_was_recorded_says_what_to_do(tmp_path, capsys):
    """A profile.json written before the "complete" field existed was refused as 'missing complete'
    with no hint; it now says how to redo it or mark a finished one."""
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "profile.json").write_text(json.dumps({"gpu": "cpu", "seq": 16, "sizes": {"h64": [64, 1, 4]}}))
    assert main(["calibrate", str(folder)]) == 2
    one_error_line(
        capsys.readouterr().err, "written before profile.json recorded", "--replace", '"complete": true'
    )


def _job(micro_batches=(1, 2)):
    import torch

    from mist.engine.profiler.layer import ProfileJob

    shape = {"hidden": 64, "heads": 4, "seq": 16, "micro_batches": micro_batches, "tps": (1,)}
    return ProfileJob(
        **shape,
        device="cpu",
        dtype=torch.float32,
        gpu="cpu",
        repeats=1,
        framework=False,
        tempo=False,
        threads=1,
        vocab=None,
        rounds=1,
    )


def _write_line_csv(folder):
    from mist.engine.profiler.ranks import write_line_csv

    write_line_csv(folder / "prim_gpt_local_all_reduce_2gpus.csv", [(2**20, 1e-3), (2**21, 1.5e-3)])
    return "prim_gpt_local_all_reduce_2gpus.csv"


def _write_p2p(folder, monkeypatch):
    from mist.engine.profiler import collectives

    rows = [(2**20, 1e-3), (2**21, 1.5e-3)]
    monkeypatch.setattr(collectives, "profile_collectives", lambda *a, **k: {"send_recv": rows})
    collectives.write_collectives(folder, 2, "cpu")
    return "p2p_intra_node.csv"


def _write_layer_csv(folder, monkeypatch):
    from mist.engine.profiler import layer

    row = {"op_name": "enc-1st-layernorm", "forward-compute": 1.0, "backward-compute": 2.0}
    monkeypatch.setattr(layer, "_point_rows", lambda job, tp, b: [row, {**row, "op_name": "enc-MLP-gelu"}])
    layer._write_layer_profiles(folder, _job(micro_batches=(1,)), None)
    return "gpt_h64_mbs1_tp1_algo0.csv"


def _write_profile_json(folder, monkeypatch):
    from mist.engine.profiler import layer

    monkeypatch.setattr(layer, "_write_layer_profiles", lambda *a: [])  # profile.json alone
    layer._write_profiles(folder, _job(), None)
    return "profile.json"


@pytest.mark.parametrize("writer", [_write_line_csv, _write_p2p, _write_layer_csv, _write_profile_json])
def test_a_profile_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch, writer):
    """`mist profile` wrote its CSV files and profile.json in place: a write that failed midway (a
    kill, a full disk) left half a file where the previous one was. Now each goes through
    measure.results' temp file + rename: the failed write leaves the previous file as it was and
    no temporary file. Control: the same write without the fault replaces the file whole."""
    import csv
    import errno
    from pathlib import Path

    folder = tmp_path / "p"
    folder.mkdir()
    run = (lambda: writer(folder)) if writer is _write_line_csv else (lambda: writer(folder, monkeypatch))
    name = run()  # the control, and the name of the file it writes
    whole = (folder / name).read_text()
    (folder / name).write_text("previous\n")
    before = sorted(folder.iterdir())

    def fail(*_):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def torn_text(path, data, *args, **kwargs):  # half the text reaches the file, then the disk is full
        with path.open("w") as fh:
            fh.write(data[: len(data) // 2])
        fail()

    def torn_rows(self, rows):  # the header and one row, then the disk is full
        self.writerow(next(iter(rows)))
        fail()

    with monkeypatch.context() as m:
        m.setattr(Path, "write_text", torn_text)
        m.setattr(csv.DictWriter, "writerows", torn_rows)
        with pytest.raises(OSError, match="injected"):
            run()
    assert (folder / name).read_text() == "previous\n"
    assert sorted(folder.iterdir()) == before  # no temporary file left beside it
    run()
    assert (folder / name).read_text() == whole and sorted(folder.iterdir()) == before


def test_concurrent_profile_copies_start_every_point_together(tmp_path, monkeypatch):
    """With concurrent copies each point starts at a barrier all copies wait at (the ops timed meet
    the same ops in the other copies, as ranks computing a micro-batch do): one wait before each
    point of each pass, the barrier's order the points'. A copy that stops makes the measured one
    fail in one line (the barrier breaks at its timeout), never wait for ever."""
    import dataclasses
    import threading

    from mist.engine.profiler import layer

    events = []

    class Barrier:
        def __init__(self, broken: bool) -> None:
            self.broken = broken

        def wait(self, timeout):
            assert 0 < timeout < float("inf")
            if self.broken:
                raise threading.BrokenBarrierError
            events.append("wait")

    def rows(job, tp, b):
        events.append((tp, b))
        return [{"op_name": "x", "forward-compute": 1.0, "backward-compute": 1.0}]

    monkeypatch.setattr(layer, "_point_rows", rows)
    job = dataclasses.replace(_job(micro_batches=(1, 2)), rounds=2)
    layer._write_layer_profiles(tmp_path, job, None, Barrier(broken=False))
    assert events == ["wait", (1, 1), "wait", (1, 2)] * 2
    events.clear()
    layer._write_layer_profiles(tmp_path, job, None, None)  # the control: no copies, no barrier
    assert events == [(1, 1), (1, 2)] * 2
    with pytest.raises(RuntimeError, match=r"did not reach point \(tp 1, micro-batch 1\) within 300 s"):
        layer._write_layer_profiles(tmp_path, job, None, Barrier(broken=True))
