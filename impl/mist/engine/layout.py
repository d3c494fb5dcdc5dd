"""Where each rank of a plan sits, resolved once (as torchtitan's ParallelDims): the plan's stages in
rank order, each TP x DP ranks with TP innermost (Megatron's order), a stage's TP and DP its own
(``Plan.stage_parallelism``); the sequences of a pipeline micro-batch each replica holds and the
positions each TP rank holds (all of them, or its shard under sequence parallelism); the
point-to-point messages between neighbouring stages; and, where stages differ, megatron-core's
per-process parallel state for this rank's stage.

A pipeline micro-batch is the same B sequences in every stage; stage i splits them over its dp_i
replicas (B / dp_i each). Between stages of different shapes each rank gets the pieces it needs
from the ranks holding them (``RankLayout._pieces``). Where stages have the same shape this is one
message each way between the ranks at the same place in their stages, as megatron's pipeline
sends them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan


@dataclass(frozen=True)
class Message:
    """A piece of an activation (or its gradient), [s, b, h] in megatron's layout: positions
    [seq_lo, seq_hi) of sequences [lo, hi) of the local tensor, to or from ``peer``."""

    peer: int
    seq_lo: int
    seq_hi: int
    lo: int
    hi: int


@dataclass(frozen=True)
class RankLayout:
    shapes: tuple[tuple[int, int], ...]  # (tp, dp) of each stage
    sequences: int  # B: the sequences of a pipeline micro-batch
    seq: int  # positions of a sequence
    sequence_parallel: bool  # a stage with TP > 1 holds its TP rank's positions only

    @classmethod
    def of(cls, plan: Plan) -> RankLayout:
        parallel = [plan.stage_parallelism(i) for i in range(len(plan.stages))]
        (sequences,) = {dp * micro_batch for _, dp, micro_batch in parallel}  # Plan.check's split
        shapes = tuple((tp, dp) for tp, dp, _ in parallel)
        return cls(shapes, sequences, plan.model_spec().seq, plan.sequence_parallel)

    @property
    def uniform(self) -> bool:
        return len(set(self.shapes)) == 1

    def first_rank(self, stage: int) -> int:
        return sum(tp * dp for tp, dp in self.shapes[:stage])

    def rank(self, stage: int, tp_rank: int, dp_rank: int) -> int:
        return self.first_rank(stage) + tp_rank + self.shapes[stage][0] * dp_rank

    def locate(self, rank: int) -> tuple[int, int, int]:
        """(stage, tp rank, dp rank) of a global rank."""
        for stage, (tp, dp) in enumerate(self.shapes):
            local = rank - self.first_rank(stage)
            if local < tp * dp:
                return stage, local % tp, local // tp
        raise ValueError(f"rank {rank} is outside the plan's {self.first_rank(len(self.shapes))} ranks")

    def rows(self, stage: int, dp_rank: int) -> tuple[int, int]:
        """The sequences [lo, hi) of a pipeline micro-batch that a replica of ``stage`` holds."""
        per = self.sequences // self.shapes[stage][1]
        return dp_rank * per, (dp_rank + 1) * per

    def _sharded(self, stage: int) -> bool:
        return self.sequence_parallel and self.shapes[stage][0] > 1

    def positions(self, stage: int, tp_rank: int) -> tuple[int, int]:
        """The positions [lo, hi) a rank of ``stage`` holds between stages (SP: its shard)."""
        if not self._sharded(stage):
            return 0, self.seq
        per = self.seq // self.shapes[stage][0]
        return tp_rank * per, (tp_rank + 1) * per

    def _pieces(self, stage: int) -> list[tuple[int, int, tuple[int, int, int, int], bool, bool]]:
        """Between ``stage`` and the next, each piece a rank of ``stage`` holds and a rank of the next
        needs: (the one, the other, the piece as global positions and sequences, whether the
        first sends it forward, whether the second sends its gradient back). Without sequence
        parallelism a stage's TP ranks hold the same activations (and, under megatron's TP
        layers, the same input gradient), so of them the one at TP rank t mod tp sends to the
        other stage's TP rank t; under it, each piece comes from the rank holding it."""
        nxt = stage + 1
        pieces = []
        (tp_a, dp_a), (tp_b, dp_b) = self.shapes[stage], self.shapes[nxt]
        for ta in range(tp_a):
            for da in range(dp_a):
                (sa, sb), (ra, rb) = self.positions(stage, ta), self.rows(stage, da)
                for tb in range(tp_b):
                    for db in range(dp_b):
                        (qa, qb), (ua, ub) = self.positions(nxt, tb), self.rows(nxt, db)
                        piece = (max(sa, qa), min(sb, qb), max(ra, ua), min(rb, ub))
                        if piece[0] >= piece[1] or piece[2] >= piece[3]:
                            continue
                        # the forward's sender: any holder if sharded, else TP rank tb mod tp_a
                        sends = self._sharded(stage) or ta == tb % tp_a
                        # the backward's sender: any holder if sharded, else TP rank ta mod tp_b
                        returns = self._sharded(nxt) or tb == ta % tp_b
                        a, b = self.rank(stage, ta, da), self.rank(nxt, tb, db)
                        pieces.append((a, b, piece, sends, returns))
        return pieces

    def _messages(self, rank: int, forward: bool, sending: bool) -> list[Message]:
        stage, t, d = self.locate(rank)
        boundary = stage if forward == sending else stage - 1  # the boundary after this stage or before
        if not 0 <= boundary < len(self.shapes) - 1:
            return []
        here_first = boundary == stage  # this rank is in the boundary's first stage
        origin_seq, origin_row = self.positions(stage, t)[0], self.rows(stage, d)[0]
        out = []
        for a, b, (s0, s1, r0, r1), sends, returns in self._pieces(boundary):
            me, peer = (a, b) if here_first else (b, a)
            if me != rank or not (sends if forward else returns):
                continue
            out.append(Message(peer, s0 - origin_seq, s1 - origin_seq, r0 - origin_row, r1 - origin_row))
        return out

    def forward_sends(self, rank: int) -> list[Message]:
        return self._messages(rank, forward=True, sending=True)

    def forward_receives(self, rank: int) -> list[Message]:
        return self._messages(rank, forward=True, sending=False)

    def backward_sends(self, rank: int) -> list[Message]:
        return self._messages(rank, forward=False, sending=True)

    def backward_receives(self, rank: int) -> list[Message]:
        return self._messages(rank, forward=False, sending=False)

    def gradient_scale(self, stage: int) -> float:
        """What the input gradient a stage receives from the next is multiplied by: each replica's
        loss is the mean of its own sequences, so a sequence's gradient arrives scaled by the last
        stage's DP, and each stage averages its weight gradients over its own replicas."""
        return self.shapes[stage][1] / self.shapes[stage + 1][1]


def init_megatron_state(layout: RankLayout, rank: int, seed: int) -> None:
    """megatron-core's per-process parallel state for ``rank``'s stage when stages differ (its own
    initialize_model_parallel takes one TP and DP for all): every stage's TP and DP groups, and
    pipeline "lanes" (one rank of each stage, in stage order: a rank's pipeline rank is its stage),
    made by every rank in the same order; then this rank's are set as megatron-core's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    mine: dict[str, tuple[list[int], object]] = {}
    stage, t, _ = layout.locate(rank)
    for i, (tp, dp) in enumerate(layout.shapes):
        for dd in range(dp):
            ranks = [layout.rank(i, tt, dd) for tt in range(tp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["tp"] = ranks, group
        for tt in range(tp):
            ranks = [layout.rank(i, tt, dd) for dd in range(dp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["dp"] = ranks, group
    widths = [tp * dp for tp, dp in layout.shapes]
    for lane in range(max(widths)):
        ranks = [layout.first_rank(i) + lane % w for i, w in enumerate(widths)]
        group = dist.new_group(ranks)
        if lane == rank - layout.first_rank(stage):
            mine["pp"] = ranks, group
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS, ps._TENSOR_MODEL_PARALLEL_GROUP = mine["tp"]
    ps._DATA_PARALLEL_GLOBAL_RANKS, ps._DATA_PARALLEL_GROUP = mine["dp"]
    ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP, ps._DATA_PARALLEL_GROUP_WITH_CP = mine["dp"]
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = mine["dp"][1]  # no partial data parallelism
    ps._PIPELINE_GLOBAL_RANKS, ps._PIPELINE_MODEL_PARALLEL_GROUP = mine["pp"]
    ps._set_global_memory_buffer()
    model_parallel_cuda_manual_seed(seed, tp_rank=t, ep_rank=0, etp_rank=0)
