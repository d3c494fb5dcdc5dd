"""The fitted presets (runtime_<gpu>.json, interference_<gpu>.json, host_cpu_adam.json) are read
through one strict reader each: a corrupted copy is refused in one line naming the file and the
field; every shipped preset reads, and what `mist calibrate --write` and `mist profile-host --write`
write reads back."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from mist.__main__ import main
from mist.model import runtime
from mist.model.interference import read_interference_preset
from mist.model.profile_data import ARTIFACT_DATA
from mist.model.runtime import PRESETS, read_cpu_adam, read_runtime_preset


def _set(*where, value):
    """An edit: the field at ``where`` (keys and list indices) set to ``value``."""

    def edit(d):
        for key in where[:-1]:
            d = d[key]
        d[where[-1]] = value

    return edit


def _drop(*where):
    def edit(d):
        for key in where[:-1]:
            d = d[key]
        del d[where[-1]]

    return edit


# (name, edit of the parsed file, what the one line must say); "duplicate" and "truncated" edit its text
_RUNTIME = [
    (
        "nan",
        _set("curves", "act", 0, "rate", value=math.nan),
        "curves.act[0].rate must be a finite number > 0",
    ),
    ("zero", _set("curves", "gemm", 1, "rate", value=0), "curves.gemm[1].rate must be a finite number > 0"),
    (
        "negative",
        _set("curves", "gemm", 1, "rate", value=-5e13),
        "curves.gemm[1].rate must be a finite number > 0",
    ),
    (  # was read as a constant: JSON has no Infinity, and a GEMM at it would be above any peak
        "infinite rate",
        _set("curves", "gemm", 0, "rate", value=math.inf),
        "curves.gemm[0].rate must be a finite number > 0 (or null: a time that does not grow with the work)",
    ),
    (
        "infinite collective",
        _set("collectives", "all_reduce/2", "rate", value=math.inf),
        "collectives.all_reduce/2.rate must be a finite number > 0",
    ),
    (
        "negative c0",
        _set("curves", "norm", 0, "c0", value=-1e-6),
        "curves.norm[0].c0 must be a finite number",
    ),
    ("infinite c0", _set("curves", "norm", 0, "c0", value=math.inf), "curves.norm[0].c0 must be a finite"),
    # no upper bound before (probe round 5): every op priced at 1e308 s, a plan's sum at infinity
    (
        "absurd c0",
        _set("curves", "norm", 0, "c0", value=1e308),
        "curves.norm[0].c0 must be a finite number >= 0, at most 1e+18",
    ),
    ("string", _set("curves", "norm", 0, "rate", value="2.3e11"), "curves.norm[0].rate must be a finite"),
    ("bool", _set("collectives", "all_reduce/2", "c0", value=True), "collectives.all_reduce/2.c0 must be"),
    ("wrong gpu", _set("gpu", value="h100"), "gpu must be 'l4' (the GPU its file name says), got 'h100'"),
    ("gpu not a string", _set("gpu", value=4), "gpu must be a non-empty string"),
    ("extra key", _set("fitted_by", value="me"), "unknown field(s) fitted_by"),
    (
        "extra curve",
        _set("curves", "attention", value=[{"c0": 0, "rate": 1}] * 2),
        "unknown field(s) attention",
    ),
    ("extra line field", _set("curves", "act", 0, "c1", value=0.0), "curves.act[0]: unknown field(s) c1"),
    ("missing curve", _drop("curves", "act"), "curves: missing act"),
    ("missing key", _drop("source"), "missing source"),
    (
        "one line",
        _set("curves", "act", value=[{"c0": 0.0, "rate": 1e11}]),
        "curves.act must be [forward line",
    ),
    (
        "collective kind",
        _set("collectives", "allreduce/2", value={"c0": 0, "rate": 1}),
        "'allreduce/2' is not",
    ),
    ("collective of one", _set("collectives", "all_reduce/1", value={"c0": 0, "rate": 1}), "'all_reduce/1'"),
    (
        "collective of 20 digits",
        _set("collectives", "all_reduce/99999999999999999999", value={"c0": 0, "rate": 1}),
        "N a whole number from 2 to 2**20",
    ),
    (
        "collective past any machine",
        _set("collectives", f"all_reduce/{2**20 + 1}", value={"c0": 0, "rate": 1}),
        f"'all_reduce/{2**20 + 1}' is not",
    ),
    ("duplicate", None, "key 'gpu' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
    ("huge rate", _set("curves", "norm", 0, "rate", value=10**400), "beyond any number read here"),
]
_INTERFERENCE = [
    ("nan", _set("factors", "compute", "compute+g2g", value=math.nan), "factors.compute.compute+g2g must be"),
    (
        "below 1",
        _set("factors", "g2g", "g2g+h2d", value=0.5),
        "factors.g2g.g2g+h2d must be a finite number >= 1",
    ),
    ("string", _set("factors", "h2d", "compute+h2d", value="2.0"), "factors.h2d.compute+h2d must be"),
    ("unknown combo", _set("factors", "compute", "compute+gpu", value=1.5), "unknown field(s) compute+gpu"),
    ("reordered combo", _set("factors", "compute", "g2g+compute", value=1.5), "unknown field(s) g2g+compute"),
    ("missing combo", _drop("factors", "d2h", "h2d+d2h"), "factors.d2h: missing h2d+d2h"),
    ("missing channel", _drop("factors", "d2h"), "factors: missing d2h"),
    ("solo slowed", _set("factors", "compute", "compute", value=2.0), "factors.compute.compute must be 1"),
    (
        "negative host rate",
        _set("host_rates", "h2d", value=-1.0),
        "host_rates.h2d must be a finite number > 0",
    ),
    ("unknown host rate", _set("host_rates", "p2p", value=1e9), "host_rates: unknown field(s) p2p"),
    ("extra key", _set("gpu", value="l4"), "unknown field(s) gpu"),
    ("missing key", _drop("host_rates"), "missing host_rates"),
    ("duplicate", None, "key 'source' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
    ("huge factor", _set("factors", "compute", "compute+g2g", value=-(10**400)), "beyond any number"),
    # no upper bound before (probe round 5): a slowdown of 1e308 read; the fit's own bound is 20
    (
        "absurd factor",
        _set("factors", "compute", "compute+g2g", value=1e308),
        "must be a finite number >= 1, at most 20",
    ),
    ("factor 21", _set("factors", "compute", "compute+g2g", value=21), "at most 20, got 21"),
    (
        "absurd host rate",
        _set("host_rates", "h2d", value=1e30),
        "host_rates.h2d must be a finite number > 0, at most 1e+18",
    ),
]
_HOST = [
    ("nan", _set("params_per_s", 0, value=math.nan), "params_per_s[0] must be a finite number > 0"),
    ("negative", _set("params_per_s", 1, value=-1.0), "params_per_s[1] must be a finite number > 0"),
    (
        "string",
        _set("bytes_moved_per_param", value="28"),
        "bytes_moved_per_param must be a finite number > 0",
    ),
    (
        "zero bytes",
        _set("bytes_moved_per_param", value=0),
        "bytes_moved_per_param must be a finite number > 0",
    ),
    ("no one thread", _set("threads", 0, value=3), "threads must be distinct thread counts with 1 among"),
    ("a thread twice", _set("threads", 1, value=1), "threads must be distinct thread counts"),
    ("a rate short", _drop("params_per_s", 1), "params_per_s must be a list of one rate a thread count"),
    ("float thread", _set("threads", 1, value=2.0), "threads[1] must be a whole number >= 1"),
    ("no params", _set("params", value=0), "params must be a whole number >= 1"),
    ("cpu not a string", _set("cpu", value=None), "cpu must be a non-empty string"),
    ("extra key", _set("gpu", value="l4"), "unknown field(s) gpu"),
    ("missing key", _drop("measured"), "missing measured"),
    ("duplicate", None, "key 'optimizer' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
    ("huge params", _set("params", value=int("9" * 400)), "(400 characters): beyond any number"),
    # no upper bound before (probe round 5): 10**30 threads read as a count
    ("absurd threads", _set("threads", 1, value=10**30), "threads[1] must be a whole number >= 1, at most"),
    (
        "absurd rate",
        _set("params_per_s", 0, value=1e30),
        "params_per_s[0] must be a finite number > 0, at most 1e+18",
    ),
]
_READERS = {
    "runtime_l4.json": lambda path: read_runtime_preset(path, "l4"),
    "interference_l4.json": read_interference_preset,
    "host_cpu_adam.json": read_cpu_adam,
}
_CASES = [
    pytest.param(name, edit, said, case, id=f"{name.removesuffix('.json')}-{case}")
    for name, cases in (
        ("runtime_l4.json", _RUNTIME),
        ("interference_l4.json", _INTERFERENCE),
        ("host_cpu_adam.json", _HOST),
    )
    for case, edit, said in cases
]


def _corrupted(name: str, case: str, edit) -> str:
    text = (PRESETS / name).read_text()
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


@pytest.mark.parametrize(("name", "edit", "said", "case"), _CASES)
def test_a_corrupted_preset_is_refused_in_one_line(tmp_path, name, edit, said, case):
    path = tmp_path / name
    path.write_text(_corrupted(name, case, edit))
    if case not in ("truncated", "nested too deep"):  # control: JSON json.loads took, as read before
        json.loads(path.read_text())
    with pytest.raises(ValueError) as e:
        _READERS[name](path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    assert said in message, message


@pytest.mark.parametrize("path", sorted(PRESETS.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_preset_reads(path):
    """The control: the shipped presets pass the readers that refuse the copies above."""
    if path.name.startswith("runtime_"):
        model = read_runtime_preset(path, path.stem.removeprefix("runtime_"))
        assert model.to_json() == json.loads(path.read_text())  # read as written, nothing changed
    elif path.name.startswith("interference_"):
        assert read_interference_preset(path).to_json() == json.loads(path.read_text())
    else:
        assert path.name == "host_cpu_adam.json" and read_cpu_adam(path).per_core_params_per_s > 0


def test_a_constant_line_is_written_as_null_and_reads_back(tmp_path):
    """A line whose time did not grow with the work (what `mist calibrate` fits to a CPU profile's
    framework excess, say) is written as "rate": null, which is JSON, and reads back as the same
    constant; it was written as Infinity (not JSON: a strict reader refuses it)."""
    from mist.model.runtime import Line

    model = read_runtime_preset(PRESETS / "runtime_l4.json", "l4")
    model.curves["framework"] = (Line(3e-3, None), Line(4e-3, 2e9))
    text = json.dumps(model.to_json(), allow_nan=False)  # raised on Infinity
    path = tmp_path / "runtime_l4.json"
    path.write_text(text)
    back = read_runtime_preset(path, "l4")
    assert back.curves["framework"][0] == Line(3e-3, None) and back.to_json() == json.loads(text)
    assert back.curves["framework"][0](np.array([1e6, 1e9])).tolist() == [3e-3, 3e-3]
    for c0, rate in ((0.0, math.inf), (0.0, 0.0), (0.0, -1.0), (-1e-6, 1.0), (math.nan, 1.0)):
        with pytest.raises(ValueError, match=r"a line is a finite c0 >= 0 and a finite rate > 0"):
            Line(c0, rate)  # made by hand or by a fit, refused where it is made


def test_a_corrupted_shipped_preset_stops_a_prediction_in_one_line(tmp_path, capsys, monkeypatch):
    """`mist predict` on a plan whose GPU's preset has a NaN rate said "1F1B simulation: nan s" with
    exit 0; now one line naming the file. Control: the same plan with the presets as shipped."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "model: gpt3-1.3b\ngpu: l4\ngpus: 2\ngpus_per_node: 8\nglobal_batch: 8\ntp: 1\ndp: 1\n"
        "micro_batch: 1\nstages: [{layers: 12}, {layers: 12}]\n"
    )
    presets = tmp_path / "presets"
    shutil.copytree(PRESETS, presets)
    monkeypatch.setattr(runtime, "PRESETS", presets)
    assert main(["predict", str(plan)]) == 0  # the control: the copies as shipped
    capsys.readouterr()
    (presets / "runtime_l4.json").write_text(_corrupted("runtime_l4.json", "nan", _RUNTIME[0][1]))
    assert main(["predict", str(plan)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "runtime_l4.json: curves.act[0].rate" in err, err


def test_calibrate_writes_presets_that_read_back(tmp_path, monkeypatch, capsys):
    """`mist calibrate --write` on the L4 profiles and bandwidth runs: each file it writes is one
    the strict readers take, and holds what was fitted."""
    data = tmp_path / "data"
    shutil.copytree(ARTIFACT_DATA / "gpu-op-profiles" / "l4", data / "gpu-op-profiles" / "l4")
    (data / "gpu-bandwidth").mkdir()
    shutil.copy(ARTIFACT_DATA / "gpu-bandwidth" / "l4-8gpu-per-node.json", data / "gpu-bandwidth")
    presets = tmp_path / "presets"
    monkeypatch.setattr(runtime, "PRESETS", presets)
    assert main(["calibrate", str(data), "--write"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in presets.iterdir()) == ["interference_l4.json", "runtime_l4.json"]
    written = read_runtime_preset(presets / "runtime_l4.json", "l4")
    assert written.to_json() == json.loads((presets / "runtime_l4.json").read_text())
    shipped = read_runtime_preset(PRESETS / "runtime_l4.json", "l4")
    assert set(written.curves) == set(shipped.curves) and set(written.collectives) == set(shipped.collectives)
    inter = read_interference_preset(presets / "interference_l4.json")
    assert inter.to_json() == json.loads((presets / "interference_l4.json").read_text())


def test_a_fit_the_reader_would_refuse_is_not_written(tmp_path):
    """What --write would write goes through the reader first: a fit without one of the layer's
    curves (e.g. none of its ops measured beyond the cache) is refused, nothing written."""
    from mist.__main__ import _readable_preset
    from mist.model.runtime import RuntimeModel

    d = json.loads((PRESETS / "runtime_l4.json").read_text())
    path = tmp_path / "runtime_l4.json"
    assert _readable_preset("l4", d, RuntimeModel.from_json, path, "l4") is d  # control: a whole fit
    del d["curves"]["act"]
    with pytest.raises(
        ValueError, match=r"l4: the fit is not a preset the planner reads; nothing written .*act"
    ):
        _readable_preset("l4", d, RuntimeModel.from_json, path, "l4")
    assert not path.exists()


def test_profile_host_writes_a_preset_that_reads_back(tmp_path, monkeypatch, capsys):
    presets = tmp_path / "presets"
    monkeypatch.setattr(runtime, "PRESETS", presets)
    args = ["profile-host", "--params", "4096", "--repeats", "1", "--max-threads", "2", "--write"]
    assert main(args) == 0, capsys.readouterr().err
    adam = read_cpu_adam(presets / "host_cpu_adam.json")
    assert adam.bytes_moved_per_param == 28 and adam.per_core_params_per_s > 0


def test_a_whole_number_beyond_a_float_fails_the_number_check_in_one_line():
    """math.isfinite of a 400-digit integer raised OverflowError inside the check meant to refuse it."""
    from measure.presets import number

    with pytest.raises(
        ValueError, match=r"p.json: rate must be a finite number >= 0, at most 1e\+18, got 1000"
    ):
        number("p.json", "rate", 10**400)
