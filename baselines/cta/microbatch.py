"""A chain of GEMMs with one layer per rank, pipelined by row chunks (micro-batching).

Rank r receives a chunk of its input from rank r-1, computes act_r(chunk @ W_r) and sends it on
while it receives the next chunk; ``chunk = M`` is plain back-to-back GEMMs (each rank waits for
the whole previous layer). Smaller chunks overlap more but pay a kernel launch, a message and
a less efficient GEMM per chunk, so the best chunk depends on M: the experiments time every chunk
of ``ctapipe.sim.candidate_chunks``, the rule the latency model prices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ctapipe.reference import activation


def pipelined_chain(
    x: torch.Tensor | None, weight: torch.Tensor, act: str, m: int, chunk: int
) -> torch.Tensor | None:
    """This rank's part; rank 0 passes x [M, K], the last rank returns Y (others None)."""
    if chunk < 1 or m % chunk:
        raise ValueError(f"chunk must divide M={m}, got {chunk}")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    if (rank == 0) != (x is not None):
        raise ValueError("rank 0 takes the chain's input x, the other ranks receive it")
    k, n = weight.shape
    out = torch.empty(m, n, dtype=weight.dtype, device=weight.device) if rank == ranks - 1 else None
    sends = []
    for start in range(0, m, chunk):
        if rank == 0:
            a = x[start : start + chunk]
        else:
            a = torch.empty(chunk, k, dtype=weight.dtype, device=weight.device)
            dist.recv(a, rank - 1)
        c = activation(a @ weight, act)
        if out is not None:
            out[start : start + chunk] = c
        else:
            sends.append(dist.isend(c, rank + 1))
    for s in sends:
        s.wait()
    return out
