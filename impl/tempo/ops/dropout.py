"""Lean dropout: keeps an 8-byte RNG seed for backward instead of a mask (Tempo's hidden dropouts).

The keep-mask is a pure function of (seed, shape, p), so backward regenerates it, as
FlashAttention does for attention dropout. torch's own dropout keeps a 1-byte-per-element mask.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._common import (
    check_float,
    check_probability,
    check_training,
    chunks,
    dropout_keep_mask,
    new_seed,
    use_triton,
)


def dropout_apply_torch(x: Tensor, p: float, seed: Tensor) -> Tensor:
    """x * keep / (1 - p) with the keep-mask of (seed, p), chunk by chunk (PyTorch path)."""
    x_flat = x.reshape(-1)
    # Allocated in x's shape and written through a flat view: the op must return a tensor that is
    # not a view, or autograd refuses in-place changes to the output (which torch's dropout allows,
    # and which are safe here: backward needs only the seed).
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_flat = y.view(-1)
    for i, part in chunks(x_flat.numel()):
        keep = dropout_keep_mask(seed, i, (part.stop - part.start,), p, x.device)
        y_flat[part] = x_flat[part] * keep * (1.0 / (1.0 - p))
    return y


@torch.library.custom_op("tempo::dropout", mutates_args=())
def dropout_op(x: Tensor, p: float, seed: Tensor) -> Tensor:
    """Dropout of a contiguous x with the mask of ``seed`` (a CPU int64 scalar)."""
    if use_triton(x):
        from ..kernels.dropout import dropout_triton

        return dropout_triton(x, p, int(seed))
    return dropout_apply_torch(x, p, seed)


@dropout_op.register_fake
def _(x: Tensor, p: float, seed: Tensor) -> Tensor:
    return x.new_empty(x.shape)  # contiguous, as both real paths return


def _setup_context(ctx, inputs, output) -> None:
    _x, p, seed = inputs
    ctx.save_for_backward(seed)
    ctx.p = p


def _backward(ctx, grad: Tensor):
    (seed,) = ctx.saved_tensors
    # The backward of dropout is the same masked scaling, with the same mask.
    return dropout_op(grad.contiguous(), ctx.p, seed), None, None


dropout_op.register_autograd(_backward, setup_context=_setup_context)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Drop-in for ``torch.nn.functional.dropout`` that keeps no mask for backward."""
    check_float("dropout input", x)
    check_probability(p)
    check_training(training)
    if not training or p == 0.0:
        return x
    return dropout_op(x.contiguous(), float(p), new_seed())


class TempoDropout(nn.Dropout):
    """Drop-in for ``nn.Dropout`` (same p; eval mode is the identity)."""

    def __init__(self, p: float = 0.5) -> None:
        check_probability(p)
        super().__init__(p)

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
