"""Mist's presets: the fitted ones (runtime_<gpu>.json, interference_<gpu>.json, host_cpu_adam.json)
and the hand-written ones (models.json, clusters.json) are read through one strict reader each: a
corrupted copy is refused in one line naming the file and the field; every shipped preset reads,
and what `mist calibrate --write` and `mist profile-host --write` write reads back."""

from __future__ import annotations

import json
import math
import random
import shutil

import numpy as np
import pytest

from measure import datasheets as measure_datasheets
from measure.datasheets import datasheets
from mist.__main__ import main
from mist.model import runtime, specs
from mist.model.interference import read_interference_preset
from mist.model.profile_data import ARTIFACT_DATA
from mist.model.runtime import PRESETS, read_cpu_adam, read_runtime_preset
from tests.preset_copies import corrupted, drop_field, refused_in_one_line, renamed_field, set_field

# (name, edit of the parsed file, what the one line must say); "duplicate" and "truncated" edit its text
_RUNTIME = [
    (
        "nan",
        set_field("curves", "act", 0, "rate", value=math.nan),
        "curves.act[0].rate must be a finite number > 0",
    ),
    (
        "zero",
        set_field("curves", "gemm", 1, "rate", value=0),
        "curves.gemm[1].rate must be a finite number > 0",
    ),
    (
        "negative",
        set_field("curves", "gemm", 1, "rate", value=-5e13),
        "curves.gemm[1].rate must be a finite number > 0",
    ),
    (  # was read as a constant: JSON has no Infinity, and a GEMM at it would be above any peak
        "infinite rate",
        set_field("curves", "gemm", 0, "rate", value=math.inf),
        "curves.gemm[0].rate must be a finite number > 0 (or null: a time that does not grow with the work)",
    ),
    (
        "infinite collective",
        set_field("collectives", "all_reduce/2", "rate", value=math.inf),
        "collectives.all_reduce/2.rate must be a finite number > 0",
    ),
    (
        "negative c0",
        set_field("curves", "norm", 0, "c0", value=-1e-6),
        "curves.norm[0].c0 must be a finite number",
    ),
    (
        "infinite c0",
        set_field("curves", "norm", 0, "c0", value=math.inf),
        "curves.norm[0].c0 must be a finite",
    ),
    # no upper bound before (probe round 5): every op priced at 1e308 s, a plan's sum at infinity
    (
        "absurd c0",
        set_field("curves", "norm", 0, "c0", value=1e308),
        "curves.norm[0].c0 must be a finite number >= 0, at most 1e+18",
    ),
    (
        "string",
        set_field("curves", "norm", 0, "rate", value="2.3e11"),
        "curves.norm[0].rate must be a finite",
    ),
    (
        "bool",
        set_field("collectives", "all_reduce/2", "c0", value=True),
        "collectives.all_reduce/2.c0 must be",
    ),
    (
        "wrong gpu",
        set_field("gpu", value="h100"),
        "gpu must be 'l4' (the GPU its file name says), got 'h100'",
    ),
    ("gpu not a string", set_field("gpu", value=4), "gpu must be a non-empty string"),
    ("extra key", set_field("fitted_by", value="me"), "unknown field(s) fitted_by"),
    (
        "extra curve",
        set_field("curves", "attention", value=[{"c0": 0, "rate": 1}] * 2),
        "unknown field(s) attention",
    ),
    (
        "extra line field",
        set_field("curves", "act", 0, "c1", value=0.0),
        "curves.act[0]: unknown field(s) c1",
    ),
    ("missing curve", drop_field("curves", "act"), "curves: missing act"),
    ("missing key", drop_field("source"), "missing source"),
    (
        "one line",
        set_field("curves", "act", value=[{"c0": 0.0, "rate": 1e11}]),
        "curves.act must be [forward line",
    ),
    (
        "collective kind",
        set_field("collectives", "allreduce/2", value={"c0": 0, "rate": 1}),
        "'allreduce/2' is not",
    ),
    (
        "collective of one",
        set_field("collectives", "all_reduce/1", value={"c0": 0, "rate": 1}),
        "'all_reduce/1'",
    ),
    (
        "collective of 20 digits",
        set_field("collectives", "all_reduce/99999999999999999999", value={"c0": 0, "rate": 1}),
        "N a whole number from 2 to 2**20",
    ),
    (
        "collective past any machine",
        set_field("collectives", f"all_reduce/{2**20 + 1}", value={"c0": 0, "rate": 1}),
        f"'all_reduce/{2**20 + 1}' is not",
    ),
    ("duplicate", None, "key 'gpu' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
    ("huge rate", set_field("curves", "norm", 0, "rate", value=10**400), "beyond any number read here"),
]
_INTERFERENCE = [
    (
        "nan",
        set_field("factors", "compute", "compute+g2g", value=math.nan),
        "factors.compute.compute+g2g must be",
    ),
    (
        "below 1",
        set_field("factors", "g2g", "g2g+h2d", value=0.5),
        "factors.g2g.g2g+h2d must be a finite number >= 1",
    ),
    ("string", set_field("factors", "h2d", "compute+h2d", value="2.0"), "factors.h2d.compute+h2d must be"),
    (
        "unknown combo",
        set_field("factors", "compute", "compute+gpu", value=1.5),
        "unknown field(s) compute+gpu",
    ),
    (
        "reordered combo",
        set_field("factors", "compute", "g2g+compute", value=1.5),
        "unknown field(s) g2g+compute",
    ),
    ("missing combo", drop_field("factors", "d2h", "h2d+d2h"), "factors.d2h: missing h2d+d2h"),
    ("missing channel", drop_field("factors", "d2h"), "factors: missing d2h"),
    (
        "solo slowed",
        set_field("factors", "compute", "compute", value=2.0),
        "factors.compute.compute must be 1",
    ),
    (
        "negative host rate",
        set_field("host_rates", "h2d", value=-1.0),
        "host_rates.h2d must be a finite number > 0",
    ),
    ("unknown host rate", set_field("host_rates", "p2p", value=1e9), "host_rates: unknown field(s) p2p"),
    ("extra key", set_field("gpu", value="l4"), "unknown field(s) gpu"),
    ("missing key", drop_field("host_rates"), "missing host_rates"),
    ("duplicate", None, "key 'source' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
    ("huge factor", set_field("factors", "compute", "compute+g2g", value=-(10**400)), "beyond any number"),
    # no upper bound before (probe round 5): a slowdown of 1e308 read; the fit's own bound is 20
    (
        "absurd factor",
        set_field("factors", "compute", "compute+g2g", value=1e308),
        "must be a finite number >= 1, at most 20",
    ),
    ("factor 21", set_field("factors", "compute", "compute+g2g", value=21), "at most 20, got 21"),
    (
        "absurd host rate",
        set_field("host_rates", "h2d", value=1e30),
        "host_rates.h2d must be a finite number > 0, at most 1e+18",
    ),
]
_HOST = [
    ("nan", set_field("params_per_s", 0, value=math.nan), "params_per_s[0] must be a finite number > 0"),
    ("negative", set_field("params_per_s", 1, value=-1.0), "params_per_s[1] must be a finite number > 0"),
    (
        "string",
        set_field("bytes_moved_per_param", value="28"),
        "bytes_moved_per_param must be a finite number > 0",
    ),
    (
        "zero bytes",
        set_field("bytes_moved_per_param", value=0),
        "bytes_moved_per_param must be a finite number > 0",
    ),
    (
        "no one thread",
        set_field("threads", 0, value=3),
        "threads must be distinct thread counts with 1 among",
    ),
    ("a thread twice", set_field("threads", 1, value=1), "threads must be distinct thread counts"),
    ("a rate short", drop_field("params_per_s", 1), "params_per_s must be a list of one rate a thread count"),
    ("float thread", set_field("threads", 1, value=2.0), "threads[1] must be a whole number >= 1"),
    ("no params", set_field("params", value=0), "params must be a whole number >= 1"),
    ("cpu not a string", set_field("cpu", value=None), "cpu must be a non-empty string"),
    ("extra key", set_field("gpu", value="l4"), "unknown field(s) gpu"),
    ("missing key", drop_field("measured"), "missing measured"),
    ("duplicate", None, "key 'optimizer' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
    ("huge params", set_field("params", value=int("9" * 400)), "(400 characters): beyond any number"),
    # no upper bound before (probe round 5): 10**30 threads read as a count
    (
        "absurd threads",
        set_field("threads", 1, value=10**30),
        "threads[1] must be a whole number >= 1, at most",
    ),
    (
        "absurd rate",
        set_field("params_per_s", 0, value=1e30),
        "params_per_s[0] must be a finite number > 0, at most 1e+18",
    ),
]
_MODELS = [
    (
        "string size",
        set_field("sizes", "7b", "hidden", value="4096"),
        "sizes.7b.hidden must be a whole number >= 1",
    ),
    ("true for a number", set_field("tiny", "layers", value=True), "tiny.layers must be a whole number >= 1"),
    (
        "float size",
        set_field("sizes", "1.3b", "layers", value=24.0),
        "sizes.1.3b.layers must be a whole number",
    ),
    (
        "past the bound",
        set_field("sizes", "22b", "layers", value=10**6),
        "sizes.22b.layers must be a whole number >= 1, at most 256",
    ),
    (
        "heads not dividing",
        set_field("sizes", "7b", "heads", value=33),
        "model gpt3-7b: hidden (4096) must be a multiple of heads (33)",
    ),
    (
        "unknown choice",
        set_field("families", "llama", "gated", value=True),
        "families.llama: unknown field(s) gated",
    ),
    (
        "choice not a bool",
        set_field("families", "falcon", "parallel_block", value=1),
        "families.falcon.parallel_block must be true or false",
    ),
    (
        "unknown norm",
        set_field("families", "llama", "norm", value="batchnorm"),
        "families.llama.norm must be one of layernorm, rmsnorm",
    ),
    (
        "nan dropout",
        set_field("families", "llama", "dropout", value=math.nan),
        "families.llama.dropout must be a finite number >= 0",
    ),
    (
        "dropout of 1",
        set_field("families", "llama", "dropout", value=1.0),
        "model llama-1.3b: dropout must be a number in [0, 1)",
    ),
    ("missing size field", drop_field("sizes", "1.3b", "heads"), "sizes.1.3b: missing heads"),
    (
        "size with a choice",
        set_field("sizes", "7b", "vocab", value=32000),
        "sizes.7b: unknown field(s) vocab",
    ),
    ("no sizes", set_field("sizes", value={}), "sizes must be a non-empty mapping of names to fields"),
    ("extra key", set_field("gpus", value={}), "unknown field(s) gpus"),
    ("source not a string", set_field("tiny_source", value=None), "tiny_source must be a non-empty string"),
    ("duplicate", None, "key 'sizes' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
]


def _device_for(name: str):
    def edit(d):
        d[name]["device"] = d["cpu"]["device"]

    return edit


def _copied(source: str, name: str):
    def edit(d):
        d[name] = d[source]

    return edit


_NVLINK_OR = 'must be a finite number > 0 (or "nvlink": the data sheet\'s, where it has one)'
_CLUSTERS = [
    (
        "string bandwidth",
        set_field("l4", "intra", "bytes_per_s", value="16e9"),
        f"l4.intra.bytes_per_s {_NVLINK_OR}",
    ),
    (
        "nvlink on PCIe",
        set_field("l4", "intra", "bytes_per_s", value="nvlink"),
        f"{_NVLINK_OR}, at most 1e+18, got 'nvlink'",
    ),
    (
        "nvlink between nodes",
        set_field("h100", "inter", "bytes_per_s", value="nvlink"),
        "h100.inter.bytes_per_s must be a finite number > 0, at most",
    ),
    (
        "negative latency",
        set_field("l4", "inter", "latency_s", value=-1e-6),
        "l4.inter.latency_s must be a finite number >= 0",
    ),
    (
        "true latency",
        set_field("a10g", "intra", "latency_s", value=True),
        "a10g.intra.latency_s must be a finite number",
    ),
    (
        "infinite bandwidth",
        set_field("cpu", "inter", "bytes_per_s", value=math.inf),
        "cpu.inter.bytes_per_s must be a finite number > 0",
    ),
    (
        "float memory",
        set_field("l4", "host", "memory_bytes", value=4.1e11),
        "l4.host.memory_bytes must be a whole number >= 1",
    ),
    (
        "absurd memory",
        set_field("l4", "host", "memory_bytes", value=2**60),
        "l4.host.memory_bytes must be a whole number >= 1, at most 1125899906842624",
    ),
    ("no cores", set_field("h200", "host", "cores", value=0), "h200.host.cores must be a whole number >= 1"),
    (
        "both DRAM forms",
        set_field("l4", "host", "dram_bytes_per_s", value=1e11),
        "l4.host: give dram_bytes_per_s or all of sockets, channels, dram_mega_transfers_per_s",
    ),
    (
        "half a DRAM form",
        drop_field("v100", "host", "channels"),
        "v100.host: give dram_bytes_per_s or all of",
    ),
    ("no source", drop_field("l4", "intra", "source"), "l4.intra: missing source"),
    ("unknown field", set_field("l4", "nic", value=1), "l4: unknown field(s) nic"),
    (
        "no data sheet",
        renamed_field("l4", to="x100"),
        "x100: no data sheet with memory, HBM, PCIe and L2 in datasheets.json",
    ),
    ("a partial data sheet", _copied("h200", "b200"), "b200: no data sheet with memory, HBM, PCIe and L2"),
    ("a device beside a data sheet", _device_for("l4"), "l4.device: l4 has a data sheet in datasheets.json"),
    ("device field missing", drop_field("cpu", "device", "l2_bytes"), "cpu.device: missing l2_bytes"),
    (
        "device string",
        set_field("cpu", "device", "hbm_bytes_per_s", value="20e9"),
        "cpu.device.hbm_bytes_per_s must be a finite number > 0",
    ),
    ("duplicate", None, "key 'l4' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
]
_READERS = {
    "runtime_l4.json": lambda path: read_runtime_preset(path, "l4"),
    "interference_l4.json": read_interference_preset,
    "host_cpu_adam.json": read_cpu_adam,
    "models.json": specs.read_models,
    "clusters.json": specs.read_clusters,
}
_CASES = [
    pytest.param(name, edit, said, case, id=f"{name.removesuffix('.json')}-{case}")
    for name, cases in (
        ("runtime_l4.json", _RUNTIME),
        ("interference_l4.json", _INTERFERENCE),
        ("host_cpu_adam.json", _HOST),
        ("models.json", _MODELS),
        ("clusters.json", _CLUSTERS),
    )
    for case, edit, said in cases
]


@pytest.mark.parametrize(("name", "edit", "said", "case"), _CASES)
def test_a_corrupted_preset_is_refused_in_one_line(tmp_path, name, edit, said, case):
    refused_in_one_line(_READERS[name], PRESETS / name, tmp_path / name, case, edit, said)


@pytest.mark.parametrize("path", sorted(PRESETS.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_preset_reads(path):
    """The control: the shipped presets pass the readers that refuse the copies above."""
    if path.name.startswith("runtime_"):
        model = read_runtime_preset(path, path.stem.removeprefix("runtime_"))
        assert model.to_json() == json.loads(path.read_text())  # read as written, nothing changed
    elif path.name.startswith("interference_"):
        assert read_interference_preset(path).to_json() == json.loads(path.read_text())
    elif path.name == "models.json":
        families, models = specs.read_models(path)
        assert models == specs.models() and families == specs.families() and "llama-tiny" in models
    elif path.name == "clusters.json":
        assert specs.read_clusters(path) == (specs.gpus(), specs.links(), specs.hosts())
        assert (
            specs.gpus()["h100"].fp32_flops == 67e12 and specs.links()["h100"][0].bw == 450e9
        )  # the sheet's
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
    (presets / "runtime_l4.json").write_text(corrupted(PRESETS / "runtime_l4.json", "nan", _RUNTIME[0][1]))
    assert main(["predict", str(plan)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "runtime_l4.json: curves.act[0].rate" in err, err


@pytest.fixture
def fresh_presets():
    """The hand-written presets read afresh in the test (its copies), and as shipped after it."""
    readers = (datasheets, specs._model_presets, specs._cluster_presets)
    for reader in readers:
        reader.cache_clear()
    yield
    for reader in readers:
        reader.cache_clear()


@pytest.mark.parametrize(
    ("module", "attribute", "name", "edit", "said"),
    [
        ("specs", "MODELS_FILE", "models.json", set_field("tiny", "heads", value="4"), "tiny.heads must be"),
        ("specs", "CLUSTERS_FILE", "clusters.json", drop_field("l4", "host"), "l4: missing host"),
        (
            "datasheets",
            "DATASHEETS_FILE",
            "datasheets.json",
            set_field("l4", "sms", value=0),
            "l4.sms must be",
        ),
    ],
    ids=["models", "clusters", "datasheets"],
)
def test_a_corrupted_hand_written_preset_stops_the_command_line_in_one_line(
    tmp_path, capsys, monkeypatch, fresh_presets, module, attribute, name, edit, said
):
    """The command line's parser lists the presets: a broken file is one line, status 2, whatever
    the command (`mist list`, `mist plan`). Control: the same commands with a copy as shipped."""
    owner = {"specs": specs, "datasheets": measure_datasheets}[module]
    shipped, copy = getattr(owner, attribute), tmp_path / name
    monkeypatch.setattr(owner, attribute, copy)
    plan = ["plan", "--model", "gpt3-tiny", "--gpu", "cpu", "--gpus", "2", "--global-batch", "8", "--quiet"]
    copy.write_text(shipped.read_text())
    assert main(["list"]) == 0 and main(plan) == 0  # the control
    capsys.readouterr()
    copy.write_text(corrupted(shipped, "edit", edit))
    for reader in (datasheets, specs._model_presets, specs._cluster_presets):
        reader.cache_clear()
    for argv in (["list"], plan):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"{copy}: {said}" in err, err


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


def _solo_all_gathers(name: str) -> list[tuple[int, float, float]]:
    """(GPUs, full-tensor bytes, seconds) of gpu-bandwidth's NCCL all-gathers that ran alone
    within one node (no GEMM, no host copies): a benchmark other than the prim_gpt rows the
    presets' collective lines are fitted to."""
    (runs,) = json.loads((ARTIFACT_DATA / "gpu-bandwidth" / name).read_text()).values()
    return [
        (
            int(r["intra_group_size"]),
            float(r["gpu_to_gpu_mbytes"]) * 2**20,
            float(r["latency"].split()[0]) * 1e-3,
        )
        for r in runs.values()
        if r["compute_n"] == r["cpu_to_gpu_mbytes"] == r["gpu_to_cpu_mbytes"] == "0"
        and r["gpu_to_gpu_mbytes"] != "0"
        and r["inter_group_size"] == "1"
    ]


@pytest.mark.parametrize(("gpu", "bandwidth"), [("a100-40gb", "a100-sxm4-40gb"), ("l4", "l4")])
def test_the_all_gather_line_predicts_the_independent_solo_all_gathers(gpu, bandwidth):
    """The artifact's prim_gpt all_gather rows give what each rank sends (Aceso's profiler sizes
    its send tensor so; its output is n times it), and were read as the full tensor before
    411de49: the shipped lines priced an all-gather 2-8x too slow (A100 over 8 GPUs: 20 GB/s
    of algorithm bandwidth against its reduce-scatter's 173). gpu-bandwidth's solo all-gathers,
    sized by the full tensor and fitted to nothing here, check the line: within 2x both ways (the
    two benchmarks call NCCL differently), where the old reading was 8-12x over 8 GPUs."""
    model = read_runtime_preset(PRESETS / f"runtime_{gpu}.json", gpu)
    runs = _solo_all_gathers(f"{bandwidth}-8gpu-per-node.json")
    assert {n for n, _, _ in runs} == {2, 4, 8}
    ratios = np.array([float(model.collective("all_gather", nbytes, n)) / t for n, nbytes, t in runs])
    assert ((ratios > 0.5) & (ratios < 2.0)).all(), ratios
    # a ring all-gather and reduce-scatter of one tensor move the same bytes
    for n in (2, 4, 8):
        nbytes = 256 * 2**20
        same = model.collective("all_gather", nbytes, n) / model.collective("reduce_scatter", nbytes, n)
        assert 0.5 < same < 2.0, (n, same)


def test_the_artifacts_all_gather_rows_are_read_as_n_times_their_size(monkeypatch):
    """read_collectives scales the artifact's all_gather rows by n (GATHER_ROWS_PER_RANK) and
    leaves the other kinds and `mist profile`'s own rows as written; the size the profiler did
    not run (1e9 ms) is left out. Control: read as written, an all-gather over 8 L4s would take
    about 8 times its reduce-scatter of the same tensor."""
    from mist.model import profile_data
    from mist.model.calibrate import fit_line

    l4 = ARTIFACT_DATA / "gpu-op-profiles" / "l4"
    rows = profile_data.read_collectives(l4)
    assert all(t < profile_data.NOT_RUN_S for kind_rows in rows.values() for _, t in kind_rows)

    def ratio(collectives: dict) -> float:
        gather = fit_line(*zip(*collectives["all_gather", 8], strict=True))
        scatter = fit_line(*zip(*collectives["reduce_scatter", 8], strict=True))
        nbytes = 256 * 2**20
        return (gather.c0 + nbytes / gather.rate) / (scatter.c0 + nbytes / scatter.rate)

    assert 0.5 < ratio(rows) < 2.0
    monkeypatch.setattr(profile_data, "GATHER_ROWS_PER_RANK", frozenset())
    as_written = profile_data.read_collectives(l4)
    assert ratio(as_written) > 4.0
    for key, kind_rows in as_written.items():
        scale = 8 if key == ("all_gather", 8) else 1
        if key[0] != "all_gather" or key == ("all_gather", 8):
            assert [b * scale for b, _ in kind_rows] == [b for b, _ in rows[key]], key


def test_mist_profiles_all_gather_rows_are_read_as_written_in_any_folder(tmp_path):
    """The file says who wrote it, not its folder (review 2026-12-07): `mist profile`'s
    prim_gpt_local_* rows are the full tensor even in a folder named like the artifact's, and the
    artifact's rows are each rank's even beside a profile.json. A collective none of whose sizes
    ran is one line, not fit_line's traceback."""
    from mist.model.profile_data import read_collectives

    folder = tmp_path / "l4"
    folder.mkdir()
    (folder / "profile.json").write_text("{}")  # read_collectives does not read it
    mib = random.randint(1, 64)
    (folder / "prim_gpt_local_all_gather_2gpus.csv").write_text(f"data_size(MB),time(ms)\n{mib},1.5\n")
    (folder / "prim_gpt_13B_all_gather_2gpus.csv").write_text(f"data_size(MB),time(ms)\n{mib},3.0\n")
    rows = sorted(read_collectives(folder)["all_gather", 2], key=lambda r: r[1])
    assert rows == [(mib * 2**20, 1.5e-3), (2 * mib * 2**20, 3e-3)]
    (folder / "prim_gpt_13B_reduce_scatter_4gpus.csv").write_text(
        "data_size(MB),time(ms)\n8,1000000000.000\n"
    )
    with pytest.raises(ValueError, match=r"no size of reduce_scatter over 4 GPUs ran") as e:
        read_collectives(folder)
    assert "\n" not in str(e.value)
