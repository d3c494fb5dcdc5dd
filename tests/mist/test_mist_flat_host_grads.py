"""Gradients accumulated on the host (``GradientOffload``) live in one flat buffer per dtype, so the
data-parallel sum is one all-reduce per dtype, as the cost model prices it; backward drains every
gradient into its view and the sum covers every view. Where the collective runs on a device
(NCCL), the sum goes through it a gradient's worth at a time."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from measure.cpu_peak import device_peak_bytes
from mist.engine.offload import GradientOffload


def _params(rng) -> list[nn.Parameter]:
    dtypes = (torch.bfloat16, torch.float32)
    shapes = [tuple(int(x) for x in rng.integers(1, 9, size=int(rng.integers(1, 4)))) for _ in range(7)]
    return [nn.Parameter(torch.zeros(shape, dtype=dtypes[i % 2])) for i, shape in enumerate(shapes)]


def test_host_gradients_are_views_of_one_buffer_per_dtype_and_sum_in_one_collective(rng):
    params = _params(rng)
    offload = GradientOffload(params, 1.0)
    assert len(offload.params) == len(params)
    assert sorted(str(b.dtype) for b in offload.buffers) == ["torch.bfloat16", "torch.float32"]
    storages = {b.untyped_storage().data_ptr(): b for b in offload.buffers}
    for p in params:
        view = offload.host[id(p)]
        assert view.shape == p.shape and view.dtype == p.dtype
        # a buffer of its own (the old layout) would fail here: the view must be inside its dtype's flat one
        assert storages[view.untyped_storage().data_ptr()].dtype == p.dtype
    for b in offload.buffers:
        assert b.numel() == sum(p.numel() for p in params if p.dtype == b.dtype)

    # backward drains each gradient into its view and drops it from the parameter
    weights = [torch.from_numpy(rng.standard_normal(p.shape)) for p in params]
    loss = sum((p.double() * w).sum() for p, w in zip(params, weights, strict=True))
    loss.backward()
    for p, w in zip(params, weights, strict=True):
        assert p.grad is None
        assert torch.equal(offload.host[id(p)], w.to(p.dtype))

    # the DP sum: one all-reduce a buffer reaches every view (one process: the sum is the value)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        offload.all_reduce(None, 2, torch.device("cpu"))  # halving is exact in binary floating point
    finally:
        if started:
            dist.destroy_process_group()
    for p, w in zip(params, weights, strict=True):
        assert torch.equal(offload.host[id(p)], w.to(p.dtype) / 2)
    offload.zero()
    assert all(not b.any() for b in offload.buffers)


def test_no_parameters_no_buffers():
    offload = GradientOffload([nn.Parameter(torch.zeros(3))], 0.0)
    assert offload.params == [] and offload.buffers == [] and offload.host == {}


@pytest.mark.parametrize(
    "device",
    ["cpu", "cpu:0", pytest.param("cuda", marks=pytest.mark.gpu)],
    ids=["in-place", "through-the-device", "through-a-gpu"],
)
def test_the_dp_sum_goes_through_the_device_a_gradient_at_a_time(device, rng, monkeypatch):
    """Where the DP group's collectives run on another device than the host (NCCL reads device
    memory only), each host buffer is summed through it in pieces of at most the largest
    gradient, one staging buffer reused: every element comes back summed and averaged (a piece
    not copied back would not), the device holds one piece at a time, and a buffer takes
    ceil(its elements / the piece) collectives. ``cpu:0``, which no CPU tensor's device equals,
    makes the copies run as on a GPU (the GPU check runs them on one); the "all-reduce" doubles
    its tensor (the sum of two equal replicas). Control, in place (the collective on the host, as
    on a CPU): one collective a buffer and no allocation but a scalar's."""
    params = _params(rng)
    if device == "cuda":  # the host sums pinned, the staging on the GPU
        params = [nn.Parameter(p.detach().cuda()) for p in params]
    offload = GradientOffload(params, 1.0)
    values = {}
    for p in params:
        values[id(p)] = torch.from_numpy(rng.standard_normal(p.shape)).to(p.dtype)
        offload.host[id(p)].copy_(values[id(p)])
    messages = []

    def doubling(tensor: torch.Tensor, group=None) -> None:
        messages.append((tensor.dtype, tensor.numel()))
        tensor.add_(tensor)  # (a python scalar's operand would be an allocation of its own)

    monkeypatch.setattr(dist, "all_reduce", doubling)
    peak = device_peak_bytes(lambda: offload.all_reduce(None, 2, torch.device(device)), device)[0]
    for p in params:  # doubled, then halved: exact
        assert torch.equal(offload.host[id(p)], values[id(p)])
    piece = max(p.numel() for p in params)
    for b in offload.buffers:
        sizes = [n for dtype, n in messages if dtype == b.dtype]
        if device == "cpu":
            assert sizes == [b.numel()]
        else:
            assert len(sizes) == -(-b.numel() // piece) and max(sizes) <= piece, (sizes, piece)
    # the average's division allocates its scalar operand on the host (10-12 bytes measured); the
    # CUDA caching allocator rounds a block up to 512 bytes
    staged = 0 if device == "cpu" else max(min(piece, b.numel()) * b.element_size() for b in offload.buffers)
    slack = 512 if device == "cuda" else 16
    assert staged <= peak < staged + slack, (peak, staged)
