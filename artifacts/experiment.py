"""What every experiment driver shares: its folders, the run flags, and the run's life.

artifacts/<name>/results/     this machine's runs (git-ignored; a run never touches a tracked file)
artifacts/<name>/reference/   the committed reference results, changed only by --update-reference
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from measure.checks import usable_cores
from measure.cli import OneLineParser, repeated_value
from measure.parallel import interrupt_handled, raise_if_interrupted, sigterm_as_interrupt
from measure.results import (
    NotAResultsFolderError,
    ResultFileError,
    Run,
    RunLockedError,
    open_run,
    update_reference,
)

ARTIFACTS = Path(__file__).resolve().parent
C = TypeVar("C")
# Options that say where or how a run writes, not what it computes: a resumed run may differ in them.
RUN_FLAGS = ("results", "fresh", "update_reference", "jobs", "keep")


@dataclass(frozen=True)
class Experiment:
    name: str

    @property
    def results_dir(self) -> Path:
        return ARTIFACTS / self.name / "results"

    @property
    def reference_dir(self) -> Path:
        return ARTIFACTS / self.name / "reference"


def add_run_arguments(ap: argparse.ArgumentParser, experiment: Experiment) -> None:
    ap.add_argument(
        "--results",
        type=Path,
        default=experiment.results_dir,
        help=f"where this run writes (default: {experiment.results_dir}, git-ignored)",
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="start over even if the last run in --results was this command and was interrupted",
    )
    ap.add_argument(
        "--update-reference",
        action="store_true",
        help=f"after the run, make its points the committed reference ({experiment.reference_dir})",
    )


def option(
    default: Any = None,
    help: str = "",
    *,
    choices: Sequence[str] | None = None,
    parse: Callable[[str], Any] | None = None,
    many: bool = False,
) -> Any:
    """A field of an experiment's config and its command-line form (``config_from_command_line``):
    ``--field-name``; a tuple default or ``many``: one or more values; a False default: a switch;
    ``parse``: text to value (default: the default's type), raising ArgumentTypeError on bad text."""
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse, "many": many})


def config_from_command_line(
    cls: type[C], experiment: Experiment, argv: list[str] | None, description: str, jobs: bool = False
) -> tuple[C, argparse.Namespace, argparse.ArgumentParser]:
    """(``cls`` from the command line, the whole command line, its parser for later refusals): the
    config's fields as options (``option``), with the run flags every experiment shares."""
    ap = OneLineParser(
        prog=f"python -m artifacts.{experiment.name}.run",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for f in fields(cls):
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        if f.default is False:
            ap.add_argument(flag, action="store_true", help=meta["help"])
            continue
        many = meta["many"] or isinstance(f.default, tuple)
        sample = f.default[0] if many and f.default else f.default
        parse = meta["parse"] or (type(sample) if sample is not None else str)
        ap.add_argument(
            flag,
            type=parse,
            nargs="+" if many else None,
            choices=meta["choices"],
            default=f.default,
            help=meta["help"],
        )
    if jobs:
        add_jobs_argument(ap)
    add_run_arguments(ap, experiment)
    args = ap.parse_args(argv)
    for f in fields(cls):
        if isinstance(getattr(args, f.name), list):  # given on the command line
            given_once(ap, "--" + f.name.replace("_", "-"), getattr(args, f.name))
    values = {f.name: getattr(args, f.name) for f in fields(cls)}
    config = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    return config, args, ap


def given_once(ap: argparse.ArgumentParser, flag: str, values: Sequence[Any]) -> None:
    """An option's values each given once, else refused in one line (exit 2): ``--seq 16 16``
    computed and printed each row twice, ``claims X X`` judged X twice, and ``--parts sim sim`` ran
    sim once, each without a word (``measure.cli.repeated_value``)."""
    if (problem := repeated_value(flag, values)) is not None:
        ap.error(problem)


def add_jobs_argument(ap: argparse.ArgumentParser) -> None:
    """--jobs: worker processes for points that run in parallel, at most the usable cores (default:
    all of them). More only share the cores: --jobs 500 on 2 started 24 workers, 1.6 GB in 10 s."""
    cores = usable_cores()

    def jobs(text: str) -> int:
        if not text.isdigit() or not 1 <= int(text) <= cores:
            raise argparse.ArgumentTypeError(
                f"--jobs takes a whole number from 1 to the {cores} cores this process may use, got {text!r}"
            )
        return int(text)

    ap.add_argument(
        "--jobs",
        type=jobs,
        default=cores,
        help=f"worker processes, at most the cores here (default: {cores})",
    )


@contextlib.contextmanager
def experiment_run(
    args: argparse.Namespace, experiment: Experiment, command: str | None = None
) -> Iterator[Run]:
    """The run of one command: resumed only if the same command was interrupted here; on success,
    optionally promoted to the reference. ``command``: which of an experiment's scripts that share
    its results folder this is, where their options alone would not tell (the GPU check's two Mist
    parts): another script's unfinished run is not this one's to resume."""
    config = {"experiment": experiment.name} | {
        k: v for k, v in sorted(vars(args).items()) if k not in RUN_FLAGS
    }
    if command is not None:
        config["command"] = command
    sigterm_as_interrupt()  # a killed run unwinds like Ctrl-C: workers stopped, resumable
    _refuse_a_reference(Path(args.results))
    try:
        run = open_run(args.results, _plain(config), args.fresh)
    except BrokenPipeError:  # its line about the run went to a reader already gone: not the folder's fault
        raise
    except OSError as e:  # the folder cannot be made or written: said without errno's numbers
        refuse(
            f"--results {args.results}: cannot hold a run's results ({e.strerror or e}); give a "
            "new or empty folder in a writable place, or one a run wrote"
        )
    except (ResultFileError, NotAResultsFolderError, RunLockedError) as e:  # before any work: one line
        refuse(str(e))
    try:
        with run, own_tmpdir(experiment.name):
            yield run
            raise_if_interrupted()  # one swallowed after the last point: the run is not finished
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM unwound as one: a line, not a traceback
        interrupt_handled()
        print(
            f"interrupted: the points finished so far are kept in {args.results}; the same command "
            "resumes the run",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    if args.update_reference:
        try:
            written = update_reference(args.results, experiment.reference_dir, run.run_id)
        except (RunLockedError, ResultFileError) as e:  # another promotion held on; a broken reference
            raise SystemExit(f"error: {e}") from None
        for path in written:
            print(f"reference updated: {path}")


def refuse(message: str) -> NoReturn:
    """A command's refusal of its input before any work: ``error: message`` on stderr and exit
    status 2, as the parser's own refusals (``OneLineParser``); a bare ``SystemExit(text)`` exits 1,
    the status of a run that failed."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


@contextlib.contextmanager
def own_tmpdir(name: str) -> Iterator[Path]:
    """TMPDIR, for this process and everything it starts, a folder of the run's own, removed when
    the run ends however it ends (but SIGKILL: then it is the killed process's own folder, left).
    Tools a run starts leave their temporary files when interrupted: gcc's ``cc*.s`` from
    inductor's C++ compile stayed in TMPDIR after 4 of 6 Ctrl-C's (probe round 4). torch's compile
    cache stays where it was (``TORCHINDUCTOR_CACHE_DIR`` set to its default place, unless set)."""
    base = tempfile.gettempdir()
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}_tmp_", dir=base))
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    cached = tempfile.tempdir
    if saved["TORCHINDUCTOR_CACHE_DIR"] is None:
        try:  # the folder inductor picks by default: <TMPDIR>/torchinductor_<user>
            user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"torchinductor_{user}")
        except (KeyError, OSError):  # no user name: inductor's own fallback, under the scratch
            pass
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)
    try:
        yield scratch
    finally:
        tempfile.tempdir = cached
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _remove_scratch(scratch)


def _remove_scratch(scratch: Path) -> None:
    """The run's scratch folder removed; but a temporary folder multiprocessing made in it for this
    process (a forkserver's socket, a semaphore's name) is multiprocessing's own to remove at exit,
    and its exit hook fails on a folder already gone: a FileNotFoundError traceback after a finished
    run's last line (the engine part, 2026-12-04). That one is left, and the scratch removed after
    it, by a hook of the same kind that runs later."""
    from multiprocessing import process, util

    theirs = process.current_process()._config.get("tempdir")
    if not theirs or not Path(theirs).is_relative_to(scratch):
        shutil.rmtree(scratch, ignore_errors=True)
        return
    with contextlib.suppress(OSError):  # on the way out of a run, interrupted too: never a traceback
        for entry in scratch.iterdir():
            if not Path(theirs).is_relative_to(entry):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    # exit hooks run by priority, highest first: multiprocessing's own folder is removed at -100
    util.Finalize(
        None, shutil.rmtree, args=(str(scratch),), kwargs={"ignore_errors": True}, exitpriority=-101
    )


def _refuse_a_reference(results: Path) -> None:
    """A committed reference changes only by --update-reference, never as a run's results folder
    (a run would rewrite its files with this run's points alone)."""
    for reference in sorted(ARTIFACTS.glob("*/reference")):
        if results.resolve().is_relative_to(reference.resolve()):
            refuse(
                f"--results {results} is {reference.parent.name}'s committed reference; give "
                f"another folder (--update-reference makes a run's points the reference)"
            )


def _plain(obj: Any) -> Any:
    """argparse values as JSON values (paths and tuples included)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj
