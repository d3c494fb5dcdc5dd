"""Gradient and optimizer-state sharding for mist.engine.run, around megatron-core's modules:
gradients in one contiguous buffer per dtype (``ContiguousGrads``, as Megatron's DDP), ZeRO-1/2
(``ShardedMasterAdamW``: fp32 master weights and Adam state sharded over the DP replicas by
buckets of one layer, and with ZeRO-2 the gradients too) and ZeRO-3 (``shard_parameters``:
torch's FSDP2 per layer, of the whole stage or of one of its parts)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from measure.training import gradient_to_step

from .hooks import after_gradient_accumulated
from .offload import HostSums, flat_views, pins_host_memory
from .pipeline import gpt_modules


def _assign_owners(
    buckets: list[list[torch.Tensor]], ranks: list[int]
) -> tuple[dict[int, int], dict[int, int]]:
    """({id(param): owner rank}, {id(param): bucket index}): each bucket, largest first, to the
    least-loaded rank (by parameters). Every rank walks the same order: the same owners everywhere."""
    load = [0] * len(ranks)
    owner: dict[int, int] = {}
    bucket_of: dict[int, int] = {}
    by_size = sorted(range(len(buckets)), key=lambda i: -sum(p.numel() for p in buckets[i]))
    for i in by_size:
        least = min(range(len(ranks)), key=load.__getitem__)
        load[least] += sum(p.numel() for p in buckets[i])
        for p in buckets[i]:
            owner[id(p)] = ranks[least]
            bucket_of[id(p)] = i
    return owner, bucket_of


class ShardedMasterAdamW:
    """ZeRO-1/2 around megatron-core's modules: each DP rank keeps the fp32 master weights and
    Adam state of its share of the parameters only, steps them, and broadcasts the updated
    half-precision weights to the other replicas (with ``offload_fraction``, that fraction of its
    share steps on the host: OffloadedMasterAdamW). Shares are whole buckets (a transformer layer,
    the embedding, the head: what Mist's model prices one collective for), greedy by size. With
    ``shard_grads`` (ZeRO-2) a bucket's gradients are reduced to its owner in one message as soon
    as a micro-batch's backward has made them all, and freed elsewhere, so no rank holds the
    full gradients.

    ``gather_in_forward`` (Megatron-LM's --overlap-param-gather): (modules, bucket parameters). The
    updated weights are not broadcast after the step but during the next forward, in groups of
    consecutive buckets in the modules' (forward) order of at least that many parameters: as the
    first module of a group starts, its group's broadcasts are waited for (begun then if not yet)
    and the next group's begun, so they run beside this group's forward. Every DP replica runs the
    same forward order, so the collectives match.

    Every broadcast is in place: the weights on the device are views into one buffer per owner and
    dtype (``_pack_weights``); ``rest_on_host``: ids of weights WeightOffload keeps on the host,
    left out of it and broadcast through the device a bucket at a time, and the first the
    offloaded optimizer steps and the offloaded gradients sum on the host (split_by_fraction)."""

    def __init__(
        self,
        buckets: list[list[torch.Tensor]],
        group,
        lr: float,
        shard_grads: bool = False,
        offload_fraction: float = 0.0,
        sequence_parallel_group=None,
        offload_grads: float = 0.0,
        gather_in_forward: tuple[list[torch.nn.Module], int] | None = None,
        rest_on_host: frozenset[int] = frozenset(),
    ) -> None:
        from measure.training import MasterWeightAdamW

        from .offload import OffloadedMasterAdamW, split_by_fraction

        if offload_grads > 0 and not shard_grads:
            raise ValueError(
                "gradient offload of a ZeRO-1 part is GradientOffload's (its grads are all-reduced)"
            )
        # where the collectives run (NCCL: the GPU); host-resident weights are copied through it
        self.device = buckets[0][0].device
        self.buckets = [[p for p in bucket if p.requires_grad] for bucket in buckets]
        self.buckets = [b for b in self.buckets if b]
        self.params = [p for bucket in self.buckets for p in bucket]
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        self.owner, self.bucket_of = _assign_owners(self.buckets, ranks)
        me = dist.get_rank()
        self.dp = len(ranks)
        self.gather_groups = [] if gather_in_forward is None else self._gather_groups(*gather_in_forward)
        # before the optimizer's copies are made: the device holds the less while it packs
        self.after_step, self.gather_messages = self._pack_weights(rest_on_host)
        # broadcast_weights' message buffer per dtype: the largest host-resting bucket's elements
        self.host_message_sizes: dict[torch.dtype, int] = {}
        for bucket in (b for _, _, host_buckets in self.after_step for b in host_buckets):
            for dtype in {p.dtype for p in bucket}:
                n = sum(p.numel() for p in bucket if p.dtype == dtype)
                self.host_message_sizes[dtype] = max(n, self.host_message_sizes.get(dtype, 0))
        owned = [p for p in self.params if self.owner[id(p)] == me]
        # optimizer offload (ZeRO-Offload): that fraction of this rank's share steps on the host.
        # A part with fewer buckets than replicas (the head alone) leaves some rank nothing to step.
        self.owned = owned
        self.inner = (
            None
            if not owned
            else OffloadedMasterAdamW(owned, offload_fraction, lr, at_rest_on_host=rest_on_host)
            if offload_fraction > 0
            else MasterWeightAdamW(owned, lr=lr, fused=True)
        )
        self.reduced: dict[int, torch.Tensor] = {}  # owned parameters' summed gradients (ZeRO-2)
        self.averaged = False  # ZeRO-2: this step's sums are averaged and on .grad
        # gradient offload under ZeRO-2: that fraction of this rank's share sums on the host
        on_host, _ = split_by_fraction(owned, offload_grads, rest_on_host) if owned else ([], [])
        pin = pins_host_memory(self.device)  # on a GPU: its copies down are DMAs
        self.host_grads = HostSums(
            self.device, {id(p): torch.zeros(p.shape, dtype=p.dtype, pin_memory=pin) for p in on_host}
        )
        self.pending: dict[int, list[torch.Tensor]] = {}  # bucket -> gradients made this micro-batch
        self.shard_grads = shard_grads
        # ZeRO-2 with sequence parallelism: the gradients of weights marked sequence_parallel (the
        # norms) are partial sums over the sequence shards, summed over the TP group before the
        # DP reduction (the engine does it after backward when gradients are not sharded)
        self.sequence_parallel_group = sequence_parallel_group
        if shard_grads:
            for p in self.params:
                after_gradient_accumulated(p, self._collect)
        self.stale: set[int] = set()  # gather groups whose broadcasts this step has not yet begun
        self.in_flight: dict[int, list] = {}  # group -> its broadcasts begun, not yet waited for
        self.gathered_in_forward = 0  # groups a forward waited for since the last step

    def shares(self) -> list[list[torch.Tensor]]:
        """The parameters each replica steps (its buckets): one list per rank that owns any, in
        rank order, the same on every rank."""
        ranks = sorted(set(self.owner.values()))
        return [[p for p in self.params if self.owner[id(p)] == rank] for rank in ranks]

    def _gather_groups(self, modules: list[torch.nn.Module], bucket_params: int) -> list[list[int]]:
        """Buckets in groups of at least ``bucket_params`` parameters, in the order ``modules`` run
        forward (each of its buckets in the first module holding one), each group's first module
        hooked to wait for it. Buckets in no module stay broadcast after the step."""
        groups: list[list[int]] = []
        size, seen = bucket_params, set()
        for module in modules:
            mine = [self.bucket_of[id(p)] for p in module.parameters() if id(p) in self.bucket_of]
            mine = sorted(set(mine) - seen, key=mine.index)
            if not mine:
                continue
            seen.update(mine)
            if size >= bucket_params:  # the group so far is full: this module starts the next
                groups.append([])
                size = 0
                index = len(groups) - 1
                module.register_forward_pre_hook(lambda *_, g=index: self._before_forward(g))
            groups[-1] += mine
            size += sum(p.numel() for i in mine for p in self.buckets[i])
        return groups

    def _pack_weights(self, rest_on_host: frozenset[int]) -> tuple[list, dict]:
        """Each owner's weights that rest on this device made views into one contiguous buffer per
        dtype, so that a broadcast of updated weights reads and writes them in place, as
        Megatron-LM's distributed optimizer gathers into its parameter buffer: a flat copy per
        message held an owner's whole share twice after the step, which the memory model does not
        price. In each buffer the buckets broadcast after the step come first (one message), then
        each bucket a forward gathers (one message each, ``gather_groups``). Weights in
        ``rest_on_host`` (ids: WeightOffload's) are left out: a slot kept for them would keep
        their device bytes. Returns (after the step: [(owner, in-place messages, host-resting
        weights by bucket)], {gathered bucket: in-place messages}); every rank builds the same
        layout (the same buckets, owners and weights at rest)."""
        gathered = [i for group in self.gather_groups for i in group]
        if any(id(p) in rest_on_host for i in gathered for p in self.buckets[i]):
            # (a weight at rest on the host would be in no in-place message: never broadcast)
            raise ValueError("weights gathered in the forward must rest on the device (plan.gather_allowed)")
        after_step, gather_messages = [], {}
        for owner in sorted(set(self.owner.values())):
            mine = [i for i in range(len(self.buckets)) if self.owner[id(self.buckets[i][0])] == owner]
            after = [i for i in mine if i not in gathered]
            order = after + [i for i in gathered if i in mine]
            buffers = _contiguous(
                [[p for p in self.buckets[i] if id(p) not in rest_on_host] for i in order], self.device
            )
            for k, i in enumerate(order[len(after) :], start=len(after)):
                gather_messages[i] = [
                    b[ends[k] : ends[k + 1]] for b, ends in buffers if ends[k + 1] > ends[k]
                ]
            messages = [b[: ends[len(after)]] for b, ends in buffers if ends[len(after)] > 0]
            host = [[p for p in self.buckets[i] if id(p) in rest_on_host] for i in after]
            after_step.append((owner, messages, [b for b in host if b]))
        return after_step, gather_messages

    def _begin_gather(self, g: int) -> None:
        self.stale.discard(g)
        works = []
        for i in self.gather_groups[g]:
            owner = self.owner[id(self.buckets[i][0])]
            for flat in self.gather_messages[i]:
                works.append(dist.broadcast(flat, owner, self.group, async_op=True).wait)
        self.in_flight[g] = works

    def _finish_gather(self, g: int) -> None:
        if g in self.stale:
            self._begin_gather(g)
        for finish in self.in_flight.pop(g, []):
            finish()

    def _before_forward(self, g: int) -> None:
        if g not in self.stale and g not in self.in_flight:  # gathered already this step
            return
        self._finish_gather(g)
        self.gathered_in_forward += 1
        if g + 1 < len(self.gather_groups) and g + 1 in self.stale:
            self._begin_gather(g + 1)

    def finish_gathers(self) -> None:
        """Every weight as this step left it, on every replica (the groups no forward has waited
        for yet gathered now, in order)."""
        for g in range(len(self.gather_groups)):
            self._finish_gather(g)

    def _collect(self, p: torch.Tensor) -> None:
        i = self.bucket_of[id(p)]
        ready = self.pending.setdefault(i, [])
        ready.append(p)
        if len(ready) < len(self.buckets[i]):
            return
        del self.pending[i]
        bucket = self.buckets[i]  # a fixed order: the same flat layout on every rank
        partial = [q.grad for q in bucket if getattr(q, "sequence_parallel", False)]
        if partial and self.sequence_parallel_group is not None:
            group = self.sequence_parallel_group
            flat_collective(partial, lambda flat: dist.all_reduce(flat, group=group, async_op=True))
        flat = torch.cat([q.grad.reshape(-1) for q in bucket])
        for q in bucket:
            q.grad = None
        owner = self.owner[id(bucket[0])]
        dist.reduce(flat, dst=owner, group=self.group)
        if owner != dist.get_rank():
            return
        # where some of the bucket sums on the host, a view kept of the rest would keep the whole
        # message, the host's part included: the rest is copied out of it
        mixed = any(id(q) in self.host_grads.host for q in bucket)
        offset = 0
        for q in bucket:
            summed = flat[offset : offset + q.numel()].view_as(q)
            offset += q.numel()
            if id(q) in self.host_grads.host:  # down, added on the host
                self.host_grads.add(id(q), summed)
                continue
            so_far = self.reduced.get(id(q))
            if so_far is None:  # a view into this bucket's message: all of it is mine, or a copy
                self.reduced[id(q)] = summed.clone() if mixed else summed
            else:
                so_far.add_(summed)

    def gradients_to_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, gradient) of this rank's share as its step reads them (for clipping's norm):
        under ZeRO-2 the reduced sums (on the host or the device), averaged over DP once a step
        and put on ``.step_grad`` (``.grad`` must be on the parameter's device, and a weight may
        rest on the host: WeightOffload); under ZeRO-1 each parameter's (GradientOffload's host
        sums where it drained them)."""
        if self.shard_grads and not self.averaged:
            self.host_grads.finish()
            for p in self.owned:
                summed = self.host_grads.host.get(id(p))
                summed = self.reduced.pop(id(p), None) if summed is None else summed
                p.step_grad = None if summed is None else summed.div_(self.dp)
            self.averaged = True
        return [(p, g) for p in self.owned if (g := gradient_to_step(p)) is not None]

    def step(self) -> None:
        self.finish_gathers()  # (a forward has waited for them all)
        self.gradients_to_step()
        self.averaged = False
        self.gathered_in_forward = 0
        if self.inner is not None:
            self.inner.step()
        self.broadcast_weights()
        self.stale = set(range(len(self.gather_groups)))

    def broadcast_weights(self) -> None:
        """Each owner's updated weights to the other replicas: one broadcast per owner and dtype, in
        place, of all its weights on the device but those the next forward gathers (what Mist's
        model prices as the engine's weight sync where `mist profile` measured it:
        RuntimeModel.zero_weight_sync); then those at rest on the host, bucket by bucket, each
        through the device (a message of one bucket at a time: broadcast_through)."""
        # one message buffer per dtype for every host-resting bucket, allocated once: a buffer
        # per message would be freed by the collective's thread when it lets go, maybe after the
        # next is made
        staging = {
            dtype: torch.empty(n, dtype=dtype, device=self.device)
            for dtype, n in self.host_message_sizes.items()
        }
        me = dist.get_rank()
        for owner, messages, host_buckets in self.after_step:
            for work in [dist.broadcast(flat, owner, self.group, async_op=True) for flat in messages]:
                work.wait()
            for bucket in host_buckets:
                broadcast_through(
                    [p.data for p in bucket],
                    [self._sent(p) for p in bucket] if me == owner else None,
                    lambda flat, src=owner: dist.broadcast(flat, src, self.group, async_op=True),
                    staging,
                )

    def _sent(self, p: torch.Tensor) -> torch.Tensor:
        """What this owner broadcasts of ``p``, a weight at rest on the host: its fp32 master where
        the step keeps that on the device (cast into the message there; the step has copied the
        same values, cast alike, down into ``p``: measure.training.copy_across), so that only the
        host-stepped share crosses up, else ``p`` on the host. (An owner steps something: its
        ``inner`` is set.)"""
        master = self.inner.master_on_device(p)
        return p.data if master is None else master

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = p.step_grad = None
        self.host_grads.zero()

    def state_tensors(self) -> list[torch.Tensor]:
        return self.inner.state_tensors() if self.inner is not None else []

    def host_tensors(self) -> list[torch.Tensor]:
        """The offloaded share's optimizer tensors, on the host (none without offloading)."""
        return self.inner.host_tensors() if hasattr(self.inner, "host_tensors") else []

    def host_gradient_tensors(self) -> list[torch.Tensor]:
        return self.host_grads.tensors()


def layer_buckets(model) -> list[list[torch.Tensor]]:
    """The parameters in the groups Mist prices one collective for: each transformer layer, and
    the others grouped by the module that holds them (word and position embeddings, final norm,
    output layer)."""
    layers = [layer for gpt in gpt_modules(model) for layer in gpt.decoder.layers]
    seen = {id(p) for layer in layers for p in layer.parameters()}
    rest = []
    for module in model.modules():  # each module's own parameters, once (a tied weight: its first)
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            rest.append(own)
    return [list(layer.parameters()) for layer in layers] + rest


def shard_parameters(model, dp_group, device: torch.device, groups: list, whole: set) -> None:
    """ZeRO-3 with torch's FSDP2 (``fully_shard``) over the DP group: each module of ``groups`` (a
    layer, the embedding, the head) is a group whose weights are gathered before its forward and
    its backward and freed after, its gradients reduce-scattered (averaged) as backward makes them.
    The root (the whole model) takes what no group did (the final norm) but the parameters in
    ``whole``: a part of the stage that is not ZeRO-3, whose gradients the engine reduces. With TP,
    each TP rank's DP group shards that rank's tensor-parallel part."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    # FSDP2 replaces the parameters by DTensors, dropping megatron-core's attributes: the one the
    # engine reads (sequence_parallel: sum the gradient over the TP group) is put back by name
    marked = {name for name, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    mesh = DeviceMesh.from_group(dp_group, device.type)
    # reshard_after_forward given: a module FSDP2 takes as a root would otherwise stay gathered
    # from its forward to its backward (the embedding and head: their own groups, so one at a time
    # is gathered, as the memory model prices them)
    for module in groups:
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
    for name, p in model.named_parameters():
        if name in marked:
            p.sequence_parallel = True


class ContiguousGrads:
    """Gradients as Megatron's DDP keeps them: every parameter's ``.grad`` is a view into one flat
    buffer per dtype, allocated once. Backward accumulates into it in place, the data-parallel
    sum is one in-place all-reduce per buffer (no per-tensor latency, no flattening copy).

    ``overlap``: (group, bucket parameters, micro-batches a step): the sum runs bucket by bucket
    during the last micro-batch's backward instead (Megatron-LM's --overlap-grad-reduce). The
    buffer is laid out in backward order (the parameters reversed, as Megatron's DDP does) and cut
    into buckets of at least that many parameters; a bucket's all-reduce starts, asynchronously,
    once every one of its parameters has had its gradient accumulated for every micro-batch."""

    def __init__(self, params, overlap: tuple | None = None) -> None:
        params = [p for p in params if p.requires_grad]
        if overlap is not None:
            params = params[::-1]
        self.buffers, views = flat_views(params, params[0].device) if params else ([], {})
        for p in params:
            p.grad = views[id(p)]
        self.works: list = []
        self.buckets: list[list[torch.Tensor]] = []  # none: the sum runs after backward
        self.needed: list[int] = []  # gradient accumulations a bucket waits for
        self.made: list[int] = []  # ...and has had this step
        self.launched_in_backward = 0  # this step's buckets whose sum began during backward
        if overlap is not None and params:
            self.group, bucket_params, micro_batches = overlap
            current, size = [], 0
            for p in params:
                current.append(p)
                size += p.numel()
                if size >= bucket_params:
                    self.buckets.append(current)
                    current, size = [], 0
            self.buckets += [current] if current else []
            self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
            self.needed = [len(bucket) * micro_batches for bucket in self.buckets]
            self.made = [0] * len(self.buckets)
            self.slices = [self._slices(bucket) for bucket in self.buckets]
            for p in params:
                after_gradient_accumulated(p, self._accumulated)

    def _slices(self, bucket: list[torch.Tensor]) -> list[torch.Tensor]:
        """A bucket's part of each dtype's buffer (its parameters are consecutive in each)."""
        out = []
        for flat in self.buffers:
            mine = [p.grad for p in bucket if p.grad.dtype == flat.dtype]
            if mine:
                lo = min(g.storage_offset() for g in mine) - flat.storage_offset()
                hi = max(g.storage_offset() + g.numel() for g in mine) - flat.storage_offset()
                out.append(flat[lo:hi])
        return out

    def _launch(self, i: int) -> None:
        self.works += [dist.all_reduce(part, group=self.group, async_op=True) for part in self.slices[i]]

    def _accumulated(self, p: torch.Tensor) -> None:
        i = self.bucket_of[id(p)]
        self.made[i] += 1
        if self.made[i] == self.needed[i]:
            self._launch(i)
            self.launched_in_backward += 1

    def wait(self) -> None:
        """Every bucket's sum done (a bucket some parameter of which made no gradient is summed
        now), where overlapping; nothing otherwise."""
        for i, made in enumerate(self.made):
            if made < self.needed[i]:
                self._launch(i)
        for work in self.works:
            work.wait()
        self.works.clear()

    def all_reduce(self, group, divide_by: int) -> None:
        if self.buckets:
            self.wait()
        else:
            for flat in self.buffers:
                dist.all_reduce(flat, group=group)
        for flat in self.buffers:
            flat /= divide_by

    def zero(self) -> None:
        for flat in self.buffers:
            flat.zero_()
        if self.buckets:
            self.made = [0] * len(self.buckets)
            self.launched_in_backward = 0


def _contiguous(
    groups: list[list[torch.Tensor]], device: torch.device
) -> list[tuple[torch.Tensor, list[int]]]:
    """Make the parameters of ``groups`` views into one new buffer per dtype on ``device``, group
    after group, their values copied. Off a CPU they wait on the host meanwhile, so the device
    never holds them twice (under a plan's memory cap the build would otherwise need a share of
    the weights more than training). Unpadded: each starts where the one before ends (real
    shapes are multiples of 64 elements). Returns per dtype, in a fixed order, its buffer and
    where each group starts and the last ends: group ``k``'s parameters of that dtype are
    ``buffer[ends[k] : ends[k + 1]]``."""
    buffers = []
    for dtype in sorted({p.dtype for group in groups for p in group}, key=str):
        members = [[p for p in group if p.dtype == dtype] for group in groups]
        if device.type != "cpu":
            for p in (p for group in members for p in group):
                p.data = p.data.cpu()  # the device copy freed
        buffer = torch.empty(sum(p.numel() for group in members for p in group), dtype=dtype, device=device)
        offset, ends = 0, [0]
        for group in members:
            for p in group:
                view = buffer[offset : offset + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
                offset += p.numel()
            ends.append(offset)
        buffers.append((buffer, ends))
    return buffers


@torch.no_grad()  # (a master sent is a leaf that requires grad)
def broadcast_through(
    tensors: list[torch.Tensor],
    sent: list[torch.Tensor] | None,
    broadcast,
    staging: dict[torch.dtype, torch.Tensor],
) -> None:
    """``broadcast(flat)`` (async, returns its work) of ``tensors`` at rest on the host, once per
    dtype, through a message in ``staging`` (a buffer per dtype, at least that large, on the
    device the collective reads). ``sent``: at the source, each tensor's value to send (the tensor
    itself, copied up, or a copy already on the device, cast into the message there: no trip up);
    None elsewhere, where the message is copied down. Neither copies what it holds already: the
    others' values are overwritten, the source's are the message (what Mist's model prices: the
    source's share up where it is not on the device, the rest down)."""
    if sent is not None and len(sent) != len(tensors):
        raise ValueError(f"{len(sent)} values to send for {len(tensors)} tensors")
    for dtype in sorted({t.dtype for t in tensors}, key=str):  # same order on every rank
        mine = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = staging[dtype][: sum(tensors[i].numel() for i in mine)]
        pieces = flat.split([tensors[i].numel() for i in mine])
        if sent is not None:
            for i, piece in zip(mine, pieces, strict=True):
                piece.copy_(sent[i].reshape(-1))
        work = broadcast(flat)
        work.wait()
        del work
        if sent is None:
            for i, piece in zip(mine, pieces, strict=True):
                tensors[i].copy_(piece.view_as(tensors[i]))


def flat_collective(tensors: list[torch.Tensor], collective) -> None:
    """Run ``collective(flat)`` (async, returns its work) once per dtype on a flat copy of
    ``tensors`` (on their device), then copy the result back: a collective per tensor pays its
    latency per tensor. (Weights at rest on the host go through the device: broadcast_through.)"""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for dtype in sorted({t.dtype for t in tensors}, key=str):  # same order on every rank
        bucket = [t for t in tensors if t.dtype == dtype]
        flat = _flatten_dense_tensors(bucket)  # (one contiguous tensor: itself, no copy)
        work = collective(flat)
        work.wait()
        del work  # the copy is then freed by this thread, where the CPU memory profiler sees it
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            t.copy_(synced)
