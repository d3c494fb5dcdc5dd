"""Exact bytes kept for backward, via ``torch.autograd.graph.saved_tensors_hooks``.

Every tensor autograd saves passes through the pack hook. We count each *storage* once: a
tensor saved by two ops, or two views of one buffer (Q, K, V as views of one projection),
cost memory once. Storages of the model's parameters and buffers are reported apart (they
exist anyway), as are storages that existed before the measured region (e.g. the input).
Each new storage is attributed to the innermost module running when it was first saved, which
tells where the bytes went.

Works on real tensors and on FakeTensor/meta tensors (storages are told apart by their C++
identity, not their address).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class SavedTensorsReport:
    activation_bytes: int  # storages first created for, and saved by, the measured region
    parameter_bytes: int  # saved storages that are the model's parameters or buffers
    input_bytes: int  # saved storages that existed before the region (inputs)
    by_module: dict[str, int] = field(default_factory=dict)  # qualified name -> activation bytes
    by_module_type: dict[str, int] = field(default_factory=dict)  # class name -> activation bytes
    by_dtype: dict[str, int] = field(default_factory=dict)
    storages: int = 0

    @property
    def total_bytes(self) -> int:
        """Everything the backward keeps alive except the parameters."""
        return self.activation_bytes + self.input_bytes


class SavedTensorsMeter:
    """Context manager: ``with SavedTensorsMeter(model, inputs=(x,)) as m: loss = model(x)``."""

    def __init__(self, model: nn.Module | None = None, inputs: tuple[torch.Tensor, ...] = ()) -> None:
        self._model = model
        self._param_keys: set[int] = set()
        if model is not None:
            for t in [*model.parameters(), *model.buffers()]:
                self._param_keys.add(storage_key(t))
        self._input_keys = {storage_key(t) for t in inputs}
        self._seen: dict[int, tuple[int, str, str, str]] = {}  # key -> (bytes, module, type, dtype)
        self._module_stack: list[tuple[str, str]] = [("<top>", "<top>")]
        self._handles: list = []
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None  # while entered

    # A tensor with no storage (e.g. a sparse or nested one) cannot be counted honestly.
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self._seen:
            name, kind = self._module_stack[-1]
            self._seen[key] = (t.untyped_storage().nbytes(), name, kind, str(t.dtype).removeprefix("torch."))
        # Kept detached (the same storage and version counter): a saved output packed as itself
        # holds its own grad_fn, a cycle through autograd's C++ that Python's collector cannot see,
        # so every graph measured stayed alive, and with it what its nodes hold (megatron-core's
        # process groups: 48 gloo threads a layer measured, 12,834 in a seed-sweep worker).
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensorsMeter:
        if self._model is not None:
            for name, module in self._model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._push(name or "<model>", module)))
                self._handles.append(module.register_forward_hook(self._pop))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        # Dropped, not kept: it holds this meter's bound methods, a cycle (meter -> hooks -> meter)
        # that kept the model alive until Python's cyclic collector ran, rarely in a large process
        # (megatron-core's process groups with it: 6,000 gloo threads in a seed-sweep worker).
        self._hooks = None
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _push(self, name: str, module: nn.Module):
        kind = type(module).__name__

        def hook(_module, _args):
            self._module_stack.append((name, kind))

        return hook

    def _pop(self, _module, _args, _out) -> None:
        self._module_stack.pop()

    def report(self) -> SavedTensorsReport:
        by_module: dict[str, int] = defaultdict(int)
        by_type: dict[str, int] = defaultdict(int)
        by_dtype: dict[str, int] = defaultdict(int)
        act = params = inputs = 0
        for key, (nbytes, name, kind, dtype) in self._seen.items():
            if key in self._param_keys:
                params += nbytes
            elif key in self._input_keys:
                inputs += nbytes
            else:
                act += nbytes
                by_module[name] += nbytes
                by_type[kind] += nbytes
                by_dtype[dtype] += nbytes
        return SavedTensorsReport(
            act, params, inputs, dict(by_module), dict(by_type), dict(by_dtype), len(self._seen)
        )


def _cuda_like_dropout(x, p=0.5, training=True, inplace=False):
    if training and p > 0 and not inplace:
        return torch.native_dropout(x, p, True)[0]
    return _TORCH_DROPOUT(x, p, training, inplace)


def _cuda_like_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if is_fake(query) and not enable_gqa:
        out, _logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, bool(is_causal), attn_mask=attn_mask, scale=scale
        )
        return out
    return _TORCH_SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


_TORCH_DROPOUT = nn.functional.dropout
_TORCH_SDPA = nn.functional.scaled_dot_product_attention


@contextmanager
def _swapped(name: str, replacement) -> Iterator[None]:
    # Swapped on the module (not a TorchFunctionMode) so that activation checkpointing's
    # recomputation inside backward runs the very same function as the forward did.
    original = getattr(nn.functional, name)
    setattr(nn.functional, name, replacement)
    try:
        yield
    finally:
        setattr(nn.functional, name, original)


@contextmanager
def cuda_like_dropout() -> Iterator[None]:
    """Make ``F.dropout`` on CPU keep what it keeps on CUDA.

    On CUDA, F.dropout runs the fused ``native_dropout`` and keeps a bool mask (1 byte per
    element). On CPU it is composed as ``x * noise`` and keeps ``noise`` in x's dtype (2-4 bytes),
    which would inflate any CPU measurement of a baseline. Here F.dropout calls
    ``native_dropout``, the very op CUDA uses (it has a CPU kernel), so bytes measured on CPU are
    the bytes the model keeps on a GPU.
    """
    with _swapped("dropout", _cuda_like_dropout):
        yield


@contextmanager
def cuda_like_attention() -> Iterator[None]:
    """Make ``F.scaled_dot_product_attention`` on *fake* CPU tensors keep what CUDA's fused
    kernels keep: Q, K, V, the output, a float32 logsumexp per row (and the mask, if one is
    given, as the memory-efficient kernel does), never an s x s matrix.

    On CPU, SDPA with dropout falls back to the math path and keeps several s x s tensors, so a
    CPU measurement would misstate what SDPA costs on a GPU. Here SDPA on fake tensors runs
    ``_scaled_dot_product_flash_attention_for_cpu``, whose saved tensors are those of CUDA flash
    attention; dropout changes no saved bytes there (CUDA keeps an RNG seed and offset). Real
    tensors are left alone: the substitute ignores dropout, so it is fit for memory accounting
    only.
    """
    with _swapped("scaled_dot_product_attention", _cuda_like_sdpa):
        yield


@contextmanager
def cuda_like() -> Iterator[None]:
    """Both substitutions: CPU measurements of what a model keeps on a CUDA GPU."""
    with cuda_like_dropout(), cuda_like_attention():
        yield


def saved_bytes(model: nn.Module, *inputs: torch.Tensor, **kwargs) -> SavedTensorsReport:
    """Bytes ``model(*inputs, **kwargs)`` keeps for backward (one forward, graph then dropped)."""
    tensor_inputs = tuple(t for t in (*inputs, *kwargs.values()) if isinstance(t, torch.Tensor))
    with SavedTensorsMeter(model, tensor_inputs) as meter:
        out = model(*inputs, **kwargs)
    del out
    return meter.report()
