"""JSON and YAML read strictly: a key given twice in one mapping is an error, never "the last one
wins" (both libraries' default), so a file that says two things about one field is refused; so
are nesting deeper than Python's parsers can follow and whole numbers beyond a float's range
(a RecursionError or OverflowError traceback otherwise, in the parser or in the reader's float());
a path that is no regular file (a FIFO would block the read, /dev/zero never end it) is refused
before it is read; and data written as JSON is JSON data, never an object's str() in its place."""

from __future__ import annotations

import json
import numbers
import os
import re
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


class StrictDataError(ValueError):
    """Well-formed text the strict readers refuse as data; the caller names the file."""


class DuplicateKeyError(StrictDataError):
    """A mapping in the file names one key twice."""


_TOO_DEEP = "lists or mappings nested deeper than Python's parser follows (no file here nests 10 deep)"
_MAX_WHOLE = int(sys.float_info.max)  # beyond it, the float() every reader does overflows
_MAX_CHARS = len(str(_MAX_WHOLE)) + 1  # its digits and a sign


def _too_large(text: str) -> StrictDataError:
    return StrictDataError(
        f"whole number {text[:12]}... ({len(text)} characters): beyond any number read here "
        f"(at most {sys.float_info.max:.1e})"
    )


def _whole_number(text: str) -> int:
    """The whole number ``text`` writes, at most a float's range. A longer text is refused
    unconverted (Python converts at most 4300 digits, with a ValueError naming no file)."""
    n = int(text) if len(text) <= _MAX_CHARS else None
    if n is None or abs(n) > _MAX_WHOLE:
        raise _too_large(text)
    return n


def _unique(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key {key!r} given twice in one mapping")
        out[key] = value
    return out


def loads_json(text: str) -> Any:
    """``json.loads`` that refuses a key given twice, nesting too deep and a whole number beyond a
    float's range (StrictDataError, a ValueError)."""
    try:
        return json.loads(text, object_pairs_hook=_unique, parse_int=_whole_number)
    except RecursionError:
        raise StrictDataError(_TOO_DEEP) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKeyError(
                    f"key {key!r} given twice in one mapping (line {key_node.start_mark.line + 1})"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > _MAX_CHARS:  # refused before converting, as in JSON
            raise _too_large(node.value)
        return _whole_number(str(super().construct_yaml_int(node)))


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)

# Booleans and numbers as YAML 1.2's core schema reads them, less its hexadecimal and octal
# integers (`0x8`, `0o17`) and leading zeros (`010`): no plan or preset writes them. PyYAML
# follows YAML 1.1, where `yes`, `on` and `y` are true, `1:20` is 80 (base 60), `0x8` and `010`
# are 8 and `1_0` is 10, each read without a word (`global_batch: 1:20` planned for batch 80).
# Here such text stays a string, which the strict schema reading it then refuses, saying what it
# takes.
_CORE = {
    "tag:yaml.org,2002:bool": (r"true|True|TRUE|false|False|FALSE", "tTfF"),
    "tag:yaml.org,2002:int": (r"[-+]?(?:0|[1-9][0-9]*)", "-+0123456789"),
    "tag:yaml.org,2002:float": (
        r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        "-+.0123456789",
    ),
}
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _CORE]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, (_pattern, _first) in _CORE.items():
    _UniqueKeyLoader.add_implicit_resolver(_tag, re.compile(f"^(?:{_pattern})$"), list(_first))


def loads_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice, nesting too deep and a whole number beyond
    a float's range (StrictDataError, a ValueError), and reads booleans and numbers by YAML 1.2's
    core schema less its hexadecimal and octal forms: ``yes``, ``1:20``, ``0x8``, ``010`` and
    ``1_0`` are strings, ``1e5`` a float."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds plain data only
    except RecursionError:
        raise StrictDataError(_TOO_DEEP) from None


# a plan, a profile's manifest or a preset is a few kB; a result file a few MB
MAX_TEXT_FILE_BYTES = 64 * 2**20


def read_text_file(path: str | os.PathLike, limit: int = MAX_TEXT_FILE_BYTES) -> str:
    """The text of ``path``, a regular file of at most ``limit`` bytes: anything else (a folder, a
    FIFO, a device, a file larger than any this project writes) is a ValueError saying so, raised
    before a byte is read. A missing file raises FileNotFoundError as ``open`` does."""
    info = os.stat(path)  # follows a link: what would be read
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file")
    if info.st_size > limit:
        raise ValueError(f"{path}: {info.st_size} bytes, more than any file this reads ({limit} at most)")
    return Path(path).read_text()


def read_json_file(path: str | os.PathLike) -> Any:
    """The JSON in ``path``, read strictly: a regular file (``read_text_file``), no key given twice
    (``loads_json``). Raises ValueError (the JSON's errors, a key twice, no regular file, not
    UTF-8) or OSError; callers name the file and what it should be."""
    return loads_json(read_text_file(path))


def json_data(obj: Any, where: str = "") -> Any:
    """``obj`` as JSON data: strings, true/false, null, numbers (numpy's as Python's, the same
    value; a 0-d array or tensor as its value), lists (tuples become lists) and mappings with
    string keys. Anything else is a
    TypeError naming where it is (``where``: the path to ``obj``), never written as its str():
    a numpy float written as "1.5" would read back as a string, a tensor as "tensor(2.)"."""
    if obj is None or isinstance(obj, str | bool):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if getattr(obj, "shape", None) == () and callable(getattr(obj, "item", None)):
        return json_data(obj.item(), where)  # a numpy bool, a 0-d array or tensor: its one value
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where or 'the data'}: key {k!r} is not a string (JSON keys are strings)")
            out[k] = json_data(v, f"{where}.{k}" if where else k)
        return out
    if isinstance(obj, list | tuple):
        return [json_data(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(
        f"{where or 'the data'}: a {type(obj).__name__} is not JSON data (accepted: strings, numbers, "
        "true/false, null, lists, and mappings with string keys)"
    )
