"""``python -m artifacts.gpu_check``: bad input refused in one line before any work, the dry run
passes every part, a second call resumes (skips the parts that passed), a part past its timeout is
killed with everything it started and reported timed out; the wheels for the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

import pytest
import torch

from artifacts import gpu_check, gpu_wheels

REPO = Path(__file__).resolve().parents[1]
PARTS = [p.name for p in gpu_check.PARTS]


def _run(*args: str, tag: str = "", timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECK_TEST_TAG": tag}
    env.pop("PYTHONPATH", None)  # the entry point finds the repo's packages itself
    return subprocess.run(
        [sys.executable, "-m", "artifacts.gpu_check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries ``tag`` (a call and everything it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"GPU_CHECK_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--parts", "kernels", "tempp"], "invalid choice: 'tempp'"),
        (["--timeout", "cuda=10"], "unknown part 'cuda'"),
        (["--timeout", "mist=0"], "SECONDS > 0"),
        (["--timeout", "kernels=inf"], "finite SECONDS > 0"),  # no bound at all: was accepted
        (["--timeout", "tempo=10", "--timeout", "tempo=20"], "part 'tempo' given twice"),  # was: last wins
        (["--budget-s", "-5"], "--budget-s takes seconds > 0"),
        (["--budget-s", "inf"], "--budget-s takes seconds > 0"),
        (["--archive", "results.zip"], ".tar.gz"),
        # a bound on a part not run was silently a bound on nothing (probe round 5 F36)
        (["--timeout", "kernels=5", "--parts", "llama"], "--timeout 'kernels=5': part 'kernels' is not run"),
        (["--budget-s", "100000"], "at most 3600 in the dry run, got 100000"),
        (["--budget-s", "nan"], "--budget-s takes seconds > 0"),
        (["--wheels", "/nonexistent"], "--wheels /nonexistent: not a folder"),
        (["--wheels", "/etc/passwd"], "--wheels /etc/passwd: not a folder"),
        (["--wheels", "."], "--wheels .: holds no wheels"),
        (["--wheels", "TMP"], "--wheels TMP: holds no wheels"),  # its only *.whl is a folder
    ],
)
def test_bad_input_one_line_before_any_work(tmp_path, capsys, args, expected):
    out = tmp_path / "out"
    (tmp_path / "only-a-folder.whl").mkdir()  # named like a wheel, as the repository's .whl is: no wheel
    args = [str(tmp_path) if a == "TMP" else a for a in args]
    expected = expected.replace("TMP", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--dry-run", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and expected in err, err
    assert not out.exists()  # nothing was started or written


def test_budget_bounds_are_what_the_help_says(capsys):
    """--budget-s 100000 was taken while the help said each call is at most 9 minutes (probe round 5
    F36): the bound of each mode is in --help, refused above it, taken at it."""
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "each call at most 9 minutes" in help_text
        and "at most 540 on the GPU, 3600 in the dry run" in help_text
    )
    for mode, most in (([], 540), (["--dry-run"], 3600)):
        assert gpu_check.parse_args([*mode, "--budget-s", str(most)]).budget_s == most  # control
        with pytest.raises(SystemExit) as exit_:
            gpu_check.parse_args([*mode, "--budget-s", str(most + 1)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and f"at most {most} " in err, err
    assert gpu_check.parse_args(["--timeout", "llama=5", "--parts", "llama"]).timeouts == {"llama": 5.0}


def test_a_folder_of_the_repository_is_refused_as_out(tmp_path, capsys):
    """--out among tracked files (the shipped presets) wrote status.json, logs/ and .lock there
    (probe round 5 F9): refused as --results is, nothing written. Control: a new folder inside the
    repository's ignored results, and an untracked one, are taken."""
    presets = REPO / "impl" / "mist" / "model" / "presets"
    before = sorted(p.name for p in presets.iterdir())
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--dry-run", "--parts", "llama", "--out", str(presets)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"--out {presets} holds files of the repository (e.g. " in err and "tracked by git" in err, err
    assert sorted(p.name for p in presets.iterdir()) == before
    for ok in (tmp_path, gpu_check.DEFAULT_OUT / "never-made"):
        assert gpu_check.parse_args(["--dry-run", "--out", str(ok)]).out == ok


def test_an_archive_in_or_above_what_it_packs_is_refused_before_any_part(tmp_path, capsys):
    """--archive at --out's own path: the part ran, then the archive failed on the folder --out had
    made (probe round 5 F21); inside --out (or a results folder it packs), each archive packed the
    one before (F32). Refused before any part; control: beside --out it is taken."""
    out = tmp_path / "out"
    cuda_results = gpu_check.Experiment("tempo_llama").results_dir
    cases = [
        (["--dry-run", "--out", str(tmp_path / "a.tgz")], tmp_path / "a.tgz", "in or above --out"),
        (["--dry-run", "--out", str(out)], out / "a.tgz", "in or above --out"),
        (["--dry-run", "--out", str(out)], out / "logs" / "a.tar.gz", "in or above --out"),
        (["--dry-run", "--out", str(tmp_path / "a.tgz" / "o")], tmp_path / "a.tgz", "in or above --out"),
        (["--out", str(out), "--parts", "llama"], cuda_results / "a.tgz", "in or above the results folder"),
    ]
    for args, archive, expected in cases:
        with pytest.raises(SystemExit) as exit_:
            gpu_check.main([*args, "--archive", str(archive)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and expected in err, err
        assert not out.exists() and not (tmp_path / "a.tgz").exists()
    # the dry run's results are under --out: an experiment's results folder is not packed then
    for args in (["--dry-run", "--out", str(out)], ["--dry-run", "--out", str(out), "--parts", "llama"]):
        assert gpu_check.parse_args([*args, "--archive", str(tmp_path / "a.tgz")]).archive
        assert gpu_check.parse_args([*args, "--archive", str(cuda_results / "a.tgz")]).archive


def _passed(change: str = "") -> str:
    """A status whose kernels part passed, one field of its record changed (``"field": value``)."""
    record = {"outcome": "passed", "seconds": 12.5, "timeout_s": 30, "returncode": 0}
    record["finished_utc"] = "2026-12-04T19:45:00+00:00"
    fields = json.dumps(record)[1:-1]
    if change:
        field = change.partition(":")[0]
        fields = ", ".join(f for f in fields.split(", ") if not f.startswith(field)) + ", " + change
    return '{"format": 1, "mode": "dry-run", "parts": {"kernels": {' + fields + "}}}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"format": 1, "mode": "dry-run", "parts": {}, "parts": {}}', "key 'parts' given twice"),
        (
            '{"format": 1, "mode": "dry-run", "parts": {"kernel": {"outcome": "passed"}}}',
            "unknown part 'kernel'",
        ),
        ('{"format": 1, "mode": "dry-run", "parts": {"kernels": {"outcome": "ok"}}}', "needs an outcome of"),
        ('{"format": 1, "mode": "dry-run", "parts": {"kernels": ["passed"]}}', "needs an outcome of"),
        ('{"format": 1, "mode": "dry-run", "parts": {"kernels": {"outcome": "passed"}}}', "no finished_utc"),
        ('{"format": true, "mode": "dry-run", "parts": {}}', "not a gpu_check status of format"),
        ('{"format": 1.0, "mode": "dry-run", "parts": {}}', "not a gpu_check status of format"),
        ('{"format": 1, "parts": {}}', "not a gpu_check status of format"),
        (
            '{"format": 1, "mode": "dry-run", "parts": {"kernels": {"outcome": "failed", "seconds": "abc"}}}',
            "part kernels's seconds must be a finite number >= 0 (or null: not run), got 'abc'",
        ),
        # nonsense the summary printed ("nan s of 30 s", "-5.0 s of -1 s"): probe round 5 F31
        (_passed('"seconds": NaN'), "part kernels's seconds must be a finite number >= 0"),
        (_passed('"seconds": -5'), "part kernels's seconds must be a finite number >= 0"),
        (_passed('"timeout_s": -1'), "part kernels's timeout_s must be a finite number > 0"),
        (_passed('"timeout_s": Infinity'), "part kernels's timeout_s must be a finite number > 0"),
        (_passed('"finished_utc": "not a date"'), "part kernels's finished_utc must be an ISO date"),
        (_passed('"finished_utc": 5'), "part kernels's finished_utc must be an ISO date"),
        (_passed('"returncode": "zero"'), "part kernels's returncode must be an integer"),
        (_passed('"returncode": true'), "part kernels's returncode must be an integer"),
        ("[" * 100_000, "not readable"),
        pytest.param(  # an OverflowError traceback in the probe round
            '{"format": 1, "mode": "dry-run", "parts": {"kernels": {"outcome": "passed", "seconds": 1%s, '
            '"finished_utc": "2026-12-04T19:45:00+00:00"}}}' % ("0" * 400),
            "beyond any number read here",
            id="400-digit seconds",
        ),
    ],
)
def test_a_broken_status_file_is_refused_in_one_line_before_any_part(tmp_path, capsys, text, expected):
    """status.json decides which parts are done: read strictly (no duplicate keys, known parts, a
    known outcome, a time for a pass), it is refused naming the file before any part runs."""
    out = tmp_path / "out"
    out.mkdir()
    text = text.replace('"format": 1', f'"format": {gpu_check.FORMAT}')
    (out / gpu_check.STATUS).write_text(text)
    code = gpu_check.main(["--dry-run", "--out", str(out), "--parts", "kernels"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err and str(out) in err, err
    assert sorted(p.name for p in out.iterdir()) == [".lock", gpu_check.STATUS]  # nothing run


def test_a_sound_status_is_read_as_written(tmp_path):
    """Control of the checks above: a passed part's record, and a not_run one whose timeout went
    below 0 (what _run_parts writes when the budget is spent) are read as they are."""
    path = tmp_path / gpu_check.STATUS
    status = json.loads(_passed().replace('"format": 1', f'"format": {gpu_check.FORMAT}'))
    status["parts"]["llama"] = {
        "outcome": "not_run",
        "timeout_s": -3.2,
        "seconds": None,
        "finished_utc": None,
    }
    path.write_text(json.dumps(status))
    assert gpu_check.read_status(path, "dry-run") == status


def test_an_archive_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys):
    """--archive is written after every part: a place it cannot be written is refused before the
    first (the probe's: after a part had run and was recorded as passed)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    (tmp_path / "folder.tar.gz").mkdir()
    out = tmp_path / "out"
    cases = [
        (afile / "gpu.tar.gz", "is not a folder this user can write in"),
        (tmp_path / "folder.tar.gz", "a folder; give the archive file's name"),
    ]
    for archive, expected in cases:
        with pytest.raises(SystemExit) as exit_:
            gpu_check.main(["--dry-run", "--out", str(out), "--archive", str(archive)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and expected in err, err
        assert not out.exists()


def test_an_out_folder_that_cannot_be_made_or_is_busy_is_one_line_before_any_work(tmp_path, capsys):
    """--out under a file cannot be made; an --out another call holds (its lock) is not written
    by a second: both refused in one line, nothing run."""
    import fcntl

    afile = tmp_path / "afile"
    afile.write_text("")
    assert gpu_check.main(["--dry-run", "--out", str(afile / "out"), "--parts", "kernels"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and str(afile / "out") in err, err
    if Path("/sys").is_dir():  # no one writes in /sys (root included): as a read-only file system
        assert gpu_check.main(["--dry-run", "--out", "/sys/gpu_check_out", "--parts", "kernels"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Errno" not in err, err  # probe round 5 F37
        assert "--out /sys/gpu_check_out: cannot hold the check's status (" in err, err
    busy = tmp_path / "busy"
    busy.mkdir()
    with open(busy / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert gpu_check.main(["--dry-run", "--out", str(busy), "--parts", "kernels"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another gpu_check is writing to" in err, err
    assert sorted(p.name for p in busy.iterdir()) == [".lock"]  # nothing run


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check of a machine without a GPU")
def test_no_gpu_is_the_one_line_whatever_else_is_missing(tmp_path, capsys, monkeypatch):
    """Without a GPU the check says so first: a package missing too (a wheel not fetched) is not
    what to fix on such a machine (it used to hide the no-CUDA line)."""
    real = gpu_check.probe

    def probe_missing_a_package(env, deadline):
        found = real(env, deadline)
        return {**found, "missing": {"liger_kernel": "ModuleNotFoundError: No module named 'liger_kernel'"}}

    monkeypatch.setattr(gpu_check, "probe", probe_missing_a_package)
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device here" in err and "missing" not in err, err


@pytest.mark.parametrize("given", [True, False])
def test_two_versions_of_a_wheel_are_refused_before_any_work(tmp_path, capsys, monkeypatch, given):
    """In a folder given with --wheels, or in the default one (which was not checked: the install
    refused it after the setup, with a traceback)."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    for version in ("0.16.0", "0.16.1"):
        (wheels / f"megatron_core-{version}-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    monkeypatch.setattr(gpu_wheels, "WHEELS_DIR", wheels)
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(
            ["--dry-run", "--out", str(tmp_path / "out"), *(["--wheels", str(wheels)] if given else [])]
        )
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "two wheels of megatron-core" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("dest", "expected"),
    [
        ("/etc/passwd", "--dest /etc/passwd: not a folder"),  # was "[Errno 17] File exists", exit 1
        ("/proc/gpu_wheels_test", "--dest /proc/gpu_wheels_test: cannot be made a folder of wheels ("),
    ],
)
def test_a_wheels_destination_that_is_no_folder_is_one_line_before_the_download(
    tmp_path, monkeypatch, capsys, dest, expected
):
    """Probe round 5 F37: said without errno, exit 2, before pip. Control: a new folder is made and
    handed to the download."""
    if not Path(dest).parent.is_dir():  # /sys and /proc are Linux's (CI's); elsewhere nothing to probe
        pytest.skip(f"no {Path(dest).parent} here")
    fetched = []
    monkeypatch.setattr(gpu_wheels, "download", lambda names, folder: fetched.append(folder) or [])
    with pytest.raises(SystemExit) as exit_:
        gpu_wheels.main(["--dest", dest])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and expected in err and "Errno" not in err, err
    assert fetched == []
    gpu_wheels.main(["--dest", str(tmp_path / "new" / "whl")])
    assert fetched == [tmp_path / "new" / "whl"] and fetched[0].is_dir()


def test_wheel_list_is_pinned_and_parsed():
    for name in gpu_wheels.MISSING_ON_DEVICE:
        assert gpu_wheels.pinned(name)  # raises if pyproject.toml does not pin it
    name = "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    assert gpu_wheels.wheel_dist(Path(name)) == ("megatron-core", "0.16.1")
    with pytest.raises(ValueError, match="not a wheel"):
        gpu_wheels.wheel_dist(Path("megatron_core-0.16.1.tar.gz"))


def _demo_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel: ``import {name}`` gives VALUE = 42."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
        z.writestr(f"{info}/RECORD", "".join(f"{arc},,\n" for arc in files) + f"{info}/RECORD,,\n")
    return path


@pytest.mark.slow
def test_wheels_install_into_a_temp_folder_only_when_missing(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _demo_wheel(wheels, "gpu_check_demo", "0.1")
    (wheels / "highspy-1.16.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")  # installed here
    site, installed = gpu_check.install_wheels(wheels, time.monotonic() + 120)
    try:
        assert installed == ["gpu_check_demo-0.1-py3-none-any.whl"]  # highspy 1.16.0 is there already
        code = "import gpu_check_demo; print(gpu_check_demo.VALUE)"
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONPATH": site},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.stdout.strip() == "42", done.stderr
    finally:
        import shutil

        shutil.rmtree(site, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(2 * gpu_check.DEFAULT_BUDGET_S + 300)
def test_dry_run_passes_every_part_and_resumes(tmp_path):
    out, archive = tmp_path / "out", tmp_path / "gpu_check.tar.gz"
    # The suite runs one test a core (nox -s tests), so a part here shares the cores with another
    # test: twice its dry-run budget. Alone (the operator's `nox -s gpu_check -- --dry-run`) the
    # parts keep to their budgets; how long they take is measured there, not judged here.
    budget = 2 * gpu_check.DEFAULT_BUDGET_S
    shared = [
        f"--budget-s={budget:g}",
        *(f"--timeout={p.name}={2 * p.dry_budget_s:g}" for p in gpu_check.PARTS),
    ]
    t0 = time.monotonic()
    first = _run(
        "--dry-run", "--out", str(out), "--archive", str(archive), "--quiet", *shared, timeout=budget + 60
    )
    wall = time.monotonic() - t0
    status = json.loads((out / "status.json").read_text())
    outcomes = {name: status["parts"].get(name, {}).get("outcome") for name in PARTS}
    assert first.returncode == 0 and outcomes == dict.fromkeys(PARTS, "passed"), (
        f"{outcomes}\n{first.stdout[-3000:]}\n{first.stderr[-3000:]}"
    )
    print(f"dry run: {wall:.0f} s")
    kernels = status["parts"]["kernels"]
    assert kernels["tests"]["tests"] >= 10 and kernels["tests"]["failures"] == kernels["tests"]["errors"] == 0
    # the dry run runs a subset (DRY_TEST_FILES); the GPU's files are the suite's own
    assert all((gpu_check.ROOT / f).is_file() for f in (*gpu_check.TEST_FILES, *gpu_check.DRY_TEST_FILES))
    provenance = kernels["provenance"]
    assert provenance["device"]["device"] == "cpu" and provenance["packages"]["torch"]
    assert {"commit", "dirty"} <= set(provenance["git"]) and provenance["date_utc"]
    for path in (
        "tempo_layer/pytest-benchmark/gpu.json",
        "tempo_bert/throughput_cpu.json",
        "cta_mlp/gpu_cpu.json",
        "mist_vs_megatron/engine.json",
        "logs/mist.log",
        "mist_vs_megatron/gpu_measured_dry_run.json",
    ):
        assert (out / path).is_file(), path
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "gpu_check/status.json" in names and "gpu_check/mist_vs_megatron/engine.json" in names, names

    # a second call does nothing: every part passed
    t0 = time.monotonic()
    second = _run("--dry-run", "--out", str(out))
    assert second.returncode == 0, second.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    assert all(f"[gpu_check] {name}: passed earlier" in second.stdout for name in PARTS), second.stdout
    assert json.loads((out / "status.json").read_text()) == status

    # --redo runs the named part again, and only it (the quickest part)
    third = _run("--dry-run", "--out", str(out), "--parts", "llama", "--redo", "--quiet")
    assert third.returncode == 0, third.stderr[-2000:]
    again = json.loads((out / "status.json").read_text())["parts"]
    assert (
        again["llama"]["outcome"] == "passed"
        and again["llama"]["started_utc"] >= status["parts"]["llama"]["finished_utc"]
    )
    others = [k for k in PARTS if k != "llama"]
    assert {k: again[k] for k in others} == {k: status["parts"][k] for k in others}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_part_past_its_timeout_is_killed_and_reported(tmp_path):
    """The kernels part takes ~30 s here; given 4 s it is killed (with everything it started), the
    call goes on to the next part and says which timed out; the next call runs it again."""
    tag, out = uuid.uuid4().hex, tmp_path / "out"
    t0 = time.monotonic()
    done = _run(
        "--dry-run", "--out", str(out), "--parts", "kernels", "--timeout", "kernels=4", "--quiet", tag=tag
    )
    wall = time.monotonic() - t0
    assert done.returncode == 1, done.stderr[-2000:]
    record = json.loads((out / "status.json").read_text())["parts"]["kernels"]
    assert record["outcome"] == "timed_out" and record["timeout_s"] == 4, record
    assert record["seconds"] < 4 + gpu_check.KILL_GRACE_S + 5 and wall < 90, (record, wall)
    assert "kernels  timed_out" in done.stdout
    deadline = time.monotonic() + 20
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tagged(tag), f"left behind: {_tagged(tag)}"
    # not done: the next call starts it again
    again = _run("--dry-run", "--out", str(out), "--parts", "kernels", "--timeout", "kernels=3", "--quiet")
    assert "passed earlier" not in again.stdout and again.returncode == 1
    rerun = json.loads((out / "status.json").read_text())["parts"]["kernels"]
    assert rerun["outcome"] == "timed_out" and rerun["started_utc"] >= record["finished_utc"], rerun


# An installer that does what a slow pip does: makes its folder in its TMPDIR (pip-unpack-*, ...),
# writes down where, and takes its time.
SLOW_PIP_CODE = (
    "import pathlib, sys, tempfile, time; made = tempfile.mkdtemp(prefix='pip-unpack-'); "
    "pathlib.Path(sys.argv[1]).write_text(made); time.sleep(60)"
)


def _slow_wheel(tmp_path: Path) -> Path:
    """A folder with one wheel of a distribution not installed (the slow installer never reads it)."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "gpu_check_slow_demo-0.1-py3-none-any.whl").write_bytes(b"")
    return wheels


def test_an_install_past_the_budget_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """The probe round: a wheel that took pip over --budget-s gave a TimeoutExpired traceback and
    left gpu_check_site_* and pip's five folders in TMPDIR. Now one line that says what to do, and
    the site folder and pip's TMPDIR (a folder of ours inside it) are gone."""
    tmp, made = tmp_path / "tmp", tmp_path / "made.txt"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the call's and, unless it sets its own, the installer's
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(gpu_check, "PIP", (sys.executable, "-c", SLOW_PIP_CODE, str(made)))
    monkeypatch.setattr(gpu_check, "sigterm_as_interrupt", lambda: None)  # pytest's handler stays
    out = tmp_path / "out"
    # 3 s: the installer has its Python started and its folder written down well within it
    args = ["--dry-run", "--out", str(out), "--parts", "llama", "--budget-s", "3"]
    t0 = time.monotonic()
    code = gpu_check.main([*args, "--wheels", str(_slow_wheel(tmp_path))])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "took over 3 s" in err and "give a larger --budget-s" in err, err
    assert time.monotonic() - t0 < 30  # killed at the limit, not after its 60 s
    assert Path(made.read_text()).parent.parent.name.startswith("gpu_check_site_")  # pip's TMPDIR: ours
    assert sorted(p.name for p in tmp.iterdir()) == []
    assert not (out / gpu_check.STATUS).exists()  # no part was started


@pytest.mark.parametrize("given_out", [False, True])
def test_an_interrupted_dry_run_says_which_out_resumes_it(tmp_path, monkeypatch, capsys, given_out):
    """A dry run without --out makes a new folder each call: the line said "the parts not yet
    passed run on the next call", which was not so. It names the folder to pass as --out."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(gpu_check, "sigterm_as_interrupt", lambda: None)

    def interrupted(folder, deadline):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_check, "install_wheels", interrupted)
    out_args = ["--out", str(tmp_path / "out")] if given_out else []
    assert gpu_check.main(["--dry-run", "--parts", "llama", *out_args]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("[gpu_check] interrupted: "), err
    (out,) = [tmp_path / "out"] if given_out else list(tmp.iterdir())  # the dry run's own folder
    assert f"the status so far is kept in {out.resolve()}" in err, err
    if given_out:
        assert err.rstrip().endswith("; the same command runs the parts not yet passed"), err
    else:
        assert f"; the same command with --out {out.resolve()} runs the parts not yet passed" in err, err


def test_the_mist_parts_keep_their_profile_and_launches_under_out(tmp_path):
    """One profile of the device for both Mist parts and a second call, and mist_measured's launches
    kept for resuming (artifacts.mist_vs_megatron.engine's --keep), under --out: the archive packs it."""
    for name in ("mist", "mist_measured"):
        for dry in (True, False):
            cmd = gpu_check.command(gpu_check.BY_NAME[name], tmp_path, dry)
            assert cmd[cmd.index("--keep") + 1] == str(tmp_path / "kept"), cmd


def test_the_kernels_part_runs_the_gpu_tests_first_and_no_cpu_only_slow_ones(monkeypatch):
    """Its budget ends the pytest it runs; the slow tests (the CPU chain under Triton's interpreter,
    the throughput path at a toy size) ran first there, then the rest by timeout, the GPU-only
    tests last. Now not the slow ones, and where CUDA is, the ``gpu`` tests first."""
    import pytest as pt

    from tests import conftest

    for dry in (True, False):
        cmd = gpu_check.command(gpu_check.BY_NAME["kernels"], Path("/tmp/out"), dry)
        assert ["-m", "not slow"] in [cmd[i : i + 2] for i in range(len(cmd))], cmd

    class Item:
        def __init__(self, name, *marks, timeout=None):
            self.name, self.keywords = name, {m: True for m in marks}
            self._timeout = pt.mark.timeout(timeout).mark if timeout else None

        def get_closest_marker(self, name):
            return self._timeout if name == "timeout" else None

    items = [Item("cpu"), Item("long", timeout=300), Item("slow", "slow"), Item("gpu", "gpu")]
    monkeypatch.setattr(conftest, "HAS_CUDA", True)
    assert [i.name for i in sorted(items, key=conftest._start_order)] == ["gpu", "slow", "long", "cpu"]
    monkeypatch.setattr(conftest, "HAS_CUDA", False)  # the CPU suite: longest first, as before
    assert [i.name for i in sorted(items, key=conftest._start_order)] == ["slow", "long", "cpu", "gpu"]
