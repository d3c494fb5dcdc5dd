"""The figure scripts on missing or broken results: one line saying so, never a traceback or a
silent exit (run on a copy of the scripts whose artifacts/ is a temporary folder)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.measure.test_interrupts import as_from_a_terminal

REPO = Path(__file__).resolve().parents[1]


def _draw(root: Path, script: str, how: str = "file") -> subprocess.CompletedProcess:
    """``script`` run as a file (as nox runs it), or with ``-m`` from ``root`` (how="module")."""
    if how == "file":
        command = [sys.executable, str(root / "figures" / script)]
    else:
        command = [sys.executable, "-m", f"figures.{script.removesuffix('.py')}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # they find the packages themselves
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def copy(tmp_path) -> Path:
    # the scripts, not what they drew: a checkout where an experiment has run has figures/results/
    # (git-ignored), and the tests that check nothing is drawn read the copy's
    shutil.copytree(
        REPO / "figures", tmp_path / "figures", ignore=shutil.ignore_patterns("reference", "results")
    )
    (tmp_path / "impl").symlink_to(REPO / "impl")
    (tmp_path / "artifacts" / "cta_mlp" / "results").mkdir(parents=True)
    for module in ("__init__.py", "verdicts.py"):  # the check the scripts read results with
        (tmp_path / "artifacts" / module).symlink_to(REPO / "artifacts" / module)
    return tmp_path


@pytest.mark.parametrize("how", ["file", "module"])
def test_no_results_is_said_in_one_line(copy, how):
    """Run either way: with ``-m`` the scripts failed with a ModuleNotFoundError traceback
    (``_common`` is found beside the script only when run as a file)."""
    done = _draw(copy, "plot_cta_mlp.py", how)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.strip().splitlines() == [
        "nothing to draw: artifacts/cta_mlp/results/ has no results; run nox -s cta_mlp first, or draw "
        "the committed reference with --reference"
    ]


@pytest.mark.parametrize("broken", ["truncated", "a point of another shape"])
def test_broken_results_are_one_line(copy, broken):
    reference = (REPO / "artifacts" / "cta_mlp" / "reference" / "sim.json").read_text()
    path = copy / "artifacts" / "cta_mlp" / "results" / "sim.json"
    if broken == "truncated":  # a write cut short
        path.write_text(reference[: len(reference) // 2])
    else:  # well-formed, but a field the figure reads is gone
        data = json.loads(reference)
        for p in data["points"]:
            p["result"] = {"renamed": p["result"]}
        path.write_text(json.dumps(data))
    done = _draw(copy, "plot_cta_mlp.py")
    err = done.stderr.strip()
    last = err.splitlines()[-1]  # (matplotlib may warn first, about a panel left empty)
    assert done.returncode == 1 and last.startswith("error: ") and "Traceback" not in err, err
    assert "sim.json" in last or "artifacts/cta_mlp/results/" in last


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_a_latency_out_of_range_is_refused_not_dropped_from_the_axis(copy, bad):
    """Probe round 5 F15: sim.json's latencies NaN or -1 were drawn around (a log axis drops them
    without a word). Now one line naming the file, the point and the field; nothing written.
    Control: the file as committed is drawn."""
    reference = json.loads((REPO / "artifacts" / "cta_mlp" / "reference" / "sim.json").read_text())
    path = copy / "artifacts" / "cta_mlp" / "results" / "sim.json"
    data = json.loads(json.dumps(reference))
    data["points"][len(data["points"]) // 2]["result"]["cta_s"] = bad
    path.write_text(json.dumps(data))
    done = _draw(copy, "plot_cta_mlp.py")
    err = done.stderr.strip()
    assert done.returncode == 1 and err.count("\n") == 0 and err.startswith(f"error: {path}: point {{"), err
    expected = "not a finite number" if bad != bad else "not a time in seconds (a number >= 0)"
    assert f"result.cta_s = {bad}, {expected}" in err, err
    assert not (copy / "figures" / "results").exists() or not any((copy / "figures" / "results").iterdir())
    path.write_text(json.dumps(reference))
    done = _draw(copy, "plot_cta_mlp.py")
    assert done.returncode == 0 and "wrote " in done.stdout, done.stderr[-2000:]


def test_a_figure_is_saved_whole_or_not_at_all(tmp_path, monkeypatch):
    """finish saved the PNG in place: a kill mid-save left a committed reference figure truncated
    (probe 5: "cannot identify image file"). At every moment of a save the figure is the old one
    or the new one: checked from inside a save cut short; a save that completes is a PNG."""
    import matplotlib.pyplot as plt

    from figures import _common
    from measure.results import Point, Results

    (tmp_path / "figures").mkdir()
    monkeypatch.setattr(_common, "__file__", str(tmp_path / "figures" / "_common.py"))
    out = tmp_path / "figures" / "results" / "x.png"
    provenance = {"git": {"commit": "0" * 40, "dirty": False}, "device": {"device": "cpu"}}
    results = Results(
        tmp_path / "r.json", [Point({"k": 1}, 1.0, {**provenance, "finished_utc": "2026-12-04"})]
    )
    fig = plt.figure()
    assert _common.finish(fig, "t", results, "x.png") == out
    old = out.read_bytes()
    assert old.startswith(b"\x89PNG\r\n\x1a\n")
    seen = []

    class Killed(plt.Figure):
        def savefig(self, target, **kwargs):
            with open(target, "wb") as f:
                f.write(old[:100])  # half written
            seen.append(out.read_bytes())  # what a kill now would leave
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _common.finish(plt.figure(FigureClass=Killed), "t", results, "x.png")
    assert seen == [old] and out.read_bytes() == old
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.png"]  # no temporary file left


def test_the_generated_docs_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """claims --write-readme rewrote README.md and docs/claims.md in place; cut short before the
    new text is on disk, the old file stays (checked by failing the sync before the rename)."""
    from artifacts import claims

    path = tmp_path / "README.md"
    old = f"before\n{claims.SUMMARY[0]}\nold summary\n{claims.SUMMARY[1]}\nafter\n"
    path.write_text(old)

    def killed(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        claims._write_generated(path, claims.SUMMARY, "new summary\n")
    assert path.read_text() == old and [p.name for p in tmp_path.iterdir()] == ["README.md"]
    monkeypatch.undo()
    claims._write_generated(path, claims.SUMMARY, "new summary\n")
    assert path.read_text() == old.replace("old summary", "new summary")


# The script as nox runs it, its figures' save held (where the probe round's Ctrl-C came), so that
# the signal reaches it drawing, never before its handler or after its end
_SAVE_HELD = """
import runpy, sys, time
import matplotlib.figure

def held(*args, **kwargs):
    print("saving", flush=True)
    # a minute in short sleeps: a signal taken just before one long sleep began would leave it
    # unbroken (tests/measure/test_interrupts.py); the handler runs as each short one returns
    for _ in range(6000):
        time.sleep(0.01)

matplotlib.figure.Figure.savefig = held
sys.path.insert(0, sys.argv[1].rsplit("/", 1)[0])  # _common beside the script, as for a file
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_script_ends_in_one_line(copy, sig):
    """Ctrl-C or ``kill`` while drawing: one line and status 130 (the probe round: a 34-line
    KeyboardInterrupt traceback, or SIGTERM's silent 143)."""
    shutil.copy(REPO / "artifacts/cta_mlp/reference/sim.json", copy / "artifacts/cta_mlp/results")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVE_HELD, str(copy / "figures" / "plot_cta_mlp.py")],
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    try:
        assert proc.stdout.readline() == "saving\n", proc.communicate()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # a no-op once it has ended
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "plot_cta_mlp.py: interrupted (what was written stays)", err
