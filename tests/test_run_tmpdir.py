"""An experiment's run gives everything it starts a TMPDIR of its own and removes it at the end:
tools leave temporary files when interrupted (gcc's cc*.s from inductor's C++ compile stayed in
TMPDIR after 4 of 6 Ctrl-C's in the fourth probe round)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import pytest

from artifacts.experiment import Experiment, experiment_run

# a child that leaves a file in its TMPDIR, as an interrupted compiler does
_LEAVES_A_FILE = "import tempfile; print(tempfile.mkstemp(prefix='cc', suffix='.s')[1])"


def _leave_a_file() -> str:
    done = subprocess.run([sys.executable, "-c", _LEAVES_A_FILE], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp


def _run(tmp_path, body) -> None:
    args = argparse.Namespace(results=tmp_path / "results", fresh=False, update_reference=False)
    with experiment_run(args, Experiment("tempo_layer")):
        body()


@pytest.mark.parametrize("ends", ["normally", "interrupted"])
def test_what_a_runs_children_leave_in_tmpdir_goes_with_the_run(tmp_path, own_tmp, ends):
    seen = {}

    def body():
        seen["tmpdir"] = os.environ["TMPDIR"]
        seen["cache"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        seen["file"] = _leave_a_file()
        assert os.path.exists(seen["file"])
        if ends == "interrupted":
            raise KeyboardInterrupt

    if ends == "interrupted":
        with pytest.raises(SystemExit):
            _run(tmp_path, body)
    else:
        _run(tmp_path, body)
    assert seen["tmpdir"].startswith(str(own_tmp)) and seen["file"].startswith(seen["tmpdir"])
    assert list(own_tmp.iterdir()) == []  # the run's folder and the child's file gone
    # torch's compile cache stays where inductor puts it by default, outside the run's folder
    assert os.path.dirname(seen["cache"]) == str(own_tmp)
    assert os.environ["TMPDIR"] == str(own_tmp) and "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_control_outside_a_run_the_childs_file_stays(own_tmp):
    left = os.path.basename(_leave_a_file())
    assert [p.name for p in own_tmp.iterdir()] == [left]


# A run during which multiprocessing makes its own temporary folder (a forkserver's socket does):
# the run's scratch holds it; multiprocessing removes it at exit
_MULTIPROCESSING_TMP = """
import argparse, multiprocessing.util, sys
from artifacts.experiment import Experiment, experiment_run
args = argparse.Namespace(results=sys.argv[1], fresh=False, update_reference=False)
with experiment_run(args, Experiment("tempo_layer")):
    print(multiprocessing.util.get_temp_dir(), flush=True)
"""


def test_multiprocessings_own_folder_in_the_runs_scratch_ends_quietly(tmp_path, own_tmp):
    """multiprocessing's temporary folder, made during a run, lies in the run's scratch; the run
    removed the scratch, and at exit multiprocessing's hook failed on its folder gone: a traceback
    after a finished run (the engine part). Now nothing on stderr, exit 0, and nothing left.
    Negative control: removing the scratch outright gives the traceback."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(root, "impl"), root])}

    def run(script: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", script, str(tmp_path / "results")]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)

    done = run(_MULTIPROCESSING_TMP)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.splitlines()[-1].startswith(str(own_tmp)) and list(own_tmp.iterdir()) == []
    outright = "import artifacts.experiment as e, shutil\n"
    outright += "e._remove_scratch = lambda p: shutil.rmtree(p)\n"
    control = run(outright + _MULTIPROCESSING_TMP)
    assert "FileNotFoundError" in control.stderr


def test_an_interrupt_swallowed_after_the_last_point_ends_the_run_unfinished(tmp_path, own_tmp):
    """A Ctrl-C that code swallowed (torch.compile's weakref callbacks do) after the run's last
    measured point, with no later point to raise it again: the run still ends as interrupted
    (exit 130, not marked finished), and once that is reported the request is done with, so a
    later run in the same process starts clean. Negative control: without a request the run
    finishes."""
    import json

    from measure import parallel

    def swallowed():
        parallel._stop_requested = "signal 2"  # as the handler records it, its exception dropped

    with pytest.raises(SystemExit) as ended:
        _run(tmp_path, swallowed)
    assert ended.value.code == 130
    assert not json.loads((tmp_path / "results" / "run.json").read_text()).get("finished_utc")
    parallel.raise_if_interrupted()  # reported: nothing more to raise
    _run(tmp_path, lambda: None)  # the control: the same run resumed, finished
    assert json.loads((tmp_path / "results" / "run.json").read_text()).get("finished_utc")
