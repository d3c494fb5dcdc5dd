"""Gradients accumulated on the host (``GradientOffload``) live in one flat buffer per dtype, so the
data-parallel sum is one all-reduce per dtype, as the cost model prices it; backward drains every
gradient into its view and the sum covers every view."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

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
        offload.all_reduce(None, divide_by=2)  # halving is exact in binary floating point
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
