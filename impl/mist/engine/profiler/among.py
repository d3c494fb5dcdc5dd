"""Every benchmark among ``n`` processes, in the order `mist profile --collectives` and the Mist
artifact's CPU fit run them: the collectives, the engine's step collectives (its gradient sum and
weight sync), ZeRO-2 and ZeRO-3 on the layer, tensor parallelism on the layer. One home, so a
profile a user makes and the fit the artifact makes measure the same things the same way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .collectives import write_collectives
from .tp_layers import write_tp_layers
from .zero_layers import write_zero_layers
from .zero_sync import sizes_for_layer, write_zero_sync

if TYPE_CHECKING:
    import torch


def write_rank_benchmarks(
    out: Path,
    n: int,
    device: str,
    hidden: int,
    heads: int,
    seq: int,
    micro_batches: list[int],
    dtype: torch.dtype,
    zero_micro_batch: int,
    repeats: int = 10,
    rounds: int = 5,
    launches: int = 1,
    progress: Callable[[str], None] | None = None,
    every: bool = False,
) -> list[Path]:
    """Benchmark among ``n`` local processes into ``out`` (the artifact's collectives files) and
    return the files written. ``repeats`` calls a window, the median of ``rounds`` interleaved
    windows, then of ``launches`` launches, for the collectives and the engine's step collectives
    (the layer mechanisms keep their own windows: a layer is milliseconds, a small message
    microseconds). ZeRO-2/3 run on the layer at ``zero_micro_batch`` where its heads split in two
    (the benchmark also times one TP-2 rank's share); TP where ``n`` divides the heads and there
    are two micro-batches or more (a line is fitted across them); elsewhere they are left out (the
    model then prices them from the collectives), or with ``every`` refused before any benchmark."""
    zero_layers, tp_layers = heads % 2 == 0, heads % n == 0 and len(set(micro_batches)) >= 2
    if every and not (zero_layers and tp_layers):
        raise ValueError(
            f"the engine's ZeRO-2/3 and TP benchmarks need heads even and divisible by {n} and two "
            f"micro-batches or more; got {heads} heads, micro-batches {micro_batches}"
        )
    say = progress or (lambda _line: None)
    timing = {"repeats": repeats, "rounds": rounds, "launches": launches}
    written = write_collectives(out, n, device, **timing)
    say(f"collectives among {n} processes: {len(written)} files")
    written += write_zero_sync(out, n, device, sizes_for_layer(hidden), **timing)
    say(f"the engine's gradient sum (ZeRO-0/1) and weight sync (ZeRO-1/2) among {n} processes")
    if zero_layers:
        for stage in (2, 3):
            layer = (hidden, heads, seq, zero_micro_batch, dtype)
            written.append(write_zero_layers(stage, out, n, device, *layer, launches=launches))
        say(f"ZeRO-2 and ZeRO-3 on the layer among {n} processes")
    if tp_layers:
        layer = (hidden, heads, seq, micro_batches, dtype)
        written += write_tp_layers(out, n, device, *layer, launches=launches)
        say(f"tensor parallelism on the layer over {n} processes")
    return written
