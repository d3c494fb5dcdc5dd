"""What ``torch.compile`` keeps for backward, found without compiling kernels (so on fake tensors
too): AOTAutograd traces forward and backward as one graph with inductor's decompositions, and
its min-cut partitioner (inductor's) splits it, recomputing cheap ops in backward instead of
saving them, as far as ``torch._functorch.config.activation_memory_budget`` asks. The two graphs
then run op by op, as plain aten ops; the tensors the forward graph hands to the backward graph
are what a compiled model keeps.

Checked against real ``torch.compile`` (inductor) on a BERT-Large encoder layer (float32, seq 128,
CPU, 2026-12-03): 11,027,968 bytes kept here against 11,030,016 compiled (0.02%: inductor keeps
two RNG scalars more), and Tempo's layer 6,882,328 both; tested on small layers at the default
budget and, for HF's, below it. Tempo's custom ops below the default budget are partitioned
otherwise than by inductor (at 0.3 on a small layer 363 KB kept here against 242 KB; the cause
not found): not used.

What this does not give: inductor's fusion. The decomposed graphs run unfused materialise what a
fused kernel never does (bfloat16 softmaxes and norms upcast to float32 over s x s scores: a
BERT-Large step at seq 512 peaked 0.9 GiB above eager's this way), so a step's peak measured
through them says nothing of the compiled step's; only the bytes kept are taken from here.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch
from torch import nn


class _LossOf(nn.Module):
    """A model's loss as a module of positional tensors (what AOTAutograd traces): ``keys`` name
    the batch's tensors in order."""

    def __init__(self, model: nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.model(**dict(zip(self.keys, tensors, strict=True))).loss,)


def _as_is(graph: torch.fx.GraphModule, _example_inputs) -> Callable:
    from functorch.compile import make_boxed_func

    return make_boxed_func(graph)


def compile_partitioned(module: nn.Module, example: list[torch.Tensor], budget: float = 1.0) -> Callable:
    """``module`` (positional tensors in, a tuple of tensors out) as ``torch.compile`` partitions
    it at the activation memory ``budget`` (1.0: the default; lower: recompute more), traced at
    ``example``'s shapes; returns the callable that runs its forward graph (and, in backward,
    its backward graph) op by op."""
    import torch._functorch.config as functorch_config
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"activation memory budget must be in [0, 1], got {budget!r}")
    # The model's Python runs once, here, as under Dynamo: code that asks whether it is being
    # compiled (transformers skips its data-dependent padding check then) is told it is
    compiling = mock.patch.object(torch.compiler, "is_compiling", lambda: True)
    with functorch_config.patch(activation_memory_budget=budget), compiling:
        return aot_module_simplified(
            module,
            example,
            fw_compiler=_as_is,
            bw_compiler=_as_is,
            partition_fn=min_cut_rematerialization_partition,
            decompositions=select_decomp_table(),
        )


def compiled_loss(model: nn.Module, batch: dict[str, torch.Tensor], budget: float = 1.0) -> Callable:
    """``loss_of(model, batch)`` for ``measure.training.train_step``: ``model(**batch).loss`` as
    ``torch.compile`` partitions it at ``budget``, traced at ``batch``'s shapes."""
    keys = list(batch)
    partitioned = compile_partitioned(_LossOf(model, keys), [batch[k] for k in keys], budget)

    def loss_of(_model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        (loss,) = partitioned(*[b[k] for k in keys])
        return loss

    return loss_of
