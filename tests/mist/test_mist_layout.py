"""mist.engine.layout: where each rank sits and what it sends between stages (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from mist import Plan, StagePlan
from mist.engine.layout import RankLayout

SEQ = 32


def _plan(shapes: list[tuple[int, int]], sequences: int, sequence_parallel: bool) -> Plan:
    stages = [StagePlan(layers=1, tp=tp, dp=dp) for tp, dp in shapes]
    g = 2  # micro-batches a step
    tp, dp = shapes[0]
    return Plan(
        model="gpt3-tiny",
        gpu="cpu",
        gpus=sum(t * d for t, d in shapes),
        gpus_per_node=8,
        global_batch=g * sequences,
        tp=tp,
        dp=dp,
        micro_batch=sequences // dp,
        stages=stages,
        sequence_parallel=sequence_parallel,
    )


def _covered(layout: RankLayout, rank: int, messages) -> np.ndarray:
    """How many times each (position, sequence) of ``rank``'s own piece the messages cover."""
    stage, t, d = layout.locate(rank)
    (s0, s1), (r0, r1) = layout.positions(stage, t), layout.rows(stage, d)
    count = np.zeros((s1 - s0, r1 - r0), int)
    for m in messages:
        assert 0 <= m.seq_lo < m.seq_hi <= s1 - s0 and 0 <= m.lo < m.hi <= r1 - r0, m
        count[m.seq_lo : m.seq_hi, m.lo : m.hi] += 1
    return count


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_rank_receives_its_whole_piece_once_and_each_send_has_its_receive(rng, sequence_parallel):
    """Random stage shapes (TP and DP of 1, 2 or 4, up to 4 stages): each rank of a stage after the
    first receives each of its positions and sequences exactly once; each rank of a stage before
    the last receives its output's gradient exactly once; and every message sent is the one its
    peer expects (same size, in the same order between the two)."""
    for _ in range(20):
        stages = int(rng.integers(2, 5))
        shapes = [(int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 4]))) for _ in range(stages)]
        layout = RankLayout.of(_plan(shapes, sequences=8, sequence_parallel=sequence_parallel))
        ranks = range(layout.first_rank(stages))
        for rank in ranks:
            stage = layout.locate(rank)[0]
            if stage > 0:
                assert (_covered(layout, rank, layout.forward_receives(rank)) == 1).all(), (shapes, rank)
            if stage < stages - 1:
                assert (_covered(layout, rank, layout.backward_receives(rank)) == 1).all(), (shapes, rank)
        for sends, receives in (
            (layout.forward_sends, layout.forward_receives),
            (layout.backward_sends, layout.backward_receives),
        ):
            sent = {(a, m.peer): (m.seq_hi - m.seq_lo, m.hi - m.lo) for a in ranks for m in sends(a)}
            got = {(m.peer, b): (m.seq_hi - m.seq_lo, m.hi - m.lo) for b in ranks for m in receives(b)}
            assert sent == got, shapes


def test_stages_of_one_shape_pair_the_ranks_at_the_same_place():
    """Where every stage has the same shape (megatron's pipeline), each rank sends its whole
    activation to the rank at its place in the next stage and gets the whole gradient back."""
    layout = RankLayout.of(_plan([(2, 2)] * 3, sequences=4, sequence_parallel=True))
    assert layout.uniform
    for rank in range(8):
        (m,) = layout.forward_sends(rank)
        assert (m.peer, m.seq_lo, m.seq_hi, m.lo, m.hi) == (rank + 4, 0, SEQ // 2, 0, 2)
        assert layout.backward_receives(rank) == [m]
    assert layout.gradient_scale(0) == 1.0


def test_the_input_gradient_is_scaled_by_the_stages_dp_over_the_next():
    layout = RankLayout.of(_plan([(1, 4), (2, 1), (1, 2)], sequences=4, sequence_parallel=False))
    assert [layout.gradient_scale(i) for i in range(2)] == [4.0, 0.5]
    assert [layout.rows(0, d) for d in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert layout.locate(4) == (1, 0, 0) and layout.locate(5) == (1, 1, 0) and layout.locate(7) == (2, 0, 1)
