"""Reading measured GPU data: per-op layer profiles and collective micro-benchmarks.

The format is the Mist artifact's (see data/mist-artifact/README.md): per GPU a directory with
``gpt_<size>_mbs<b>_tp<t>_algo<k>.csv`` (one row per op of one layer, plus embedding and head;
times in microseconds) and ``prim_gpt_<size>_<collective>_<n>gpus.csv`` (message MB, time ms).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from measure.strict import StrictDataError, read_json_file, read_text_file

from .specs import ModelSpec, positive_int

# The Mist artifact's measured GPU data, vendored in the repository (see data/README.md).
ARTIFACT_DATA = Path(__file__).resolve().parents[3] / "data" / "mist-artifact"

# The profiled models' shapes by file-name size (GPT-3 style, vocab 50304, no bias). The 1.3B
# profiles are 32-head: their attention-score tensors are 256 MiB at micro-batch 1, seq 2048
# (heads x seq^2 x 2 bytes), though Mist's own GPT-3 1.3B configuration has 16 heads.
PROFILED_SIZES = {
    "1_3B": (2048, 24, 32),
    "2_6B": (2560, 32, 32),
    "6_7B": (4096, 32, 32),
    "13B": (5120, 40, 40),
    "22B": (6144, 48, 64),
    "40B": (8192, 48, 64),
}
ARTIFACT_VOCAB = 50304  # the profiled GPT-3 models' vocabulary
# Sequence length each profile directory was taken at.
PROFILE_SEQ = {
    "l4": 2048,
    "a10g": 2048,
    "a100-sxm4-40gb": 4096,
    "a100-sxm4-40gb-larger-model": 4096,
    "v100-sxm2-32gb-seq2048": 2048,
}
# Which planner GPU preset a profile directory, or the GPU a gpu-bandwidth file names, measures.
PROFILE_GPU = {
    "l4": "l4",
    "a10g": "a10g",
    "a100-sxm4-40gb": "a100-40gb",
    "a100-sxm4-40gb-larger-model": "a100-40gb",
    "v100-sxm2-32gb-seq2048": "v100",
}
# Profile op name -> the symbolic tracer's op names whose work it measures (Megatron fuses the
# residual add into the dropout before it).
LAYER_OPS = {
    "enc-1st-layernorm": ("layernorm-1",),
    "enc-attention-qkv": ("attention-qkv",),
    "enc-attention-score": ("attention-score",),
    "enc-attention-softmax": ("attention-softmax",),
    "enc-attention-dropout": ("attention-dropout",),
    "enc-attention-context": ("attention-context",),
    "enc-attention-dense": ("attention-dense",),
    "enc-post-attention-dropout": ("post-attention-dropout", "residual-1"),
    "enc-2nd-layernorm": ("layernorm-2",),
    "enc-MLP-GEMM-1": ("mlp-gemm-1",),
    "enc-MLP-gelu": ("mlp-gelu",),
    "enc-MLP-GEMM-2": ("mlp-gemm-2",),
    "enc-post-MLP-dropout": ("post-mlp-dropout", "residual-2"),
}
# Rows of the artifact's profiles outside the layer: the embedding, and the final norm + LM head
# with the loss ("post-process").
EMBEDDING_OP, FINAL_NORM_OP, HEAD_OP = "encoder-embedding", "final-layernorm", "gpt-post-process"
# `mist profile` also times megatron-core's whole layer; what it costs beyond the sum of its ops
# (Python and framework overhead, casts, extra copies) is stored as one more row.
FRAMEWORK_OP = "layer-framework-overhead"
# `mist profile --tempo` also times the layer with Tempo's ops (tempo.megatron's spec); what it
# costs beyond megatron-core's plain layer is one more row (Tempo's extra work, mostly backward's),
# for the GPT-3 layer and for a Llama layer of the same size (``gated_layer``): Tempo replaces
# different ops in each (GELU and dropouts; SwiGLU and RMSNorm).
TEMPO_OP = "layer-tempo-excess"
TEMPO_GATED_OP = "layer-tempo-excess-gated"
# The plain Llama layer that row is taken against, whole (forward, backward): its ops are priced by
# the lines fitted to the GPT-3 layer's (RMSNorm by LayerNorm's, SwiGLU by GELU's), and what it
# measures beyond that is fitted from this row (calibrate: the "gated" curve).
GATED_LAYER_OP = "layer-gated-whole"
# `mist profile` also times adding one micro-batch's weight gradients of the layer into the
# accumulated ones, as the engine does (an in-place add per parameter, half precision): no op's
# time includes it, and on a CPU the residual add's line (dropout's random numbers included)
# priced it about seven times slower than it runs. One more row, the same time in both columns.
GRAD_ACCUMULATE_OP = "layer-grad-accumulate"
_LAYER_FILE = re.compile(r"gpt_(?P<size>[0-9_]+B|h\d+)_mbs(?P<mbs>\d+)_tp(?P<tp>\d+)_algo(?P<algo>\d+)\.csv")
_PRIM_FILE = re.compile(r"prim_gpt_(?P<size>[0-9_]+B|local)_(?P<coll>[a-z_]+?)_(?P<n>\d+)gpus\.csv")


@dataclass(frozen=True)
class LayerProfile:
    gpu_dir: str
    size: str
    mbs: int
    tp: int
    algo: int
    ops: dict[str, tuple[float, float]]  # op -> (forward s, backward s)
    shape: tuple[int, int, int]  # hidden, layers, heads
    seq: int
    tp_comm_inside: bool = True  # TP all-reduces measured inside the ops (Megatron runs; not `mist profile`)
    # Whether a weight GEMM's backward column holds both of its GEMMs (input and weight gradient)
    # or the input gradient's alone (backward_has_weight_gradients tells from the data).
    weight_gradients: bool = True
    vocab: int = 50304  # the profiled model's (ARTIFACT_VOCAB; `mist profile` records its own)

    @property
    def model(self) -> ModelSpec:
        hidden, layers, heads = self.shape
        return ModelSpec(
            f"gpt3-{self.size}", hidden, layers, heads, vocab=self.vocab, seq=self.seq, flash=False
        )

    @property
    def layer_seconds(self) -> float:
        """Forward + backward of one transformer layer (TP communication included, as measured)."""
        return sum(fwd + bwd for op, (fwd, bwd) in self.ops.items() if op in LAYER_OPS or op == FRAMEWORK_OP)


def gated_layer(model: ModelSpec) -> ModelSpec:
    """The Llama-style layer ``mist profile --tempo`` times beside the profiled GPT-3 one (its
    TEMPO_GATED_OP row): RMSNorm, SwiGLU MLP (its default width), no dropout; the same hidden size,
    heads and sequence. Rotary positions are left out: they cost the same with Tempo's layer."""
    return replace(model, norm="rmsnorm", gated_mlp=True, dropout=0.0, ffn=None)


def profile_meta(gpu_dir: Path) -> dict:
    """What a profile directory measured: {"gpu", "seq", "sizes", "dtype", ...}. ``mist profile`` writes it
    as profile.json; the artifact's directories are known by name."""
    meta = gpu_dir / "profile.json"
    if meta.exists():
        d = _read_meta(meta)
        return {
            "gpu": d["gpu"],
            "seq": d["seq"],
            "sizes": {k: tuple(v) for k, v in d["sizes"].items()},
            "tp_comm_inside": d.get("tp_comm_inside", False),
            # autograd's backward of a linear layer computes both gradients
            "weight_gradients": d.get("weight_gradients", True),
            "vocab": d.get("vocab", ARTIFACT_VOCAB),  # the embedding and head rows' vocabulary
            # what bounds its fitted FLOP/s (``calibrate.peak_flops``); one that does not say is
            # held to the highest peak (half precision's), never refused for a rate it may reach
            "dtype": d.get("dtype", "fp16"),
            "complete": d["complete"],
        }
    if gpu_dir.name in PROFILE_GPU:
        return {
            "gpu": PROFILE_GPU[gpu_dir.name],
            "seq": PROFILE_SEQ[gpu_dir.name],
            "sizes": PROFILED_SIZES,
            "tp_comm_inside": True,
            "vocab": ARTIFACT_VOCAB,
            "dtype": "fp16",  # Megatron's half precision (data/mist-artifact/README.md)
            "complete": True,  # as published
        }
    return {}


# a preset's name, as the shipped ones are (l4, a100-40gb, cpu): it names a preset file when
# `mist calibrate --write` writes one, so no path separators, no leading dot, no spaces
_PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
PRESET_NAME_RULE = "a preset's name: up to 64 letters, digits, '.', '_' or '-', a letter or digit first"


def is_preset_name(name: object) -> bool:
    return isinstance(name, str) and _PRESET_NAME.fullmatch(name) is not None


# profile.json's fields: (what it must be, the check); "sizes": {size name: [hidden, layers, heads]}
_META_FIELDS = {
    "gpu": (PRESET_NAME_RULE, is_preset_name),
    "seq": ("a whole number > 0", positive_int),
    "sizes": (
        "{size name: [hidden, layers, heads]}, whole numbers > 0",
        lambda v: (
            isinstance(v, dict)
            and bool(v)
            and all(isinstance(x, list) and len(x) == 3 and all(map(positive_int, x)) for x in v.values())
        ),
    ),
    "tp_comm_inside": ("true or false", lambda v: isinstance(v, bool)),
    "weight_gradients": ("true or false", lambda v: isinstance(v, bool)),
    "vocab": ("a whole number > 0", positive_int),
    # what `mist profile` also records (read by people, not by the model)
    "device": ("a device name", lambda v: isinstance(v, str)),
    "dtype": ("a dtype's name", lambda v: isinstance(v, str)),
    "cpu_threads": ("a whole number > 0 or null", lambda v: v is None or positive_int(v)),
    # whether `mist profile` finished: false from its start until every benchmark it was asked
    # for is written (``mark_profile_complete``), so an interrupted one is never fitted as whole
    "complete": ("true or false", lambda v: isinstance(v, bool)),
}
_META_REQUIRED = ("gpu", "seq", "sizes", "complete")


def _read_meta(path: Path) -> dict:
    """profile.json, strictly: each field of its kind (a string is not a number), no key twice, no
    field it does not know; one line naming the file and the field otherwise."""
    try:
        d = read_json_file(path)
    except (json.JSONDecodeError, UnicodeDecodeError, StrictDataError) as e:
        raise ValueError(f"{path}: not a readable profile.json ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a profile.json is a mapping of {', '.join(_META_FIELDS)}")
    unknown = sorted(set(d) - set(_META_FIELDS))
    missing = [k for k in _META_REQUIRED if k not in d]
    if missing == ["complete"] and not unknown:  # from before profiles recorded it (2026-12-04)
        raise ValueError(
            f"{path}: written before profile.json recorded whether `mist profile` finished (no "
            '"complete" field): redo it with `mist profile ... --replace`, or add "complete": true '
            "if that run finished"
        )
    if unknown or missing:
        wrong = [f"unknown field(s) {', '.join(unknown)}"] if unknown else []
        wrong += [f"missing {', '.join(missing)}"] if missing else []
        raise ValueError(f"{path}: {'; '.join(wrong)} (fields: {', '.join(_META_FIELDS)})")
    for key, value in d.items():
        what, ok = _META_FIELDS[key]
        if not ok(value):
            raise ValueError(f"{path}: {key} must be {what}, got {value!r}")
    return d


def mark_profile_complete(gpu_dir: Path) -> None:
    """Say in ``gpu_dir``'s profile.json that the profile is whole: the last thing `mist profile`
    writes, after every benchmark it was asked for (the file written whole or not at all)."""
    from measure.results import write_json_atomic

    meta = gpu_dir / "profile.json"
    write_json_atomic(meta, {**_read_meta(meta), "complete": True})


def check_complete(gpu_dir: Path) -> None:
    """Refuse a profile `mist profile` did not finish (interrupted, or failed part-way): fitted, it
    would pass for the whole profile, the benchmarks it lacks priced from the presets unsaid."""
    from measure.results import folder_is_locked

    if not profile_meta(gpu_dir).get("complete", True):
        if folder_is_locked(gpu_dir):  # not failed: being written
            raise ValueError(
                f"{gpu_dir}: being written by a `mist profile` still running (the folder is locked): "
                "calibrate it once that run has finished"
            )
        raise ValueError(
            f"{gpu_dir}: an incomplete profile (its `mist profile` did not finish; profile.json says "
            "complete: false): redo it by rerunning that command with --replace"
        )


WEIGHT_GEMMS = ("enc-attention-qkv", "enc-attention-dense", "enc-MLP-GEMM-1", "enc-MLP-GEMM-2")


def backward_has_weight_gradients(ops_per_profile: list[dict[str, tuple[float, float]]]) -> bool:
    """Whether the backward times of weight GEMMs include the weight-gradient GEMM.

    A weight GEMM's backward is two GEMMs of the forward's FLOPs (input gradient, weight
    gradient), so it takes about twice the forward when both are timed. In the Mist artifact's
    A10G profiles it does (median backward/forward 1.9-2.0); in the L4, A100 and V100 ones it is
    0.7-0.9, which would need backward GEMMs faster than the data-sheet peak (A100: 555 TFLOP/s
    against 312): those columns timed the input gradient alone (the weight gradient is computed
    elsewhere, e.g. by Megatron's fused gradient accumulation). Decided from the median ratio over
    every weight GEMM of every profile: above 1.4, both.
    """
    ratios = sorted(
        ops[op][1] / ops[op][0]
        for ops in ops_per_profile
        for op in WEIGHT_GEMMS
        if op in ops and ops[op][0] > 0
    )
    return not ratios or ratios[len(ratios) // 2] > 1.4


def _csv_rows(path: Path, what: str) -> list[dict[str, str]]:
    """A profile CSV's rows under its header, each with exactly the header's fields: a row cut
    short (csv fills the missing fields with None) or run on (it files the extra ones under None)
    is refused, naming the file and its line, not read as whatever its fields happen to say."""
    try:
        with io.StringIO(read_text_file(path), newline="") as fh:  # a FIFO of the name: refused
            reader = csv.DictReader(fh)
            rows = []
            for row in reader:
                fields = len(reader.fieldnames) + len(row.get(None, ())) - list(row.values()).count(None)
                if fields != len(reader.fieldnames):
                    raise ValueError(
                        f"{path}: line {reader.line_num} has {fields} fields, its header "
                        f"{len(reader.fieldnames)}: each row gives every column"
                    )
                rows.append(row)
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path}: {what}: {e!r}") from None
    return rows


def _us_pair(forward: str, backward: str) -> tuple[float, float]:
    """A layer profile's (forward, backward) microseconds in seconds."""
    return float(forward) * 1e-6, float(backward) * 1e-6


def read_layer_profiles(gpu_dir: Path) -> list[LayerProfile]:
    meta = profile_meta(gpu_dir)
    out = []
    for path in sorted(gpu_dir.glob("gpt_*.csv")):
        m = _LAYER_FILE.fullmatch(path.name)
        if m is None:  # a layer profile misnamed would be left out of the fit without a word
            raise ValueError(f"{path}: not a layer profile's name (gpt_<size>_mbs<b>_tp<t>_algo<a>.csv)")
        if not meta or m["size"] not in meta["sizes"]:
            continue
        what = "not a layer profile (needs op_name, forward-compute, backward-compute in µs)"
        table = _csv_rows(path, what)  # a row with a field too few or too many: refused, naming its line
        try:
            rows = [(r["op_name"], _us_pair(r["forward-compute"], r["backward-compute"])) for r in table]
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: {what}: {e!r}") from None
        ops = dict(rows)
        if len(ops) < len(rows):  # two rows for one op: which one was measured is unknown
            names = [name for name, _ in rows]
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"{path}: op {twice[0]!r} has two rows; a layer profile has one per op")
        missing = [op for op in LAYER_OPS if op not in ops]
        if missing:
            raise ValueError(f"{path}: not a layer profile: no row for {', '.join(missing)}")
        bad = [op for op, times in ops.items() if not all(math.isfinite(x) and x >= 0 for x in times)]
        if bad:
            raise ValueError(f"{path}: negative or non-finite times for {', '.join(bad)}")
        shape = meta["sizes"][m["size"]]
        out.append(
            LayerProfile(
                gpu_dir.name,
                m["size"],
                int(m["mbs"]),
                int(m["tp"]),
                int(m["algo"]),
                ops,
                shape,
                meta["seq"],
                meta["tp_comm_inside"],
                vocab=meta["vocab"],
            )
        )
    if "weight_gradients" in meta:  # `mist profile` says what it timed
        wgrad = meta["weight_gradients"]
    else:
        wgrad = backward_has_weight_gradients([p.ops for p in out if p.tp == 1] or [p.ops for p in out])
    return [replace(p, weight_gradients=wgrad) for p in out]


def best_algo(profiles: list[LayerProfile]) -> list[LayerProfile]:
    """Of the two implementations profiled per case, the faster layer (as Mist picks)."""
    best: dict[tuple, LayerProfile] = {}
    for p in profiles:
        key = (p.gpu_dir, p.size, p.mbs, p.tp)
        if key not in best or p.layer_seconds < best[key].layer_seconds:
            best[key] = p
    return list(best.values())


# The artifact's collective benchmarks (prim_gpt_<size>B_*: Aceso's communication profiler) give
# all_gather's size as what each rank sends, 1/n of the full tensor the planner prices
# (RuntimeModel.collective); all_reduce's and reduce_scatter's as the full tensor, all_to_all's
# as each rank's tensor. `mist profile`'s own (prim_gpt_local_*) give every size as the full
# tensor (profiler/collectives.py), whatever folder they are in. Read as the full tensor, an
# all-gather over 8 A100s came out at 17 GB/s of bus bandwidth against its reduce-scatter's 149,
# though a ring all-gather and reduce-scatter of one tensor move the same bytes; the artifact's
# all-gather/reduce-scatter time ratio at equal rows is close to n on every GPU
# (tests/mist/test_mist_presets.py).
GATHER_ROWS_PER_RANK = frozenset({"all_gather"})
# That profiler writes 1e9 ms for a size above its limit and 1e6 ms for one that failed: no time
NOT_RUN_S = 1e3


def read_collectives(gpu_dir: Path) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(collective, gpus) -> [(bytes of the full tensor, seconds)], all profiled model sizes
    pooled (GATHER_ROWS_PER_RANK); a size the benchmark did not run is left out (NOT_RUN_S), and
    a collective none of whose sizes ran is refused. Point-to-point messages within a node
    (``p2p_intra_node.csv``, or ``mist profile``'s send_recv benchmark) are ("send_recv", 2)."""
    out: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for size, rate in read_p2p(gpu_dir).get("intra", []):
        out.setdefault(("send_recv", 2), []).append((size, size / rate))
    for path in sorted(gpu_dir.glob("prim_gpt_*.csv")):
        m = _PRIM_FILE.fullmatch(path.name)
        if m is None:  # a benchmark misnamed would be left out, its collective priced by the link
            raise ValueError(
                f"{path}: not a collective benchmark's name (prim_gpt_<size>_<kind>_<n>gpus.csv)"
            )
        what = "not a collective benchmark (needs data_size(MB), time(ms))"
        table = _csv_rows(path, what)  # a row with a field too few or too many: refused, naming its line
        try:
            rows = [(float(r["data_size(MB)"]) * 2**20, float(r["time(ms)"]) * 1e-3) for r in table]
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: {what}: {e!r}") from None
        # a size > 0 and a time >= 0 (a ZeRO benchmark's extra time may measure as none): a line
        # fitted through a negative or infinite time would price collectives as free or as never ending
        bad = next(((b, t) for b, t in rows if not (_positive_finite(b) and 0 <= t < math.inf)), None)
        if bad is not None:
            raise ValueError(
                f"{path}: sizes must be finite and > 0, times finite and >= 0; got "
                f"{bad[0] / 2**20:g} MB in {bad[1] * 1e3:g} ms"
            )
        kind, n = m["coll"], int(m["n"])
        scale = n if m["size"] != "local" and kind in GATHER_ROWS_PER_RANK else 1
        out.setdefault((kind, n), []).extend((b * scale, t) for b, t in rows if t < NOT_RUN_S)
    if none_ran := [f"{kind} over {n} GPUs" for (kind, n), rows in out.items() if not rows]:
        raise ValueError(
            f"{gpu_dir}: no size of {', '.join(none_ran)} ran (every time is the profiler's mark of "
            f"one it did not run, {NOT_RUN_S:g} s or more)"
        )
    return out


def _positive_finite(*values: float) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values)


def read_p2p(gpu_dir: Path) -> dict[str, list[tuple[float, float]]]:
    """'intra'/'inter' -> [(bytes, bytes/s)]. A file is pairs of lines, message MB then GB/s (one
    pair per repetition)."""
    out = {}
    for where in ("intra", "inter"):
        path = gpu_dir / f"p2p_{where}_node.csv"
        if not path.exists():
            continue
        lines = read_text_file(path).split()
        try:
            if len(lines) % 2 or not lines:
                raise ValueError("not pairs of lines")
            out[where] = [
                (float(a) * 2**20, float(r) * 1e9)
                for sizes, rates in zip(lines[::2], lines[1::2], strict=True)
                for a, r in zip(sizes.split(","), rates.split(","), strict=True)
            ]
            if not all(_positive_finite(b, r) for b, r in out[where]):
                raise ValueError("message sizes and rates must be finite and > 0")
        except ValueError as e:
            raise ValueError(f"{path}: not a p2p benchmark (lines of message MB, then GB/s): {e}") from None
    return out
