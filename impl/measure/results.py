"""Result files for every experiment: per-point provenance, atomic writes, resumable runs.

Each experiment keeps two folders of result files in the same format:

* ``results/``: what runs on this machine compute (git-ignored). A run computes every point it
  is asked for from scratch; only a run that was interrupted is resumed, by the same command at
  the same commit (``Run``).
* ``reference/``: committed reference results, changed only deliberately (``update_reference``).

A result file is one JSON object::

    {"format": 2, "points": [{"key": {...}, "result": ..., "provenance": {...}}, ...]}

A point's ``key`` is the full configuration that determines its result (model, sequence length,
dtype, budget, ...), so a run with other options adds points beside the others and never drops
any. Its ``provenance`` is its own: the run that computed it (commit, dirty flag, package
versions, device, host, when, how long), so a resumed or later run never relabels a point.
Each finished point is written at once (temp file + fsync + rename: never a torn file).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import platform
import secrets
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from .parallel import raise_if_interrupted
from .strict import json_data, read_json_file

PACKAGES = ("torch", "triton", "transformers", "megatron-core", "numpy", "scipy", "sympy", "highspy")
REPO_ROOT = Path(__file__).resolve().parents[2]
FORMAT = 2
RUN_MANIFEST = "run.json"

Key = dict[str, Any]


class ResultFileError(ValueError):
    """A result file that cannot be read as one; the message names the file and what to do."""


class NotAResultsFolderError(ValueError):
    """A results folder asked for that holds files that are not results (a source folder)."""


class RunLockedError(RuntimeError):
    """Another run is writing to the same results folder."""


class NotALockFileError(RunLockedError):
    """A folder's ``.lock`` is a link, a folder, a FIFO or a device: the folder cannot be locked."""


# ---------------------------------------------------------------- provenance


# Where git is missing, the commit a copied tree is at (``artifacts.gpu_check --commit``).
SOURCE_COMMIT_ENV = "MEMTIME_SOURCE_COMMIT"


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    # Committed reference results and figures are outputs, not code: updating them does not make
    # the code that computes the next point dirty.
    outputs = (":(exclude)artifacts/*/reference/*", ":(exclude)figures/reference/*")
    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", *outputs)),
        }
    except (OSError, subprocess.SubprocessError):
        # no git here (the GPU machine gets a copy of the tree without it): the commit its caller
        # says the tree is at, or none; whether the tree differs from it is not known
        return {"commit": os.environ.get(SOURCE_COMMIT_ENV) or None, "dirty": None}


def cpu_model() -> str:
    """The processor's model name (results can depend on it: floating-point kernels differ)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: str = "cpu") -> dict[str, Any]:
    out: dict[str, Any] = {"device": device, "cpu": cpu_model(), "cpus": os.cpu_count()}
    if device.startswith("cuda"):
        import torch  # only here: reading a result file must not load torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.device(device))
            out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return out


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def utc_now() -> str:
    """Now, in UTC, to the second (ISO 8601): when a run, point or file was made."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _canonical(obj: Any, where: str = "") -> Any:
    """``obj`` as it reads back from JSON (tuples become lists, numpy numbers Python's), so keys and
    configs compare as stored; what is not JSON data is a TypeError naming where it is."""
    return json_data(obj, where)


def key_id(key: Key) -> str:
    """A point's identity: its key serialised canonically (never parsed back)."""
    return _json_text(_canonical(key))


def _json_text(data: Any) -> str:
    """JSON data as text that is equal exactly where the data are equal as JSON values: a whole
    float written as its integer (2.0 and 2 are one number; ``select`` matched them while the
    identities differed), true and 1 apart (Python's == would not tell them)."""
    return json.dumps(_whole_as_int(data), sort_keys=True)


def _whole_as_int(data: Any) -> Any:
    if isinstance(data, float) and data.is_integer():
        return int(data)
    if isinstance(data, dict):
        return {k: _whole_as_int(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_whole_as_int(v) for v in data]
    return data


# ---------------------------------------------------------------- files


def temp_beside(path: Path) -> str:
    """A new empty file ``.<name>.*.tmp`` in ``path``'s folder: what ``atomic_path`` writes and
    renames over ``path`` (and the name the results-folder check knows as a writer's leftover)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return tmp


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary file beside ``path`` for the block to write (by any means: text, a tarball);
    synced and renamed over ``path`` when the block ends, removed if it raises. ``path`` then holds
    what it held before or the whole new file, never a torn one (a kill in between leaves a
    ``.<name>.*.tmp`` beside it, not half a file). Only a regular file is replaced
    (``check_replaceable``), checked before the block and again before the rename."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(path)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a result file is for everyone to read
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        check_replaceable(path)  # the block can take long (a tarball): something put there since
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_replaceable(path: str | os.PathLike) -> None:
    """``path`` is absent or a regular file, so a new file may be renamed over it: a rename would
    turn a device, a FIFO or a link into a regular file (as root, ``/dev/null``). ValueError, one
    line, otherwise."""
    if (kind := not_regular(path)) is not None:
        raise ValueError(
            f"{path}: {kind}, not a regular file; a file is written only as a new one or over a "
            "regular file: give another path"
        )


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """``path`` holds ``text`` or what it held before (``atomic_path``)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """``path`` holds ``obj`` as JSON (``strict.json_data``: a value that is not JSON data is a
    TypeError naming where it is, never written as its str()) or what it held before."""
    write_text_atomic(path, json.dumps(json_data(obj), indent=1, sort_keys=True) + "\n")


@dataclass(frozen=True)
class Point:
    key: Key
    result: Any
    provenance: dict[str, Any]


class Results:
    """The points of one result file, read-only: what figures, summaries and claims read."""

    def __init__(self, path: str | os.PathLike, points: list[Point] | None = None) -> None:
        self.path = Path(path)
        self._points: dict[str, Point] = {key_id(p.key): p for p in points or []}

    @classmethod
    def load(cls, path: str | os.PathLike) -> Results:
        """Read ``path``; a missing file is an empty set, a broken one a clear error."""
        path = Path(path)
        if not path.exists():
            return cls(path)
        advice = (
            "move it aside (or delete it) to start afresh; results/ holds only this machine's runs, "
            "the committed reference is in reference/"
        )
        try:
            # a regular file: a FIFO of the name would block the read
            data = read_json_file(path)
        except (UnicodeDecodeError, ValueError) as e:  # JSON, a key twice, no regular file
            raise ResultFileError(f"{path}: not a readable result file ({e}); {advice}") from None
        if (
            not isinstance(data, dict)
            or data.get("format") != FORMAT
            or not isinstance(data.get("points"), list)
        ):
            raise ResultFileError(
                f"{path}: not a result file of format {FORMAT} (a truncated file, or one from an older "
                f"version of this repository); {advice}"
            )
        try:
            points = [Point(p["key"], p["result"], p["provenance"]) for p in data["points"]]
        except (KeyError, TypeError) as e:
            raise ResultFileError(
                f"{path}: a point lacks key, result or provenance ({e!r}); {advice}"
            ) from None
        seen: dict[str, int] = {}
        for n, p in enumerate(points):
            if not isinstance(p.key, dict) or not isinstance(p.provenance, dict):
                raise ResultFileError(f"{path}: point {n}: its key and provenance must be mappings; {advice}")
            # two points of one key: which one a reader gets would be an accident of the file's order
            if (k := key_id(p.key)) in seen:
                raise ResultFileError(
                    f"{path}: point {n} repeats the key of point {seen[k]}, "
                    f"{json.dumps(p.key, sort_keys=True)} (keys compare as JSON values: 2 and 2.0 are one "
                    f"number); {advice}"
                )
            seen[k] = n
        return cls(path, points)

    def __len__(self) -> int:
        return len(self._points)

    def __iter__(self) -> Iterator[Point]:
        return iter(self._points.values())

    def get(self, key: Key) -> Point | None:
        return self._points.get(key_id(key))

    def select(self, **fields: Any) -> list[Point]:
        """Every point whose key has these values (in the order they were first added)."""
        want = {k: _json_text(v) for k, v in _canonical(fields).items()}  # as key_id compares them
        return [
            p for p in self._points.values() if all(_json_text(p.key.get(k)) == v for k, v in want.items())
        ]

    def one(self, **fields: Any) -> Point | None:
        """The point matching ``fields``, None if none; several matching is an error."""
        found = self.select(**fields)
        if len(found) > 1:
            keys = ", ".join(key_id(p.key) for p in found[:3])
            raise LookupError(f"{self.path}: {len(found)} points match {fields}: {keys} ...")
        return found[0] if found else None

    def _put(self, point: Point) -> None:
        """Add ``point``, replacing the one with the same key (written by ``_write``)."""
        self._points[key_id(point.key)] = point

    def _write(self) -> None:
        points = [
            {"key": p.key, "result": p.result, "provenance": p.provenance} for p in self._points.values()
        ]
        write_json_atomic(self.path, {"format": FORMAT, "points": points})


# ---------------------------------------------------------------- runs


def lock_folder(folder: Path, busy: str, wait_s: float = 0.0) -> TextIO:
    """Hold ``folder``'s lock (its ``.lock`` file, flock'd) while the returned file is open: one
    writer a folder (a results folder's run, a profile folder's ``mist profile``). Another process
    holding it: ``RunLockedError(busy)`` at once, or after waiting up to ``wait_s`` for it to end
    (never without bound). The lock goes with the process, however it ends (a kill included); the
    empty ``.lock`` file stays (removing it would let a third process lock a new file while a
    second still holds the old one). A ``.lock`` that is not a regular file is refused
    (``NotALockFileError``), never opened through."""
    path = folder / ".lock"
    if (kind := not_regular(path)) is not None:  # before opening: a device's open alone can act
        raise NotALockFileError(_not_a_lock_file(path, kind))
    try:
        # no O_TRUNC: the lock is the flock, not the content, and a .lock hard-linked to a result
        # file must not empty it; O_NOFOLLOW: a link is never written through; O_NONBLOCK: a FIFO
        # put in place since the check is not waited on (its open fails or returns at once)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # a link, a folder, a FIFO after all
            raise NotALockFileError(_not_a_lock_file(path, "not a regular file")) from None
        raise
    lock = os.fdopen(fd, "w")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped in between the check and the open
            raise NotALockFileError(_not_a_lock_file(path, "not a regular file"))
        if not _flock_within(lock, wait_s):
            raise RunLockedError(busy)
    except BaseException:
        lock.close()
        raise
    return lock


def _flock_within(lock: TextIO, wait_s: float) -> bool:
    """Whether ``lock``'s exclusive flock was had within ``wait_s`` (polled: flock has no timeout)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def folder_is_locked(folder: Path) -> bool:
    """Whether a process holds ``folder``'s lock now (``lock_folder``: a run or `mist profile` still
    writing it). Read-only: nothing is created; a missing or irregular ``.lock`` is not held. Its
    probe is a shared flock taken and let go at once (a writer starting in that instant is told
    the folder is busy, as for any other holder)."""
    path = folder / ".lock"
    if not_regular(path) is not None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # absent, or gone since the check
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing lets a taken lock go
    return False


def not_regular(path: str | os.PathLike) -> str | None:
    """What ``path`` is, in words ("a FIFO"), where it exists and is not a regular file; None where
    it is absent or a regular file. lstat: a symbolic link is one, whatever it points to."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"))
    return next((word for test, word in kinds if test(mode)), "a device or socket")


def _not_a_lock_file(path: Path, what: str) -> str:
    return (
        f"{path}: {what}; a folder's .lock must be a regular file or absent (it is never written "
        "through): move it aside"
    )


def unlock_folder(lock: TextIO) -> None:
    """Let ``lock_folder``'s lock go (again: nothing)."""
    if not lock.closed:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


class Run:
    """One invocation of an experiment, writing into ``results_dir``.

    ``config`` is the command's options. A run starts from scratch unless the previous run in
    the folder was the same command at the same commit and did not finish: then it resumes it,
    skipping the points it already computed. Points of earlier runs stay in the files (with
    their own provenance) until this run recomputes them. One run writes a folder at a time.
    """

    def __init__(self, results_dir: str | os.PathLike, config: dict[str, Any], fresh: bool = False) -> None:
        self.dir = Path(results_dir)
        _check_results_folder(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_folder(
            self.dir,
            f"another run is writing to {self.dir}; wait for it to end or use another --results folder",
        )
        try:
            self._start(config, fresh)
        except BaseException:
            self.close()
            raise

    def _start(self, config: dict[str, Any], fresh: bool) -> None:
        for existing in sorted(self.dir.glob("*.json")):  # a broken file stops the run before any work
            if existing.name != RUN_MANIFEST:
                Results.load(existing)
        self.config = _canonical(config)
        git = git_state()
        manifest_path = self.dir / RUN_MANIFEST
        previous = self._read_manifest(manifest_path)
        self.resumed = (
            not fresh
            and previous is not None
            and previous.get("finished_utc") is None
            and previous.get("config") == self.config
            and previous.get("git", {}).get("commit") == git["commit"]
            and git["commit"] is not None
        )
        if self.resumed:
            self.run_id, started = previous["run_id"], previous["started_utc"]
        else:
            self.run_id, started = f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}", utc_now()
        self.manifest = {
            "run_id": self.run_id,
            "config": self.config,
            "git": git,
            "started_utc": started,
            "finished_utc": None,
        }
        write_json_atomic(manifest_path, self.manifest)
        self._common = {
            "run_id": self.run_id,
            "git": git,
            "packages": package_versions(),
            "host": platform.node(),
        }
        self._devices: dict[str, dict[str, Any]] = {}

    @staticmethod
    def _read_manifest(path: Path) -> dict[str, Any] | None:
        try:
            data = read_json_file(path)
        except (OSError, ValueError):  # JSON's errors, a key twice, a FIFO or device of the name
            return None  # no (readable) manifest: nothing to resume
        return data if isinstance(data, dict) else None

    def status_line(self) -> str:
        if self.resumed:
            return (
                f"resuming run {self.run_id} (interrupted; started {self.manifest['started_utc']}) "
                f"in {self.dir}; --fresh starts over"
            )
        return f"run {self.run_id}: computing into {self.dir}"

    def provenance(self, device: str) -> dict[str, Any]:
        if device not in self._devices:
            self._devices[device] = device_description(device)
        return {**self._common, "device": self._devices[device]}

    def file(self, name: str, device: str = "cpu", config: dict[str, Any] | None = None) -> ResultFile:
        """The result file ``name`` (e.g. "max_batch.json") in this run's folder."""
        return ResultFile(self.dir / name, self, device, config)

    def finish(self) -> None:
        self.manifest["finished_utc"] = utc_now()
        write_json_atomic(self.dir / RUN_MANIFEST, self.manifest)
        self.close()

    def close(self) -> None:
        unlock_folder(self._lock)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.finish()
        else:
            self.close()  # unfinished: the same command resumes it


class ResultFile(Results):
    """A result file written by a run, e.g.

    >>> store = run.file("max_batch.json")
    >>> for key in keys:
    ...     store.compute(key, lambda: measure(key))   # skipped only if this run already did it
    """

    def __init__(
        self, path: Path, run: Run, device: str = "cpu", config: dict[str, Any] | None = None
    ) -> None:
        super().__init__(path, list(Results.load(path)))
        self.run = run
        self.device = device
        self.config = _canonical(config or {})  # the part's settings, stored with each point

    def done(self, key: Key) -> bool:
        """Computed by this run (a point of an earlier run is recomputed)."""
        point = self.get(key)
        return point is not None and point.provenance.get("run_id") == self.run.run_id

    def add(self, key: Key, result: Any, seconds: float | None = None) -> None:
        """Write the point ``key`` -> ``result`` now. A key is a mapping of the settings that decide
        the result; key and result are JSON data (``json_data``: a TypeError otherwise, before the
        file is touched)."""
        if not isinstance(key, dict):
            raise TypeError(f"{self.path}: a point's key is a mapping of its settings, got {key!r}")
        key, result = _canonical(key, "key"), _canonical(result, "result")
        provenance = {
            **self.run.provenance(self.device),
            "finished_utc": utc_now(),
            "seconds": None if seconds is None else round(seconds, 3),
            "config": self.config,
        }
        self._put(Point(key, result, provenance))
        self._write()
        raise_if_interrupted()  # kept (whole, computed apart), then the run stops as asked

    def compute(self, key: Key, fn: Callable[[], Any]) -> Any:
        if not self.done(key):
            t0 = time.perf_counter()
            result = fn()
            raise_if_interrupted()  # not kept: measured while an interrupt was swallowed in it
            self.add(key, result, time.perf_counter() - t0)
        return self.get(key).result

    def this_run(self) -> Results:
        """Only the points this run computed (what its summary prints)."""
        return Results(self.path, [p for p in self if p.provenance.get("run_id") == self.run.run_id])


def _check_results_folder(folder: Path) -> None:
    """A run writes only into a folder of runs' results (new, empty, or holding result files and
    its manifest): never among other files, such as the repository's (``--results ''``)."""
    if not folder.is_dir():
        return  # made by the run (or refused by mkdir: not a folder)
    # a run's: result files, its manifest and lock, a write a kill interrupted (write_json_atomic),
    # and the GPU check's benchmark output (artifacts/gpu_check.py writes pytest-benchmark/ beside)
    # (regular files: a FIFO named like a result file would block its reader)
    ours = lambda p: (
        (
            p.is_file()
            and (p.suffix == ".json" or p.name == ".lock" or (p.name[0] == "." and p.suffix == ".tmp"))
        )
        or (p.is_dir() and p.name == "pytest-benchmark")
    )
    others = sorted(p.name for p in folder.iterdir() if not ours(p))
    if others:
        raise NotAResultsFolderError(
            f"{folder} holds files that are not results (e.g. {others[0]}): give --results a new "
            "or empty folder, or one a run wrote"
        )
    # the repository's own files (presets, data: JSON too) are never a run's results folder
    tracked = tracked_files(folder)
    if tracked:
        raise NotAResultsFolderError(
            f"{folder} holds files of the repository (e.g. {tracked[0]}, tracked by git): give "
            "--results a new or empty folder, or one a run wrote"
        )


def tracked_files(folder: Path) -> list[str]:
    """The files git tracks in ``folder`` (none where it is in no repository or git is missing)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), "ls-files", "-z", "--", "."],  # -z: names with spaces whole
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [name for name in done.stdout.split("\0") if name] if done.returncode == 0 else []


def open_run(results_dir: str | os.PathLike, config: dict[str, Any], fresh: bool = False) -> Run:
    """A ``Run`` to use in a ``with``: marked finished only if the body completes (an interrupted
    one can resume); says whether it starts or resumes."""
    run = Run(results_dir, config, fresh)
    print(run.status_line(), flush=True)
    return run


# A promotion writes a few files in seconds: one ahead of this one is waited for, a stuck one not.
REFERENCE_WAIT_S = 60.0


def update_reference(
    results_dir: str | os.PathLike, reference_dir: str | os.PathLike, run_id: str
) -> list[Path]:
    """Make run ``run_id``'s points the reference: each replaces the reference point with the same
    key; reference points of other keys stay. Returns the reference files written. Holds the
    reference folder's lock (``lock_folder``, waiting up to ``REFERENCE_WAIT_S``): two runs
    promoting at once each read, add to and write a file, and the later write dropped the
    earlier's points."""
    reference_dir = Path(reference_dir)
    reference_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_folder(
        reference_dir,
        f"another run has been updating {reference_dir} for {REFERENCE_WAIT_S:g} s; this run's points "
        f"are kept in {results_dir}: rerun with --update-reference once it has ended",
        wait_s=REFERENCE_WAIT_S,
    )
    try:
        written = []
        for path in sorted(Path(results_dir).glob("*.json")):
            if path.name == RUN_MANIFEST:
                continue
            if new := [p for p in Results.load(path) if p.provenance.get("run_id") == run_id]:
                written.append(_promote(new, reference_dir / path.name))
        return written
    finally:
        unlock_folder(lock)


def _promote(points: list[Point], reference: Path) -> Path:
    """``points`` put into the reference file ``reference`` (read now, under its folder's lock)."""
    ref = Results.load(reference)
    for p in points:
        ref._put(p)
    ref._write()
    return ref.path
