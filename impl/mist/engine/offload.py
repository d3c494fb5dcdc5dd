"""Offloading for mist.engine.run, around megatron-core's modules.

* Optimizer state (``offload_optimizer``, ZeRO-Offload, Ren et al. 2021): the fp32 master weights
  and Adam moments of that fraction of the parameters this rank steps (largest first; with ZeRO,
  of its share) live on the host. Their gradients go down, the host steps them (torch's fused CPU
  AdamW), and the new half-precision weights come back up. The rest step on the device as usual.
* Activations (``offload_activations``, ActivationOffload): the tensors that layers keep for
  backward are moved to the host as they are saved (saved-tensor hooks) and come back when the
  layer's backward begins, the next backward layer's prefetched (the two layers' swap buffers
  Mist's memory model prices); on a CPU the host copies are host work, out of the device peak.
  This covers that fraction of the stage's layers that are not recomputed, rounded to whole
  layers.

* Gradients (``offload_grads``, GradientOffload; under ZeRO-2 ShardedMasterAdamW): that
  fraction of the part's gradients (largest first; under ZeRO-2 of the rank's reduced share)
  accumulates on the host: each micro-batch's gradient is added into a host buffer as soon as
  backward makes it (ZeRO-2: once reduced to its owner, on the device) and freed on the device
  (HostSums); the DP sum (ZeRO-0/1: through the device a gradient's worth at a time, as NCCL
  reads device memory only) and the optimizer step read the host buffer.
* Weights (``offload_weights``, WeightOffload): that fraction of each layer's weights (largest
  first; the embedding and head count as layers) lives on the host and comes up for the layer's
  forward and again for its backward, the next layer's prefetched (the two layers' buffers
  Mist's memory model prices), and is dropped from the device after the forward and once
  backward has made the layer's gradients. ZeRO-1/2's broadcast of the updated weights carries
  those at rest on the host through a message of one bucket (zero.broadcast_through: cast into
  it from the fp32 master where the owner steps on the device, else up from the host; down at
  the others); the others it broadcasts in place (ShardedMasterAdamW keeps them
  in one buffer per owner, the host-resting ones left out: weights_at_rest_on_host).
* Under ZeRO-3 (FSDP2 gathers each layer's weights from the shards and reduce-scatters its
  gradients): that fraction of each module's weight shards rests on the host and is what FSDP2's
  all-gather reads (ShardedWeightOffload), and that fraction of its gradient shards is added
  into host buffers as each reduce-scatter makes them (ShardedGradientOffload). CPU only: on a
  GPU, FSDP2's collectives would read and write host shards, which NCCL cannot.

On a GPU the copies of weights, gradients and activations run on a CUDA stream of their own
(Transfers), overlapping compute as Mist's cost model prices them; mist.engine.run refuses what
is CPU only here. On a CPU-only machine "host" and "device" are the same memory: offloaded tensors
are counted as host bytes and a weight's trip up is a real copy, so the device peak shows what
offloading saves as a GPU would (the copies are not overlapped there).
"""

from __future__ import annotations

import enum
from collections import deque

import torch
from torch import nn

from measure.training import WEIGHT_DECAY, MasterWeightAdamW, copy_across, gradient_to_step, to_across

from ..plan import activation_offloaded_layers
from .hooks import after_gradient_accumulated

# The profiler range of work done in host memory (the offloaded optimizer's step): on a CPU, where
# host and device are one memory, the engine's device peak leaves its allocations out
HOST_WORK = "mist.host_work"
HOST = torch.device("cpu")


def pins_host_memory(device: torch.device) -> bool:
    """Whether host memory holding ``device``'s offloaded tensors is pinned: on a GPU, where a copy
    between them is then a DMA (which an asynchronous copy needs); a CPU has nothing to pin for."""
    return device.type == "cuda"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a ZeRO-3 (FSDP2) parameter or gradient is a DTensor, whose local
    shard is what this rank holds and steps (under no_grad, the very storage)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class CudaCopy:
    """The end of a copy on a GPU's copy stream (Transfers)."""

    __slots__ = ("event",)

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def synchronize(self) -> None:
        """Wait on the host until the copy is done."""
        self.event.synchronize()

    def done(self) -> bool:
        """Whether the copy is done (without waiting)."""
        return self.event.query()

    def hand_to_compute(self, tensor: torch.Tensor) -> None:
        """The compute stream's later work waits for the copy, and the allocator keeps ``tensor``'s
        memory until the work queued on that stream is done, wherever the tensor is freed."""
        compute = torch.cuda.current_stream(tensor.device)
        compute.wait_event(self.event)
        tensor.record_stream(compute)


class CopyTiming(enum.Enum):
    """When Transfers' copies are made on a CPU. ``IN_LINE``: as they are issued (training). The
    deferred timings check the waits a GPU's copy stream needs (DeferredCopy: a copy's destination
    holds poison until it is made, its source is read then):

    * ``LATEST``: a copy is made only when it, or a later copy of its stream, is waited for: a
      read that skipped its wait sees poison, a source changed after the copy was issued shows;
    * ``RUN_AHEAD``: every copy queued is made at the first wait after it, a stream that ran
      ahead: a later copy lands before the host used an earlier one's destination (a staging
      buffer reused while in flight shows).

    What neither can show: waits on the host and on the compute stream are alike on a CPU (a
    host write that a GPU would order only through the compute stream), compute runs eagerly (a
    copy down issued before the compute that makes its source), and a source stays referenced
    until copied (a missing ``record_stream``)."""

    IN_LINE = "in-line"
    LATEST = "latest"
    RUN_AHEAD = "run-ahead"


class _DeferredStream:
    """The copies a deferred Transfers has queued, made in order, as a stream makes them."""

    def __init__(self, run_ahead: bool) -> None:
        self.queue: deque[DeferredCopy] = deque()
        self.run_ahead = run_ahead

    def make_through(self, copy: DeferredCopy) -> None:
        """Make ``copy`` and every copy before it (run ahead: every copy queued)."""
        while copy.source is not None or (self.run_ahead and self.queue):
            first = self.queue.popleft()
            first.destination.copy_(first.source)
            first.source = None


class DeferredCopy:
    """A copy of Transfers' deferred timings (CopyTiming), made by its stream (_DeferredStream)
    when waited for. Until then its destination holds poison: NaN, or for integers and booleans
    the bitwise inverse of the value the copy will bring (each element wrong, whatever it is)."""

    __slots__ = ("destination", "source", "stream")

    def __init__(self, stream: _DeferredStream, source: torch.Tensor, destination: torch.Tensor) -> None:
        self.stream, self.source, self.destination = stream, source, destination
        if destination.is_floating_point() or destination.is_complex():
            destination.fill_(float("nan"))
        else:  # the inverse of what it will hold: that of a copy into the source still queued
            coming = next((c.source for c in reversed(stream.queue) if c.destination is source), source)
            destination.copy_(coming).bitwise_not_()
        stream.queue.append(self)

    def done(self) -> bool:
        return self.source is None

    def synchronize(self) -> None:
        self.stream.make_through(self)

    def hand_to_compute(self, tensor: torch.Tensor) -> None:
        self.stream.make_through(self)


Copy = CudaCopy | DeferredCopy

# when Transfers made from now on, on a CPU, make their copies (``set_copy_timing``)
_COPY_TIMING = CopyTiming.IN_LINE


def set_copy_timing(timing: CopyTiming) -> None:
    """When Transfers made from now on, on a CPU, make their copies (CopyTiming). The deferred
    timings are checks, not a way to train: the copies' sources stay held until made, so the
    device peak reported is not offloading's."""
    global _COPY_TIMING
    _COPY_TIMING = timing


class Arriving:
    """A tensor being copied up to the device (Transfers.up): ``take`` hands it to the compute
    stream once the copy is done."""

    __slots__ = ("pending", "tensor")

    def __init__(self, tensor: torch.Tensor, pending: Copy | None) -> None:
        self.tensor, self.pending = tensor, pending  # pending: the copy not yet waited for

    def take(self) -> torch.Tensor:
        """The tensor, usable on the current (compute) stream: that stream waits for the copy, and
        the allocator keeps the copy's memory until the work queued on it is done, wherever the
        tensor is freed."""
        if self.pending is not None:
            self.pending.hand_to_compute(self.tensor)
            self.pending = None
        return self.tensor


class Transfers:
    """The copies offloading makes between device and host memory. On a GPU they run on a CUDA
    stream of their own, so they overlap the compute stream's work, as Mist's cost model prices
    them (stage_cost overlaps the swaps and weight uploads with compute): a copy up is issued ahead
    (a prefetch) and the compute stream waits for it only where the tensor is first used
    (Arriving.take); a copy down waits for the compute that made its tensor and leaves the
    compute stream free. Host memory is pinned there, which asynchronous copies need. On a CPU,
    where host and device are one memory, each copy is made in line, a real copy all the same:
    the device peak holds what a GPU's would; or, to check the waits, as late or as early as a
    stream may (CopyTiming)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        deferred = self.stream is None and _COPY_TIMING is not CopyTiming.IN_LINE
        self.deferred = _DeferredStream(_COPY_TIMING is CopyTiming.RUN_AHEAD) if deferred else None

    @property
    def asynchronous(self) -> bool:
        """A copy may be done after it is issued (on a GPU's stream, or deferred): it is waited for."""
        return self.stream is not None or self.deferred is not None

    def settle(self) -> None:
        """Wait on the host until every copy issued so far is done."""
        if self.stream is not None:
            self.stream.synchronize()
        elif self.deferred is not None and self.deferred.queue:
            self.deferred.make_through(self.deferred.queue[-1])

    def host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An empty host tensor shaped like ``tensor`` (pinned on a GPU machine)."""
        pin = pins_host_memory(self.device)
        return torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)

    def up(self, host: torch.Tensor) -> Arriving:
        """Begin copying ``host`` to the device."""
        if self.deferred is not None:
            tensor = torch.empty_like(host)
            return Arriving(tensor, DeferredCopy(self.deferred, host, tensor))
        if self.stream is None:
            return Arriving(host.clone(), None)
        with torch.cuda.stream(self.stream):
            tensor = host.to(self.device, non_blocking=True)
            done = CudaCopy(self.stream)
        return Arriving(tensor, done)

    def down(self, tensor: torch.Tensor, host: torch.Tensor) -> Copy | None:
        """Copy ``tensor`` (on the device) into ``host``; returns the copy's end, to wait for (None
        on a CPU, where it is done). On a GPU the copy waits for the work queued so far on the
        compute stream, and the allocator keeps ``tensor``'s memory until the copy is done. A
        later ``up`` of ``host`` is ordered after it by the stream; the host reads it only after
        waiting for it."""
        if self.deferred is not None:
            return DeferredCopy(self.deferred, tensor, host)
        if self.stream is None:
            with torch.profiler.record_function(HOST_WORK):
                host.copy_(tensor)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            done = CudaCopy(self.stream)
        tensor.record_stream(self.stream)
        return done


def split_by_fraction(
    params: list[nn.Parameter], fraction: float, first: frozenset[int] = frozenset()
) -> tuple[list, list]:
    """(host, device): the largest parameters go to the host until ``fraction`` of the elements
    this rank holds (a ZeRO-3 parameter: its shard). Those whose ids are in ``first`` go before the
    others: the weights at rest on the host, so that the optimizer's and the gradients' host
    shares hold them first (then one share holds the other's parameters, the smaller in the
    larger, and a step moves the least over the host link: the placement
    stage_cost.optimizer_step_s prices). Largest first alone would not nest them: equal sizes
    (an MLP's two weights) are taken layer by layer over a part, a weight per layer by the weight
    offload."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the offloaded fraction must be in [0, 1], got {fraction}")
    total = sum(local(p).numel() for p in params)
    host, moved = [], 0
    for p in sorted(params, key=lambda q: (id(q) not in first, -local(q).numel())):
        if moved + local(p).numel() <= fraction * total + 0.5:
            host.append(p)
            moved += local(p).numel()
    chosen = {id(p) for p in host}
    return host, [p for p in params if id(p) not in chosen]


class OffloadedMasterAdamW:
    """Mixed-precision AdamW with the optimizer of a fraction of the parameters on the host. The
    parameters may be this rank's share under ZeRO-1/2 (ShardedMasterAdamW steps its share with
    one) or ZeRO-3 DTensors (their local shards are stepped). ``at_rest_on_host``: ids of the
    weights at rest on the host, stepped there first (split_by_fraction)."""

    def __init__(
        self,
        params,
        fraction: float,
        lr: float,
        weight_decay: float = WEIGHT_DECAY,
        at_rest_on_host: frozenset[int] = frozenset(),
    ) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        host, device = split_by_fraction(self.model_params, fraction, at_rest_on_host)
        self.device_opt = (
            MasterWeightAdamW(device, lr=lr, weight_decay=weight_decay, fused=True) if device else None
        )
        self.host_params = host
        self.host_master = [local(p).detach().to("cpu", torch.float32, copy=True) for p in host]
        if host and pins_host_memory(local(host[0]).device):
            self.host_master = [m.pin_memory() for m in self.host_master]
        for m in self.host_master:
            m.requires_grad_(True)
        self.host_opt = (
            torch.optim.AdamW(self.host_master, lr=lr, weight_decay=weight_decay, fused=True)
            if host
            else None
        )

    @torch.no_grad()
    def step(self) -> None:
        if self.device_opt is not None:
            self.device_opt.step()
        if self.host_opt is None:
            return
        with torch.profiler.record_function(HOST_WORK):
            for p, master in zip(self.host_params, self.host_master, strict=True):
                grad = gradient_to_step(p)
                master.grad = None if grad is None else to_across(local(grad), HOST, torch.float32)  # down
            self.host_opt.step()
            for p, master in zip(self.host_params, self.host_master, strict=True):
                copy_across(local(p), master, non_blocking=True)  # up, in the model's dtype
                master.grad = None

    def master_on_device(self, p: nn.Parameter) -> torch.Tensor | None:
        """``p``'s fp32 master where its step runs on the device (None: on the host)."""
        return None if self.device_opt is None else self.device_opt.master_on_device(p)

    def zero_grad(self) -> None:
        if self.device_opt is not None:
            self.device_opt.zero_grad()
        for p in self.host_params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer tensors on the device (the host ones are in host_tensors)."""
        return self.device_opt.state_tensors() if self.device_opt is not None else []

    def host_tensors(self) -> list[torch.Tensor]:
        state = [t for s in (self.host_opt.state.values() if self.host_opt else []) for t in s.values()]
        return [*self.host_master, *(t for t in state if isinstance(t, torch.Tensor))]


def offload_layer_activations(model, recompute: int, fraction: float) -> int:
    """Wrap ``plan.activation_offloaded_layers`` of the layers (those after the recomputed ones) so
    what they save for backward waits on the host (``ActivationOffload``); returns how many layers
    were wrapped."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload_activations must be in [0, 1], got {fraction}")
    layers = list(model.decoder.layers)
    count = int(activation_offloaded_layers(fraction, len(layers) - recompute))
    if count:
        ActivationOffload(layers[recompute : recompute + count])
    return count


class _Swapped:
    """One saved tensor: its host copy and, once brought up for backward, its device copy (on a CPU
    a real copy too: the device peak holds it while backward uses it, as a GPU holds the copy it
    brings up)."""

    __slots__ = ("host", "transfers", "up")

    def __init__(self, transfers: Transfers, host: torch.Tensor) -> None:
        self.transfers, self.host, self.up = transfers, host, None

    def bring_up(self) -> None:
        if self.up is None:
            self.up = self.transfers.up(self.host)


class ActivationOffload:
    """What ``layers`` keep for backward waits on the host between their forward and backward,
    swapped as Mist's memory model prices it (the two layers' swap buffers of
    ``stage_cost._device_memory``): each tensor goes down as it is saved; when a layer's backward
    begins, everything it saved comes up and the previous layer's (the next backward's) is
    prefetched, so backward holds at most two offloaded layers' activations at a time. A copy
    leaves the device once backward has used it. Micro-batches in flight (1F1B, gradient
    accumulation) run backward in the order of their forwards: each layer keeps a queue of its
    micro-batches' saved tensors (were that order broken, only when copies come up would change,
    never a value: each saved tensor comes back from its own host copy). On a GPU the copies run
    on a stream of their own (Transfers): down as each tensor is saved, up ahead of the backward
    that reads it."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.transfers = Transfers(next(layers[0].parameters()).device)
        self.queues: list[list[list[_Swapped]]] = [[] for _ in layers]  # layer -> micro-batch -> saved
        for i, layer in enumerate(layers):
            forward = layer.forward

            def wrapped(*args, _forward=forward, _i=i, **kwargs):
                if not torch.is_grad_enabled():  # nothing is saved: no micro-batch to queue
                    return _forward(*args, **kwargs)
                saved: list[_Swapped] = []
                self.queues[_i].append(saved)
                to_host = lambda t: _to_host(t, saved, self.transfers)
                with torch.autograd.graph.saved_tensors_hooks(to_host, _from_host):
                    return _forward(*args, **kwargs)

            layer.forward = wrapped
            layer.register_full_backward_pre_hook(lambda _m, _g, i=i: self._backward_begins(i))

    def _backward_begins(self, i: int) -> None:
        """Layer i's backward of its oldest micro-batch begins (backward runs the layers in
        reverse): its saved tensors come up, and the previous layer's for the same micro-batch."""
        if not self.queues[i]:
            return
        for t in self.queues[i].pop(0):
            t.bring_up()
        if i > 0 and self.queues[i - 1]:
            for t in self.queues[i - 1][0]:
                t.bring_up()


def _is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves its weight, or its transpose, for the
    input's gradient): it stays on the device whether or not activations are offloaded."""
    base = tensor if tensor._base is None else tensor._base
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


def _to_host(tensor: torch.Tensor, saved: list[_Swapped], transfers: Transfers) -> _Swapped | torch.Tensor:
    """A saved tensor's copy in host memory. On a CPU, where host and device are one memory, the
    copy is made as host work so the device peak leaves it out, as a GPU's would (torch's
    save_on_cpu keeps it in the peak there). Weights are not activations: they are kept as they
    are (swapping them would bring a copy of the layer's weights up with its activations, 3 MiB a
    layer in the engine's test model, which the memory model rightly does not price). Neither are
    tensors already off the device: Tempo's ops save their dropout seed, a CPU scalar, which must
    come back to its op as it was (on a GPU it would come back on the device)."""
    if _is_weight(tensor) or tensor.device != transfers.device:
        return tensor
    with torch.profiler.record_function(HOST_WORK):
        host = transfers.host_like(tensor)
    transfers.down(tensor, host)
    swapped = _Swapped(transfers, host)
    saved.append(swapped)
    return swapped


def _from_host(swapped: _Swapped | torch.Tensor) -> torch.Tensor:
    """The saved tensor on its device for backward: the copy brought up (or begun now, where no
    hook brought it), handed to autograd, which frees it after the op's backward."""
    if isinstance(swapped, torch.Tensor):  # a weight, never swapped
        return swapped
    swapped.bring_up()
    up, swapped.up = swapped.up, None
    return up.take()


def weights_at_rest_on_host(layers: list[nn.Module], fraction: float) -> list[list[nn.Parameter]]:
    """The weights WeightOffload keeps on the host (ShardedWeightOffload: the shards): of each
    layer, ``fraction`` of its parameters, largest first (known before it is built: ZeRO-1/2's
    weight buffers leave them out, the offloaded optimizer and gradients take them first)."""
    return [split_by_fraction([q for q in m.parameters() if q.requires_grad], fraction)[0] for m in layers]


class WeightOffload:
    """Weights of ``fraction`` of each of ``layers``' parameters at rest on the host (see the module
    docstring). The parameters keep their identity (optimizers and autograd hold them); only what
    ``.data`` points at changes: the host copy at rest, a copy of it while the layer runs. The
    optimizer steps the host copy in place (on a GPU a copy down from the master weights).

    Built after the optimizers and gradient buffers, which are made where the weights are, the
    device. On a GPU the gradients stay there (a view into ContiguousGrads, or as autograd made
    them) while ``.data`` rests on the host: ZeRO-1/2's broadcast copies it through the device
    (zero.broadcast_through); a ZeRO-3 gather over DP would read it, which NCCL cannot (ZeRO-3
    offloads its shards instead: ShardedWeightOffload, CPU only)."""

    def __init__(self, layers: list[nn.Module], fraction: float, prefetch: bool = True) -> None:
        self.layers = layers
        self.prefetch = prefetch  # the next module's weights with this one's (off: they run apart)
        self.offloaded: list[list[nn.Parameter]] = []
        self.host: dict[int, torch.Tensor] = {}
        # layer -> offloaded gradients this backward has still to make (each makes each one once)
        self.pending = [0] * len(layers)
        self.up = [False] * len(layers)  # layer -> its offloaded weights are on the device
        self.arriving: list[list[Arriving]] = [[] for _ in layers]  # layer -> copies not yet waited for
        self.transfers = Transfers(next(p for m in layers for p in m.parameters()).device)
        at_rest = weights_at_rest_on_host(layers, fraction)
        for i, (layer, host) in enumerate(zip(layers, at_rest, strict=True)):
            self.offloaded.append(host)
            self.pending[i] = len(host)
            for q in host:
                self.host[id(q)] = self.transfers.host_like(q)
                self.host[id(q)].copy_(q.detach())
                q.data = self.host[id(q)]
                after_gradient_accumulated(q, self._made_gradient, i)
            layer.register_forward_pre_hook(lambda _m, _a, i=i: self._before(i, step=1))
            layer.register_forward_hook(lambda _m, _a, _o, i=i: self._down(i))
            # before the layer's backward and so before a recomputed layer's second forward (the
            # checkpoint reruns the bare forward, which no module hook sees): it keeps them up
            layer.register_full_backward_pre_hook(lambda _m, _g, i=i: self._before(i, step=-1))

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self.host.values())

    def settle(self) -> None:
        """Before the step writes the host copies: every copy up that reads them done (the
        compute stream waited for each, the host may not have)."""
        self.transfers.settle()

    def resident(self) -> int:
        """How many offloaded parameters are on the device now (none between steps)."""
        return sum(len(ps) for ps, up in zip(self.offloaded, self.up, strict=True) if up)

    def _before(self, i: int, step: int) -> None:
        """Layer i is about to run (forward: step 1, backward: step -1): bring it up and wait for
        it, and begin bringing up the next one in that direction (the prefetch the memory model
        prices as a second layer's buffer), which runs while layer i computes."""
        self._up(i)
        for copy in self.arriving[i]:
            copy.take()
        self.arriving[i] = []
        if self.prefetch and 0 <= i + step < len(self.layers):
            self._up(i + step)

    def _up(self, i: int) -> None:
        if self.up[i]:
            return
        self.up[i] = True
        for q in self.offloaded[i]:  # a real copy: the device buffer the memory model prices
            copy = self.transfers.up(self.host[id(q)])
            q.data = copy.tensor  # not read before _before(i) has waited for it
            self.arriving[i].append(copy)

    def _down(self, i: int) -> None:
        self.up[i] = False
        for copy in self.arriving[i]:  # a prefetch never waited for: done before the step may
            if copy.pending is not None:  # write the host copy it reads (none is, in 1F1B's order)
                copy.pending.synchronize()
        self.arriving[i] = []
        for q in self.offloaded[i]:
            q.data = self.host[id(q)]  # the device copy is freed (weights change only in the step)

    def _made_gradient(self, _q: nn.Parameter, i: int) -> None:
        self.pending[i] -= 1
        if self.pending[i] == 0:  # this backward has made the layer's gradients: drop its weights
            self._down(i)
            self.pending[i] = len(self.offloaded[i])


def flat_views(
    params: list[nn.Parameter], device: torch.device | str, pin: bool = False
) -> tuple[list[torch.Tensor], dict]:
    """One zeroed flat buffer per dtype on ``device`` (in the same order on every rank; ``pin``:
    in pinned host memory) and, by parameter id, a view of it shaped like the parameter: what one
    collective per buffer sums."""
    buffers, views = [], {}
    for dtype in sorted({p.dtype for p in params}, key=str):
        group = [p for p in params if p.dtype == dtype]
        flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device, pin_memory=pin)
        offset = 0
        for p in group:
            views[id(p)] = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        buffers.append(flat)
    return buffers, views


class HostSums:
    """Sums in host memory (``host``: key -> buffer) of tensors made on the device, one addend at a
    time (``add``). On a GPU an addend goes down on the copy stream (Transfers) into a pinned
    staging buffer and is added on the host once that copy is done, meanwhile the compute stream
    runs on: the copies done are added at each ``add``, the rest in ``finish``, oldest first (a
    stream makes them in order), so each sum adds its addends in the CPU's order, bit for bit.
    A staging buffer added is reused (kept by shape and dtype), and the bytes in flight are at
    most the sums' (the host waits for the oldest copy first): at most as much host memory again.
    On a CPU an addend is added in place. A ZeRO-3 buffer is a DTensor: its local shard is added
    to."""

    def __init__(self, device: torch.device, host: dict[int, torch.Tensor]) -> None:
        self.host = host
        self.transfers = Transfers(device)
        self.in_flight: deque[tuple[int, torch.Tensor, Copy]] = deque()  # (key, staging, its copy)
        self.free: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) -> staging buffers added
        self.limit = sum(local(t).numel() * local(t).element_size() for t in host.values())
        self.in_flight_bytes = 0

    def add(self, key: int, tensor: torch.Tensor) -> None:
        """Add ``tensor`` (on the device) into ``host[key]``; the caller may free it at once."""
        if not self.transfers.asynchronous:
            with torch.profiler.record_function(HOST_WORK):  # down, added on the host
                local(self.host[key]).add_(tensor)
            return
        nbytes = tensor.numel() * tensor.element_size()
        while self.in_flight and (self.in_flight[0][2].done() or self.in_flight_bytes + nbytes > self.limit):
            self._add_oldest()
        free = self.free.get((tensor.shape, tensor.dtype))
        staging = free.pop() if free else self.transfers.host_like(tensor)
        self.in_flight.append((key, staging, self.transfers.down(tensor, staging)))
        self.in_flight_bytes += nbytes

    def _add_oldest(self) -> None:
        """The oldest addend in flight added, once its copy is done (waiting for it)."""
        key, staging, copy = self.in_flight.popleft()
        copy.synchronize()
        with torch.profiler.record_function(HOST_WORK):
            local(self.host[key]).add_(staging)
        self.in_flight_bytes -= staging.numel() * staging.element_size()
        self.free.setdefault((staging.shape, staging.dtype), []).append(staging)

    def finish(self) -> None:
        """Every addend so far in its sum."""
        while self.in_flight:
            self._add_oldest()

    def zero(self) -> None:
        for buffer in self.host.values():
            local(buffer).zero_()

    def tensors(self) -> list[torch.Tensor]:
        """The host sums, and on a GPU the staging buffers."""
        staging = [t for _, t, _ in self.in_flight] + [t for ts in self.free.values() for t in ts]
        return [local(t) for t in self.host.values()] + staging


class _HostGradients:
    """Gradients of ``params`` added into host sums (``sums``: HostSums, by parameter id) as
    backward makes them, and dropped on the device; ``attach`` puts the sums where the optimizer
    reads them (``p.step_grad``: measure.training.gradient_to_step). A ZeRO-3 parameter, its
    gradient and its buffer are DTensors: each rank's shard is what is added."""

    params: list[nn.Parameter]
    sums: HostSums

    @property
    def host(self) -> dict[int, torch.Tensor]:
        """Parameter id -> its host sum."""
        return self.sums.host

    def _drain(self, p: nn.Parameter) -> None:
        self.sums.add(id(p), local(p.grad))
        p.grad = None  # freed on the device (on a GPU once its copy down is done)

    def attach(self) -> None:
        """The summed gradients where the optimizer reads them, for its step."""
        self.sums.finish()
        for p in self.params:
            p.step_grad = self.host[id(p)]

    def zero(self) -> None:
        for p in self.params:
            p.grad = p.step_grad = None
        self.sums.zero()

    def host_tensors(self) -> list[torch.Tensor]:
        """The host sums, and on a GPU their staging buffers."""
        return self.sums.tensors()


class GradientOffload(_HostGradients):
    """Gradients of ``fraction`` of ``params`` (largest first) accumulated on the host, for a part
    whose gradients are otherwise all-reduced after backward (ZeRO-0/1). Sequence-parallel
    weights stay on the device: their TP sum reads ``.grad`` (they are a norm's few elements).
    The host buffers are views into one flat buffer per dtype, so the DP sum is one all-reduce,
    as on the device (zero.ContiguousGrads) and as the cost model prices it: one per parameter
    paid gloo's latency per parameter (the 2-process Llama plan's sync took 2x the grid's).
    ``at_rest_on_host``: ids of the weights at rest on the host, summed there first
    (split_by_fraction). ``shares``: ``params`` grouped by the replica that steps them (ZeRO-1's
    owners: ShardedMasterAdamW.shares), the fraction taken of each, so that every replica's step
    finds that fraction of its gradients on the host, as stage_cost prices each stepped
    parameter (taken over the whole part, the largest first, one replica's share could be all on
    the host and another's none); None: one share, the whole of ``params``."""

    def __init__(
        self,
        params: list[nn.Parameter],
        fraction: float,
        at_rest_on_host: frozenset[int] = frozenset(),
        shares: list[list[nn.Parameter]] | None = None,
    ) -> None:
        if shares is not None and sorted(id(p) for share in shares for p in share) != sorted(map(id, params)):
            raise ValueError("the shares must hold each of the parameters once, and nothing else")
        self.params = [
            p
            for share in (shares if shares is not None else [params])
            for p in split_by_fraction(
                [q for q in share if not getattr(q, "sequence_parallel", False)], fraction, at_rest_on_host
            )[0]
        ]
        device = params[0].device
        # pinned on a GPU machine: the step's copy of a device-stepped part's sums up is then a DMA
        self.buffers, host = flat_views(self.params, "cpu", pin=pins_host_memory(device))
        self.sums = HostSums(device, host)
        # elements of the DP sum's staging on the device: the largest gradient, which backward
        # held there as it made it
        self.piece = max((p.numel() for p in self.params), default=0)
        for p in self.params:
            after_gradient_accumulated(p, self._drain)

    def all_reduce(self, group, divide_by: int, device: torch.device) -> None:
        """The DP sum of the host buffers over ``group``, averaged. Where the collective runs on
        another ``device`` than the host (NCCL reads device memory only), each buffer goes
        through it in pieces of at most the largest gradient, one staging buffer reused: up,
        summed there, down; so the sum is a device all-reduce, as the cost model prices it, with
        the trip up and back (stage_cost's ``host_sum_trip``). On a CPU each buffer is summed in
        place, one all-reduce."""
        import torch.distributed as dist

        self.sums.finish()
        for flat in self.buffers:
            if flat.device == device:
                dist.all_reduce(flat, group=group)
            else:
                self._sum_through(flat, group, device)  # its staging freed before the next's
            flat /= divide_by

    def _sum_through(self, flat: torch.Tensor, group, device: torch.device) -> None:
        """``flat``'s DP sum through ``device``, a piece at a time (all_reduce)."""
        import torch.distributed as dist

        staging = torch.empty(min(self.piece, flat.numel()), dtype=flat.dtype, device=device)
        for piece in flat.split(self.piece):
            on_device = staging[: piece.numel()]
            on_device.copy_(piece, non_blocking=True)  # from pinned memory: a DMA
            dist.all_reduce(on_device, group=group)
            piece.copy_(on_device)  # waits: the next piece reuses the staging


class ShardedWeightOffload:
    """ZeRO-3's weights at rest on the host: of each of ``modules`` (FSDP2 groups), that fraction of
    its parameters (largest first, by this rank's shard). FSDP2's all-gather reads the shard and
    builds the full weights on the device, the buffers the memory model prices; the optimizer
    steps the shard in place. On a CPU the shard's own trip up is that read, with no staging
    copy (a GPU would copy one group's shard up before its all-gather: transient, unpriced), so
    this is where the engine keeps the offloaded bytes: they are counted as host bytes, not
    device ones, and a shard left out of ``host_tensors`` is counted on the device."""

    def __init__(self, modules: list[nn.Module], fraction: float) -> None:
        self.offloaded = [p for host in weights_at_rest_on_host(modules, fraction) for p in host]

    def host_tensors(self) -> list[torch.Tensor]:
        return [local(p) for p in self.offloaded]

    def settle(self) -> None:
        """Nothing to wait for: FSDP2's all-gather reads the shards (CPU only)."""

    def resident(self) -> int:
        """Offloaded weights on the device between steps: none (FSDP2 frees what it gathered)."""
        return 0


class ShardedGradientOffload(_HostGradients):
    """ZeRO-3's gradients accumulated on the host: that fraction of ``modules``' (FSDP2 groups)
    parameters, largest first by this rank's shard. As FSDP2's reduce-scatter makes a
    micro-batch's gradient shard, it is added into a host buffer and dropped on the device (FSDP2
    calls the shard's post-accumulate-grad hooks). A group's shards are views into one
    reduce-scatter output, which one shard left on the device would keep whole: in a group with
    some shards drained, those kept are copied out of it. Sequence-parallel weights (norms) stay
    on the device: their TP sum reads ``.grad``. ``attach`` puts the host sums where the
    optimizer reads them. ``at_rest_on_host``: ids of the shards at rest on the host, summed
    there first (split_by_fraction)."""

    def __init__(
        self, modules: list[nn.Module], fraction: float, at_rest_on_host: frozenset[int] = frozenset()
    ) -> None:
        groups = [[q for q in m.parameters() if q.requires_grad] for m in modules]
        candidates = [q for g in groups for q in g if not getattr(q, "sequence_parallel", False)]
        self.params, _ = split_by_fraction(candidates, fraction, at_rest_on_host)
        chosen = {id(q) for q in self.params}
        for group in groups:
            if not any(id(q) in chosen for q in group):
                continue
            for q in group:
                if id(q) in chosen:
                    after_gradient_accumulated(q, self._drain)
                else:  # a static method: it holds nothing
                    q.register_post_accumulate_grad_hook(self._own_storage)
        # DTensors like the shards (same mesh and placements): the step reads them as gradients.
        # CPU only (mist.engine.run refuses it on a GPU): added in place
        self.sums = HostSums(torch.device("cpu"), {id(p): torch.zeros_like(p) for p in self.params})

    @staticmethod
    def _own_storage(p: nn.Parameter) -> None:
        g = local(p.grad)
        if g.untyped_storage().nbytes() > g.numel() * g.element_size():  # a view into the group's output
            p.grad = p.grad.clone()
