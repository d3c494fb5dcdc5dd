"""Tensor parallelism as the engine runs it: megatron-core's layer split over the processes."""

from __future__ import annotations

from pathlib import Path

import torch

from ...model.runtime import TP_LAYER, TP_LAYER_FORWARD
from .megatron_layer import engine_layer, layer_inputs, megatron_state
from .ranks import init_rank, interleaved_seconds_all_ranks, median_rows, run_ranks, write_line_csv


def _tp_worker(
    rank: int, n: int, port: int, device: str, shapes: list, dtype, repeats: int, rounds: int, out
) -> None:
    """One rank of ``profile_tp_layers``: per shape, megatron-core's layer split over the ``n``
    ranks (its own tensor parallelism) and one rank's share of it built alone, timed forward
    alone and forward + backward, interleaved, all ranks at once."""
    import torch.distributed as dist

    dev = init_rank(rank, n, port, device)

    calls = {}
    try:
        for split in (False, True):  # one rank's share under TP 1, then the whole layer under TP n
            with megatron_state(tp=n if split else 1):
                for shape in shapes:
                    b, s, h, heads = shape
                    # megatron splits a TP-n layer's heads itself; a layer keeps the groups of
                    # the state it is built in
                    torch.manual_seed(0)
                    module = engine_layer(h, heads, 1 if split else n, dtype, dev)  # split by megatron-core
                    x, mask, grad = layer_inputs(b, s, h, dtype, dev)

                    def forward(module=module, x=x, mask=mask) -> torch.Tensor:
                        y = module(x, attention_mask=mask)
                        return y[0] if isinstance(y, tuple) else y

                    def both(module=module, forward=forward, grad=grad) -> None:
                        forward().backward(grad)
                        module.zero_grad(set_to_none=True)  # every call as the first (as ZeRO's)

                    calls["forward", shape, split] = forward
                    calls["both", shape, split] = both
                if split:  # timed while TP n is the state (dropout's RNG tracker needs one)
                    seconds = interleaved_seconds_all_ranks(calls, repeats, rounds, dev)
    finally:
        dist.destroy_process_group()
    if rank == 0:  # by one all-reduce's bytes: the layer's [s, b, h] output in the layer's dtype
        item = torch.empty((), dtype=dtype).element_size()
        added = {
            (part, shape): seconds[part, shape, True] - seconds[part, shape, False]
            for part, shape, _ in calls
        }
        out.put(
            [
                (b * s * h * item, added["forward", shape], added["both", shape])
                for shape in shapes
                for b, s, h, _ in [shape]
            ]
        )


def profile_tp_layers(
    n: int,
    device: str,
    hidden: int,
    heads: int,
    seq: int,
    micro_batches: list[int],
    dtype: torch.dtype,
    repeats: int = 5,
    rounds: int = 10,
    launches: int = 1,
) -> list[tuple[float, float, float]]:
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
    return median_rows(run_ranks(_tp_worker, n, (device, shapes, dtype, repeats, rounds), launches))


def write_tp_layers(out: Path, n: int, device: str, *args, **kwargs) -> list[Path]:
    """``profile_tp_layers`` into ``out`` as two collectives' files (one all-reduce's bytes as the
    size): what TP adds to forward + backward, and to the forward alone."""
    rows = profile_tp_layers(n, device, *args, **kwargs)
    return [
        write_line_csv(out / f"prim_gpt_local_{TP_LAYER}_{n}gpus.csv", [(b, both) for b, _, both in rows]),
        write_line_csv(out / f"prim_gpt_local_{TP_LAYER_FORWARD}_{n}gpus.csv", [(b, f) for b, f, _ in rows]),
    ]
