"""Interference of overlapped channels: compute, GPU<->GPU, host->device and device->host traffic.

Four channels started together each run at their solo speed divided by a slowdown factor that
depends on which channels are active at the moment; when one finishes the others speed up. The
factors (one per channel and set of active channels) are fitted to the concurrency
micro-benchmarks in data/mist-artifact/gpu-bandwidth, where GEMMs, NCCL all-gathers and both copy
directions were launched together and the wall time of the group measured.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from measure.checks import finite
from measure.presets import check_fields, load_preset, number, text
from measure.strict import read_json_file

CHANNELS = ("compute", "g2g", "h2d", "d2h")
# The largest slowdown a preset may hold: what fit_interference fits factors within (its
# least_squares bounds); the shipped fits are at most ~8 (four channels sharing a GPU slow each
# other by a few times, never by orders of magnitude).
MAX_FACTOR = 20.0
_MASKS = range(1, 1 << len(CHANNELS))


def _members(mask: int) -> list[int]:
    return [c for c in range(len(CHANNELS)) if mask >> c & 1]


@dataclass
class Interference:
    """factors[c][mask]: slowdown of channel c while the channels in ``mask`` run (1 when alone)."""

    factors: np.ndarray = field(default_factory=lambda: np.ones((len(CHANNELS), 1 << len(CHANNELS))))
    source: str = "none (overlapped channels do not slow each other)"
    host_rates: dict[str, float] = field(default_factory=dict)  # measured h2d/d2h bytes/s per GPU

    @classmethod
    def serial(cls, source: str) -> Interference:
        """Channels that take turns: while k channels are active each runs k times slower, so
        channels started together finish after the sum of their solo times (one processor doing
        all of the work, and collectives issued synchronously)."""
        factors = np.ones((len(CHANNELS), 1 << len(CHANNELS)))
        for mask in _MASKS:
            for c in _members(mask):
                factors[c][mask] = len(_members(mask))
        return cls(factors, source)

    def host_rate(self, direction: str, default: float) -> float:
        """Host<->device bytes/s per GPU with all GPUs of a node copying (measured when known)."""
        return self.host_rates.get(direction, default)

    def overlap(self, *times) -> np.ndarray:
        """Wall time of channels started together with these solo times (broadcast arrays)."""
        solo = np.broadcast_arrays(*(np.asarray(t, dtype=float) for t in times))
        shape = solo[0].shape
        if np.all(self.factors == 1.0):
            return np.max(solo, axis=0)
        # a channel with no work anywhere is never active and slows nothing: leaving it out
        # changes no result and saves its rounds (the searches call this with idle copy
        # channels more often than not)
        live = [c for c, t in enumerate(solo) if t.any()]
        if not live:
            return np.zeros(shape)
        remaining = np.stack([solo[c] for c in live]).reshape(len(live), -1)
        rows = np.array(live)[:, None]
        bits = 1 << rows
        elapsed = np.zeros(remaining.shape[1])
        for _ in live:  # each round one channel (at least) finishes
            active = remaining > 0
            if not active.any():
                break
            slowed = self.factors[rows, (active * bits).sum(axis=0)]
            finish = np.where(active, remaining * slowed, np.inf)
            step = finish.min(axis=0)
            step = np.where(np.isfinite(step), step, 0.0)
            remaining = np.where(active & (finish > step), np.maximum(remaining - step / slowed, 0.0), 0.0)
            elapsed = elapsed + step
        return elapsed.reshape(shape)

    def to_json(self) -> dict:
        table = {
            CHANNELS[c]: {_combo(m): float(self.factors[c][m]) for m in _MASKS if m >> c & 1}
            for c in range(len(CHANNELS))
        }
        return {"source": self.source, "factors": table, "host_rates": self.host_rates}

    @classmethod
    def from_json(cls, d: dict, path: Path | str = "an interference preset") -> Interference:
        """The model an interference preset (``to_json``'s mapping) describes, read strictly (see
        ``measure.presets``): exactly its fields; per channel a factor for every set of channels it
        runs with, named as ``to_json`` names them (CHANNELS' order, joined by "+"), each a finite
        slowdown >= 1 and 1 alone; host rates finite bytes/s > 0. ``path`` names the file in the
        one-line errors."""
        check_fields(path, "", d, ("source", "factors", "host_rates"))
        table = check_fields(path, "factors", d["factors"], CHANNELS)
        factors = np.ones((len(CHANNELS), 1 << len(CHANNELS)))
        for c, name in enumerate(CHANNELS):
            combos = {_combo(m): m for m in _MASKS if m >> c & 1}
            for combo, value in check_fields(path, f"factors.{name}", table[name], tuple(combos)).items():
                where, alone = f"factors.{name}.{combo}", combos[combo] == 1 << c
                factors[c][combos[combo]] = number(path, where, value, least=1.0, most=MAX_FACTOR)
                if alone and value != 1:
                    raise ValueError(
                        f"{path}: {where} must be 1 (a channel alone runs at its own speed), got {value!r}"
                    )
        rates = check_fields(path, "host_rates", d["host_rates"], (), ("h2d", "d2h"))
        host_rates = {k: number(path, f"host_rates.{k}", v, above=True) for k, v in rates.items()}
        return cls(factors, text(path, "source", d["source"]), host_rates)


def _combo(mask: int) -> str:
    """A set of channels as presets name it: "compute+g2g"."""
    return "+".join(CHANNELS[k] for k in _members(mask))


def read_interference_preset(path: Path) -> Interference:
    """The interference preset in ``path`` (interference_<gpu>.json), read strictly."""
    return Interference.from_json(load_preset(path), path)


# A gpu-bandwidth run's fields (data/mist-artifact/gpu-bandwidth): every value is text, a number
# with its unit where it has one. The fit reads the sizes, the group shape and the latency; the
# rest (the run's spread and the rates derived from it) are the benchmark's own report.
_RUN_SIZES = (
    "compute_n",
    "compute_m",
    "compute_k",
    "gpu_to_gpu_mbytes",
    "cpu_to_gpu_mbytes",
    "gpu_to_cpu_mbytes",
)
_RUN_GROUP = ("world_size", "intra_group_size", "inter_group_size")
_RUN_REPORTED = ("std", "std/mean", "gflops", "g2g_bandwidth", "c2g_bandwidth", "g2c_bandwidth")


def _run_number(path: Path, where: str, value: object, unit: str = "", above: bool = False) -> float:
    """A run's field ``where``: text writing a finite number >= 0 (> 0 where ``above``), followed
    by `` unit`` where given; one line naming the file and the field otherwise (float() took "nan
    ms", "-5 ms" and "1e400" without a word, and a number that is no text failed in .split())."""
    text = value if isinstance(value, str) else ""
    if unit:
        text = text[: -len(unit) - 1] if text.endswith(f" {unit}") else ""
    try:
        parsed = float(text)
    except ValueError:
        parsed = math.nan
    if not (finite(parsed) and (parsed > 0 if above else parsed >= 0)):
        form = f'"<number> {unit}"' if unit else "text of a number"
        raise ValueError(
            f"{path}: {where} must be {form}, finite and {'> 0' if above else '>= 0'}, got {value!r:.40}"
        )
    return parsed


def bandwidth_file_gpu(path: Path) -> str:
    """The name of the GPU a gpu-bandwidth file measured (its one top-level key), checked as
    ``fit_interference`` reads the file; ValueError, naming the file, where it is not one."""
    return _runs(path)[0]


def _runs(path: Path) -> tuple[str, list[dict]]:
    """(the GPU's name, its runs) of a gpu-bandwidth file: one GPU's name mapping to its runs by
    name, each with the fields above, read strictly; whatever is wrong is one line naming the file
    and the run."""
    try:
        data = read_json_file(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict) or len(data) != 1 or not isinstance(next(iter(data.values())), dict):
        raise ValueError(
            f"{path}: a gpu-bandwidth file is a mapping of one GPU's name to its runs by name, "
            f"got {type(data).__name__} of {len(data) if isinstance(data, dict | list) else 0} entries"
        )
    ((gpu, entries),) = data.items()
    if not entries:
        raise ValueError(f"{path}: no runs (a gpu-bandwidth file maps one GPU's name to its runs)")
    out = []
    for name, run in entries.items():
        where = f"run {name}"
        check_fields(path, where, run, (*_RUN_SIZES, *_RUN_GROUP, "latency"), _RUN_REPORTED)
        size = {k: _run_number(path, f"{where}: {k}", run[k]) for k in _RUN_SIZES}
        for k in _RUN_GROUP:  # the group's shape stays the text it is: it names a group, is not summed
            if not (isinstance(run[k], str) and re.fullmatch(r"[1-9][0-9]*", run[k])):
                raise ValueError(
                    f"{path}: {where}: {k} must be text of a whole number >= 1, got {run[k]!r:.40}"
                )
        out.append(
            {
                "flops": 2.0 * size["compute_n"] * size["compute_m"] * size["compute_k"],
                "g2g": size["gpu_to_gpu_mbytes"] * 2**20,
                "h2d": size["cpu_to_gpu_mbytes"] * 2**20,
                "d2h": size["gpu_to_cpu_mbytes"] * 2**20,
                "group": tuple(run[k] for k in _RUN_GROUP),
                "seconds": _run_number(path, f"{where}: latency", run["latency"], unit="ms", above=True)
                * 1e-3,
            }
        )
    return gpu, out


def _host_rate(path: Path, name: str, line) -> float:
    """A host copy's fitted bandwidth; a copy whose time did not grow with its bytes has none."""
    if line.rate is None:
        raise ValueError(f"{path}: {name} copies alone took as long whatever their size: no bandwidth to fit")
    return line.rate


# the work of each channel in a run, in Interference's channel order (compute, GPU-to-GPU, host copies)
_WORK_KEYS = ("flops", "g2g", "h2d", "d2h")


def _solo_lines(runs: list[dict], fit_line) -> dict[tuple, object]:
    """{(channel, group): line} fitted to the runs with that channel's work alone (per process-group
    shape for g2g, group None for the others), where there are at least two."""
    solo: dict[tuple, object] = {}
    for channel, key in enumerate(_WORK_KEYS):
        groups = sorted({run["group"] for run in runs}) if key == "g2g" else [None]
        for group in groups:
            alone = [
                run
                for run in runs
                if run[key] > 0
                and all(run[other] == 0 for other in _WORK_KEYS if other != key)
                and (group is None or run["group"] == group)
            ]
            if len(alone) >= 2:
                solo[(channel, group)] = fit_line(
                    [run[key] for run in alone], [run["seconds"] for run in alone]
                )
    return solo


def _overlapped_runs(runs: list[dict], solo: dict[tuple, object]) -> list[tuple[list[float], float]]:
    """(each channel's solo seconds, measured seconds) of every run with two or more channels at
    work, each priced by a solo line."""
    usable = []
    for run in runs:
        times = []
        for channel, key in enumerate(_WORK_KEYS):
            line = solo.get((channel, run["group"] if key == "g2g" else None))
            times.append(0.0 if run[key] == 0 else (None if line is None else float(line(run[key]))))
        if None not in times and sum(t > 0 for t in times) >= 2:
            usable.append((times, run["seconds"]))
    return usable


def fit_interference(path: Path) -> tuple[Interference, dict]:
    """Fit solo lines per channel (per process-group shape for g2g) and the slowdown factors."""
    from scipy.optimize import least_squares

    from .calibrate import fit_line

    _, runs = _runs(path)
    solo = _solo_lines(runs, fit_line)
    usable = _overlapped_runs(runs, solo)
    params = [(c, m) for m in _MASKS for c in _members(m) if len(_members(m)) >= 2]
    held_out = np.arange(len(usable)) % 5 == 4  # every fifth run checks the fit
    all_times = np.array([u[0] for u in usable]).T
    all_measured = np.array([u[1] for u in usable])
    times, measured = all_times[:, ~held_out], all_measured[~held_out]

    def model(x):
        inter = Interference()
        for (c, m), value in zip(params, x, strict=True):
            inter.factors[c][m] = value
        return inter

    def residual(x):
        return np.log(model(x).overlap(*times)) - np.log(measured)

    fit = least_squares(residual, np.full(len(params), 1.2), bounds=(1.0, MAX_FACTOR))
    inter = model(fit.x)
    inter.source = f"fitted to {Path(path).name} ({int((~held_out).sum())} overlapped runs)"
    inter.host_rates = {
        name: _host_rate(path, name, solo[(c, None)])
        for c, name in ((2, "h2d"), (3, "d2h"))
        if (c, None) in solo
    }
    test_t, test_m = all_times[:, held_out], all_measured[held_out]
    before = np.abs(Interference().overlap(*test_t) / test_m - 1)
    after = np.abs(inter.overlap(*test_t) / test_m - 1)
    report = {
        "runs": len(usable),
        "no_interference_mean_abs_error": float(before.mean()),
        "fitted_mean_abs_error": float(np.abs(inter.overlap(*times) / measured - 1).mean()),
        "held_out_mean_abs_error": float(after.mean()),
        "held_out_max_abs_error": float(after.max()),
    }
    return inter, report
