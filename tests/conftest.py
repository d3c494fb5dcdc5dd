"""Test setup: fresh random inputs every run (the seed is printed so a failure can be replayed),
and Triton kernels run in the interpreter when there is no GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined (i.e. before tempo.kernels loads).
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Seed torch from the OS per test; replay a failure with TEST_SEED=<printed seed>."""
    seed = int(os.environ.get("TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        for name, value in item.user_properties:
            if name == "seed":
                print(f"\n[replay with TEST_SEED={value}]")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run by `nox -s gpu_check`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
