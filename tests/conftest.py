"""Test setup.

Fresh random inputs every run, all from one seed a test: torch's, numpy's and Python's global
generators, the ``rng`` fixture (a numpy Generator) and Hypothesis are all seeded from it, and a
failure prints it (replay with ``TEST_SEED=<seed>``). Each test also records in its report whether
it drew random inputs (``draws_random``), which the seed sweep (tests/sweep.py) reads. Triton kernels
run in the interpreter when there is no GPU.
"""

from __future__ import annotations

import inspect
import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined (i.e. before tempo.kernels loads).
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def _global_rng_states() -> tuple:
    """What a draw from a global generator changes (CPU torch, numpy's legacy one, Python's)."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return torch.random.get_rng_state(), (keys.tobytes(), pos, has_gauss, cached), random.getstate()


def _same_states(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def pytest_configure(config: pytest.Config) -> None:
    seed = os.environ.get("TEST_SEED")
    if seed is not None and not (seed.isdigit() and int(seed) < 2**32):
        raise pytest.UsageError(f"TEST_SEED must be a whole number from 0 to 2**32 - 1, got {seed!r}")


def _seed_of(request: pytest.FixtureRequest) -> int:
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "sweep_seed" in callspec.params:  # given by tests/sweep.py
        return callspec.params["sweep_seed"]
    if "TEST_SEED" in os.environ:
        return int(os.environ["TEST_SEED"])
    return int.from_bytes(os.urandom(4), "little")


@pytest.fixture(autouse=True)
def fresh_seed(request: pytest.FixtureRequest):
    """Seed every generator a test may draw from; replay a failure with TEST_SEED=<printed seed>."""
    seed = _seed_of(request)
    torch.manual_seed(seed)
    np.random.seed(seed)  # seeds are 32-bit: numpy's legacy generator takes them as they are
    random.seed(seed)
    test = request.function
    if getattr(test, "is_hypothesis_test", False):
        from hypothesis import seed as hypothesis_seed

        hypothesis_seed(seed)(test)  # and no example database: the seed alone decides the examples
    request.node.user_properties.append(("seed", seed))
    before = _global_rng_states()
    yield seed
    # Runs after every other fixture's teardown (autouse fixtures are set up first): it sees them all.
    moved = not _same_states(before, _global_rng_states())
    asked = "rng" in request.fixturenames or "fresh_seed" in inspect.signature(test).parameters
    draws_random = moved or asked or getattr(test, "is_hypothesis_test", False)
    request.node.user_properties.append(("draws_random", draws_random))  # reports carry it (xdist too)


@pytest.fixture
def rng(fresh_seed: int) -> np.random.Generator:
    """A numpy Generator drawn from the test's seed."""
    return np.random.default_rng(fresh_seed)


def _start_order(item: pytest.Item) -> tuple[int, int, float]:
    """Where CUDA is, the ``gpu`` tests first: the GPU check runs its tests within a budget, and
    the ones only a GPU can run must not be the ones it cuts. Then longest first: ``slow`` tests
    (processes, or > ~10 s), those allowed the longest timeout first, then the rest, each group in
    collection order (the sort is stable)."""
    timeout = item.get_closest_marker("timeout")
    allowed = float(timeout.args[0]) if timeout and timeout.args else 0.0
    gpu_first = 0 if HAS_CUDA and "gpu" in item.keywords else 1
    return (gpu_first, 0 if "slow" in item.keywords else 1, -allowed)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The suite runs one xdist worker a core (nox -s tests); a long test started last would keep
    # one worker busy while the others idle, so the long ones start first. Deterministic: every
    # worker must collect the same order.
    items.sort(key=_start_order)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run by `nox -s gpu_check`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> None:
    if call.when == "call" and call.excinfo is not None:
        for name, value in item.user_properties:
            if name == "seed":
                print(f"\n[replay with TEST_SEED={value}]")
