"""Result files and runs: nothing lost, nothing relabelled, broken files refused clearly, a run
resumed only when it is the same interrupted command, never a tracked file written."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from measure.results import (
    FORMAT,
    REPO_ROOT,
    ResultFileError,
    Results,
    Run,
    RunLockedError,
    open_run,
    update_reference,
    write_json_atomic,
)


def _random_keys(n: int) -> list[dict]:
    """Fresh keys each run, with the value types keys hold (tuples become lists in JSON)."""
    tag = os.urandom(3).hex()
    return [
        {"case": f"{tag}-{i}", "seq": 2 ** (i % 9), "shape": (i, i + 1), "flag": i % 2 == 0} for i in range(n)
    ]


def test_points_keep_their_key_result_and_provenance(tmp_path):
    keys = _random_keys(5)
    with open_run(tmp_path, {"x": 1}) as run:
        store = run.file("r.json", config={"part": "setting"})
        for i, key in enumerate(keys):
            assert store.compute(key, lambda i=i: {"value": i}) == {"value": i}
    loaded = Results.load(tmp_path / "r.json")
    assert len(loaded) == len(keys)
    for i, key in enumerate(keys):
        point = loaded.get(key)  # the tuple in the key finds the list it became
        assert point.result == {"value": i}
        prov = point.provenance
        assert prov["run_id"] == run.run_id and prov["config"] == {"part": "setting"}
        assert {"git", "packages", "device", "host", "finished_utc", "seconds"} <= set(prov)
        assert prov["packages"]["python"] and prov["device"]["device"] == "cpu"
    assert loaded.select(flag=True) == [loaded.get(k) for k in keys if k["flag"]]
    assert json.loads((tmp_path / "run.json").read_text())["finished_utc"] is not None
    assert not list(tmp_path.glob(".*.tmp"))


def test_other_options_add_points_and_drop_none(tmp_path):
    first, second = _random_keys(3), _random_keys(2)
    with open_run(tmp_path, {"scale": "cpu"}) as run_a:
        store = run_a.file("r.json")
        for key in first:
            store.add(key, 1)
    before = {json.dumps(p.key, sort_keys=True): p.provenance for p in Results.load(tmp_path / "r.json")}
    with open_run(tmp_path, {"scale": "paper"}) as run_b:
        store = run_b.file("r.json")
        for key in second:
            store.add(key, 2)
    after = Results.load(tmp_path / "r.json")
    assert len(after) == len(first) + len(second)
    for key in first:  # the earlier run's points: untouched, with their own provenance
        point = after.get(key)
        assert point.result == 1 and point.provenance == before[json.dumps(point.key, sort_keys=True)]
        assert point.provenance["run_id"] == run_a.run_id != run_b.run_id
    assert all(after.get(k).provenance["run_id"] == run_b.run_id for k in second)


def test_a_new_run_recomputes_and_an_interrupted_one_resumes(tmp_path):
    keys = _random_keys(4)
    calls = []

    def measure(key):
        calls.append(key["case"])
        return len(calls)

    with open_run(tmp_path, {"x": 1}) as run:  # a finished run
        store = run.file("r.json")
        for key in keys:
            store.compute(key, lambda k=key: measure(k))
    assert len(calls) == 4
    with pytest.raises(KeyboardInterrupt), open_run(tmp_path, {"x": 1}) as run:  # the same command again:
        store = run.file("r.json")  # from scratch, interrupted after two points
        store.compute(keys[0], lambda: measure(keys[0]))
        store.compute(keys[1], lambda: measure(keys[1]))
        raise KeyboardInterrupt
    interrupted = run.run_id
    done_before = {k["case"]: Results.load(tmp_path / "r.json").get(k).provenance for k in keys[:2]}
    assert len(calls) == 6
    with open_run(tmp_path, {"x": 1}) as run:  # resumes: only the two points it had not done
        assert run.resumed and run.run_id == interrupted
        store = run.file("r.json")
        for key in keys:
            store.compute(key, lambda k=key: measure(k))
    assert calls[6:] == [keys[2]["case"], keys[3]["case"]]
    after = Results.load(tmp_path / "r.json")
    for key in keys[:2]:  # the resumed points were not recomputed, nor relabelled
        assert after.get(key).provenance == done_before[key["case"]]
    with open_run(tmp_path, {"x": 2}) as run:  # another command never resumes another's run
        assert not run.resumed


def test_interrupted_run_of_another_command_is_not_resumed(tmp_path):
    with pytest.raises(RuntimeError), open_run(tmp_path, {"x": 1}):
        raise RuntimeError("killed")
    with open_run(tmp_path, {"x": 1}, fresh=True) as run:
        assert not run.resumed
    with pytest.raises(RuntimeError), open_run(tmp_path, {"x": 1}):
        raise RuntimeError("killed")
    with open_run(tmp_path, {"x": 3}) as run:
        assert not run.resumed


@pytest.mark.parametrize(
    "content",
    [
        '{"format": 2, "points": [{"key": {"a": 1}, "result": 1, "provenance"',  # truncated mid-write
        "",  # empty
        "\x00\x01garbage",
        '{"provenance": {}, "points": {"a/s1": 1}}',  # the old format (string keys, one provenance)
        '{"format": 2, "points": [{"key": {"a": 1}}]}',  # a point without result and provenance
        "[1, 2]",
        '{"format": 2, "points": [{"key": 3, "result": 1, "provenance": {}}]}',  # a key that is no mapping
        # one key twice with two values: "the last one wins" would decide a verdict by file order
        '{"format": 2, "points": [{"key": {"a": 1}, "result": 1, "provenance": {}}, '
        '{"key": {"a": 1}, "result": 2, "provenance": {}}]}',
        # one field twice inside a point's result: the same, within a point
        '{"format": 2, "points": [{"key": {"a": 1}, "result": {"x": 1, "x": 2}, "provenance": {}}]}',
    ],
)
def test_broken_result_file_is_refused_naming_it_and_what_to_do(tmp_path, content):
    path = tmp_path / "max_batch.json"
    path.write_text(content)
    with pytest.raises(ResultFileError) as e:
        Results.load(path)
    message = str(e.value)
    assert str(path) in message and "move it aside" in message and "\n" not in message
    with pytest.raises(ResultFileError):  # a run refuses before any work, not when it reaches the file
        Run(tmp_path, {"x": 1})
    assert path.read_text() == content  # never overwritten or dropped


@pytest.mark.slow
def test_driver_reports_a_broken_file_in_one_line_before_any_work(tmp_path):
    (tmp_path / "layer_saved_bytes.json").write_text('{"format": 2, "points": [')
    done = subprocess.run(
        [sys.executable, "-m", "artifacts.tempo_layer.run", "--seq", "16", "--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert done.returncode != 0
    assert done.stderr.strip().startswith("error: ") and "Traceback" not in done.stderr
    assert str(tmp_path / "layer_saved_bytes.json") in done.stderr
    assert "Saved-for-backward" not in done.stdout  # refused before measuring anything


def test_one_run_writes_a_folder_at_a_time(tmp_path):
    with open_run(tmp_path, {"x": 1}), pytest.raises(RunLockedError, match="another run"):
        Run(tmp_path, {"x": 1})
    with open_run(tmp_path, {"x": 1}):  # released when the first ended
        pass


def test_update_reference_takes_this_runs_points_and_keeps_the_others(tmp_path):
    results, reference = tmp_path / "results", tmp_path / "reference"
    old, shared, new = _random_keys(2), _random_keys(2), _random_keys(1)
    with open_run(reference, {"x": 0}) as run:  # the committed reference, made earlier
        store = run.file("r.json")
        for key in old + shared:
            store.add(key, "old")
    with open_run(results, {"x": 0}) as earlier:  # a point of an earlier run in results/
        earlier.file("r.json").add(_random_keys(1)[0], "not this run")
    with open_run(results, {"x": 1}) as run:
        store = run.file("r.json")
        for key in shared + new:
            store.add(key, "new")
    assert update_reference(results, reference, run.run_id) == [reference / "r.json"]
    ref = Results.load(reference / "r.json")
    assert {p.result for p in ref} == {"old", "new"} and len(ref) == 5
    assert all(ref.get(k).result == "old" for k in old)
    assert all(
        ref.get(k).result == "new" and ref.get(k).provenance["run_id"] == run.run_id for k in shared + new
    )


def _promote_at_once(barrier, results, reference, run_id) -> None:
    barrier.wait()  # both processes read the reference at the same moment
    update_reference(results, reference, run_id)


@pytest.mark.timeout(120)
def test_two_promotions_at_once_keep_both_runs_points(tmp_path):
    """Two runs promoting into one reference at once each read it, added their points and wrote
    it: the later write dropped the earlier's points (probe 5: 300 of 600 left in 29 of 30
    trials). The reference folder's lock orders them: every trial keeps all 600."""
    import multiprocessing

    from measure.results import Point

    ids = {}
    for who in "AB":
        with open_run(tmp_path / who, {"who": who}) as run:
            store = run.file("x.json")
            for i in range(300):  # put, then one write: 300 writes would dominate the test
                store._put(Point({"who": who, "i": i}, i, run.provenance("cpu")))
            store._write()
            ids[who] = run.run_id
    fork = multiprocessing.get_context("fork")  # the test's module, not a re-import of it
    for trial in range(3):
        reference = tmp_path / f"reference{trial}"
        barrier = fork.Barrier(2)
        workers = [
            fork.Process(target=_promote_at_once, args=(barrier, tmp_path / w, reference, ids[w]))
            for w in "AB"
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert [w.exitcode for w in workers] == [0, 0]
        assert len(Results.load(reference / "x.json")) == 600, f"trial {trial}"


def test_a_promotion_waits_a_bounded_time_then_refuses_in_one_line(tmp_path, monkeypatch):
    """Another promotion holding the reference longer than REFERENCE_WAIT_S: one line saying so
    and where this run's points are kept; the reference untouched."""
    from measure import results as results_module
    from measure.results import lock_folder, unlock_folder

    with open_run(tmp_path / "results", {"x": 1}) as run:
        run.file("r.json").add({"k": 1}, 1.0)
    reference = tmp_path / "reference"
    reference.mkdir()
    monkeypatch.setattr(results_module, "REFERENCE_WAIT_S", 0.3)
    held = lock_folder(reference, "held by the test")
    try:
        with pytest.raises(RunLockedError) as e:
            update_reference(tmp_path / "results", reference, run.run_id)
    finally:
        unlock_folder(held)
    message = str(e.value)
    assert message.startswith(f"another run has been updating {reference} for 0.3 s"), message
    assert str(tmp_path / "results") in message and "\n" not in message
    assert not (reference / "r.json").exists()
    assert update_reference(tmp_path / "results", reference, run.run_id) == [reference / "r.json"]


def test_keys_compare_as_json_values(tmp_path):
    """Two points whose keys differ only as 2 and 2.0 loaded as two (their identities were their
    JSON texts), while ``select`` matched both, so a claim's ``one`` raised a LookupError
    traceback. 2 and 2.0 are one JSON number: such a file is refused in one line naming it and
    the key; identity and ``select`` agree (a whole float finds its integer, true is not 1)."""
    path = tmp_path / "kernels_cpu.json"
    point = lambda key: {"key": key, "result": 1.0, "provenance": {}}
    write_json_atomic(
        path, {"format": FORMAT, "points": [point({"processes": 2}), point({"processes": 2.0})]}
    )
    with pytest.raises(ResultFileError) as e:
        Results.load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: point 1 repeats the key of point 0, ") and "\n" not in message
    assert '{"processes": 2.0}' in message and "2 and 2.0 are one number" in message, message
    points = [point({"n": 2.0, "flag": True}), point({"n": 3, "flag": 1})]
    write_json_atomic(path, {"format": FORMAT, "points": points})
    loaded = Results.load(path)  # true and 1 are two values
    assert loaded.get({"n": 2, "flag": True}).key == {"n": 2.0, "flag": True}
    assert [p.key["n"] for p in loaded.select(n=2)] == [2.0] and loaded.one(flag=True).key["n"] == 2.0
    assert loaded.one(flag=1).key["n"] == 3 and loaded.select(n=2.5) == []


def test_write_json_atomic_leaves_no_partial_file(tmp_path):
    path = tmp_path / "out.json"
    write_json_atomic(path, {"ok": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object.__new__(type("X", (), {"__str__": None}))})
    assert json.loads(path.read_text()) == {"ok": 1}
    assert not list(tmp_path.glob(".*.tmp"))


def test_runs_write_only_ignored_paths():
    """Every experiment writes under artifacts/<experiment>/results/ and figures/results/ by
    default: both git-ignored, so a run never modifies a tracked file."""
    from artifacts import claims
    from artifacts.experiment import Experiment

    sources = [c.source for c in claims.claims()]
    paths = [Experiment(s.experiment).results_dir / s.file for s in sources]
    paths += [
        REPO_ROOT / "figures" / "results" / "x.png",
        REPO_ROOT / "artifacts" / "tempo_bert" / "results" / "run.json",
    ]
    rel = [str(p.relative_to(REPO_ROOT)) for p in paths]
    done = subprocess.run(
        ["git", "check-ignore", *rel], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
    )
    assert sorted(set(done.stdout.split())) == sorted(set(rel))
    reference = [
        str((Experiment(s.experiment).reference_dir / s.file).relative_to(REPO_ROOT)) for s in sources
    ]
    done = subprocess.run(
        ["git", "check-ignore", *reference], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
    )
    assert done.stdout == "", "reference results must be committed, not ignored"
    assert FORMAT == 2


def test_an_unwritable_results_folder_is_refused_before_any_work(tmp_path, capsys):
    """Refused as bad input: one line and exit status 2, as the parser's refusals (it was 1, the
    status of a failed run: probe round 5 F40)."""
    import argparse

    from artifacts.experiment import Experiment, experiment_run

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = argparse.Namespace(results=blocker / "results", fresh=False, update_reference=False, seq=[1])
    work = []
    with pytest.raises(SystemExit) as e, experiment_run(args, Experiment("tempo_layer")):
        work.append("measured")  # never reached
    # said as what it is, not as "[Errno 20] Not a directory: ..." (the probe round's raw errno text)
    message = capsys.readouterr().err.removesuffix("\n")
    assert e.value.code == 2
    assert message.startswith(f"error: --results {blocker / 'results'}: cannot hold a run's results"), message
    assert "Errno" not in message and "\n" not in message
    assert work == []


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("reference", "error: --results . is tempo_llama's committed reference"),
        ("repository", "error: . holds files that are not results"),
        ("presets", "error: . holds files of the repository"),
    ],
)
def test_a_reference_or_a_source_folder_is_refused_as_results(tmp_path, monkeypatch, capsys, where, message):
    """--results pointed at a committed reference or at the repository (``--results ''``) wrote
    the run's files among them (a probe overwrote a tracked reference file): refused in one line
    before any work, with exit status 2 (bad input; it was 1: probe round 5 F40). Control: a new,
    an empty and a run's own folder are taken."""
    import argparse

    from artifacts.experiment import Experiment, experiment_run

    experiment = Experiment("tempo_llama")
    folder = {
        "reference": experiment.reference_dir,
        "repository": REPO_ROOT,
        "presets": REPO_ROOT / "impl" / "mist" / "model" / "presets",  # tracked JSON files only
    }[where]
    monkeypatch.chdir(folder)
    args = argparse.Namespace(results=type(folder)(""), fresh=False, update_reference=False)
    work, locked = [], (folder / ".lock").exists()  # a reference's: left by --update-reference
    with pytest.raises(SystemExit) as e, experiment_run(args, experiment):
        work.append("measured")  # never reached
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert work == [] and not (folder / "run.json").exists() and (folder / ".lock").exists() == locked
    (tmp_path / "empty").mkdir()
    (tmp_path / "gpu_check" / "pytest-benchmark").mkdir(parents=True)  # the GPU check's, beside
    for ok in (tmp_path / "new", tmp_path / "empty", tmp_path / "new", tmp_path / "gpu_check"):
        with open_run(ok, {"x": 1}):  # the third: a folder a run wrote
            pass


def test_a_folder_given_as_a_result_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ResultFileError, match=f"{tmp_path}: not a readable result file"):
        Results.load(tmp_path)  # was a raw IsADirectoryError


def test_keys_and_results_that_are_not_json_data_are_refused_not_stringified(tmp_path):
    """A numpy float was stored as "1.5", a tensor as "tensor(2.)", a numpy integer in a key as
    "8" (so the same key given as 8 missed it), a list key was written and the file then refused."""
    import numpy as np

    value = float(np.float32(os.urandom(1)[0] / 7))  # exact in float32
    with open_run(tmp_path / "r", {"x": 1}) as run:
        store = run.file("f.json")
        store.add({"k": np.int64(8), "shape": (1, 2)}, {"v": np.float32(value), "n": np.int32(3)})
        assert store.get({"k": 8, "shape": [1, 2]}).result == {"v": value, "n": 3}  # numbers, as given
        store.add({"k": 9}, {"ok": np.bool_(True), "zero_d": np.array(2.5)})  # their one value each
        assert store.get({"k": 9}).result == {"ok": True, "zero_d": 2.5}
        for key, result, where in (
            (["a"], 1.0, "a point's key is a mapping"),
            ({"k": 1}, {"bad": {1, 2}}, "result.bad: a set is not JSON data"),
            ({"k": 1}, {2: 1.0}, "result: key 2 is not a string"),
            ({"k": object()}, 1.0, "key.k: a object is not JSON data"),
        ):
            with pytest.raises(TypeError, match=where):
                store.add(key, result)
    assert [p.key for p in Results.load(tmp_path / "r" / "f.json")] == [{"k": 8, "shape": [1, 2]}, {"k": 9}]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_like_a_result_file_is_refused_not_waited_on(tmp_path):
    """A FIFO named sim.json in --results blocked the run's start until killed."""
    from measure.results import NotAResultsFolderError

    folder = tmp_path / "r"
    folder.mkdir()
    os.mkfifo(folder / "sim.json")  # no writer: a read would block (the test's timeout ends it)
    with pytest.raises(NotAResultsFolderError, match="holds files that are not results"):
        open_run(folder, {"x": 1})
    with pytest.raises(ResultFileError, match=r"sim\.json: not a readable result file .*not a regular file"):
        Results.load(folder / "sim.json")


@pytest.mark.skipif(not (REPO_ROOT / ".git").exists(), reason="not a git checkout")
def test_a_folder_of_the_repositorys_own_json_files_is_refused_as_results(tmp_path):
    """--results at the shipped presets (JSON files only) was taken, left a .lock among them and
    then advised deleting a preset. Control: a copy of the same files outside the repository is
    a folder of JSON files a run may have written, and is taken."""
    import shutil

    from measure.results import NotAResultsFolderError, _check_results_folder

    presets = REPO_ROOT / "impl" / "mist" / "model" / "presets"
    with pytest.raises(NotAResultsFolderError, match=r"holds files of the repository .*tracked by git"):
        open_run(presets, {"x": 1})
    assert not (presets / ".lock").exists()
    copy = tmp_path / "copy"
    shutil.copytree(presets, copy)
    _check_results_folder(copy)  # taken: not the repository's


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["link to a result file", "link outside", "FIFO", "folder"])
def test_a_lock_that_is_not_a_regular_file_is_refused_and_nothing_written_through(tmp_path, kind):
    """``.lock`` was opened with open(..., "w"): a link to the folder's sim.json emptied it (85 kB of
    points lost), a link outside truncated its target, a FIFO blocked the run until killed, a
    folder gave an IsADirectoryError traceback. Each is refused in one line naming it, nothing
    written; the folder's points stay."""
    from measure.results import lock_folder

    folder, outside = tmp_path / "r", tmp_path / "victim.txt"
    with open_run(folder, {"x": 1}) as run:
        run.file("sim.json").add({"k": 1}, 1.0)
    outside.write_text("kept")
    lock, sim = folder / ".lock", folder / "sim.json"
    before = sim.read_bytes()
    lock.unlink()
    {
        "link to a result file": lambda: lock.symlink_to("sim.json"),
        "link outside": lambda: lock.symlink_to(outside),
        "FIFO": lambda: os.mkfifo(lock),  # no reader: an open for writing would wait for one
        "folder": lambda: lock.mkdir(),
    }[kind]()
    # lock_folder is what mist profile and gpu_check call; a run checks its folder first (that
    # refuses a FIFO or a folder as "not results"), then locks it
    attempts = [lambda: lock_folder(folder, "busy")] + [lambda: Run(folder, {"x": 2})] * kind.startswith(
        "link"
    )
    for attempt in attempts:
        with pytest.raises(RunLockedError) as e:
            attempt()
        message = str(e.value)
        assert message.startswith(f"{lock}: ") and "must be a regular file or absent" in message, message
        assert "\n" not in message
    assert sim.read_bytes() == before and outside.read_text() == "kept"
    assert len(Results.load(sim)) == 1


def test_a_lock_file_is_never_truncated(tmp_path):
    """The lock is the flock, not the file's content: a ``.lock`` hard-linked to a result file
    keeps its bytes (open(..., "w") truncated it). Control: an absent ``.lock`` is made, and the
    lock still excludes a second writer."""
    from measure.results import lock_folder, unlock_folder

    folder = tmp_path / "r"
    with open_run(folder, {"x": 1}) as run:
        run.file("sim.json").add({"k": 1}, 1.0)
    before = (folder / "sim.json").read_bytes()
    (folder / ".lock").unlink()
    os.link(folder / "sim.json", folder / ".lock")
    held = lock_folder(folder, "busy")
    with pytest.raises(RunLockedError, match="busy"):
        lock_folder(folder, "busy")
    unlock_folder(held)
    assert (folder / "sim.json").read_bytes() == before
    (folder / ".lock").unlink()
    unlock_folder(lock_folder(folder, "busy"))
    assert (folder / ".lock").is_file()


def _not_regular_files(tmp_path) -> dict:
    """A FIFO, links (to a file, to a device) and, where this user may make one, a device node:
    each a path a write must not turn into a regular file."""
    (tmp_path / "victim.txt").write_text("kept")
    made = {"fifo": tmp_path / "f.json", "link": tmp_path / "l.json", "link-to-device": tmp_path / "d.json"}
    os.mkfifo(made["fifo"])
    made["link"].symlink_to(tmp_path / "victim.txt")
    made["link-to-device"].symlink_to(os.devnull)
    try:
        os.mknod(tmp_path / "null.json", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        made["device"] = tmp_path / "null.json"
    except PermissionError:  # not root: no device node to try
        pass
    return made


@pytest.mark.timeout(60)
def test_a_write_never_replaces_what_is_not_a_regular_file(tmp_path):
    """atomic_path renamed its temporary file over whatever was at the path: a device node, a
    FIFO and a link each became a regular file (as root, Plan.save("/dev/null") would replace the
    machine's /dev/null). Refused in one line, before writing, each left as it was; control: a
    new file and a regular file are written."""
    from measure.results import write_text_atomic

    for kind, path in _not_regular_files(tmp_path).items():
        before = os.lstat(path)
        with pytest.raises(ValueError, match=r"not a regular file; a file is written only as a new one") as e:
            write_text_atomic(path, "new")
        assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value), kind
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), kind
    assert (tmp_path / "victim.txt").read_text() == "kept"
    assert not list(tmp_path.glob(".*.tmp"))
    for path in (tmp_path / "new.json", tmp_path / "victim.txt"):
        write_text_atomic(path, "new")
        assert path.read_text() == "new"
