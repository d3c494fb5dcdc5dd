"""Per-op layer profiles (``mist profile``): each op, megatron-core's whole layer and its edges."""

from __future__ import annotations

import csv
import math
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from measure.results import atomic_path, write_json_atomic
from measure.timing import time_fn
from measure.units import MiB

from ...model.profile_data import (
    EMBEDDING_OP,
    FINAL_NORM_OP,
    FRAMEWORK_OP,
    GATED_LAYER_OP,
    GRAD_ACCUMULATE_OP,
    HEAD_OP,
    TEMPO_GATED_OP,
    TEMPO_OP,
    gated_layer,
    mark_profile_complete,
)
from ...model.specs import ModelSpec
from .megatron_layer import (
    engine_layer,
    forward_backward_seconds,
    layer_inputs,
    megatron_config,
    megatron_state,
)


def _ops(b: int, s: int, h: int, heads: int, tp: int, dtype, device) -> list[tuple[str, Callable, list]]:
    """(profile op name, fn, input shapes) of one TP rank's share of the layer (heads / tp heads of
    the model's head size, ffn 4h / tp); fn takes the inputs, returns the output."""
    d, heads, ffn = h // heads, heads // tp, 4 * h // tp
    p = 0.1
    ln = nn.LayerNorm(h, device=device, dtype=dtype)
    qkv = nn.Linear(h, 3 * heads * d, bias=False, device=device, dtype=dtype)
    dense = nn.Linear(heads * d, h, bias=False, device=device, dtype=dtype)
    fc1 = nn.Linear(h, ffn, bias=False, device=device, dtype=dtype)
    fc2 = nn.Linear(ffn, h, bias=False, device=device, dtype=dtype)
    scale = 1 / math.sqrt(d)
    stream, scores = (b, s, h), (b, heads, s, s)
    return [
        ("enc-1st-layernorm", ln, [stream]),
        ("enc-attention-qkv", qkv, [stream]),
        (
            "enc-attention-score",
            lambda q, k: torch.matmul(q, k.transpose(-1, -2)) * scale,
            [(b, heads, s, d)] * 2,
        ),
        ("enc-attention-softmax", lambda x: x.softmax(-1), [scores]),
        ("enc-attention-dropout", lambda x: nn.functional.dropout(x, p), [scores]),
        ("enc-attention-context", torch.matmul, [scores, (b, heads, s, d)]),
        ("enc-attention-dense", dense, [(b, s, heads * d)]),
        ("enc-post-attention-dropout", lambda x, r: r + nn.functional.dropout(x, p), [stream, stream]),
        ("enc-2nd-layernorm", ln, [stream]),
        ("enc-MLP-GEMM-1", fc1, [stream]),
        ("enc-MLP-gelu", nn.functional.gelu, [(b, s, ffn)]),
        ("enc-MLP-GEMM-2", fc2, [(b, s, ffn)]),
        ("enc-post-MLP-dropout", lambda x, r: r + nn.functional.dropout(x, p), [stream, stream]),
    ]


def profile_layer(
    b: int, s: int, h: int, heads: int, tp: int, dtype: torch.dtype, device: str, repeats: int = 5
) -> list[dict]:
    """Per op: forward and backward microseconds and tensor sizes (MiB), as the artifact's CSVs."""
    rows = []
    for name, fn, shapes in _ops(b, s, h, heads, tp, dtype, device):
        inputs = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for shape in shapes]
        out = fn(*inputs)
        grad = torch.randn_like(out)
        params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
        fwd = time_fn(lambda f=fn, x=inputs: f(*x), device, warmup=1, repeats=repeats)

        def backward(f=fn, x=inputs, g=grad, w=params):
            y = f(*x)
            torch.autograd.grad(y, [*x, *w], g)

        both = time_fn(backward, device, warmup=1, repeats=repeats)
        rows.append(
            {
                "op_name": name,
                "forward-compute": fwd.median_s * 1e6,
                "backward-compute": max(both.median_s - fwd.median_s, 0.0) * 1e6,
                "input_size": sum(x.numel() * x.element_size() for x in inputs) / MiB,
                "output_size": out.numel() * out.element_size() / MiB,
                "weights": sum(w.numel() * w.element_size() for w in params) / MiB,
                "activations": 0.0,
                "fwd_reserved": 0.0,
                "bwd_reserved": 0.0,
            }
        )
    return rows


def megatron_layer_seconds(
    b: int,
    s: int,
    h: int,
    heads: int,
    tp: int,
    dtype: torch.dtype,
    device: str,
    repeats: int = 5,
    tempo: bool = False,
    gated_ffn: int | None = None,
) -> tuple[float, float]:
    """(forward, backward) seconds of a decoder layer of the engine's spec (``engine_layer``) at
    one rank's share; timed like the ops, so the difference is the framework. ``tempo``: the
    layer with Tempo's ops, as the engine builds a Tempo plan's; ``gated_ffn``: a Llama layer."""
    with megatron_state():
        layer = engine_layer(h, heads, tp, dtype, device, tempo, gated_ffn)
        x, mask, grad = layer_inputs(b, s, h, dtype, device)

        def forward():
            out = layer(x, attention_mask=mask)
            return out[0] if isinstance(out, tuple) else out

        return forward_backward_seconds(forward, lambda y: y.backward(grad), device, repeats)


def grad_accumulation_seconds(
    h: int, heads: int, tp: int, dtype: torch.dtype, device: str, repeats: int = 5
) -> float:
    """Seconds of adding one micro-batch's weight gradients of megatron-core's layer (one rank's
    share) into the accumulated ones, as mist.engine.run's autograd does: an in-place add per
    parameter, in half precision (the engine's gradients; ``dtype`` where it is 16-bit). No op's
    profile holds it (each op's gradients are fresh) and the cost model prices it per micro-batch
    (stage_cost._accumulation_s)."""
    with megatron_state():
        shapes = [p.shape for p in engine_layer(h, heads, tp, dtype, "cpu").parameters()]
    half = dtype if dtype.itemsize == 2 else torch.bfloat16
    accumulated = [torch.zeros(shape, dtype=half, device=device) for shape in shapes]
    new = [torch.randn(shape, device=device).to(half) for shape in shapes]

    def add() -> None:
        for total, grad in zip(accumulated, new, strict=True):
            total.add_(grad)

    return time_fn(add, device, warmup=1, repeats=repeats).median_s


def megatron_edge_rows(
    b: int, s: int, h: int, heads: int, vocab: int, tp: int, dtype: torch.dtype, device: str, repeats: int = 5
) -> list[dict]:
    """The rows outside the layer, as megatron-core's GPTModel runs them at one rank's share (the
    model mist.engine.run trains, its vocabulary split over ``tp``): the embedding (token and
    position lookup, and the tables' gradients), the final norm, and the post-process (output
    layer, cross-entropy over the vocabulary, the mean the engine backpropagates from). Each is a
    difference of whole one-layer models with and without it, so GPTModel's own work around
    them is counted; the final norm is timed alone and taken out of the post-process."""
    if vocab % tp:
        raise ValueError(f"tp {tp} does not divide the vocabulary {vocab}")
    seconds = _gpt_model_seconds(b, s, h, heads, vocab, tp, dtype, device, repeats)
    norm = nn.LayerNorm(h, device=device, dtype=dtype)
    x = torch.randn(b, s, h, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(b, s, h, dtype=dtype, device=device)
    final_norm = forward_backward_seconds(lambda: norm(x), lambda y: y.backward(g), device, repeats)
    diff = [a - b for a, b in zip(seconds[True, False], seconds[False, False], strict=True)]
    head = [a - b - n for a, b, n in zip(seconds[True, True], seconds[True, False], final_norm, strict=True)]
    return [_edge_row(EMBEDDING_OP, *diff), _edge_row(FINAL_NORM_OP, *final_norm), _edge_row(HEAD_OP, *head)]


def _gpt_model_seconds(
    b: int, s: int, h: int, heads: int, vocab: int, tp: int, dtype: torch.dtype, device: str, repeats: int
) -> dict[tuple[bool, bool], tuple[float, float]]:
    """{(pre_process, post_process): (forward, backward) seconds} of a one-layer GPTModel at one
    rank's share: without the embedding and head, with the embedding, with both."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from ..layers import block_spec

    seconds = {}
    with megatron_state():
        config = megatron_config(h, heads, tp, dtype)
        tokens = torch.randint(0, vocab // tp, (b, s + 1), device=device)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(s, device=device).expand(b, -1)
        mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).tril().logical_not()
        grad = torch.randn(s, b, h, dtype=dtype, device=device)
        for pre, post in ((False, False), (True, False), (True, True)):
            model = GPTModel(
                config=config,
                transformer_layer_spec=block_spec("LayerNorm", False, 1),  # the engine's, final norm included
                vocab_size=vocab // tp,
                max_sequence_length=s,
                pre_process=pre,
                post_process=post,
                share_embeddings_and_output_weights=False,
            )
            if dtype != torch.float32:  # as mist.engine.run: megatron's wrapper casts inputs and outputs
                model = Float16Module(config, model)
            model = model.to(device).train()
            hidden = torch.randn(s, b, h, dtype=dtype, device=device, requires_grad=True)

            def forward(model=model, pre=pre, post=post, hidden=hidden):
                if not pre:
                    (model.module if hasattr(model, "module") else model).set_input_tensor(hidden)
                out = model(ids, pos, mask, labels=labels if post else None)
                return out.float().mean() if post else out

            seconds[pre, post] = forward_backward_seconds(
                forward, (lambda y: y.backward()) if post else (lambda y: y.backward(grad)), device, repeats
            )
    return seconds


def _edge_row(name: str, fwd: float, bwd: float) -> dict:
    """A profile row of an op outside the layer: its times in microseconds (a difference below
    zero is none), no sizes."""
    sizes = dict.fromkeys(
        ("input_size", "output_size", "weights", "activations", "fwd_reserved", "bwd_reserved"), 0.0
    )
    return {
        "op_name": name,
        "forward-compute": max(fwd, 0.0) * 1e6,
        "backward-compute": max(bwd, 0.0) * 1e6,
        **sizes,
    }


@dataclass(frozen=True, kw_only=True)
class ProfileJob:
    """What one profile measures: every (TP, micro-batch) point of one layer shape, on one device
    (what ``write_profiles`` was asked for, handed whole to the concurrent copies)."""

    device: str
    hidden: int
    heads: int
    seq: int
    micro_batches: tuple[int, ...]
    tps: tuple[int, ...]
    dtype: torch.dtype
    gpu: str  # the profile's name in the data folder
    repeats: int
    framework: bool  # megatron-core's whole layer too: its excess over the ops is one more row
    tempo: bool  # the layer with Tempo's ops too: its excess over the plain layer is one more row
    threads: int | None  # the CPU threads a point runs on; None on a GPU
    vocab: int | None  # with it, the embedding, final norm and head rows too
    rounds: int

    @property
    def size(self) -> str:
        return f"h{self.hidden}"


# Long for its 18 options (a profile's whole request) and its docstring: the work is in helpers
def write_profiles(
    out: Path,
    device: str,
    hidden: int,
    heads: int,
    seq: int,
    micro_batches: list[int],
    tps: list[int],
    dtype: torch.dtype,
    gpu: str,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
    framework: bool = True,
    cpu_threads: int = 1,
    vocab: int | None = None,
    concurrent: int = 1,
    rounds: int = 1,
    tempo: bool = False,
    complete: bool = True,
) -> list[Path]:
    """Profile every (micro-batch, TP) pair; returns the CSV files written. With ``framework``,
    megatron-core's whole layer is timed too and its excess over the ops is one more row; with
    ``tempo`` also, the layer with Tempo's ops (tempo.megatron) and its excess over the plain layer
    (what pricing a Tempo plan adds). With ``vocab``, the embedding, final norm and post-process
    rows too (``megatron_edge_rows``). The profile is marked complete at the end (profile.json)
    unless ``complete`` is False: its caller writes more benchmarks into ``out`` and marks it
    (``profile_data.mark_profile_complete``) once they are all written.

    On a CPU the ops run on ``cpu_threads`` threads: the device a plan's rank gets. Each rank of
    ``mist.engine.run`` runs one (torchrun with OMP_NUM_THREADS=1, ``measure.launch``), so a
    profile on every core would time a faster device than the one the plan runs on. For the same
    reason ``concurrent`` copies of the profile run at once on a CPU (the ranks of a plan that
    share the machine's cores, caches and memory); this process's copy is the one written.

    Each (TP, micro-batch) point's times are the medians over ``rounds`` passes over every point:
    a CPU's speed drifts over seconds on a shared machine (the same layer measured 112-132 ms in
    three back-to-back profiles here), and a pass spreads each point's repeats over the others'
    time, so one slow stretch moves one pass of a point, not the point."""
    if cpu_threads < 1 or concurrent < 1 or rounds < 1:
        raise ValueError(
            f"cpu_threads, concurrent and rounds must be >= 1, got {cpu_threads}, {concurrent}, {rounds}"
        )
    if tempo and not framework:
        raise ValueError("tempo: Tempo's excess is over megatron-core's whole layer; it needs framework")
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(cpu_threads)
    try:
        job = ProfileJob(
            device=device,
            hidden=hidden,
            heads=heads,
            seq=seq,
            micro_batches=tuple(micro_batches),
            tps=tuple(tps),
            dtype=dtype,
            gpu=gpu,
            repeats=repeats,
            framework=framework,
            tempo=tempo,
            threads=cpu_threads if device == "cpu" else None,
            vocab=vocab,
            rounds=rounds,
        )
        written = _write_beside_copies(out, job, progress, concurrent - 1 if device == "cpu" else 0)
        if complete:
            mark_profile_complete(out)
        return written
    finally:
        torch.set_num_threads(before)


def _write_beside_copies(
    out: Path, job: ProfileJob, progress: Callable[[str], None] | None, copies: int
) -> list[Path]:
    """``_write_profiles`` into ``out`` while ``copies`` copies of it run in lockstep beside it
    (none: alone), then the copies ended."""
    # the copies' throw-away profiles: this process's folder, removed once they are ended (a
    # copy's own would be left when it is terminated or killed with this process)
    with tempfile.TemporaryDirectory(prefix="profile_copies_") as scratch:
        running, lockstep = _start_copies(copies, job, Path(scratch)) if copies else ([], None)
        try:
            return _write_profiles(out, job, progress, lockstep)
        finally:
            for copy in running:  # they only kept this one company
                copy.terminate()
                copy.join(timeout=30)


def _profile_copy(parent: int, job: ProfileJob, started, scratch: Path, lockstep) -> None:
    """A copy of the profile that only keeps the measured one company (its results dropped into
    ``scratch``, which the measured one made and removes), point by point in ``lockstep``."""
    from measure.parallel import die_with_parent, no_tqdm_semaphore

    die_with_parent(parent)
    no_tqdm_semaphore()  # it compiles Tempo's ops (a tqdm bar) and ends by SIGTERM
    torch.set_num_threads(job.threads or 1)
    started.set()  # imports done: from here on it competes for the cores
    while True:  # until the measured copy is done and terminates this one
        _write_profiles(scratch, job, None, lockstep)


COPY_START_TIMEOUT_S = 120  # a copy's start: a fresh interpreter importing torch and megatron-core


def _start_copies(n: int, job: ProfileJob, scratch: Path) -> tuple[list, object]:
    """``n`` running copies of the profile, each writing under ``scratch``, and the barrier that
    keeps them and the measured one in lockstep (``_write_layer_profiles``); returns once each has
    started (or raises)."""
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    events = [ctx.Event() for _ in range(n)]
    lockstep = ctx.Barrier(n + 1)
    copies = [
        ctx.Process(
            target=_profile_copy, args=(os.getpid(), job, e, scratch / f"copy{i}", lockstep), daemon=True
        )
        for i, e in enumerate(events)
    ]
    for copy in copies:
        copy.start()
    deadline = time.monotonic() + COPY_START_TIMEOUT_S
    for copy, event in zip(copies, events, strict=True):
        if not event.wait(max(deadline - time.monotonic(), 0.0)):
            for c in copies:
                c.terminate()
            raise RuntimeError(
                f"a concurrent profile copy did not start within {COPY_START_TIMEOUT_S} s "
                f"(exit code {copy.exitcode})"
            )
    return copies, lockstep


def _write_profiles(
    out: Path, job: ProfileJob, progress: Callable[[str], None] | None, lockstep=None
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "gpu": job.gpu,
        "seq": job.seq,
        "sizes": {job.size: [job.hidden, 1, job.heads]},
        "device": job.device,
        "dtype": str(job.dtype),
        "weight_gradients": True,  # autograd times a linear layer's input and weight gradients together
        "cpu_threads": job.threads,  # None on a GPU
        "complete": False,  # until every benchmark asked for is written (mark_profile_complete)
        **({"vocab": job.vocab} if job.vocab else {}),  # the edge rows' vocabulary
    }
    write_json_atomic(out / "profile.json", meta)  # whole or not at all: a torn one reads as no profile
    from .. import cpu_shim

    with cpu_shim.gpu_standins():  # the ops as the engine runs them (a no-op on a GPU)
        return _write_layer_profiles(out, job, progress, lockstep)


def _point_rows(job: ProfileJob, tp: int, b: int) -> list[dict]:
    """One (TP, micro-batch) point's rows: the layer's ops, the framework's excess, Tempo's, the edges."""
    shape = (b, job.seq, job.hidden, job.heads)
    rows = profile_layer(*shape, tp, job.dtype, job.device, job.repeats)
    if job.framework:
        whole = megatron_layer_seconds(*shape, tp, job.dtype, job.device, job.repeats)
        ops = [sum(r[k] for r in rows) * 1e-6 for k in ("forward-compute", "backward-compute")]
        rows.append(
            {
                **dict.fromkeys(rows[0], 0.0),
                "op_name": FRAMEWORK_OP,
                "forward-compute": max(whole[0] - ops[0], 0.0) * 1e6,
                "backward-compute": max(whole[1] - ops[1], 0.0) * 1e6,
            }
        )
        add = grad_accumulation_seconds(job.hidden, job.heads, tp, job.dtype, job.device, job.repeats) * 1e6
        rows.append(
            {
                **dict.fromkeys(rows[0], 0.0),
                "op_name": GRAD_ACCUMULATE_OP,
                "forward-compute": add,
                "backward-compute": add,
            }
        )
    if job.tempo:  # a negative excess (Tempo's forward saves less) is priced as none, as the framework's
        lean = megatron_layer_seconds(*shape, tp, job.dtype, job.device, job.repeats, tempo=True)
        ffn = gated_layer(ModelSpec("profiled", job.hidden, 1, job.heads, seq=job.seq)).ffn_hidden
        llama = [
            megatron_layer_seconds(*shape, tp, job.dtype, job.device, job.repeats, tempo=t, gated_ffn=ffn)
            for t in (False, True)
        ]
        for name, plain, with_tempo in ((TEMPO_OP, whole, lean), (TEMPO_GATED_OP, *llama)):
            rows.append(
                {
                    **dict.fromkeys(rows[0], 0.0),
                    "op_name": name,
                    "forward-compute": max(with_tempo[0] - plain[0], 0.0) * 1e6,
                    "backward-compute": max(with_tempo[1] - plain[1], 0.0) * 1e6,
                }
            )
        rows.append(
            {
                **dict.fromkeys(rows[0], 0.0),
                "op_name": GATED_LAYER_OP,
                "forward-compute": llama[0][0] * 1e6,
                "backward-compute": llama[0][1] * 1e6,
            }
        )
    if job.vocab:
        rows += megatron_edge_rows(*shape, job.vocab, tp, job.dtype, job.device, job.repeats)
    return rows


def _median_passes(passes: list[list[dict]]) -> list[dict]:
    """Rows measured in several passes: each row's sizes and the median of each of its times."""
    timed = ("forward-compute", "backward-compute")
    return [
        {k: statistics.median(r[k] for r in rows) if k in timed else v for k, v in rows[0].items()}
        for rows in zip(*passes, strict=True)
    ]


# The longest a profile copy waits for the others at a point: a point of the largest CPU profile
# here takes seconds; a copy that has stopped must not hold the measured one for ever
LOCKSTEP_TIMEOUT_S = 300.0


def _write_layer_profiles(
    out: Path, job: ProfileJob, progress: Callable[[str], None] | None, lockstep=None
) -> list[Path]:
    """Every point's rows, ``job.rounds`` passes, each point the median of its passes; written as
    the artifact's CSVs. With ``lockstep`` (concurrent copies on a CPU, ``write_profiles``) every
    copy starts each point together, so the ops timed meet the same ops in the other copies, as
    ranks computing the same micro-batch do. Unaligned, a copy's heavy op could meet the other's
    light one or its Python between points; the 2-process CPU fit so made priced the engine's
    micro-batches 7-14% under what they measured (mist_vs_megatron's engine part at 9b4a957).
    Two runs in lockstep measured them 1-8% and 10-18% under: whether it closes that gap is not
    shown (docs/claims.md); it is kept for being how ranks run."""
    for tp in job.tps:
        if job.heads % tp:
            raise ValueError(f"tp {tp} does not divide heads {job.heads}")
    points = [(tp, b) for tp in job.tps for b in job.micro_batches]
    passes: dict[tuple[int, int], list[list[dict]]] = {point: [] for point in points}
    for k in range(job.rounds):
        for tp, b in points:
            if lockstep is not None:
                try:
                    lockstep.wait(LOCKSTEP_TIMEOUT_S)
                except threading.BrokenBarrierError:
                    raise RuntimeError(
                        f"a concurrent profile copy did not reach point (tp {tp}, micro-batch {b}) within "
                        f"{LOCKSTEP_TIMEOUT_S:g} s of this one"
                    ) from None
            rows = _point_rows(job, tp, b)
            passes[tp, b].append(rows)
            if progress:
                layer_ms = sum(r["forward-compute"] + r["backward-compute"] for r in rows) / 1e3
                of = f" (pass {k + 1} of {job.rounds})" if job.rounds > 1 else ""
                progress(f"tp {tp} micro-batch {b}: {layer_ms:.2f} ms a layer{of}")
    written = []
    for (tp, b), measured in passes.items():
        rows = _median_passes(measured)
        path = out / f"gpt_{job.size}_mbs{b}_tp{tp}_algo0.csv"
        # whole or not at all: a kill mid-write leaves the file it replaces, never half of one
        with atomic_path(path) as tmp, tmp.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
        written.append(path)
    return written
