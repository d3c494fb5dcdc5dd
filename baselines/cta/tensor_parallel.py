"""Megatron-style tensor parallelism of a chain of GEMMs (Shoeybi et al., 2019).

Layers go in pairs: the first column-parallel (each rank holds N/t columns of W and applies the
activation to its own columns), the second row-parallel (K/t rows; partial sums), then one
all-reduce of the pair's output. An odd last layer is column-parallel followed by an all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ctapipe.reference import activation


def shard_chain(weights: list[torch.Tensor], rank: int, ranks: int) -> list[torch.Tensor]:
    """This rank's shard of every layer: even layers by columns, odd layers by rows."""
    shards = []
    for i, w in enumerate(weights):
        dim = 1 if i % 2 == 0 else 0
        if w.shape[dim] % ranks:
            raise ValueError(f"layer {i}: dimension {dim} ({w.shape[dim]}) must divide by TP size {ranks}")
        shards.append(w.chunk(ranks, dim=dim)[rank].contiguous())
    return shards


def tp_chain(x: torch.Tensor, shards: list[torch.Tensor], acts: list[str], group=None) -> torch.Tensor:
    """Every rank passes the whole input x and gets the whole output."""
    for i, (w, act) in enumerate(zip(shards, acts, strict=True)):
        if i % 2 == 0:
            x = activation(x @ w, act)  # column-parallel: the activation is per column
            if i == len(shards) - 1:  # odd count: gather the last layer's columns
                parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, x.contiguous(), group=group)
                x = torch.cat(parts, dim=1)
        else:
            x = x @ w  # row-parallel: a partial sum of the pair's output
            dist.all_reduce(x, group=group)
            x = activation(x, act)
    return x
