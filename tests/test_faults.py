"""Killed runs: no process outlives its parent, and the same command resumes where it stopped."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from measure.checks import usable_cores
from tests.measure.test_interrupts import as_from_a_terminal

REPO = Path(__file__).resolve().parents[1]
# How long what a killed run started may take to end: a child killed before it armed its guard
# (die_with_parent, after its imports of torch and the like) ends only once it arms it, which on a
# loaded 2-core machine can take several times the seconds it takes alone. What is checked is that
# they end, not how fast.
ORPHAN_GRACE_S = 60
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture
def run_tmp():
    """An empty TMPDIR for the run under test, on a short path: multiprocessing's forkserver binds a
    socket in it and AF_UNIX paths are limited to 107 bytes (under pytest's tmp_path with a longer
    TMPDIR the forkserver failed to start). Removed after the test."""
    folder = Path(tempfile.mkdtemp(prefix="fault_", dir="/tmp" if os.access("/tmp", os.W_OK) else None))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries ``tag`` (the run under test and everything it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"FAULT_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return pids


def _wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def _start(tag: str, results: Path, tmp: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "artifacts.mist_vs_megatron.run",
        "--parts",
        "comparison",
        "--jobs",
        "2",
        "--results",
        str(results),
    ]
    env = {**os.environ, "FAULT_TEST_TAG": tag, "PYTHONPATH": f"{REPO}:{REPO / 'impl'}", "TMPDIR": str(tmp)}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _until_workers(tag: str, proc: subprocess.Popen) -> None:
    # the parent and its two pool workers (and multiprocessing's resource tracker) are up
    assert _wait_until(lambda: len(_tagged(tag)) >= 3 or proc.poll() is not None, 120), (
        "workers never started"
    )
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(3)  # into a point


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(usable_cores() < 2, reason="--jobs 2 (two pool workers to kill) needs 2 usable cores")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_run_leaves_no_process_and_resumes(tmp_path, run_tmp, sig):
    tag = uuid.uuid4().hex
    results = tmp_path / "results"
    proc = _start(tag, results, run_tmp)
    _until_workers(tag, proc)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert _wait_until(lambda: not _tagged(tag), ORPHAN_GRACE_S), (
        f"left behind after {sig.name}: {_tagged(tag)}"
    )
    # pymp-: the pool's folder; mist_vs_megatron_: the run's own scratch
    assert _files_left(run_tmp, sig, its_own=("pymp-", "mist_vs_megatron_")) == []
    run = json.loads((results / "run.json").read_text())
    assert run["finished_utc"] is None, run  # interrupted: the next same command resumes it
    if sig == signal.SIGTERM:  # unwound like Ctrl-C: one line says so, and how to resume
        last = proc.stderr.read().decode().strip().splitlines()[-1]
        assert proc.returncode == 130 and last.startswith("interrupted: the points finished so far"), last
    # the same command again starts (the lock is not held by a dead run) and resumes this run
    again = _start(tag, results, run_tmp)
    _until_workers(tag, again)
    assert json.loads((results / "run.json").read_text())["run_id"] == run["run_id"]
    again.send_signal(signal.SIGTERM)
    again.wait(timeout=60)
    assert _wait_until(lambda: not _tagged(tag), ORPHAN_GRACE_S)
    assert _files_left(run_tmp, sig, its_own=("pymp-", "mist_vs_megatron_")) == []


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Process ``pid`` has a handler of its own for ``sig`` (its SigCgt mask in /proc)."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:  # gone
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught >> (sig - 1) & 1)


def _files_left(tmp: Path, sig: signal.Signals, its_own: tuple[str, ...] = ()) -> list[str]:
    """What a killed run left in its TMPDIR, less torch's compile cache (a cache, kept on purpose)
    and, under SIGKILL, the killed process's own temporary folders (``its_own``: name prefixes;
    SIGKILL gives a process no chance to remove its own): what its children left."""
    exempt = ("torchinductor_", *(its_own if sig == signal.SIGKILL else ()))
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith(exempt))


def _kill_tagged(tag: str) -> None:
    for pid in _tagged(tag):  # only what the test started (its tag is in their environment)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _kill_when_busy(
    tag: str,
    command: list[str],
    sig: signal.Signals,
    busy,
    tmp: Path,
    settle_s: float = 0.0,
    group: bool = False,
    none_at_exit: bool = False,
) -> subprocess.Popen:
    """Start ``command``, send it ``sig`` ``settle_s`` after ``busy(pids with their command lines)``
    holds, and check that nothing it started is left ORPHAN_GRACE_S later. ``tmp``: its temporary folder
    (TMPDIR, ``run_tmp``), for the caller to check what is left there; ``group``: the signal goes to
    its whole process group, as a terminal's Ctrl-C does (the command in a session of its own);
    ``none_at_exit``: nothing it started may be left even at the moment it exits."""
    env = {**os.environ, "FAULT_TEST_TAG": tag, "PYTHONPATH": f"{REPO}:{REPO / 'impl'}", "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=group,
        preexec_fn=as_from_a_terminal,  # a suite run in the background passes SIGINT on ignored
    )
    try:
        commands = lambda: {p: _cmdline(p) for p in _tagged(tag)}
        started = _wait_until(lambda: proc.poll() is not None or busy(commands()), 120)
        assert started, "its children never started"
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(settle_s)
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        proc.wait(timeout=60)
        left = {p: _cmdline(p) for p in _tagged(tag)}
        assert not (none_at_exit and left), f"alive when it exited after {sig.name}: {left}"
        assert _wait_until(lambda: not _tagged(tag), ORPHAN_GRACE_S), f"left behind after {sig.name}: {left}"
    finally:
        _kill_tagged(tag)
        if proc.poll() is None:
            proc.kill()
    return proc


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_run_leaves_no_torchrun_rank(tmp_path, run_tmp, sig):
    """cta_mlp's distributed baselines: the run starts torchrun, torchrun starts two ranks in
    sessions of their own. Killed while both ranks exist (importing, or in their gloo group),
    neither may outlive the run."""
    command = [
        sys.executable,
        "-m",
        "artifacts.cta_mlp.run",
        "--parts",
        "baselines",
        "--results",
        str(tmp_path / "results"),
    ]

    # torchrun's command line names the module too: torchrun and its two ranks
    def busy(cmds: dict[int, str]) -> bool:
        return sum("artifacts.cta_mlp.distributed" in c for c in cmds.values()) >= 3

    # unwound by SIGTERM, the run stops torchrun, which stops its ranks, before it exits (killed at
    # once, torchrun left them to notice: they outlived the run by up to 0.9 s)
    _kill_when_busy(uuid.uuid4().hex, command, sig, busy, tmp=run_tmp, none_at_exit=sig == signal.SIGTERM)
    # cta_mlp_: the run's scratch; torchrun_logs_: torchrun's logs, made by the run (run_torchrun)
    assert _files_left(run_tmp, sig, its_own=("cta_mlp_", "torchrun_logs_")) == []


_BENCHMARK = """
from measure.parallel import sigterm_as_interrupt
from mist.engine.profiler import profile_collectives
sigterm_as_interrupt()  # as an experiment run: SIGTERM unwinds like Ctrl-C
profile_collectives(2, "cpu", sizes=[4096], repeats=10, rounds=10**6)  # busy until killed
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_benchmark_leaves_no_rank(run_tmp, sig):
    """The engine's collective, ZeRO and TP benchmarks fork their ranks from a server process
    (mist.engine.profiler): killed while the ranks are in their gloo group, no rank nor the server
    may outlive the run (on SIGTERM the run ends at once, not after the ranks' work), and no file
    of theirs is left."""
    command = [sys.executable, "-c", _BENCHMARK]

    # the server and the ranks it forked share its command line
    def busy(cmds: dict[int, str]) -> bool:
        return sum("forkserver" in c for c in cmds.values()) >= 3

    proc = _kill_when_busy(uuid.uuid4().hex, command, sig, busy, settle_s=2.0, tmp=run_tmp)
    if sig == signal.SIGTERM:
        assert proc.returncode != 0
    # pymp-: the killed process's multiprocessing folder (its forkserver's socket)
    assert _files_left(run_tmp, sig, its_own=("pymp-",)) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_benchmark_killed_while_its_ranks_start_is_quiet_and_leaves_nothing(run_tmp, sig):
    """F22 (probe round 5): killed while the ranks' server was still importing its preload, or as
    a rank was being started, the run printed a rank's traceback for the queue's semaphore its
    launcher had removed, and the server lived on until its imports were done. Now a rank's result
    goes through the launch's store (no semaphore) and the server dies with its client from its
    first import. The semaphore's traceback came in 1 of 3 kills by hand, so this checks it is
    absent rather than proving it gone; what it does hold every time: nothing left."""
    command = [sys.executable, "-c", _BENCHMARK]

    def starting(cmds: dict[int, str]) -> bool:  # the server is up, its ranks not yet
        return any("forkserver" in c for c in cmds.values())

    proc = _kill_when_busy(uuid.uuid4().hex, command, sig, starting, tmp=run_tmp)
    err = proc.stderr.read().decode()
    # the launcher's own KeyboardInterrupt (a bare script) is expected; a failing rank start-up
    # (forkserver's _serve_one unpickling a semaphore already removed) is not
    assert "_serve_one" not in err and "SemLock" not in err and "FileNotFoundError" not in err, err[-2000:]
    assert _files_left(run_tmp, sig, its_own=("pymp-",)) == []


_FORKED = """
from measure.fork_launch import ForkLauncher
from measure.parallel import sigterm_as_interrupt
sigterm_as_interrupt()
ForkLauncher("tests.measure.fork_target:preload").run(2, "tests.measure.fork_target", ["sleep"], timeout=600)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("sig", "group"), [(signal.SIGTERM, False), (signal.SIGKILL, False), (signal.SIGINT, True)]
)
def test_killed_fork_launch_leaves_no_server_or_rank(run_tmp, sig, group):
    """measure.fork_launch (the engine's CPU launches): its client killed while two forked ranks
    run, neither the warm server nor a rank may outlive it, nor the folder of the ranks' output
    (the server's, removed when its client dies, even by SIGKILL). Ctrl-C reaches the server
    too: it left the folder and a traceback."""
    command = [sys.executable, "-c", _FORKED]

    # the server and the ranks it forked share its command line
    def busy(cmds: dict[int, str]) -> bool:
        return sum("measure.fork_launch" in c for c in cmds.values()) >= 3

    proc = _kill_when_busy(uuid.uuid4().hex, command, sig, busy, settle_s=1.0, tmp=run_tmp, group=group)
    assert _files_left(run_tmp, sig) == []
    if group:  # the client's KeyboardInterrupt is the script's own; nothing from the server
        err = proc.stderr.read().decode()
        assert "in _serve" not in err and "in _run_ranks" not in err, err


_PROFILE = """
from measure.parallel import sigterm_as_interrupt
from mist.engine.profiler import write_profiles
from pathlib import Path
import tempfile, torch
sigterm_as_interrupt()
# a profile that takes minutes, two copies beside it; its folder named to tell it from theirs
with tempfile.TemporaryDirectory(prefix="script-") as out:
    write_profiles(Path(out), "cpu", 256, 4, 128, [1, 2, 4, 8], [1], torch.bfloat16, "cpu", repeats=10**4,
                   concurrent=3)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_profile_leaves_no_concurrent_copy(run_tmp, sig):
    """`mist profile` on a CPU runs copies of itself beside the measured one (a plan's ranks share
    the cores): killed while they run, no copy may outlive it, nor a copy's files."""
    command = [sys.executable, "-c", _PROFILE]

    # the measured profile and its two copies (multiprocessing's spawned children), both copies
    # writing (a copy's files made before the kill were left when it made them in a folder of its
    # own: seen on CI's slower runner only, where the copies had got that far)
    def busy(cmds: dict[int, str]) -> bool:
        writing = len(list((run_tmp).rglob("profile.json")))  # the measured one's and theirs
        return sum("multiprocessing.spawn" in c for c in cmds.values()) >= 2 and writing >= 3

    _kill_when_busy(uuid.uuid4().hex, command, sig, busy, settle_s=1.0, tmp=run_tmp)
    # the script's folder and the copies' scratch are the killed process's own
    assert _files_left(run_tmp, sig, its_own=("script-", "profile_copies_")) == []


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("artifacts.smoke", ["--bogus"], "unrecognized arguments: --bogus"),
        (
            "artifacts.cta_mlp.run",
            ["--parts", "sim", "--gpu-dry-run"],
            "--gpu-dry-run applies to the gpu part",
        ),
        (
            "artifacts.mist_vs_megatron.run",
            ["--parts", "calibration", "--scale", "paper"],
            "--scale applies to the comparison and tempo parts",
        ),
    ],
)
def test_an_option_a_command_would_ignore_is_refused(module, argv, message, capsys, tmp_path):
    """The probe round found these taken and ignored without a word: one line, exit 2, nothing run."""
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main([*argv, *([] if module == "artifacts.smoke" else ["--results", str(tmp_path / "r")])])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["artifacts.cta_mlp.run", "--parts", "sim", "--results", "r"], id="experiment"),
        pytest.param(
            ["tempo.maxbatch", "--model", "bert-mini", "--seq", "32", "--gpu-mem", "1GB"], id="maxbatch"
        ),
        pytest.param(["artifacts.smoke"], id="smoke", marks=pytest.mark.slow),
    ],
)
def test_a_reader_that_stops_early_ends_the_command_quietly(argv, tmp_path):
    """``… | head -c1``: the reader gone, the command ends quietly with the shell's status for it
    (141), as ``mist`` does (the probe round: a BrokenPipeError traceback and status 1 from every
    experiment driver, the smoke run and tempo.maxbatch). The five experiments end alike (the same
    lines under __main__), so one stands for all. The reader closes before anything is printed."""
    command = [sys.executable, "-m", *argv]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": f"{REPO / 'impl'}{os.pathsep}{REPO}"},
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=280)
    assert proc.returncode == 141 and err == "", err


_SLOW_INSTALL = """
import sys
from artifacts import gpu_check
# an installer that does what a slow pip does: a folder in its TMPDIR, then it takes its time
code = "import tempfile, time; tempfile.mkdtemp(prefix='pip-unpack-'); time.sleep(120)"
gpu_check.PIP = (sys.executable, "-c", code)
sys.exit(gpu_check.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sig", "group"), [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_gpu_check_interrupted_while_installing_leaves_nothing(tmp_path, run_tmp, sig, group):
    """gpu_check installs the wheels of missing packages into a temporary folder first. Interrupted
    during the install, it left that folder (SIGINT) and pip's five folders as well (SIGTERM). Now
    one line and nothing left: pip's TMPDIR is a folder inside ours."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "gpu_check_slow_demo-0.1-py3-none-any.whl").write_bytes(b"")  # not installed here
    args = ["--dry-run", "--parts", "llama", "--out", str(tmp_path / "out"), "--wheels", str(wheels)]
    command = [sys.executable, "-c", _SLOW_INSTALL, *args]

    # the call and its installer (which has then had a second to make its folder)
    def busy(cmds: dict[int, str]) -> bool:
        return sum("tempfile.mkdtemp(prefix='pip-unpack-')" in c for c in cmds.values()) >= 2

    proc = _kill_when_busy(uuid.uuid4().hex, command, sig, busy, settle_s=1.0, tmp=run_tmp, group=group)
    assert _files_left(run_tmp, sig) == []
    err = proc.stderr.read().decode()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        f"[gpu_check] interrupted: the status so far is kept in {(tmp_path / 'out').resolve()}; the same "
        "command runs the parts not yet passed"
    ], err


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("sig", "group"), [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_interrupted_smoke_is_one_line_and_leaves_nothing(run_tmp, sig, group):
    """`python -m artifacts.smoke` during its checks (the probe round: Ctrl-C gave a 90-line traceback,
    SIGTERM exit 143 and not a word): one line that says what to do, exit 130, and its temporary
    folder gone."""
    command = [sys.executable, "-m", "artifacts.smoke"]

    # its signal handlers installed, then 1 s into its checks (~7 s in all here). A fixed 4 s from
    # its start failed once in a loaded full suite: a signal while Python still imports, before the
    # handlers, is Python's own (a traceback), and on a faster machine 4 s after the handlers the
    # checks could be over
    def busy(cmds: dict[int, str]) -> bool:
        return any("artifacts.smoke" in c and _catches(pid, signal.SIGTERM) for pid, c in cmds.items())

    proc = _kill_when_busy(uuid.uuid4().hex, command, sig, busy, settle_s=1.0, tmp=run_tmp, group=group)
    err = proc.stderr.read().decode()
    assert proc.returncode == 130 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted in the "), err
    assert lines[0].endswith(
        "a smoke run keeps nothing, so python -m artifacts.smoke starts it again from the first check"
    )
    assert _files_left(run_tmp, sig) == []


# A spawned or forkserver child that draws a tqdm bar (torch.compile does, in the profile's copies
# when they compile Tempo's ops) and is ended by the interrupted run. The bar stands in for the
# compile (seconds, not the minutes of a cold inductor cache); everything else is the profiler's.
_BAR_CHILD = """
import os, sys, time
from pathlib import Path
from tqdm import tqdm

def bar_then_wait(*args):  # in the children (defined when they import this file as __mp_main__)
    with tqdm(total=1, file=sys.stdout) as bar:
        bar.update()
    Path(os.environ["TMPDIR"], f"bar-{os.getpid()}").touch()
    for _ in range(60000):  # short sleeps: a signal taken just before one long sleep began would
        time.sleep(0.01)  # leave it unbroken for its ten minutes (tests/measure/test_interrupts.py)

if sys.argv[1] == "copies":  # write_profiles' concurrent copies (spawn): each runs _write_profiles
    from mist.engine.profiler import layer
    layer._write_profiles = lambda out, job, progress, lockstep=None: bar_then_wait()

if __name__ == "__main__":
    import torch
    from measure.parallel import sigterm_as_interrupt
    from mist.engine.profiler import ranks, write_profiles
    sigterm_as_interrupt()
    if sys.argv[1] == "copies":
        write_profiles(Path(os.environ["TMPDIR"]), "cpu", 64, 4, 16, [1], [1], torch.float32, "cpu",
                       concurrent=3)
    else:  # the collective benchmarks' ranks (forkserver)
        ranks.run_ranks(bar_then_wait, 2, (), 1)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("children", "sig", "group"), [("copies", signal.SIGINT, True), ("ranks", signal.SIGTERM, False)]
)
def test_interrupted_profile_leaks_no_semaphore(tmp_path, run_tmp, children, sig, group):
    """L6: interrupted while the profile's copies ran (`artifacts.mist_vs_megatron.run --parts
    engine`), the run ended with multiprocessing's resource tracker saying "There appear to be 1
    leaked semaphore objects to clean up at shutdown": tqdm's class-wide lock, made by a copy's
    first bar, is there a named semaphore, and a child ended by a signal never unlinks it. Now the
    children the profiler starts (its copies, its benchmarks' ranks) keep tqdm to a thread lock."""
    script = tmp_path / "bar_child.py"
    script.write_text(_BAR_CHILD)
    command = [sys.executable, str(script), children]

    def busy(cmds: dict[int, str]) -> bool:  # every child has drawn its bar
        return len(list(run_tmp.glob("bar-*"))) >= 2

    proc = _kill_when_busy(uuid.uuid4().hex, command, sig, busy, tmp=run_tmp, group=group)
    err = proc.stderr.read().decode()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
    assert "leaked semaphore" not in err, err[-2000:]


# An experiment's run whose first point swallows the Ctrl-C that arrives while it runs, as
# torch.compile did to about 1 in 9 (M1): Python prints "Exception ignored in ..." for an exception
# raised in a weakref callback (inductor's code runs in them) and drops it; or the point's own code
# catches it. The signal is sent by the point itself, so it lands there every time.
_SWALLOWS = """
import argparse, os, signal, sys, time, weakref
from pathlib import Path
from artifacts.experiment import Experiment, experiment_run
from measure.timing import time_fn

class Graph:
    pass

def in_a_weakref_callback():
    print("a call", flush=True)

    def callback(_):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the handler runs here: its KeyboardInterrupt is printed and dropped
    graph = Graph()
    ref = weakref.ref(graph, callback)
    del graph

def caught():
    print("a call", flush=True)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    except KeyboardInterrupt:
        pass

swallow = {"weakref": in_a_weakref_callback, "caught": caught}[sys.argv[2]]
timed = sys.argv[3] == "timed"
args = argparse.Namespace(results=Path(sys.argv[1]), fresh=False, update_reference=False)
with experiment_run(args, Experiment("tempo_layer")) as run:
    store = run.file("points.json")
    for n in range(3):
        point = (lambda: time_fn(swallow, warmup=1, repeats=2).repeats) if timed else swallow
        store.compute({"n": n}, point)
print("finished all points")
"""


@pytest.mark.parametrize("timed", ["timed", "point"])
@pytest.mark.parametrize("swallowed", ["weakref", "caught"])
def test_a_swallowed_interrupt_still_stops_the_run(tmp_path, swallowed, timed):
    """M1: the KeyboardInterrupt of a Ctrl-C that lands in a weakref callback (or in code that
    catches it) never reached the run, which measured every point and exited 0. The handler now
    records the signal, and the run checks it after each timed call (``time_fn``: a compile is a
    first call) and each point: one line, exit 130, the point measured under it not kept."""
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'impl'}"}
    command = [sys.executable, "-c", _SWALLOWS, str(results), swallowed, timed]
    proc = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, preexec_fn=as_from_a_terminal
    )
    if swallowed == "weakref":  # what M1 printed: Python's own word that it dropped it
        assert "Exception ignored in" in proc.stderr and "KeyboardInterrupt" in proc.stderr, proc.stderr
    # stopped after the call it was swallowed in (a timed one: before the timing's next call)
    assert proc.stdout.count("a call") == 1 and "finished all points" not in proc.stdout, proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 130 and last.startswith("interrupted: the points finished so far"), proc.stderr
    assert not (results / "points.json").exists()  # the point measured under it is not kept
    assert json.loads((results / "run.json").read_text())["finished_utc"] is None  # resumable
