"""In-place LayerNorm (Tempo §3.2): keep the output, not the input.

The output y is what the next Linear keeps anyway, so LayerNorm's own input and mean need not
be kept: backward rebuilds x_hat = (y - beta) / gamma from y and the affine parameters, and
uses rstd (one float per row). Everything is accumulated in float32 (float64 for float64).

gamma ~ 0: x_hat is then lost (y - beta rounds to 0). We divide by gamma clamped away from 0
by magnitude (|gamma| >= GAMMA_FLOOR, sign kept) and clamp |x_hat| <= sqrt(D) (a LayerNorm
output can never exceed that), so nothing becomes inf/NaN; the term gamma * x_hat itself is
taken as y - beta, exact whatever gamma is. Only channels whose |gamma| is at the floor get an
approximate x_hat (their d_gamma and their x_hat * mean(g * (y - beta)) part of dx).

Autocast: torch runs layer_norm in float32 under autocast, and the following Linear keeps its
own half copy of that float32 output: keeping the float32 y as well would cost more than the
input we meant to drop. So under autocast Tempo's LayerNorm computes in float32 but returns
(and keeps) the autocast dtype, the same half tensor the next Linear casts to and keeps; the
saving holds. The price: the residual stream after this LayerNorm is half precision, as in
models run in half precision outright.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .._common import CHUNK_ELEMS, check_float, chunks, opmath, use_triton


def gamma_floor(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-6


def _rows(x: Tensor, normalized_ndim: int) -> tuple[int, int]:
    d = math.prod(x.shape[x.dim() - normalized_ndim :])
    return x.numel() // max(d, 1), d


def layer_norm_backward_torch(
    grad: Tensor, y: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor, normalized_ndim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch implementation of the backward (CPU; the reference for the Triton kernel)."""
    rows, d = _rows(y, normalized_ndim)
    f = opmath(y.dtype)
    g_all, y_all, rstd_all = grad.reshape(rows, d), y.reshape(rows, d), rstd.reshape(rows, 1)
    w = weight.reshape(d).to(f)
    b = bias.reshape(d).to(f)
    floor = gamma_floor(y.dtype)
    w_safe = torch.where(w.abs() < floor, torch.where(w < 0, -floor, floor), w)
    dx = torch.empty_like(g_all)
    dw = torch.zeros(d, dtype=f, device=y.device)
    db = torch.zeros(d, dtype=f, device=y.device)
    for _, part in chunks(rows, max(1, CHUNK_ELEMS // max(d, 1))):
        g = g_all[part].to(f)
        centred = y_all[part].to(f) - b  # = gamma * x_hat, exact even where gamma ~ 0
        x_hat = torch.clamp(centred / w_safe, -math.sqrt(d), math.sqrt(d))
        gw = g * w
        mean_gw = gw.mean(dim=1, keepdim=True)
        mean_gwx = (g * centred).mean(dim=1, keepdim=True)
        dx[part] = rstd_all[part].to(f) * (gw - mean_gw - x_hat * mean_gwx)
        dw += (g * x_hat).sum(dim=0)
        db += g.sum(dim=0)
    return dx.view(y.shape), dw.to(weight.dtype).view(weight.shape), db.to(bias.dtype).view(bias.shape)


def layer_norm_forward_torch(
    x: Tensor, weight: Tensor, bias: Tensor, normalized_ndim: int, eps: float
) -> tuple[Tensor, Tensor]:
    shape = x.shape[x.dim() - normalized_ndim :]
    y, _mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
    if rstd.dtype == opmath(x.dtype):
        return y, rstd.reshape(-1)
    # CPU kernels return a half rstd for half inputs; recompute it in float32, row chunk by chunk.
    rows, d = _rows(x, normalized_ndim)
    x2 = x.reshape(rows, d)
    rstd = torch.empty(rows, dtype=opmath(x.dtype), device=x.device)
    for _, part in chunks(rows, max(1, CHUNK_ELEMS // max(d, 1))):
        rstd[part] = torch.rsqrt(x2[part].to(rstd.dtype).var(dim=1, correction=0) + eps)
    return y, rstd


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("tempo::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: Tensor, weight: Tensor, bias: Tensor, normalized_ndim: int, eps: float
) -> tuple[Tensor, Tensor]:
    """LayerNorm over the last ``normalized_ndim`` dims; returns (y, rstd[rows] in float32/64)."""
    if use_triton(x, weight, bias):
        from ..kernels.layernorm import layer_norm_fwd_triton

        return layer_norm_fwd_triton(x, weight, bias, normalized_ndim, eps)
    return layer_norm_forward_torch(x, weight, bias, normalized_ndim, eps)


@layer_norm_fwd.register_fake
def _(x, weight, bias, normalized_ndim, eps):
    rows, _ = _rows(x, normalized_ndim)
    return torch.empty_like(x), x.new_empty(rows, dtype=opmath(x.dtype))


@torch.library.custom_op("tempo::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    grad: Tensor, y: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor, normalized_ndim: int
) -> tuple[Tensor, Tensor, Tensor]:
    grad = grad.contiguous()
    if use_triton(grad, y, rstd, weight, bias):
        from ..kernels.layernorm import layer_norm_bwd_triton

        return layer_norm_bwd_triton(grad, y, rstd, weight, bias, normalized_ndim)
    return layer_norm_backward_torch(grad, y, rstd, weight, bias, normalized_ndim)


@layer_norm_bwd.register_fake
def _(grad, y, rstd, weight, bias, normalized_ndim):
    return y.new_empty(y.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _setup_context(ctx, inputs, output) -> None:
    _x, weight, bias, normalized_ndim, _eps = inputs
    y, rstd = output
    ctx.save_for_backward(y, rstd, weight, bias)
    ctx.normalized_ndim = normalized_ndim


def _backward(ctx, grad_y: Tensor, _grad_rstd: Tensor | None):
    y, rstd, weight, bias = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd(grad_y, y, rstd, weight, bias, ctx.normalized_ndim)
    return dx, dw, db, None, None


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Drop-in for ``torch.nn.functional.layer_norm`` that keeps its output, not its input."""
    check_float("layer_norm input", x)
    normalized_shape = tuple(normalized_shape)
    if tuple(x.shape[x.dim() - len(normalized_shape) :]) != normalized_shape or x.dim() < len(
        normalized_shape
    ):
        raise ValueError(
            f"normalized_shape {list(normalized_shape)} must equal the trailing dims of the input, "
            f"whose shape is {list(x.shape)}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            check_float(f"layer_norm {name}", p)
            if tuple(p.shape) != normalized_shape:
                raise ValueError(
                    f"{name} has shape {list(p.shape)}, expected normalized_shape {list(normalized_shape)}"
                )
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)  # see the module docstring
    x = x.to(dtype).contiguous()
    # Without affine parameters x_hat = y exactly; ones/zeros keep one code path (D floats each).
    weight = x.new_ones(normalized_shape) if weight is None else weight.to(dtype)
    bias = x.new_zeros(normalized_shape) if bias is None else bias.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        y, _ = layer_norm_fwd(x, weight, bias, len(normalized_shape), float(eps))
    return y


class TempoLayerNorm(nn.LayerNorm):
    """Drop-in for ``nn.LayerNorm`` (same parameters and state dict)."""

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm) -> TempoLayerNorm:
        """A TempoLayerNorm sharing ``ln``'s parameters (so optimizers keep working) and eps."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = ln.normalized_shape
        new.eps = ln.eps
        new.elementwise_affine = ln.elementwise_affine
        new.weight = ln.weight
        new.bias = ln.bias
        return new
