"""Command lines that answer bad input in one line."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .results import check_replaceable, temp_beside


class OneLineParser(argparse.ArgumentParser):
    """Bad input: one line on stderr (no usage block; ``--help`` shows it), exit status 2. Its
    subcommands' parsers are of this class too (argparse makes them of their parent's)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def repeated_value(flag: str, values: Sequence[Any]) -> str | None:
    """The one-line refusal of an option given a value twice (a tuple value, such as a MODEL/SEQ
    case, said as it was typed), or None where each value is given once."""
    seen = set()
    for value in values:
        if value in seen:
            text = "/".join(map(str, value)) if isinstance(value, tuple) else str(value)
            return f"{flag}: {text} given twice; give each value once"
        seen.add(value)
    return None


def check_writable_file(path: Path, suffixes: tuple[str, ...] = ()) -> None:
    """Before any work: a file can be written at ``path`` (of one of ``suffixes``, where given).
    Raises ValueError saying why not."""
    if suffixes and path.suffix not in suffixes:
        names = " or ".join(filter(None, (", ".join(suffixes[:-1]), suffixes[-1])))
        raise ValueError(f"{path}: written as {names}")
    try:
        if path.is_dir():
            raise ValueError(f"{path}: a folder; give the file's name")
        check_replaceable(path)  # a device, FIFO or link would become a regular file
        if not path.parent.is_dir():
            raise ValueError(f"{path}: folder {path.parent} does not exist")
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(f"{path}: not writable")
        # the writers' temporary file beside it (atomic_path's name), made and removed: os.access
        # says yes to root in /sys and /proc, where the write then failed after the work
        os.unlink(temp_beside(path))
    except OSError as e:  # a name too long, a read-only or pseudo file system: said without errno
        raise ValueError(f"{path}: cannot be written there ({e.strerror or e})") from None


def reader_gone() -> int:
    """stdout's reader stopped early (``| head``): the status to end with quietly, as a shell tool
    does. stdout then goes to /dev/null, so that the flush at exit has nothing to fail on (it
    printed "Exception ignored ... BrokenPipeError" and ended with status 120)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what the shell reports for such a pipeline


@contextlib.contextmanager
def quiet_broken_pipe() -> Iterator[None]:
    """A command's body: its reader stopping early ends it quietly with status 141, never a
    BrokenPipeError traceback. stdout is flushed here, while a failure can still be caught, also
    when the body ends by ``sys.exit``."""
    try:
        try:
            yield
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        raise SystemExit(reader_gone()) from None
