"""A chain of GEMMs with one layer per device, CTA-pipelined across devices.

Rank r computes act_r(In_r @ W_r). Its tiles go straight into rank r+1's input buffer ``In_{r+1}``
and each finished row block bumps rank r+1's ready counter; rank r+1's CTAs start on a row block
as soon as it is complete, while rank r is still producing the next ones. The last rank writes Y.

Buffers a rank sees (``PeerBuffers``): its own inbox and counters, and views of the next rank's.

* GPUs (``symmetric_buffers``): torch's symmetric memory (peer-mapped allocations, one process
  per GPU under torchrun); the views of rank r+1's buffers are device pointers on rank r.
* CPU emulation (``shared_buffers``): one process per emulated device, shared-memory tensors,
  kernels under TRITON_INTERPRET=1; the processes really run concurrently, so a consumer really
  can read before its producer has written (the tests' negative control relies on that).

Before the first pipelined call every rank compiles its kernel (``warm_up``): otherwise the
consumer's JIT compile, not the producer, decides when it starts.

Counters are never reset (a peer may still be signalling): pass e waits for e x the upstream
rank's column tiles per row block. That stays in step because a chain's shapes are fixed by its
buffers (M) and weights (the upstream width). Every wait is bounded in time (gemm.WAIT_TIMEOUT_S
by default): a rank whose tile gave up raises ``StageTimeout`` naming the rank and the tile. Its
tiles that gave up neither wrote nor signalled, so the ranks after it give up too, and the chain's
counters are then out of step: build a new chain (new buffers) after a ``StageTimeout``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemm import check_flags, launch_stage, new_status, raise_if_gave_up
from .tiling import DEFAULT_TILING, Tiling


@dataclass
class PeerBuffers:
    inbox: torch.Tensor | None  # [M, D_r]: written by rank r-1 (None on rank 0)
    ready: torch.Tensor | None  # int32 [row blocks]: rank r-1's signals
    next_inbox: torch.Tensor | None  # rank r+1's inbox (None on the last rank)
    next_ready: torch.Tensor | None


def _row_blocks(m: int, tiling: Tiling) -> int:
    return -(-m // tiling.block_m)


def shared_buffers(m: int, dims: list[int], dtype: torch.dtype, tiling: Tiling) -> list[PeerBuffers]:
    """Per rank of a chain with layer widths ``dims`` (len = ranks + 1): shared-memory buffers."""
    ranks = len(dims) - 1
    inboxes = [None] + [torch.zeros(m, dims[r], dtype=dtype).share_memory_() for r in range(1, ranks)]
    ready = [None] + [
        torch.zeros(_row_blocks(m, tiling), dtype=torch.int32).share_memory_() for _ in range(1, ranks)
    ]
    return [
        PeerBuffers(
            inboxes[r],
            ready[r],
            inboxes[r + 1] if r + 1 < ranks else None,
            ready[r + 1] if r + 1 < ranks else None,
        )
        for r in range(ranks)
    ]


def symmetric_buffers(m: int, dims: list[int], dtype: torch.dtype, tiling: Tiling, group=None) -> PeerBuffers:
    """This rank's PeerBuffers in symmetric memory (collective: every rank of ``group`` calls it)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = group or dist.group.WORLD
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    if len(dims) != ranks + 1:
        raise ValueError(f"a chain on {ranks} ranks needs {ranks + 1} widths, got {len(dims)}")
    device = torch.device("cuda", torch.cuda.current_device())
    width, rows = max(dims[1:-1] or [1]), _row_blocks(m, tiling)
    # identical shapes on every rank (symmetric memory's rule): the widest inbox, viewed per rank
    data = symm_mem.empty(m * width, dtype=dtype, device=device)
    flags = symm_mem.empty(rows, dtype=torch.int32, device=device).zero_()
    data_h, flags_h = symm_mem.rendezvous(data, group), symm_mem.rendezvous(flags, group)
    dist.barrier(group)  # every rank's counters are zero before anyone signals

    def inbox(r: int) -> torch.Tensor:
        return data_h.get_buffer(r, (m * width,), dtype)[: m * dims[r]].view(m, dims[r])

    last = rank == ranks - 1
    return PeerBuffers(
        inbox(rank) if rank > 0 else None,
        flags if rank > 0 else None,
        None if last else inbox(rank + 1),
        None if last else flags_h.get_buffer(rank + 1, (rows,), torch.int32),
    )


class ChainStage:
    """Rank ``rank``'s layer of a CTA-pipelined chain.

    One inbox per rank: before a rank starts pass e+1 its consumer must be done reading pass e
    (the counters order writes after reads only within a pass). Drivers therefore separate
    passes with a barrier, as artifacts/cta_mlp/distributed.py does.

    ``timeout_s`` / ``max_spins``: the wait bounds (gemm.launch_stage). A pass of a rank that waits
    raises ``StageTimeout`` (stage ``chain rank r of n``) if one of its tiles gave up; with
    ``check=False`` it does not wait for its kernel, and ``raise_if_gave_up()`` checks every pass
    since the last check (after a give-up later passes do not wait: one bound lost, not one each).
    """

    def __init__(
        self,
        rank: int,
        ranks: int,
        weight: torch.Tensor,
        act: str,
        buffers: PeerBuffers,
        tiling: Tiling = DEFAULT_TILING,
        max_spins: int = 0,
        timeout_s: float | None = None,
    ) -> None:
        if (rank > 0) != (buffers.inbox is not None) or (rank < ranks - 1) != (
            buffers.next_inbox is not None
        ):
            raise ValueError(f"rank {rank} of {ranks}: buffers do not match its place in the chain")
        self.rank, self.ranks, self.weight, self.act = rank, ranks, weight, act
        self.buffers, self.tiling, self.max_spins, self.timeout_s = buffers, tiling, max_spins, timeout_s
        self.name = f"chain rank {rank} of {ranks}"
        self.epoch = 0
        self.status = new_status(weight.device)

    def _upstream_tiles_n(self) -> int:
        return -(-self.weight.shape[0] // self.tiling.block_n)  # rank r-1's column tiles = our K / block_n

    def warm_up(self, m: int) -> None:
        """Compile this rank's kernel exactly as the pipeline launches it, touching no peer state."""
        w, b = self.weight, self.buffers
        a = torch.zeros(m, w.shape[0], dtype=w.dtype, device=w.device)
        out = torch.empty(m, w.shape[1], dtype=w.dtype, device=w.device)
        rows = _row_blocks(m, self.tiling)
        scratch = torch.zeros(rows, dtype=torch.int32, device=w.device)
        launch_stage(
            a,
            w,
            out,
            ready_in=scratch if b.inbox is not None else None,
            ready_out=torch.zeros_like(scratch) if b.next_inbox is not None else None,
            wait_target=0,
            act=self.act,
            tiling=self.tiling,
            timeout_s=self.timeout_s,
            max_spins=self.max_spins,
            name=f"{self.name} (warm-up)",
        )

    def __call__(
        self, x: torch.Tensor | None = None, wait: bool = True, check: bool = True
    ) -> torch.Tensor | None:
        """One pipelined pass: rank 0 takes ``x``; the last rank returns Y, the others None. Raises
        ``StageTimeout`` if a tile gave up waiting (after the pass's kernel finished; ``check``)."""
        check_flags(wait=wait, check=check)  # None was taken as no wait
        b = self.buffers
        if (self.rank == 0) != (x is not None):
            raise ValueError("rank 0 takes the chain's input x; the other ranks read their inbox")
        self.epoch += 1
        a = x if x is not None else b.inbox
        last = self.rank == self.ranks - 1
        out = (
            torch.empty(a.shape[0], self.weight.shape[1], dtype=a.dtype, device=a.device)
            if last
            else b.next_inbox
        )
        launch_stage(
            a,
            self.weight,
            out,
            ready_in=b.ready,
            ready_out=b.next_ready,
            wait_target=self.epoch * self._upstream_tiles_n(),
            act=self.act,
            status=self.status,
            timeout_s=self.timeout_s,
            max_spins=self.max_spins,
            tiling=self.tiling,
            wait=None if wait else False,
            check=False,
        )
        if check:
            self.raise_if_gave_up()
        return out if last else None

    def raise_if_gave_up(self) -> None:
        """Raise ``StageTimeout`` if a pass since the last check gave up (naming its first tile that
        did); waits for this rank's kernels."""
        if self.rank > 0:  # rank 0 never waits
            raise_if_gave_up(self.status, self.name, self.timeout_s, self.max_spins)
