"""The one strict reader every preset is read through (torch-free): presets are JSON files.

Each kind of preset has one reader beside the dataclass it builds, read lazily (on first use,
then cached), never at import: the GPU data sheets (``measure.datasheets``: presets/datasheets.json),
Mist's models and cluster hardware (``mist.model.specs``: models.json, clusters.json), Tempo's
models (``tempo.models``: presets/models.json), and the fitted ones Mist's tools write:
``runtime.read_runtime_preset`` (runtime_<gpu>.json), ``interference.read_interference_preset``
(interference_<gpu>.json) and ``runtime.read_cpu_adam`` (host_cpu_adam.json). They share these
checks: the file is JSON with no key given twice (else the last one would win without a word),
each mapping has exactly the fields of its kind, numbers are numbers (never a string that would
convert, never true/false), finite and in their range, strings are strings. Whatever fails is one
line naming the file and the field, and what is accepted. ``mist calibrate --write`` and ``mist
profile-host --write`` pass what they write through the same reader first, so a written preset is
one that reads back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from measure.checks import finite, whole
from measure.strict import StrictDataError, loads_json, read_text_file

# The largest number a preset may hold. Every number in one is a time in seconds, a rate per
# second (FLOP, bytes, parameters), a slowdown factor or a fraction; the largest any machine reaches is a
# GPU's FLOP rate, ~1e15/s (the fitted A100 GEMM: 2.8e14; a B200's dense BF16 data sheet: 2.25e15).
# 1e18 (an exaFLOP per second, a whole supercomputer's rate, no one device's) is beyond every one
# of them by orders of magnitude: a number past it is an error in the file (c0 1e308 priced every
# op at 1e308 s, and a plan's sum of them at infinity).
MAX_PRESET_NUMBER = 1e18
# The largest count a preset may hold: thread counts and the parameters the host step was timed
# on. 2**40 parameters at 4 bytes are 4 TiB, beyond any host's memory; thread counts are far fewer.
MAX_PRESET_COUNT = 2**40
# The largest amount of memory a preset may hold, in bytes: 1 PiB, far beyond any one node's DRAM
# (the largest shared-memory servers hold 32 TiB; the hosts here 2 TiB, past MAX_PRESET_COUNT) and
# any GPU's memory.
MAX_PRESET_BYTES = 2**50


def load_preset(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, keys unique; a truncated or unreadable file is one line naming it."""
    try:
        text = read_text_file(path)  # a FIFO or a device is refused, not read without end
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (a preset is a JSON object)") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        data = loads_json(text)
    except (json.JSONDecodeError, StrictDataError) as e:
        raise ValueError(f"{path}: not a readable preset (a JSON object, no key twice): {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a preset is a JSON object, got {type(data).__name__}")
    return data


def check_fields(
    path: Path | str, where: str, d: object, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``d`` (the field ``where`` of the preset; "" for the whole file) is a mapping with every field
    in ``required``, others only from ``optional``; returns it."""
    name = where or "the preset"
    allowed = ", ".join((*required, *optional))
    if not isinstance(d, dict):
        raise ValueError(f"{path}: {name} must be a mapping of {allowed}, got {d!r}")
    unknown = [k for k in d if k not in required and k not in optional]
    missing = [k for k in required if k not in d]
    if unknown or missing:
        wrong = [f"unknown field(s) {', '.join(map(str, unknown))}"] if unknown else []
        wrong += [f"missing {', '.join(missing)}"] if missing else []
        raise ValueError(f"{path}: {name}: {'; '.join(wrong)} (fields: {allowed})")
    return d


def number(
    path: Path | str,
    where: str,
    value: object,
    least: float = 0.0,
    above: bool = False,
    or_else: str = "",
    most: float = MAX_PRESET_NUMBER,
) -> float:
    """``value`` (the field ``where``) as a float: a JSON number (not a string, not true/false),
    finite (never NaN or Infinity), >= ``least`` (> where ``above``) and <= ``most``. ``or_else``:
    what else the field's caller accepts, for the message."""
    ok = finite(value) and (value > least if above else value >= least) and value <= most
    if not ok:
        bound = f"{'>' if above else '>='} {least:g}"
        raise ValueError(
            f"{path}: {where} must be a finite number {bound}{or_else}, at most {most:g}, got {value!r:.40}"
        )
    return float(value)


def count(
    path: Path | str,
    where: str,
    value: object,
    least: int = 1,
    most: int = MAX_PRESET_COUNT,
    or_else: str = "",
) -> int:
    """``value`` (the field ``where``): a whole number >= ``least``, <= ``most`` (not 1.0, not true).
    ``or_else``: what else the field's caller accepts, for the message."""
    if not (whole(value, least) and value <= most):
        raise ValueError(
            f"{path}: {where} must be a whole number >= {least}{or_else}, at most {most}, got {value!r:.40}"
        )
    return int(value)


def flag(path: Path | str, where: str, value: object) -> bool:
    """``value`` (the field ``where``): true or false (not 1, not "no", which would read as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{path}: {where} must be true or false, got {value!r:.40}")
    return value


def text(path: Path | str, where: str, value: object) -> str:
    """``value`` (the field ``where``): a string that is not empty."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}: {where} must be a non-empty string, got {value!r}")
    return value
