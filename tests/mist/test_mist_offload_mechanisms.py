"""offload.py's mechanisms on a stack of plain layers, without megatron-core: weights at rest on
the host (WeightOffload), gradients summed on the host (GradientOffload; under ZeRO-2, over a
process group of one, ShardedMasterAdamW's) and saved activations swapped out
(ActivationOffload), trained over several micro-batches against the same stack without them.
The engine's tests (test_mist_run.py) train them inside megatron-core on gloo; these isolate the
mechanisms, in float32 so that every sum is the plain run's bit for bit.

On a CPU the copies are made in line; on a GPU (``cuda``, run by the GPU check) they run on
offload.py's copy stream, where a copy the compute stream did not wait for would read or leave
stale values: the same exact equality then checks the stream's synchronisation, and the device
peak checks that the weights left the device. ``cpu-latest`` and ``cpu-run-ahead`` check the same
waits on a CPU: each copy is made as late, or as early, as a stream may, its destination
poisoned until then (offload.CopyTiming); controls there drop a wait and must fail.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from measure.cpu_peak import device_peak_bytes
from measure.training import gradient_to_step
from mist.engine import offload
from mist.engine.offload import (
    ActivationOffload,
    GradientOffload,
    OffloadedMasterAdamW,
    Transfers,
    WeightOffload,
    split_by_fraction,
    weights_at_rest_on_host,
)

# the cuda cases are marked gpu: skipped without CUDA (tests/conftest.py), run by the GPU check
DEVICES = ["cpu", "cpu-latest", "cpu-run-ahead", pytest.param("cuda", marks=pytest.mark.gpu)]
LAYERS, MICRO_BATCHES = 4, 3


@pytest.fixture
def device(request, monkeypatch) -> str:
    """The device of a case (``cpu-latest``, ``cpu-run-ahead``: the CPU, its copies made at that
    offload.CopyTiming)."""
    device, _, timing = request.param.partition("-")
    monkeypatch.setattr(offload, "_COPY_TIMING", offload.CopyTiming(timing or "in-line"))
    return device


class _KeepsACpuSeed(torch.autograd.Function):
    """The identity, saving a CPU int64 scalar for backward as Tempo's dropout and attention save
    their seed: it must come back on the CPU, also where the layer runs on a GPU."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(torch.tensor(7, dtype=torch.int64))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (seed,) = ctx.saved_tensors
        assert seed.device.type == "cpu" and int(seed) == 7, seed
        return grad


class Block(nn.Module):
    """A residual MLP block: what it saves for backward is activations, its weights and a seed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(_KeepsACpuSeed.apply(x))))


def _stack(width: int, device: str, seed: int) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(Block(width) for _ in range(LAYERS)).to(device)


def _train(layers: nn.ModuleList, batches: list[torch.Tensor], after_forward=lambda: None) -> list[float]:
    """Forward and backward of every micro-batch, gradients accumulated; the losses."""
    losses = []
    for x in batches:
        for layer in layers:
            x = layer(x)
        loss = x.square().mean()
        after_forward()
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_a_copy_up_and_down_round_trips(device):
    """Transfers.up then down returns the tensor bit for bit, the up copy a new tensor on the
    device (never the host one: the device peak must hold it)."""
    transfers = Transfers(torch.device(device))
    host = transfers.host_like(torch.empty(257, 3))
    host.copy_(torch.randn(257, 3))
    arriving = transfers.up(host)
    if transfers.deferred is not None:  # not made before it is waited for: poison until then
        assert torch.isnan(arriving.tensor).all()
    up = arriving.take()
    assert up.device.type == device and up.data_ptr() != host.data_ptr()
    back = transfers.host_like(up)
    done = transfers.down(up * 2, back)
    if done is not None:
        done.synchronize()
    assert torch.equal(back, host * 2)


def _plain_and_offloaded(device: str, mechanisms: tuple[str, ...]) -> tuple[dict, dict]:
    """({offloaded: (losses, summed gradients)}, {offloaded: the device peak, on a GPU}): the stack
    trained without and with ``mechanisms``' offloading, from the same weights and batches."""
    width = 256 if device == "cuda" else 32
    seed = int(torch.randint(0, 2**31, ()).item())
    batches = [torch.randn(8, width, device=device) for _ in range(MICRO_BATCHES)]
    peaks, runs = {}, {}
    for offloaded in (False, True):
        layers = _stack(width, device, seed)
        params = list(layers.parameters())
        grads = weights = activations = None
        if offloaded and "activations" in mechanisms:
            activations = ActivationOffload(list(layers))
        if offloaded and "grads" in mechanisms:
            grads = GradientOffload(params, 1.0)
        if offloaded and "weights" in mechanisms:  # last, as the engine builds it
            weights = WeightOffload(list(layers), 1.0)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        swapped = []  # activations waiting on the host after each forward

        def count_swapped(activations=activations, swapped=swapped) -> None:
            queued = activations.queues if activations is not None else []
            swapped.append(sum(len(saved) for queue in queued for saved in queue))

        losses = _train(layers, batches, count_swapped)
        if grads is not None:
            assert all(p.grad is None for p in grads.params)  # drained as made
            grads.attach()
        if device == "cuda":
            torch.cuda.synchronize()
            peaks[offloaded] = torch.cuda.max_memory_allocated()
        runs[offloaded] = losses, [gradient_to_step(p).clone().cpu() for p in params]
        if weights is not None:
            assert weights.resident() == 0
            assert all(p.device.type == "cpu" for p in params)  # at rest on the host
        if activations is not None:
            # each layer's input, the GELU's input and output, and on a CPU (where it is on the
            # device) the seed of every layer but the first (whose input takes no gradient: no
            # node is recorded, nothing saved): on the host after the forward
            seeds = LAYERS - 1 if device == "cpu" else 0
            assert swapped == [3 * LAYERS + seeds] * MICRO_BATCHES, swapped
            assert all(not q for q in activations.queues)  # every micro-batch's came back
    return runs, peaks


def _same(runs: dict) -> bool:
    (plain_losses, plain_values), (losses, values) = runs[False], runs[True]
    return losses == plain_losses and all(
        torch.equal(a, b) for a, b in zip(values, plain_values, strict=True)
    )


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize(
    "mechanisms",
    [("weights",), ("grads",), ("activations",), ("weights", "grads", "activations")],
    ids=["weights", "grads", "activations", "all"],
)
def test_offloaded_stack_trains_as_the_plain_one(device, mechanisms):
    """The same losses and the same summed gradients as the plain stack, bit for bit; offloaded
    weights rest on the host between steps, offloaded gradients are host sums the optimizer reads
    (gradient_to_step) while .grad holds none, and swapped activations were taken off the device
    as saved. On a GPU the step's device peak is below the plain one's by at least the weights'
    bytes where weights are offloaded (a weight that never left the device would fail it)."""
    runs, peaks = _plain_and_offloaded(device, mechanisms)
    assert _same(runs), runs
    if device == "cuda":  # whatever is offloaded, the device holds less at its peak
        assert peaks[True] < peaks[False], peaks
    if device == "cuda" and "weights" in mechanisms:  # all but two layers' weights off the device
        weight_bytes = sum(t.numel() * t.element_size() for t in runs[False][1])  # a gradient a weight
        assert peaks[False] - peaks[True] >= weight_bytes * (1 - 2 / LAYERS), peaks


@pytest.mark.parametrize(
    ("device", "mechanisms", "dropped"),
    [
        ("cpu-latest", ("weights",), "the compute stream's wait for a copy up"),
        ("cpu-latest", ("activations",), "the compute stream's wait for a copy up"),
        ("cpu-latest", ("grads",), "the host's wait for a gradient's copy down"),
        ("cpu-run-ahead", ("grads",), "a staging buffer's wait for its add before reuse"),
    ],
    ids=[
        "weights-taken-without-wait",
        "activations-taken-without-wait",
        "host-add-without-wait",
        "staging-reused-in-flight",
    ],
    indirect=["device"],
)
def test_a_wait_dropped_fails_where_copies_are_deferred(device, mechanisms, dropped, monkeypatch):
    """The negative controls of the deferred timings: with a wait the GPU needs dropped, the values
    trained change (a copy up read as poison; a host sum adding its staging buffer before the copy
    into it was made; one staging buffer a shape, reused while a copy into it is in flight, which
    only a stream that runs ahead shows), or poison meets a check inside the run (the CPU seed
    saved for backward: _KeepsACpuSeed)."""
    if dropped.startswith("the compute"):
        monkeypatch.setattr(offload.DeferredCopy, "hand_to_compute", lambda self, tensor: None)
    elif dropped.startswith("the host"):
        monkeypatch.setattr(offload.DeferredCopy, "synchronize", lambda self: None)
    else:
        shared: dict[tuple, torch.Tensor] = {}
        monkeypatch.setattr(
            offload.Transfers,
            "host_like",
            lambda self, t: shared.setdefault((t.shape, t.dtype), torch.empty(t.shape, dtype=t.dtype)),
        )
    try:
        runs, _ = _plain_and_offloaded(device, mechanisms)
    except AssertionError as e:  # the seed's check: the poison of its int64, the inverse of 7
        assert str(~7) in str(e), e
        return
    assert not _same(runs), dropped


def test_the_host_shares_take_the_weights_at_rest_there_first(rng):
    """The offloaded optimizer's and gradients' shares take the weights at rest on the host first
    (split_by_fraction's ``first``), so of two host shares the smaller is inside the larger, as
    stage_cost.optimizer_step_s prices the step: where a share is at least the weights', it holds
    every weight at rest on the host (none of them steps on the device; every gradient summed on
    the host has its weight there), and a smaller share holds only weights at rest there but for
    what fits after the first that did not (less than the largest left out). Control: largest
    first alone (a Block's two weights tie in size and are taken layer by layer over the stack,
    a layer's weights one per layer) splits them, leaving more than a parameter's worth at rest
    on the host outside a share of the same fraction."""
    layers = _stack(int(rng.integers(4, 17)), "cpu", int(rng.integers(2**31)))
    params = list(layers.parameters())
    size = {id(p): p.numel() for p in params}
    eighths = [k / 8 for k in range(1, 9)]
    weights = float(rng.choice(eighths[:-1]))
    at_rest = frozenset(id(q) for layer in weights_at_rest_on_host(list(layers), weights) for q in layer)
    for share in eighths:
        stepped = OffloadedMasterAdamW(params, share, lr=1e-3, at_rest_on_host=at_rest).host_params
        summed = GradientOffload(params, share, at_rest).params
        for chosen in ({id(p) for p in stepped}, {id(p) for p in summed}):
            if sum(size[i] for i in chosen) >= sum(size[i] for i in at_rest):
                assert at_rest <= chosen, (weights, share)
            else:
                left_out = max(size[i] for i in at_rest - chosen)
                assert sum(size[i] for i in chosen - at_rest) < left_out, (weights, share)
    plain = {id(p) for p in split_by_fraction(params, 0.5)[0]}
    at_half = frozenset(id(q) for layer in weights_at_rest_on_host(list(layers), 0.5) for q in layer)
    assert sum(size[i] for i in at_half - plain) > max(size.values())
    with_first = {id(p) for p in split_by_fraction(params, 0.5, at_half)[0]}
    assert at_half <= with_first


def test_each_zero1_replica_sums_its_fraction_of_the_gradients_it_steps(rng):
    """Under ZeRO-1 each replica steps its own buckets (zero._assign_owners, as
    ShardedMasterAdamW.shares groups them) and sums every gradient; GradientOffload given those
    shares takes the fraction of each, so every replica's step finds that fraction of the
    gradients it steps on the host, as stage_cost prices each stepped parameter alike: within
    the share's largest parameter below (whole parameters move) and half an element above, here
    over 4 layers of random width and an embedding as large as they are, at 2-4 replicas.
    Control: taken over the whole part, largest first, at a half the embedding alone goes to the
    host, and at 2 replicas the other steps 4 layers with none of their gradients there (the
    bound above asks for more than a parameter's worth)."""
    from mist.engine.zero import _assign_owners

    layers = _stack(int(rng.integers(4, 17)), "cpu", int(rng.integers(2**31)))
    buckets = [list(layer.parameters()) for layer in layers]
    embedding = nn.Parameter(torch.zeros(sum(p.numel() for b in buckets for p in b)))
    buckets.append([embedding])
    params = [p for b in buckets for p in b]

    def shares_at(dp: int) -> list[list[nn.Parameter]]:
        owner, _ = _assign_owners(buckets, list(range(dp)))
        return [[p for p in params if owner[id(p)] == rank] for rank in range(dp)]

    def on_host(summed: set[int], share: list[nn.Parameter]) -> int:
        return sum(p.numel() for p in share if id(p) in summed)

    shares = shares_at(int(rng.integers(2, 5)))
    for fraction in (rng.uniform(0.05, 0.95), 0.5):
        summed = {id(p) for p in GradientOffload(params, fraction, shares=shares).params}
        for share in shares:
            held = sum(p.numel() for p in share)
            largest = max(p.numel() for p in share)
            assert fraction * held - largest < on_host(summed, share) <= fraction * held + 0.5
    plain = {id(p) for p in GradientOffload(params, 0.5).params}
    assert plain == {id(embedding)}
    layers_share = next(share for share in shares_at(2) if all(p is not embedding for p in share))
    assert 0.5 * sum(p.numel() for p in layers_share) - max(p.numel() for p in layers_share) > 0
    assert on_host(plain, layers_share) == 0


class _Crossings(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, of each copy between two devices, (source dtype, destination dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            source, destination = args[0], out
        elif func is torch.ops.aten.copy_.default:
            destination, source = args[0], args[1]
        else:
            return out
        if source.device != destination.device:
            self.seen.append((source.dtype, destination.dtype))
        return out


@pytest.mark.parametrize("elsewhere", ["meta", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("host_dtype", [torch.float32, torch.bfloat16], ids=["fp32-host", "bf16-host"])
def test_a_step_copy_crosses_in_the_narrower_dtype(elsewhere, host_dtype, rng):
    """The step's copies between host and device (measure.training.to_across, copy_across: an
    fp16 gradient summed on the host going up to an fp32 master, a master coming back into a
    weight resting on the host or going up into one on the device) cross as the narrower dtype,
    cast on whichever side holds the wider: torch's own copy converts on the host when blocking,
    so a gradient would cross as fp32 (Mist's model prices 2 bytes). Each copy that moves between
    devices is a pure move of bf16, both ways (``meta`` stands in for a GPU on a CPU machine: it
    records the copies, not values); values survive where they can be read. Control: torch's
    one-call conversions cross converting, which the recorder tells apart."""
    from measure.training import copy_across, to_across

    host = torch.from_numpy(rng.standard_normal((5, 3))).to(host_dtype)
    wide, narrow = torch.float32, torch.bfloat16
    other = wide if host_dtype == narrow else narrow
    device = torch.device(elsewhere)
    with _Crossings() as up:
        on_device = to_across(host, device, other)
        into = torch.empty((5, 3), dtype=other, device=device)
        copy_across(into, host)
    with _Crossings() as down:
        back = torch.empty((5, 3), dtype=host_dtype)
        if elsewhere != "meta":  # a meta tensor holds no values to copy out
            copy_across(back, on_device)
            assert torch.equal(back, host.to(other).to(host_dtype))
            assert torch.equal(to_across(into, torch.device("cpu"), host_dtype), back)
    for crossings in (up.seen, down.seen):
        assert all(pair == (narrow, narrow) for pair in crossings), crossings
    assert len(up.seen) == 2 and len(down.seen) == (0 if elsewhere == "meta" else 2)
    assert on_device.dtype == other and on_device.device.type == device.type
    with _Crossings() as plain:
        host.to(device, other)
        into.copy_(host)
    assert plain.seen and all(pair[0] != pair[1] for pair in plain.seen), plain.seen


class _Done:
    def wait(self) -> None:
        pass


def test_a_flat_collective_runs_once_a_dtype_and_copies_back(rng):
    """zero.flat_collective runs one collective per dtype on a flat message. Here the
    "collective" doubles its message: every tensor, of either dtype, any shape, a transposed view
    among them, comes back doubled (one that was not copied back would not be)."""
    from mist.engine.zero import flat_collective

    shapes = [tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 4)))) for _ in range(5)]
    tensors = [
        torch.from_numpy(rng.standard_normal(shape)).to([torch.float32, torch.bfloat16][i % 2])
        for i, shape in enumerate(shapes)
    ]
    tensors.append(torch.from_numpy(rng.standard_normal((3, 4))).float().t())  # not contiguous
    before = [t.clone() for t in tensors]
    messages = []

    def doubling(flat: torch.Tensor) -> _Done:
        messages.append(flat.dtype)
        flat.mul_(2)
        return _Done()

    flat_collective(tensors, doubling)
    assert sorted(messages, key=str) == [torch.bfloat16, torch.float32]  # one message a dtype
    for t, was in zip(tensors, before, strict=True):
        assert torch.equal(t, was * 2)


def test_a_broadcast_through_the_device_copies_up_at_the_source_and_down_elsewhere(rng):
    """zero.broadcast_through carries weights at rest on the host through a message on the device
    (ZeRO-1/2's broadcast of them): the source copies what it sends into the message, the others
    copy the message down, one message a dtype, and neither copies what it holds already (Mist's
    model prices the source's host-stepped share up and the rest down). Two ranks stood in for in
    one process: each message starts poisoned (NaN); the source's stand-in broadcast reads the
    message and then scribbles on it (a copy down at the source would show), the other's finds it
    still poisoned (a copy up there would have written it) and writes the source's values in.
    The source sends some tensors from a wider copy (the fp32 master the step keeps on the
    device), whose host tensor it must not read (poisoned here): the message holds that copy cast
    to the tensor's dtype. Every tensor of the other, of any dtype, a transposed view among
    them, ends with the values sent, bit for bit; the source's are unchanged."""
    from mist.engine.zero import broadcast_through

    shapes = [tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 4)))) for _ in range(6)]
    dtypes = [[torch.float16, torch.bfloat16][i % 2] for i in range(len(shapes))]

    def weights() -> list[torch.Tensor]:
        made = [
            torch.from_numpy(rng.standard_normal(sh)).to(dt) for sh, dt in zip(shapes, dtypes, strict=True)
        ]
        return [*made, torch.from_numpy(rng.standard_normal((3, 4))).float().t()]  # not contiguous

    source, other = weights(), weights()
    # some of the half-precision ones, never all: both ways are used in every draw
    masters = set(rng.choice(len(shapes), size=int(rng.integers(1, len(shapes))), replace=False).tolist())
    from_master = [i in masters for i in range(len(source))]
    sent = [
        torch.from_numpy(rng.standard_normal(t.shape)).float() if master else t
        for t, master in zip(source, from_master, strict=True)
    ]
    for t, master in zip(source, from_master, strict=True):
        if master:
            t.fill_(float("nan"))  # the step wrote it with the master's values: not read here
    expected = [v.to(t.dtype) for v, t in zip(sent, source, strict=True)]
    held = [t.clone() for t in source]
    dts = {t.dtype for t in source}
    staging = {
        dt: torch.full((sum(t.numel() for t in source if t.dtype == dt) + 3,), float("nan"), dtype=dt)
        for dt in dts
    }
    messages: dict[torch.dtype, torch.Tensor] = {}

    def at_source(flat: torch.Tensor) -> _Done:
        messages[flat.dtype] = flat.clone()
        flat.fill_(7)  # what a copy down at the source would bring back
        return _Done()

    def elsewhere(flat: torch.Tensor) -> _Done:
        assert torch.isnan(flat).all(), "the others copied their stale tensors up"
        flat.copy_(messages[flat.dtype])
        return _Done()

    broadcast_through(source, sent, at_source, staging)
    assert sorted(messages, key=str) == sorted(dts, key=str)  # one message a dtype
    for t in staging.values():
        t.fill_(float("nan"))
    broadcast_through(other, None, elsewhere, staging)
    for s, o, was, want in zip(source, other, held, expected, strict=True):
        assert torch.allclose(s, was, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(o, want)


@pytest.mark.parametrize(
    ("device", "control"),
    [
        ("cpu", False),
        ("cpu", True),
        ("cpu-latest", False),
        ("cpu-run-ahead", False),
        pytest.param("cuda", False, marks=pytest.mark.gpu),
    ],
    ids=["cpu", "cpu-control-lost-host-sums", "cpu-latest", "cpu-run-ahead", "cuda"],
    indirect=["device"],
)
def test_zero2_with_offloaded_weights_and_gradients_steps_as_the_plain_one(
    device, control, one_process_group, monkeypatch
):
    """ZeRO-2 (ShardedMasterAdamW) with half of each layer's weights at rest on the host
    (WeightOffload: its first matrix and last bias) and 60% of its gradient share summed on the
    host (largest first: the first two layers' matrices, every bias), over 2 steps of 3
    micro-batches: the same losses and weights as the plain stack under MasterWeightAdamW, bit for
    bit. Its reduced gradients go down into host sums (HostSums: on a GPU the copy stream); the
    step reads every sum through ``step_grad`` (``.grad`` cannot hold a GPU sum of a weight at
    rest on the host, as the last two layers' first matrices are); its broadcast of the updated
    weights copies those at rest on the host through a message on the device
    (zero.broadcast_through) and back. On a GPU these are
    the lines ZeRO-2 runs over many replicas, where NCCL reads device memory only. A bucket (a
    layer) whose gradients sum partly on the host keeps no view of its reduced message, which
    would keep it whole. Control: host sums that never receive their gradients must change the
    result."""
    from measure.training import MasterWeightAdamW
    from mist.engine.offload import HostSums
    from mist.engine.zero import ShardedMasterAdamW

    if control:
        monkeypatch.setattr(HostSums, "add", lambda self, key, tensor: None)
    width = 256 if device == "cuda" else 32
    seed = int(torch.randint(0, 2**31, ()).item())
    batches = [torch.randn(8, width, device=device) for _ in range(MICRO_BATCHES)]
    runs = {}
    for offloaded in (False, True):
        layers = _stack(width, device, seed)
        params = list(layers.parameters())
        if offloaded:
            at_rest = {id(q) for layer in weights_at_rest_on_host(list(layers), 0.5) for q in layer}
            optimizer = ShardedMasterAdamW(
                [list(layer.parameters()) for layer in layers],
                one_process_group,
                lr=1e-2,
                shard_grads=True,
                offload_grads=0.6,
                rest_on_host=frozenset(at_rest),
            )
            on_host = [[id(q) in optimizer.host_grads.host for q in layer.parameters()] for layer in layers]
            assert any(any(h) and not all(h) for h in on_host), on_host  # a layer sums on both
            # the weight buffer keeps no slot for a weight at rest on the host
            ((_, messages, _),) = optimizer.after_step
            assert sum(m.numel() for m in messages) == sum(p.numel() for p in params if id(p) not in at_rest)
            weights = WeightOffload(list(layers), 0.5)  # last, as the engine builds it
        else:
            optimizer = MasterWeightAdamW(params, lr=1e-2, fused=True)
        losses = []
        for _ in range(2):
            losses += _train(layers, batches)
            if offloaded:  # a layer's sums on the device hold their own bytes, no more
                for layer in layers:
                    kept = [
                        optimizer.reduced[id(q)] for q in layer.parameters() if id(q) in optimizer.reduced
                    ]
                    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
                    assert sum(held.values()) == sum(t.numel() * t.element_size() for t in kept), held
                # every sum where the step reads it, none on .grad (a GPU sum cannot go on the
                # .grad of a weight resting on the host)
                optimizer.gradients_to_step()
                assert all(p.grad is None and p.step_grad is not None for p in params)
                weights.settle()  # as the engine does before the step writes the host weights
            optimizer.step()
            optimizer.zero_grad()
        if offloaded:
            assert weights.resident() == 0
            assert any(p.device.type == "cpu" for p in params) and all(p.step_grad is None for p in params)
        runs[offloaded] = losses, [p.detach().cpu().clone() for p in params]
    assert _same(runs) != control, runs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("at_rest", [0.0, 0.5], ids=["all-on-the-device", "half-on-the-host"])
def test_zero1_broadcasts_updated_weights_in_place(device, at_rest, one_process_group, rng):
    """ZeRO-1/2's broadcast of the updated weights (ShardedMasterAdamW.broadcast_weights) runs on
    the weights' own buffer: the weights on the device are views into one buffer per owner and
    dtype, so it allocates nothing (a flat copy per owner would hold its whole share twice after
    the step, which the memory model does not price). Weights at rest on the host (half of each
    layer's, WeightOffload's choice, moved there as it moves them) go through the device a bucket
    (a layer) at a time, in one message buffer per dtype of its largest bucket's size, made once
    (which is also the control that the measurement sees the broadcast's allocations); with none
    at rest, flat copies of the weights are the control. Values survive the
    packing and the broadcast bit for bit, and every weight of either dtype keeps its shape. On a
    GPU (NCCL) the caching allocator rounds each block up to 512 bytes."""
    import torch.distributed as dist

    from mist.engine.zero import ShardedMasterAdamW, flat_collective

    rounding = 512 if device == "cuda" else 1
    layers = _stack(8, device, int(rng.integers(2**31)))
    layers[1].half()  # two dtypes: one buffer each
    for p in layers.parameters():
        p.data = torch.from_numpy(rng.standard_normal(tuple(p.shape))).to(device, p.dtype)
    before = [p.detach().cpu() for p in layers.parameters()]
    resting = weights_at_rest_on_host(list(layers), at_rest)
    optimizer = ShardedMasterAdamW(
        [list(layer.parameters()) for layer in layers],
        one_process_group,
        lr=1e-2,
        rest_on_host=frozenset(id(q) for layer in resting for q in layer),
    )
    for q in (q for layer in resting for q in layer):
        q.data = q.data.cpu()  # as WeightOffload moves them (on a CPU: the same memory)
    for p, was in zip(layers.parameters(), before, strict=True):
        assert torch.equal(p.cpu(), was) and p.shape == was.shape
    on_device = [p for p in layers.parameters() if all(p is not q for layer in resting for q in layer)]
    assert len({p.untyped_storage().data_ptr() for p in on_device}) == 2  # one buffer a dtype
    # the in-place messages cover every weight on the device, each once (over one replica a
    # broadcast changes nothing, so this is what says none is left out)
    ((_, messages, _),) = optimizer.after_step
    assert sum(m.numel() for m in messages) == sum(p.numel() for p in on_device)
    for p in on_device:
        start, end = p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()
        inside = [
            m
            for m in messages
            if m.data_ptr() <= start and end <= m.data_ptr() + m.numel() * m.element_size()
        ]
        assert len(inside) == 1, p.shape
    optimizer.broadcast_weights()  # once before measuring: the communicator is made (NCCL)
    peak = device_peak_bytes(optimizer.broadcast_weights, device)[0]
    if at_rest:  # a message buffer per dtype, of its largest bucket, held through the call
        largest: dict[torch.dtype, int] = {}
        for layer in resting:
            for dtype in {q.dtype for q in layer}:
                nbytes = sum(q.numel() * q.element_size() for q in layer if q.dtype == dtype)
                largest[dtype] = max(largest.get(dtype, 0), -(-nbytes // rounding) * rounding)
        assert peak == sum(largest.values()), (peak, largest)
    else:
        assert peak == 0, peak
        # control: flat copies of the same weights (one message a dtype, not in place) allocate
        # at least the largest dtype's (the collective's thread may let go of one after the next
        # is made): the measurement sees them

        def flat_copy() -> None:
            broadcast = lambda flat: dist.broadcast(flat, 0, one_process_group, async_op=True)
            flat_collective([p.data for p in on_device], broadcast)

        copied = device_peak_bytes(flat_copy, device)[0]
        by_dtype: dict[torch.dtype, int] = {}
        for p in on_device:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
        assert max(by_dtype.values()) <= copied < sum(by_dtype.values()) + 2 * rounding, (copied, by_dtype)
    for p, was in zip(layers.parameters(), before, strict=True):
        assert torch.equal(p.cpu(), was)


@pytest.mark.parametrize("device", ["cpu"])
def test_an_owner_sends_the_weights_it_steps_on_the_device_from_their_masters(
    device, one_process_group, monkeypatch, rng
):
    """ZeRO-1/2's owner fills the broadcast's message for a weight at rest on the host from what
    its step keeps on the device where it stepped it there (the fp32 master, cast in the message:
    no copy up), and from the host copy where it stepped it on the host (OffloadedMasterAdamW's
    share, here a random part of the weights at rest). After the step, each device-stepped
    weight's host copy, which the step wrote with the same values, is poisoned (NaN): no message
    may hold a NaN, and each host-stepped weight is sent as it is. Control: at least one weight
    of each kind in every draw; sending the host copies instead fails it."""
    import torch.distributed as dist

    from mist.engine import zero
    from mist.engine.zero import ShardedMasterAdamW

    layers = _stack(int(rng.integers(4, 17)), device, int(rng.integers(2**31)))
    resting = [q for layer in weights_at_rest_on_host(list(layers), 0.5) for q in layer]
    host_share = float(rng.uniform(0.1, 0.4))  # of the rank's share: less than what rests on the host
    optimizer = ShardedMasterAdamW(
        [list(layer.parameters()) for layer in layers],
        one_process_group,
        lr=1e-2,
        offload_fraction=host_share,
        rest_on_host=frozenset(id(q) for q in resting),
    )
    device_stepped = [q for q in resting if optimizer.inner.master_on_device(q) is not None]
    host_stepped = [q for q in resting if optimizer.inner.master_on_device(q) is None]
    assert device_stepped and host_stepped
    for p in layers.parameters():
        p.grad = torch.from_numpy(rng.standard_normal(tuple(p.shape))).to(p.dtype)
    inner_step = optimizer.inner.step

    def step_then_poison() -> None:
        inner_step()
        for q in device_stepped:
            q.data.fill_(float("nan"))

    monkeypatch.setattr(optimizer.inner, "step", step_then_poison)
    messages: list[torch.Tensor] = []
    broadcast = dist.broadcast

    def recorded(flat: torch.Tensor, *args, **kwargs):
        messages.append(flat.clone())
        return broadcast(flat, *args, **kwargs)

    monkeypatch.setattr(zero.dist, "broadcast", recorded)
    optimizer.step()
    sent = {x for m in messages for x in m.tolist()}
    assert messages and not any(torch.isnan(m).any() for m in messages)
    for q in host_stepped:
        assert set(q.data.reshape(-1).tolist()) <= sent


@pytest.mark.parametrize("device", ["cpu"])
@pytest.mark.parametrize("resting", [0.5, 0.0], ids=["half-at-rest-refused", "control-none-at-rest"])
def test_a_weight_gathered_in_the_forward_may_not_rest_on_the_host(device, resting, one_process_group):
    """A bucket the next forward gathers is broadcast in place from the weights' buffer, which
    leaves out the weights at rest on the host: such a weight would never reach the other
    replicas, so ZeRO-1/2 refuses it at once (plan.gather_allowed keeps plans from asking).
    Control: the same gather with every weight on the device is built."""
    from mist.engine.zero import ShardedMasterAdamW

    layers = _stack(8, device, 0)
    at_rest = frozenset(id(q) for layer in weights_at_rest_on_host(list(layers), resting) for q in layer)
    with (
        pytest.raises(ValueError, match="gathered in the forward must rest on the device")
        if resting
        else nullcontext()
    ):
        optimizer = ShardedMasterAdamW(
            [list(layer.parameters()) for layer in layers],
            one_process_group,
            lr=1e-2,
            gather_in_forward=(list(layers), 1),
            rest_on_host=at_rest,
        )
        assert optimizer.gather_groups
