"""``mist profile``: measure one GPT-3-style layer op by op on this machine's device.

Writes a profile directory in the Mist artifact's format (see model/profile_data.py), so ``mist
calibrate`` fits a runtime model for this device exactly as for the shipped GPU data:

    python -m mist profile --out profiles/mygpu --device cuda --hidden 2048 --heads 16 --seq 2048 \
        --micro-batches 1 2 4 --tp 1 2

TP is emulated on one device by giving the layer one rank's share (heads / t of the model's head
size, ffn / t); its collectives are not included (they come from the collective benchmarks).
Every op is timed in isolation, forward and backward, on fresh random inputs, median of several
repeats. Then megatron-core's own layer (the one mist.engine.run trains) is timed whole, and what it
costs beyond the sum of its ops (framework overhead) is written as one more row.

``--collectives 2 4`` also benchmarks all-reduce, all-gather and reduce-scatter among that many
local processes (gloo on a CPU, NCCL on GPUs), written as the artifact's ``prim_gpt_*`` files,
so collectives are priced by this machine's measured lines rather than the preset's link, and
three mechanisms as the engine runs them, on whole layers: ZeRO-2 (its reductions of each
layer's gradients to the layer's owner, ``prim_gpt_local_grad_shard_layer_*``) and ZeRO-3 (FSDP2,
``prim_gpt_local_fsdp_layer_*``) at two sizes, and tensor parallelism (megatron-core's layer split
over the processes, per micro-batch, ``prim_gpt_local_tp_layer[_forward]_*``), which price such a
layer by what it measurably adds rather than by its collectives timed back to back. Every such
point is the median of interleaved rounds (on a CPU gloo's latency drifts between modes over
seconds), and with ``launches`` of several launches (it settles into a mode for a launch's life).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import torch
from torch import nn

from measure.launch import HOST, serve_rendezvous
from measure.timing import time_fn
from measure.units import MiB

from ..model.profile_data import EMBEDDING_OP, FINAL_NORM_OP, FRAMEWORK_OP, HEAD_OP
from ..model.runtime import TP_LAYER, TP_LAYER_FORWARD, ZERO2_LAYER, ZERO3_LAYER


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


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def _pipeline_message(tensor: torch.Tensor, rank: int, n: int) -> None:
    """One pipeline message: even ranks send the tensor to the next (odd) rank, which receives it."""
    import torch.distributed as dist

    if rank % 2 == 0 and rank + 1 < n:
        dist.send(tensor, rank + 1)
    elif rank % 2 == 1:
        dist.recv(tensor, rank - 1)


def _window_seconds_all_ranks(call: Callable[[], object], repeats: int, dev: torch.device) -> float:
    """Mean seconds of ``repeats`` back-to-back calls started together on every rank (a barrier
    first); the slowest rank's, which is what finishes a collective step."""
    import torch.distributed as dist

    cuda = dev.type == "cuda"
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    if cuda:
        torch.cuda.synchronize()
    mean = torch.tensor([(time.perf_counter() - t0) / repeats], dtype=torch.float64, device=dev)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return float(mean)


def _interleaved_seconds_all_ranks(
    calls: dict[Hashable, Callable[[], object]], repeats: int, rounds: int, dev: torch.device
) -> dict[Hashable, float]:
    """{key: seconds} of each of ``calls`` ({key: call}): per round, one window of ``repeats``
    back-to-back calls of each in turn (``_window_seconds_all_ranks``); the median window over
    ``rounds``. On a CPU gloo's latency drifts between modes (~0.3 to ~4 ms a call) over seconds:
    one window per point would catch one mode, and comparing two points (sharded against plain,
    one size against another) would compare two modes; interleaved rounds see the same drift."""
    for call in calls.values():  # warm-up (connections, NCCL communicators, FSDP2's lazy init)
        call(), call()
    windows: dict = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            windows[key].append(_window_seconds_all_ranks(call, repeats, dev))
    return {key: statistics.median(w) for key, w in windows.items()}


# What a benchmark rank imports before it runs: its ranks are forked from one server process that
# imported these once (multiprocessing's forkserver), not started as fresh interpreters (~5 s a
# launch of 2 ranks on 2 cores, twelve launches a 2-process fit). The server has only imported
# (no threads, no torch ops), as fork_launch's; it exits once this process and its ranks have.
_RANK_PRELOAD = ["torch.distributed", "torch.distributed.fsdp", "megatron.core.models.gpt.gpt_layer_specs",
                 "megatron.core.transformer.spec_utils", "mist.engine.profiler"]  # fmt: skip


def _rank_main(rank: int, launcher: int, worker: Callable, *args) -> None:
    """A benchmark rank: dies with the server that forked it and with ``launcher``, the process
    that launched it (the server outlives ``launcher`` while its ranks live: they hold its
    liveness pipe), then ``worker(rank, *args)``."""
    from measure.parallel import die_with_launcher

    die_with_launcher(launcher)
    worker(rank, *args)


def _run_ranks(worker: Callable, n: int, args: tuple, launches: int) -> list:
    """Rank 0's result of ``worker(rank, n, port, *args, out)`` on ``n`` forked processes, for
    each of ``launches`` launches (a fresh process group each, joining a store this process serves
    on ``port``: measure.launch). On a CPU gloo's latency settles
    into a mode for a launch's whole life (the same all-reduce: ~0.4 ms a call in one launch,
    ~1.7 ms in the next), so a benchmark point is the median over launches."""
    import torch.multiprocessing as mp

    if launches < 1:
        raise ValueError(f"launches must be at least 1, got {launches}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)  # read when the server starts (the first launch)
    results = []
    for _ in range(launches):
        out, store = ctx.SimpleQueue(), serve_rendezvous()
        ranks = mp.start_processes(_rank_main, (os.getpid(), worker, n, store.port, *args, out), nprocs=n,
                                   join=False, start_method="forkserver")  # fmt: skip
        try:
            while not ranks.join():
                pass
        except BaseException:  # a failed rank, or this run interrupted: the others go now, not at exit
            for rank in ranks.processes:
                rank.kill()
            raise
        results.append(out.get())
        del store
    return results


def _median_rows(launches: list[list[tuple]]) -> list[tuple]:
    """Rows (size, seconds, ...) measured in several launches: each row's size and the median of
    each of its times."""
    return [
        (rows[0][0], *(statistics.median(times) for times in list(zip(*rows, strict=True))[1:]))
        for rows in zip(*launches, strict=True)
    ]


def _init_rank(rank: int, n: int, port: int, device: str) -> torch.device:
    """Join a benchmark's ``n``-process group as ``rank`` (NCCL on GPUs, gloo on a CPU) set up as a
    rank of mist.engine.run: its own GPU, or one thread (measure.launch); the device to use. The
    group's store is the launcher's, served on ``port``."""
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, n, is_master=False)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=n)
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def _collective_worker(
    rank: int, n: int, port: int, device: str, sizes: list[int], repeats: int, rounds: int, out
) -> None:
    import torch.distributed as dist

    dev = _init_rank(rank, n, port, device)
    calls = {}
    try:
        for nbytes in sizes:
            # data_size is the full tensor (all-reduce's, all-gather's output, reduce-scatter's input),
            # as in the artifact's files and RuntimeModel.collective
            full = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
            shard = torch.empty(nbytes // 2 // n, dtype=torch.bfloat16, device=dev)
            calls[("all_reduce", nbytes)] = lambda full=full: dist.all_reduce(full)
            calls[("all_gather", nbytes)] = lambda full=full, shard=shard: dist.all_gather_single(full, shard)
            calls[("reduce_scatter", nbytes)] = lambda f=full, sh=shard: dist.reduce_scatter_single(sh, f)
            calls[("send_recv", nbytes)] = lambda full=full: _pipeline_message(full, rank, n)
        # back-to-back calls, averaged (as nccl-tests): one rank's late start is spread thin
        seconds = _interleaved_seconds_all_ranks(calls, repeats, rounds, dev)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out.put({c: [(b, sec) for (name, b), sec in seconds.items() if name == c] for c in COLLECTIVES})


def profile_collectives(
    n: int,
    device: str,
    sizes: list[int] | None = None,
    repeats: int = 10,
    rounds: int = 5,
    launches: int = 1,
) -> dict[str, list[tuple[float, float]]]:
    """Seconds of each collective among ``n`` local processes, {name: [(bytes, seconds)]}: the
    median over ``rounds`` of a window of ``repeats`` calls, every point's window in each round,
    and over ``launches`` (``_run_ranks``)."""

    if n < 2:
        raise ValueError(f"collectives need at least 2 processes, got {n}")
    if device.startswith("cuda") and n > torch.cuda.device_count():
        raise ValueError(f"{n} processes need {n} GPUs; this machine has {torch.cuda.device_count()}")
    if sizes is None:  # small messages on a CPU, Megatron-sized ones on GPUs
        sizes = [2**k for k in (range(20, 29, 2) if device.startswith("cuda") else range(12, 23, 2))]
    results = _run_ranks(_collective_worker, n, (device, sizes, repeats, rounds), launches)
    return {name: _median_rows([r[name] for r in results]) for name in results[0]}


def write_collectives(
    out: Path, n: int, device: str, repeats: int = 10, rounds: int = 5, launches: int = 1
) -> list[Path]:
    """Benchmark the collectives among ``n`` processes into ``out`` (the artifact's CSV format)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, rows in profile_collectives(
        n, device, repeats=repeats, rounds=rounds, launches=launches
    ).items():
        if name == "send_recv":  # a message between two processes, whatever n: the artifact's p2p file
            sizes = ",".join(f"{b / MiB:.6f}" for b, _ in rows)
            rates = ",".join(f"{b / sec / 1e9:.6f}" for b, sec in rows)
            path = out / "p2p_intra_node.csv"
            path.write_text(f"{sizes}\n{rates}\n")
            written.append(path)
            continue
        written.append(_write_line_csv(out / f"prim_gpt_local_{name}_{n}gpus.csv", rows))
    return written


def _layer_inputs(
    b: int, s: int, h: int, dtype: torch.dtype, dev: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """A megatron-core layer's input ([s, b, h], megatron's order), causal mask and output gradient."""
    x = torch.randn(s, b, h, dtype=dtype, device=dev, requires_grad=True)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=dev).tril().logical_not()
    return x, mask, torch.randn(s, b, h, dtype=dtype, device=dev)


class _Layers(nn.Module):
    """The layers of a ZeRO benchmark in sequence, as one module: FSDP2's root in the ZeRO-3 one. In
    the engine the root is the whole model (it holds the embedding and the head), and only a layer
    that is not the root frees its gathered weights after forward and gathers them again for
    backward."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask)
            x = x[0] if isinstance(x, tuple) else x
        return x


def _zero_worker(
    rank: int, n: int, port: int, device: str, stage: int, shapes: list, dtype, repeats: int, rounds: int,
    out,
) -> None:  # fmt: skip
    """One rank of ``profile_zero_layers``: per shape, megatron-core's layers timed forward +
    backward plain and sharded as mist.engine.run shards them, interleaved, all ranks at once."""
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from .zero import ShardedMasterAdamW

    dev = _init_rank(rank, n, port, device)
    # ZeRO-2 reduces each layer's gradients to the layer's owner: n layers, one owned by each rank
    # (as the engine's equal layers are shared out); ZeRO-3 is the same on every layer: one
    count = n if stage == 2 else 1
    calls, weight_bytes = {}, {}
    try:
        with _megatron_state():  # DP = n: the group is this one
            mesh = DeviceMesh.from_group(dist.group.WORLD, dev.type)
            for shape in shapes:
                b, s, h, heads, tp = shape
                config = _megatron_config(h, heads, tp, dtype)
                for sharded in (False, True):
                    torch.manual_seed(0)
                    layers = [
                        build_module(get_gpt_layer_local_spec(), config=config, layer_number=i + 1).to(
                            dev, dtype
                        )
                        for i in range(count)
                    ]  # every parameter in them in the layer's dtype, as megatron's Float16Module
                    weight_bytes[shape] = sum(p.numel() * p.element_size() for p in layers[0].parameters())
                    module, optimizer = _Layers(layers), None
                    if sharded and stage == 3:  # as shard_parameters: each layer, then the root
                        for layer in layers:
                            fully_shard(layer, mesh=mesh)
                        fully_shard(module, mesh=mesh)
                    if sharded and stage == 2:  # the engine's optimizer: its backward hooks reduce
                        buckets = [list(layer.parameters()) for layer in layers]  # as layer_buckets
                        optimizer = ShardedMasterAdamW(buckets, dist.group.WORLD, 1e-3, shard_grads=True)
                    x, mask, grad = _layer_inputs(b, s, h, dtype, dev)

                    def step(module=module, optimizer=optimizer, x=x, mask=mask, grad=grad):
                        module(x, attention_mask=mask).backward(grad)
                        # every micro-batch as the first: accumulating into earlier gradients is
                        # priced apart (stage_cost's gradient accumulation), for either variant
                        module.zero_grad(set_to_none=True)
                        if optimizer is not None:
                            optimizer.reduced.clear()

                    calls[shape, sharded] = step
            seconds = _interleaved_seconds_all_ranks(calls, repeats, rounds, dev)
    finally:
        dist.destroy_process_group()
    if rank == 0:  # a layer's share of what sharding added
        out.put([(weight_bytes[sh], (seconds[sh, True] - seconds[sh, False]) / count) for sh in shapes])


def profile_zero_layers(
    stage: int, n: int, device: str, hidden: int, heads: int, seq: int, micro_batch: int, dtype: torch.dtype,
    repeats: int = 5, rounds: int = 10, launches: int = 1,
) -> list[tuple[float, float]]:  # fmt: skip
    """What ZeRO ``stage`` (2 or 3) adds to one layer's forward + backward among ``n`` processes,
    as mist.engine.run runs it: [(the layer's full weight bytes, seconds)] for the layer and for
    one TP-2 rank's share of it (two sizes: a line can be fitted), the median over ``launches``.
    A micro-benchmark of the mechanism, like the collectives', that prices what they miss (the
    copies, hooks, and waits for the other ranks inside backward):

    * ZeRO-3: FSDP2 over the data-parallel group, the layer not its root: the weights gathered
      for forward and again for backward, the gradients reduce-scattered, its copies in and out
      (on this project's 2-core CPU about twice the raw collectives it issues);
    * ZeRO-2: the engine's ShardedMasterAdamW, whose backward hooks reduce each layer's gradients
      to the layer's owner in one message as backward makes them, blocking."""
    if stage not in (2, 3):
        raise ValueError(f"the ZeRO layer benchmark is for stages 2 and 3, got {stage}")
    if n < 2:
        raise ValueError(f"ZeRO-{stage} needs at least 2 processes, got {n}")
    if heads % 2:
        raise ValueError(f"the ZeRO-{stage} benchmark halves the layer (heads / 2): heads {heads} is odd")
    if device.startswith("cuda") and n > torch.cuda.device_count():
        raise ValueError(f"{n} processes need {n} GPUs; this machine has {torch.cuda.device_count()}")
    shapes = [(micro_batch, seq, hidden, heads, tp) for tp in (1, 2)]
    return _median_rows(
        _run_ranks(_zero_worker, n, (device, stage, shapes, dtype, repeats, rounds), launches)
    )


def write_zero_layers(stage: int, out: Path, n: int, device: str, *args, **kwargs) -> Path:
    """``profile_zero_layers`` into ``out`` as a collective's file (the layer's weights as the size)."""
    rows = profile_zero_layers(stage, n, device, *args, **kwargs)  # refuses stages other than 2 and 3
    name = {2: ZERO2_LAYER, 3: ZERO3_LAYER}[stage]
    return _write_line_csv(out / f"prim_gpt_local_{name}_{n}gpus.csv", rows)


def _tp_worker(rank: int, n: int, port: int, device: str, shapes: list, dtype, repeats: int, rounds: int,
               out) -> None:  # fmt: skip
    """One rank of ``profile_tp_layers``: per shape, megatron-core's layer split over the ``n``
    ranks (its own tensor parallelism) and one rank's share of it built alone, timed forward
    alone and forward + backward, interleaved, all ranks at once."""
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    dev = _init_rank(rank, n, port, device)

    calls = {}
    try:
        for split in (False, True):  # one rank's share under TP 1, then the whole layer under TP n
            with _megatron_state(tp=n if split else 1):
                for shape in shapes:
                    b, s, h, heads = shape
                    # megatron splits a TP-n layer's heads itself; a layer keeps the groups of
                    # the state it is built in
                    torch.manual_seed(0)
                    config = _megatron_config(h, heads, 1 if split else n, dtype)
                    module = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)
                    module = module.to(dev, dtype)
                    x, mask, grad = _layer_inputs(b, s, h, dtype, dev)

                    def forward(module=module, x=x, mask=mask) -> torch.Tensor:
                        y = module(x, attention_mask=mask)
                        return y[0] if isinstance(y, tuple) else y

                    def both(module=module, forward=forward, grad=grad) -> None:
                        forward().backward(grad)
                        module.zero_grad(set_to_none=True)  # every call as the first (as ZeRO's)

                    calls["forward", shape, split] = forward
                    calls["both", shape, split] = both
                if split:  # timed while TP n is the state (dropout's RNG tracker needs one)
                    seconds = _interleaved_seconds_all_ranks(calls, repeats, rounds, dev)
    finally:
        dist.destroy_process_group()
    if rank == 0:  # by one all-reduce's bytes: the layer's [s, b, h] output in the layer's dtype
        item = torch.empty((), dtype=dtype).element_size()
        added = {
            (part, shape): seconds[part, shape, True] - seconds[part, shape, False]
            for part, shape, _ in calls
        }
        out.put([(b * s * h * item, added["forward", shape], added["both", shape])
                 for shape in shapes for b, s, h, _ in [shape]])  # fmt: skip


def profile_tp_layers(
    n: int, device: str, hidden: int, heads: int, seq: int, micro_batches: list[int], dtype: torch.dtype,
    repeats: int = 5, rounds: int = 10, launches: int = 1,
) -> list[tuple[float, float, float]]:  # fmt: skip
    """What tensor parallelism over ``n`` processes adds to one layer as mist.engine.run runs it
    (megatron-core's layer split over the ranks, against one rank's share built alone and timed
    at the same time): [(bytes of one of its all-reduces, seconds added to the forward, to
    forward + backward)] per micro-batch (at least two: a line is fitted), the median over
    ``launches``. A micro-benchmark of the mechanism, like ZeRO's: the two all-reduces each way
    with the waits between the ranks' compute, which back-to-back collectives do not have (on
    this project's 2-core CPU four of them cost less inside the layer than back to back); the
    forward's part apart, because recomputation repeats it and backward's all-reduces can
    overlap the weight gradients."""
    if n < 2:
        raise ValueError(f"tensor parallelism needs at least 2 processes, got {n}")
    if heads % n:
        raise ValueError(
            f"the TP benchmark splits the heads over {n} processes: heads {heads} is not a multiple"
        )
    if len(set(micro_batches)) < 2:
        got = sorted(set(micro_batches))
        raise ValueError(f"the TP benchmark fits a line over micro-batches: needs two or more, got {got}")
    if device.startswith("cuda") and n > torch.cuda.device_count():
        raise ValueError(f"{n} processes need {n} GPUs; this machine has {torch.cuda.device_count()}")
    shapes = [(b, seq, hidden, heads) for b in sorted(set(micro_batches))]
    return _median_rows(_run_ranks(_tp_worker, n, (device, shapes, dtype, repeats, rounds), launches))


def write_tp_layers(out: Path, n: int, device: str, *args, **kwargs) -> list[Path]:
    """``profile_tp_layers`` into ``out`` as two collectives' files (one all-reduce's bytes as the
    size): what TP adds to forward + backward, and to the forward alone."""
    rows = profile_tp_layers(n, device, *args, **kwargs)
    return [
        _write_line_csv(out / f"prim_gpt_local_{TP_LAYER}_{n}gpus.csv", [(b, both) for b, _, both in rows]),
        _write_line_csv(out / f"prim_gpt_local_{TP_LAYER_FORWARD}_{n}gpus.csv", [(b, f) for b, f, _ in rows]),
    ]


def _write_line_csv(path: Path, rows: list[tuple[float, float]]) -> Path:
    """(bytes, seconds) rows in the artifact's collective file format (a negative difference of two
    timings is written as 0)."""
    lines = ["data_size(MB),time(ms)"] + [f"{b / MiB:.6f},{max(sec, 0.0) * 1e3:.4f}" for b, sec in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def _megatron_state(tp: int = 1):
    """megatron-core's parallel state (TP ``tp``; its modules need one), on a one-process group
    where none is initialised, torn down after; an existing group or state is used as it is."""
    import torch.distributed as dist

    from . import cpu_shim

    cpu_shim.install()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    own_state = not ps.model_parallel_is_initialized()
    try:
        if own_state:
            ps.initialize_model_parallel(tp, 1)
            model_parallel_cuda_manual_seed(0)
        with cpu_shim.bf16_gemms_in_float32():  # as the engine runs them
            yield
    finally:
        if own_state:
            ps.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def _megatron_config(h: int, heads: int, tp: int, dtype: torch.dtype):
    """One TP rank's share of a GPT-3 layer as megatron-core configures it (as mist.engine.run's)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=heads // tp, ffn_hidden_size=4 * h // tp,
        kv_channels=h // heads, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        hidden_dropout=0.1, attention_dropout=0.1,
        attention_softmax_in_fp32=False,  # Megatron-LM's default (mist.engine.megatron.model_settings)
    )  # fmt: skip


def _forward_backward_seconds(forward: Callable, backward_from: Callable, device: str, repeats: int):
    """(forward, backward) seconds: the forward timed alone, the backward as (both) - forward."""

    def both():
        backward_from(forward())

    fwd = time_fn(forward, device, warmup=1, repeats=repeats).median_s
    total = time_fn(both, device, warmup=1, repeats=repeats).median_s
    return fwd, max(total - fwd, 0.0)


def megatron_layer_seconds(
    b: int, s: int, h: int, heads: int, tp: int, dtype: torch.dtype, device: str, repeats: int = 5
) -> tuple[float, float]:
    """(forward, backward) seconds of megatron-core's own GPT layer (local spec, the layer
    mist.engine.run trains) at one rank's share; timed like the ops, so the difference is the framework."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    with _megatron_state():
        config = _megatron_config(h, heads, tp, dtype)
        layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1).to(device).train()
        x, mask, grad = _layer_inputs(b, s, h, dtype, device)

        def forward():
            out = layer(x, attention_mask=mask)
            return out[0] if isinstance(out, tuple) else out

        return _forward_backward_seconds(forward, lambda y: y.backward(grad), device, repeats)


def megatron_edge_rows(
    b: int, s: int, h: int, heads: int, vocab: int, tp: int, dtype: torch.dtype, device: str, repeats: int = 5
) -> list[dict]:
    """The rows outside the layer, as megatron-core's GPTModel runs them at one rank's share (the
    model mist.engine.run trains, its vocabulary split over ``tp``): the embedding (token and
    position lookup, and the tables' gradients), the final norm, and the post-process (output
    layer, cross-entropy over the vocabulary, the mean the engine backpropagates from). Each is a
    difference of whole one-layer models with and without it, so GPTModel's own work around
    them is counted; the final norm is timed alone and taken out of the post-process."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    if vocab % tp:
        raise ValueError(f"tp {tp} does not divide the vocabulary {vocab}")
    seconds = {}
    with _megatron_state():
        config = _megatron_config(h, heads, tp, dtype)
        tokens = torch.randint(0, vocab // tp, (b, s + 1), device=device)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(s, device=device).expand(b, -1)
        mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).tril().logical_not()
        grad = torch.randn(s, b, h, dtype=dtype, device=device)
        for pre, post in ((False, False), (True, False), (True, True)):
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                             vocab_size=vocab // tp, max_sequence_length=s, pre_process=pre,
                             post_process=post, share_embeddings_and_output_weights=False)  # fmt: skip
            if dtype != torch.float32:  # as mist.engine.run: megatron's wrapper casts inputs and outputs
                model = Float16Module(config, model)
            model = model.to(device).train()
            hidden = torch.randn(s, b, h, dtype=dtype, device=device, requires_grad=True)

            def forward(model=model, pre=pre, post=post, hidden=hidden):
                if not pre:
                    (model.module if hasattr(model, "module") else model).set_input_tensor(hidden)
                out = model(ids, pos, mask, labels=labels if post else None)
                return out.float().mean() if post else out

            seconds[pre, post] = _forward_backward_seconds(
                forward, (lambda y: y.backward()) if post else (lambda y: y.backward(grad)), device, repeats
            )
    norm = nn.LayerNorm(h, device=device, dtype=dtype)
    x = torch.randn(b, s, h, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(b, s, h, dtype=dtype, device=device)
    final_norm = _forward_backward_seconds(lambda: norm(x), lambda y: y.backward(g), device, repeats)

    def row(name: str, fwd: float, bwd: float) -> dict:
        sizes = dict.fromkeys(("input_size", "output_size", "weights", "activations", "fwd_reserved",
                               "bwd_reserved"), 0.0)  # fmt: skip
        return {"op_name": name, "forward-compute": max(fwd, 0.0) * 1e6,
                "backward-compute": max(bwd, 0.0) * 1e6, **sizes}  # fmt: skip

    diff = [a - b for a, b in zip(seconds[True, False], seconds[False, False], strict=True)]
    head = [a - b - n for a, b, n in zip(seconds[True, True], seconds[True, False], final_norm, strict=True)]
    return [row(EMBEDDING_OP, *diff), row(FINAL_NORM_OP, *final_norm), row(HEAD_OP, *head)]


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
) -> list[Path]:
    """Profile every (micro-batch, TP) pair; returns the CSV files written. With ``framework``,
    megatron-core's whole layer is timed too and its excess over the ops is one more row. With
    ``vocab``, the embedding, final norm and post-process rows too (``megatron_edge_rows``).

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
        raise ValueError(f"cpu_threads, concurrent and rounds must be >= 1, got {cpu_threads}, {concurrent}, "
                         f"{rounds}")  # fmt: skip
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(cpu_threads)
    try:
        threads = cpu_threads if device == "cpu" else None
        args = (device, hidden, heads, seq, micro_batches, tps, dtype, gpu, repeats, None, framework, threads,
                vocab, rounds)  # fmt: skip
        copies = _start_copies(concurrent - 1, args) if device == "cpu" else []
        try:
            return _write_profiles(out, *args[:9], progress, *args[10:])
        finally:
            for copy in copies:  # they only kept this one company
                copy.terminate()
                copy.join(timeout=30)
    finally:
        torch.set_num_threads(before)


def _profile_copy(parent: int, threads: int, args: tuple, started) -> None:
    """A copy of the profile that only keeps the measured one company (its results dropped)."""
    import tempfile

    from measure.parallel import die_with_parent

    die_with_parent(parent)
    torch.set_num_threads(threads)
    started.set()  # imports done: from here on it competes for the cores
    with tempfile.TemporaryDirectory() as tmp:
        while True:  # until the measured copy is done and terminates this one
            _write_profiles(Path(tmp), *args)


COPY_START_TIMEOUT_S = 120  # a copy's start: a fresh interpreter importing torch and megatron-core


def _start_copies(n: int, args: tuple) -> list:
    """``n`` running copies of the profile; returns once each has started (or raises)."""
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    events = [ctx.Event() for _ in range(n)]
    copies = [ctx.Process(target=_profile_copy, args=(os.getpid(), args[11] or 1, args, e), daemon=True)
              for e in events]  # fmt: skip
    for copy in copies:
        copy.start()
    deadline = time.monotonic() + COPY_START_TIMEOUT_S
    for copy, event in zip(copies, events, strict=True):
        if not event.wait(max(deadline - time.monotonic(), 0.0)):
            for c in copies:
                c.terminate()
            raise RuntimeError(f"a concurrent profile copy did not start within {COPY_START_TIMEOUT_S} s "
                               f"(exit code {copy.exitcode})")  # fmt: skip
    return copies


def _write_profiles(out, device, hidden, heads, seq, micro_batches, tps, dtype, gpu, repeats, progress,
                    framework, threads, vocab, rounds) -> list[Path]:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    size = f"h{hidden}"
    meta = {
        "gpu": gpu,
        "seq": seq,
        "sizes": {size: [hidden, 1, heads]},
        "device": device,
        "dtype": str(dtype),
        "weight_gradients": True,  # autograd times a linear layer's input and weight gradients together
        "cpu_threads": threads,  # None on a GPU
        **({"vocab": vocab} if vocab else {}),  # the edge rows' vocabulary
    }
    (out / "profile.json").write_text(json.dumps(meta, indent=1))
    from . import cpu_shim

    with cpu_shim.bf16_gemms_in_float32():  # the ops as the engine runs them (a no-op on a GPU)
        return _write_layer_profiles(out, device, hidden, heads, seq, micro_batches, tps, dtype, repeats,
                                     progress, framework, vocab, size, rounds)  # fmt: skip


def _point_rows(b, seq, hidden, heads, tp, dtype, device, repeats, framework, vocab) -> list[dict]:
    """One (TP, micro-batch) point's rows: the layer's ops, the framework's excess, the edges."""
    rows = profile_layer(b, seq, hidden, heads, tp, dtype, device, repeats)
    if framework:
        whole = megatron_layer_seconds(b, seq, hidden, heads, tp, dtype, device, repeats)
        ops = [sum(r[k] for r in rows) * 1e-6 for k in ("forward-compute", "backward-compute")]
        rows.append({**dict.fromkeys(rows[0], 0.0), "op_name": FRAMEWORK_OP,
                     "forward-compute": max(whole[0] - ops[0], 0.0) * 1e6,
                     "backward-compute": max(whole[1] - ops[1], 0.0) * 1e6})  # fmt: skip
    if vocab:
        rows += megatron_edge_rows(b, seq, hidden, heads, vocab, tp, dtype, device, repeats)
    return rows


def _median_passes(passes: list[list[dict]]) -> list[dict]:
    """Rows measured in several passes: each row's sizes and the median of each of its times."""
    timed = ("forward-compute", "backward-compute")
    return [
        {k: statistics.median(r[k] for r in rows) if k in timed else v for k, v in rows[0].items()}
        for rows in zip(*passes, strict=True)
    ]


def _write_layer_profiles(out, device, hidden, heads, seq, micro_batches, tps, dtype, repeats, progress,
                          framework, vocab, size, rounds) -> list[Path]:  # fmt: skip
    for tp in tps:
        if heads % tp:
            raise ValueError(f"tp {tp} does not divide heads {heads}")
    points = [(tp, b) for tp in tps for b in micro_batches]
    passes: dict[tuple[int, int], list[list[dict]]] = {point: [] for point in points}
    for k in range(rounds):
        for tp, b in points:
            rows = _point_rows(b, seq, hidden, heads, tp, dtype, device, repeats, framework, vocab)
            passes[tp, b].append(rows)
            if progress:
                layer_ms = sum(r["forward-compute"] + r["backward-compute"] for r in rows) / 1e3
                of = f" (pass {k + 1} of {rounds})" if rounds > 1 else ""
                progress(f"tp {tp} micro-batch {b}: {layer_ms:.2f} ms a layer{of}")
    written = []
    for (tp, b), measured in passes.items():
        rows = _median_passes(measured)
        path = out / f"gpt_{size}_mbs{b}_tp{tp}_algo0.csv"
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
        written.append(path)
    return written


# What a fused fp32 AdamW step moves per parameter: reads weight, gradient and both moments,
# writes weight and both moments.
ADAM_BYTES_MOVED = 28


def profile_cpu_adam(params: int = 1 << 24, threads: tuple[int, ...] = (1,), repeats: int = 5) -> dict:
    """Measure the host optimizer step mist.engine.run uses when it offloads optimizer state (torch's
    fused CPU AdamW on fp32 master weights): parameters per second with each thread count, median
    of ``repeats`` steps after a warm-up step. What ``model.runtime.cpu_adam_params_per_s`` prices from."""
    from measure.results import cpu_model

    if params < 1 or repeats < 1 or not threads or min(threads) < 1:
        raise ValueError("params, repeats and every thread count must be >= 1")
    before = torch.get_num_threads()
    rates = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            weight = torch.zeros(params, requires_grad=True)
            weight.grad = torch.randn(params)
            opt = torch.optim.AdamW([weight], lr=1e-3, fused=True)
            opt.step()  # allocates the moments
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            rates.append(params / sorted(times)[len(times) // 2])
    finally:
        torch.set_num_threads(before)
    return {
        "optimizer": "torch.optim.AdamW(fused=True), fp32, on the CPU",
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "params": params,
        "threads": list(threads),
        "params_per_s": rates,
        "bytes_moved_per_param": ADAM_BYTES_MOVED,
        "measured": time.strftime("%Y-%m-%d", time.gmtime()),
    }
