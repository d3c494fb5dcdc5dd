"""Broken copies of a shipped preset file, for the tests that each strict reader refuses them in
one line (tests/mist/test_mist_presets.py, tests/measure/test_measure.py, tests/tempo/test_tempo_eval.py).

A case is (name, edit of the parsed file, what the one line must say); the cases "duplicate",
"truncated" and "nested too deep" edit the file's text instead, and take no edit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

TEXT_CASES = ("duplicate", "truncated", "nested too deep")


def set_field(*where, value) -> Callable[[dict], None]:
    """An edit: the field at ``where`` (keys and list indices) set to ``value``."""

    def edit(d):
        for key in where[:-1]:
            d = d[key]
        d[where[-1]] = value

    return edit


def drop_field(*where) -> Callable[[dict], None]:
    """An edit: the field at ``where`` removed."""

    def edit(d):
        for key in where[:-1]:
            d = d[key]
        del d[where[-1]]

    return edit


def renamed_field(*where, to: str) -> Callable[[dict], None]:
    """An edit: the field at ``where`` renamed ``to`` (its value kept)."""

    def edit(d):
        for key in where[:-1]:
            d = d[key]
        d[to] = d.pop(where[-1])

    return edit


def corrupted(shipped: Path, case: str, edit: Callable[[dict], None] | None) -> str:
    """The text of ``shipped`` broken as ``case`` says (``edit`` applied to its parsed form)."""
    text = shipped.read_text()
    if case == "truncated":  # a write a kill cut short
        return text[: len(text) // 2]
    if case == "nested too deep":  # a RecursionError traceback from the parser
        return "[" * 100_000 + "]" * 100_000
    d = json.loads(text)
    if case == "duplicate":  # the first field again, first: a plain reader takes the last one
        first = next(iter(d))
        return "{" + json.dumps(first) + ": " + json.dumps(d[first]) + "," + text.lstrip()[1:]
    edit(d)
    return json.dumps(d, indent=1)


def refused_in_one_line(
    reader: Callable[[Path], object], shipped: Path, copy: Path, case: str, edit, said: str
) -> None:
    """A copy of ``shipped`` at ``copy``, broken as ``case`` says, is refused by ``reader`` in one
    line that names the copy and says ``said``."""
    copy.write_text(corrupted(shipped, case, edit))
    if case not in ("truncated", "nested too deep"):  # control: JSON json.loads took, as read before
        json.loads(copy.read_text())
    with pytest.raises(ValueError) as e:
        reader(copy)
    message = str(e.value)
    assert message.startswith(f"{copy}: ") and "\n" not in message, message
    assert said in message, message
