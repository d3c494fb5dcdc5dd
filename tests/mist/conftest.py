"""Fixtures shared by Mist's engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_process_group(request):
    """A process group of this process alone (NCCL for a GPU's tensors where the test is
    parametrized with ``device="cuda"``, else gloo), torn down after the test: ZeRO's collectives
    over one replica run the same code as over many."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    callspec = getattr(request.node, "callspec", None)
    on_gpu = callspec is not None and callspec.params.get("device") == "cuda"
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if on_gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()
