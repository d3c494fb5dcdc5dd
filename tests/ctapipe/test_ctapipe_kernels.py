"""CTA-pipelined GEMM kernels against torch.matmul (under TRITON_INTERPRET=1 without a GPU).

Every test that could spin has a timeout, and every wait is bounded (in time, by default
ctapipe.WAIT_TIMEOUT_S) so a lost signal raises StageTimeout instead of hanging (the bounds
themselves: tests/ctapipe/test_ctapipe_faults.py). The negative control runs the consumer without its
wait while the producer is late, in a really concurrent process pair, and checks the test
catches it.

What checks the wait (the spin on the ready counter in kernels._acquire): the interpreter runs
a grid's programs, and launches, one after another, so in a single process a producer has always
finished before its consumer reads, and the in-process pipelines below compute the right result
with the wait removed (checked by making _acquire return True at once: the persistent/partitioned
and ticketed tests still passed, the producer-consumer one failed only at its give-up check).
They test tile arithmetic, counters, epochs and schedules. The wait's real checks are the
cross-process tests (producer and consumer concurrent, the producer late on purpose: both failed
without the wait) and the give-up checks (a consumer whose target is not reached must give up
and write nothing: they failed too). On a GPU (`nox -s gpu_check`) the PartitionedMLP and
TicketMLP programs do run concurrently.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ctapipe import (
    INTERPRETER_TILING,
    PartitionedMLP,
    StageTimeout,
    TicketMLP,
    Tiling,
    launch_stage,
    new_status,
    ticket_schedule,
)
from ctapipe.emulate import run_chain_processes
from ctapipe.gemm import GPU_DTYPES, INTERPRETER_DTYPES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILING = Tiling(32, 32, 32) if DEVICE == "cuda" else INTERPRETER_TILING
ATOL = 2e-2 if DEVICE == "cuda" else 1e-5  # GPU fp32 tl.dot runs in TF32


def _act(x: torch.Tensor, act: str) -> torch.Tensor:
    return {"none": x, "relu": x.relu(), "gelu": torch.nn.functional.gelu(x, approximate="tanh")}[act]


def _mlp(m: int, d: int, f: int):
    x = torch.randn(m, d, device=DEVICE)
    w1 = torch.randn(d, f, device=DEVICE) / d**0.5
    w2 = torch.randn(f, d, device=DEVICE) / f**0.5
    return x, w1, w2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("act", ["none", "relu", "gelu"])
def test_producer_consumer_stages_match_matmul(act):
    """Proves: the tile arithmetic (edges not multiples of the tile, the activation) matches
    matmul; the producer releases each row block's counter once per tile, and the counters keep
    counting across passes (epochs); a consumer with the right epoch's target does not give up,
    and one targeting the next epoch before the producer's next pass does give up and writes
    nothing (old counts do not satisfy a new epoch). Does not prove that a consumer waits for a
    producer still running: here the producer's launch is over before the consumer's starts
    (see the module docstring; test_chain_across_processes_and_the_negative_control does)."""
    m, d, f = (int(v) for v in torch.randint(17, 70, (3,)))  # edges not multiples of the tile
    x, w1, w2 = _mlp(m, d, f)
    rows = TILING.tiles(m, f)[0]
    ready = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    h = torch.empty(m, f, device=DEVICE)
    y = torch.empty(m, d, device=DEVICE)
    tiles_n = TILING.tiles(m, f)[1]
    for epoch in (1, 2):  # the counters are never reset: the second pass waits for epoch 2
        # Before this pass's producer ran, the counters hold epoch - 1: a consumer of this epoch
        # must give up (bounded spins), raise and leave its output untouched.
        early = torch.full((m, d), float("nan"), device=DEVICE)
        with pytest.raises(StageTimeout, match=f"saw {(epoch - 1) * tiles_n}, needed {epoch * tiles_n}"):
            launch_stage(
                h, w2, early, ready_in=ready, wait_target=epoch * tiles_n, max_spins=20, tiling=TILING
            )
        assert early.isnan().all()
        launch_stage(x, w1, h, ready_out=ready, act=act, tiling=TILING)
        assert ready.tolist() == [epoch * tiles_n] * rows
        status = new_status(DEVICE)
        launch_stage(h, w2, y, ready_in=ready, wait_target=epoch * tiles_n, status=status, tiling=TILING)
        assert status.tolist() == [0] * 6
        torch.testing.assert_close(y, _act(x @ w1, act) @ w2, atol=ATOL, rtol=ATOL)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("programs", [1, 3])
def test_persistent_stages_and_the_sm_partitioned_mlp(programs):
    """Fewer programs than tiles (each loops over tiles in order), and the two-'device' MLP built
    on it. Proves: the persistent loop computes every tile once and in place; PartitionedMLP
    wires producer, counters and consumer right and its epoch target is met on every call (no
    give-up, result equals matmul); its arguments are checked. Does not prove the consumer's
    wait under the interpreter: the two stages run one after the other there. On a GPU the two
    persistent kernels really run at once on their SM shares, and then it does."""
    m, d, f = (int(v) for v in torch.randint(17, 60, (3,)))
    x, w1, w2 = _mlp(m, d, f)
    h = torch.empty(m, f, device=DEVICE)
    launch_stage(x, w1, h, act="relu", tiling=TILING, programs=programs)
    torch.testing.assert_close(h, _act(x @ w1, "relu"), atol=ATOL, rtol=ATOL)
    mlp = PartitionedMLP("gelu", TILING)
    for _ in range(2):
        y = mlp(x, w1, w2)  # (a give-up would raise StageTimeout)
        assert mlp.status.tolist() == [0] * 6
        torch.testing.assert_close(y, _act(x @ w1, "gelu") @ w2, atol=ATOL, rtol=ATOL)
    with pytest.raises(ValueError, match="programs must be a whole number >= 1"):
        launch_stage(x, w1, h, tiling=TILING, programs=0)
    with pytest.raises(ValueError, match=r"producer_share must be a number in \(0, 1\)"):
        PartitionedMLP(producer_share=1.0)


@pytest.mark.timeout(120)
def test_consumer_without_its_signal_gives_up_and_writes_nothing():
    """The wait really gates the read: no producer ran, so no tile may be computed."""
    x, w1, _ = _mlp(40, 24, 40)
    ready = torch.zeros(TILING.tiles(40, 40)[0], dtype=torch.int32, device=DEVICE)
    out = torch.full((40, 40), float("nan"), device=DEVICE)
    with pytest.raises(StageTimeout, match=r"tile 0 \(row block 0, column block 0\)"):
        launch_stage(x, w1, out, ready_in=ready, wait_target=1, max_spins=50, tiling=TILING)
    assert out.isnan().all()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("programs,lag", [(1, 0), (3, 1), (7, 2)])
def test_ticketed_mlp_matches_matmul(programs, lag):
    """Proves: the kernel decodes tickets (layer, row block, column block) and computes both
    layers' tiles right for any grid size and lag; every layer-0 tile releases its row block once
    per call (the counters are zeroed per call), and every call's target is met (no give-up).
    Does not prove the ticket order or the wait keep a consumer tile from reading unfinished
    producers: the interpreter's
    first program takes every ticket in schedule order before the next program starts, so each
    layer-1 tile runs after its producers whatever the wait does. The order itself is checked by
    test_ticket_schedule_puts_every_consumer_tile_after_its_producers; concurrency only on a GPU."""
    m, d, f = (int(v) for v in torch.randint(17, 60, (3,)))
    x, w1, w2 = _mlp(m, d, f)
    tiles_m, tiles_n1 = TILING.tiles(m, f)
    mlp = TicketMLP("gelu", TILING, programs=programs, lag=lag)
    for _ in (1, 2):  # the second call on the same counters, zeroed again
        y = mlp(x, w1, w2)  # (a give-up would raise StageTimeout)
        assert mlp.status.tolist() == [0] * 6
        assert mlp.ready.buffer[:tiles_m].tolist() == [tiles_n1] * tiles_m
        torch.testing.assert_close(y, _act(x @ w1, "gelu") @ w2, atol=ATOL, rtol=ATOL)


def test_ticket_schedule_puts_every_consumer_tile_after_its_producers():
    tiles_m, n1, n2 = (int(v) for v in torch.randint(1, 9, (3,)))
    for lag in range(4):
        order = ticket_schedule(tiles_m, n1, n2, lag).tolist()
        assert sorted(map(tuple, order)) == sorted(
            [(0, i, j) for i in range(tiles_m) for j in range(n1)]
            + [(1, i, j) for i in range(tiles_m) for j in range(n2)]
        )
        produced = [0] * tiles_m  # layer-0 tiles of each row block handed out so far
        for layer, i, _ in order:
            if layer == 0:
                produced[i] += 1
            else:
                assert produced[i] == n1, f"lag {lag}: a consumer tile of row block {i} before its producers"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_chain_across_processes_and_the_negative_control():
    """Two concurrent 'devices' (processes), the producer 1 s late. With the wait the consumer's
    tiles match matmul; the same kernel without its wait reads the unwritten inbox, and the
    comparison must catch it. A waiting consumer refuses the order that would deadlock it."""
    m, d, f = 48, 32, 48
    x, w1, w2 = (t.cpu() for t in _mlp(m, d, f))
    ref = _act(x @ w1, "gelu") @ w2
    y = run_chain_processes(x, [w1, w2], ["gelu", "none"], INTERPRETER_TILING, delays=[1.0, 0.0])
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    # Without the wait the consumer must be caught; the producer starts only after it finished,
    # so the control cannot pass by luck of scheduling.
    y_bad = run_chain_processes(
        x, [w1, w2], ["gelu", "none"], INTERPRETER_TILING, wait=False, producer_last=True
    )
    assert not torch.allclose(y_bad, ref, atol=1e-3), "the missing wait went unnoticed"
    with pytest.raises(ValueError, match="producer_last needs wait=False"):
        run_chain_processes(x, [w1, w2], ["gelu", "none"], INTERPRETER_TILING, producer_last=True)
    # in this process, before any rank starts (a float64 X failed in each rank; short delays an
    # IndexError; a tiling that is none a rank's AttributeError)
    for bad, says in (
        (dict(x=x.double()), "must share one dtype of"),
        (dict(delays=[1.0]), "delays: one for each of the 2 ranks"),
        (dict(delays=[-1.0, 0.0]), "delays: one for each of the 2 ranks"),
        (dict(tiling="x"), "tiling must be a ctapipe.tiling.Tiling"),
    ):
        args = {"x": x, "tiling": INTERPRETER_TILING, **bad}
        with pytest.raises((TypeError, ValueError), match=says):
            run_chain_processes(args.pop("x"), [w1, w2], ["gelu", "none"], args.pop("tiling"), **args)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_stage_chain_across_processes():
    m = int(torch.randint(20, 50, ()))
    dims = [int(v) for v in torch.randint(16, 48, (4,))]
    x = torch.randn(m, dims[0])
    weights = [torch.randn(a, b) / a**0.5 for a, b in itertools.pairwise(dims)]
    acts = ["relu", "gelu", "none"]
    ref = x
    for w, a in zip(weights, acts, strict=True):
        ref = _act(ref @ w, a)
    y = run_chain_processes(x, weights, acts, INTERPRETER_TILING, delays=[0.5, 0.0, 0.0])
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused_with_what_is_accepted():
    x, w1, _ = _mlp(8, 16, 16)
    with pytest.raises(ValueError, match="activation 'swish' unknown; accepted: none, relu, gelu"):
        launch_stage(x, w1, torch.empty(8, 16, device=DEVICE), act="swish", tiling=TILING)
    with pytest.raises(ValueError, match="shapes do not chain"):
        launch_stage(x, w1, torch.empty(8, 8, device=DEVICE), tiling=TILING)
    with pytest.raises(ValueError, match="power of two"):
        Tiling(24, 32, 32)
    with pytest.raises(ValueError, match=r"need x \[M, D\]"):
        TicketMLP("gelu", TILING)(x, w1, w1.T[:4])
    with pytest.raises(ValueError, match="int32 with one counter per row block"):
        launch_stage(x, w1, torch.empty(8, 16, device=DEVICE), ready_in=torch.zeros(1), tiling=TILING)
    # what the kernels cannot compute, refused before any launch, naming what is accepted
    c = torch.empty(8, 16, device=DEVICE)
    for dtype in (torch.float64, torch.int32, *([torch.bfloat16] if DEVICE == "cpu" else [])):
        with pytest.raises(TypeError, match=r"must share one dtype of torch\.float16"):
            launch_stage(x.to(dtype), w1.to(dtype), c.to(dtype), tiling=TILING)
        with pytest.raises(TypeError, match="must share one dtype of"):
            TicketMLP("gelu", TILING)(x.to(dtype), w1.to(dtype), w1.to(dtype))
        with pytest.raises(TypeError, match="must share one dtype of"):
            PartitionedMLP("gelu", TILING)(x.to(dtype), w1.to(dtype), w1.to(dtype))
    with pytest.raises(TypeError, match="must share one dtype"):
        launch_stage(x, w1.half(), c, tiling=TILING)
    with pytest.raises(ValueError, match=r"must be matrices \(2-d\), got a 1-d"):
        launch_stage(x[0], w1, c, tiling=TILING)
    with pytest.raises(ValueError, match="must be matrices"):
        PartitionedMLP("gelu", TILING)(x[0], w1, w1)
    with pytest.raises(ValueError, match="must not be empty"):
        launch_stage(x[:0], w1, c[:0], tiling=TILING)
    with pytest.raises(TypeError, match=r"w1 must be a torch\.Tensor, got list"):
        TicketMLP("gelu", TILING)(x, w1.tolist(), w1)
    # an output that overlaps an input or itself (the probe's: 11.8 and 1.45 relative errors)
    square = torch.randn(16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="c overlaps a in memory"):
        launch_stage(square, torch.randn(16, 16, device=DEVICE), square, tiling=TILING)
    with pytest.raises(ValueError, match="c must not overlap itself"):
        launch_stage(x, w1, torch.empty(1, 16, device=DEVICE).expand(8, 16), tiling=TILING)
    # one element expanded to a column or a row (a size-1 dimension's stride hid the 0 stride)
    for rows, cols in ((8, 1), (1, 16)):
        with pytest.raises(ValueError, match="c must not overlap itself"):
            launch_stage(
                x[:rows], w1[:, :cols], torch.empty(1, 1, device=DEVICE).expand(rows, cols), tiling=TILING
            )
        launch_stage(x[:rows], w1[:, :cols], torch.empty(rows, cols, device=DEVICE), tiling=TILING)  # control
    launch_stage(x, w1, torch.empty(8, 32, device=DEVICE)[:, :16], tiling=TILING)  # strided, not overlapping
    with pytest.raises(ValueError, match="requires grad"):
        launch_stage(x.requires_grad_(), w1, c, tiling=TILING)
    with pytest.raises(ValueError, match="programs must be a whole number >= 1"):
        TicketMLP("gelu", TILING, programs=0)
    # at construction, not at the first call (a string tiling was an AttributeError there)
    for make, says in (
        (lambda: TicketMLP(tiling="x"), "tiling must be a ctapipe.tiling.Tiling"),
        (lambda: PartitionedMLP(tiling=None), "tiling must be a ctapipe.tiling.Tiling"),
        (lambda: TicketMLP(lag=1.5), "lag must be a whole number of row blocks >= 0"),
        (lambda: TicketMLP(lag=-1), "lag must be a whole number of row blocks >= 0"),
        (lambda: PartitionedMLP(act="bogus"), "activation 'bogus' unknown"),
        (lambda: PartitionedMLP(producer_share="0.5"), r"producer_share must be a number in \(0, 1\)"),
        (lambda: ticket_schedule(2, 2, 2, lag=0.5), "lag must be a whole number >= 0, got 0.5"),
        (lambda: ticket_schedule(-1, 2, 2), "tiles_m must be a whole number >= 0, got -1"),
    ):
        with pytest.raises(ValueError, match=says):
            make()


ACCEPTED = GPU_DTYPES if DEVICE == "cuda" else INTERPRETER_DTYPES


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", ACCEPTED, ids=str)
def test_every_accepted_dtype_against_float64(dtype):
    """C = A @ B by launch_stage and the MLP's first layer by both MLPs, in each dtype the kernels
    accept on this device, against float64 from the same rounded inputs. The bound, per element:
    float32 accumulation over K products (gamma_(K+1) ~ (K + 1) 2^-24; for float32 on a GPU also
    TF32's rounding of both inputs, 2 x 2^-11) times sum_k |a_ik| |b_kj| (the product's
    conditioning), then the output's rounding to its dtype, u times what was rounded."""
    m, k, n = (int(v) for v in torch.randint(17, 70, (3,)))
    a = torch.randn(m, k, device=DEVICE).to(dtype)
    b = (torch.randn(k, n, device=DEVICE) / k**0.5).to(dtype)
    u = torch.finfo(dtype).eps / 2
    inputs = 2 * 2**-11 if (DEVICE == "cuda" and dtype == torch.float32) else 0.0

    def rounded_bound(exact: torch.Tensor, accumulated: torch.Tensor) -> torch.Tensor:
        return u * exact.abs() + (1 + u) * accumulated

    exact = a.double() @ b.double()
    bound = rounded_bound(exact, (inputs + 1.01 * (k + 1) * 2**-24) * (a.double().abs() @ b.double().abs()))
    c = torch.empty(m, n, dtype=dtype, device=DEVICE)
    launch_stage(a, b, c, tiling=TILING)
    assert ((c.double() - exact).abs() <= bound).all(), ((c.double() - exact).abs() / bound).max()
    # negative control: a tile-indexing fault (two rows of C exchanged) is far outside the bound
    swapped = c[[1, 0, *range(2, m)]]
    assert not ((swapped.double() - exact).abs() <= bound).all()
    x, w1 = a, b  # the MLPs' first layer (relu: what the kernels apply to h) is the same GEMM
    w2 = (torch.randn(n, k, device=DEVICE) / n**0.5).to(dtype)
    for mlp in (TicketMLP("relu", TILING), PartitionedMLP("relu", TILING)):
        y = mlp(x, w1, w2)
        assert y.dtype == dtype and y.isfinite().all()
        # y = relu(h) @ w2 with h rounded to dtype: bounded from the h the kernel could have made
        h = exact.clamp_min(0)
        h_bound = bound  # relu does not widen it
        y_exact = h @ w2.double()
        w2d = w2.double()
        y_bound = rounded_bound(
            y_exact,
            (inputs + 1.01 * (n + 1) * 2**-24) * ((h.abs() + h_bound) @ w2d.abs()) + h_bound @ w2d.abs(),
        )
        assert ((y.double() - y_exact).abs() <= y_bound).all(), (
            type(mlp).__name__,
            ((y.double() - y_exact).abs() / y_bound).max(),
        )
