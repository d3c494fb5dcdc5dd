"""The engine's gradient hooks hold their owners weakly (mist.engine.hooks): a bound method kept by
a parameter's C++ autograd metadata made an optimizer, its parameters and its process group live
for the whole process (a seed-sweep worker piled up 2,400 gloo threads)."""

from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from mist.engine.hooks import after_gradient_accumulated

IMPL = Path(__file__).resolve().parents[2] / "impl"


class _Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def record(self, t: torch.Tensor, tag: str = "") -> None:
        self.calls.append((id(t), tag))


def _backward(model: nn.Module) -> None:
    model(torch.randn(2, model.in_features)).sum().backward()


def test_a_hook_runs_while_its_owner_lives_and_does_not_keep_it():
    """Control: the same method registered directly keeps its owner, the collector run."""
    model = nn.Linear(3, 2)
    seen = _Seen()
    after_gradient_accumulated(model.weight, seen.record, "w")
    _backward(model)
    _backward(model)
    assert seen.calls == [(id(model.weight), "w")] * 2
    alive = weakref.ref(seen)
    del seen
    assert alive() is None  # by reference counting alone: no cycle held it
    _backward(model)  # its hook now does nothing, and fails nothing

    kept = _Seen()
    model.weight.register_post_accumulate_grad_hook(kept.record)
    alive = weakref.ref(kept)
    del kept
    gc.collect()
    assert alive() is not None


def test_only_bound_methods_are_taken():
    with pytest.raises(TypeError):
        after_gradient_accumulated(nn.Linear(3, 2).weight, lambda t: None)


def _sharded_master_adamw(layers: nn.ModuleList, group):
    from mist.engine.zero import ShardedMasterAdamW

    buckets = [list(layer.parameters()) for layer in layers]
    return ShardedMasterAdamW(buckets, group, lr=1e-3, shard_grads=True, offload_grads=0.5)


def _contiguous_grads(layers: nn.ModuleList, group):
    from mist.engine.zero import ContiguousGrads

    return ContiguousGrads(list(layers.parameters()), overlap=(group, 16, 1))


def _gradient_offload(layers: nn.ModuleList, group):
    from mist.engine.offload import GradientOffload

    return GradientOffload(list(layers.parameters()), 0.5)


def _weight_offload(layers: nn.ModuleList, group):
    from mist.engine.offload import WeightOffload

    return WeightOffload(list(layers), 0.5)


@pytest.mark.parametrize(
    "build", [_sharded_master_adamw, _contiguous_grads, _gradient_offload, _weight_offload]
)
def test_what_the_engine_hooks_on_gradients_is_freed_with_its_model(build, one_process_group):
    """Each lives as long as the layers it works on (their module hooks hold it, which the
    collector sees), and no longer: freed with them, its process group then free to end."""
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    owner = build(layers, one_process_group)
    x = torch.randn(4, 8)
    for layer in layers:
        x = layer(x)
    x.square().mean().backward()  # its hooks ran
    alive = weakref.ref(owner)
    del owner, layers, layer, x
    gc.collect()
    assert alive() is None


def test_no_engine_code_hooks_a_bound_method_on_a_gradient_directly():
    """Each hook on a gradient goes through after_gradient_accumulated (a static method holds
    nothing and may be registered as it is)."""
    direct = re.compile(r"register_post_accumulate_grad_hook\((?!self\._own_storage\))")
    found = [
        f"{path.relative_to(IMPL)}:{n}"
        for path in IMPL.rglob("*.py")
        if path.name != "hooks.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert found == []
