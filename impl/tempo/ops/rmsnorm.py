"""In-place RMSNorm: keep the output, not the input (Tempo §3.2's LayerNorm idea, for the RMSNorm of
Llama-family decoders).

    y = gamma * (x * rstd),   rstd = 1 / sqrt(mean(x^2) + eps)   (per row, in float32)

as HuggingFace's LlamaRMSNorm computes it: x * rstd in float32, rounded to x's dtype, then scaled by
gamma. The next Linear keeps y anyway, so RMSNorm's own input need not be kept: backward rebuilds
x_hat = x * rstd = y / gamma from y and gamma, and uses rstd (one float per row):

    dx = rstd * (gamma g - x_hat * mean(g y)),   dgamma = sum over rows of g x_hat.

The term gamma * x_hat is y itself, so mean(g y) is exact whatever gamma is. gamma ~ 0 loses x_hat
(y rounds to 0): as for Tempo's LayerNorm we divide by gamma clamped away from 0 by magnitude
(``layernorm_rows.gamma_floor``, sign kept) and clamp |x_hat| <= sqrt(D) (an RMS-normalised row
never exceeds it), so nothing becomes inf/NaN; channels at the floor get an approximate x_hat
(their dgamma, and their x_hat * mean(g y) part of dx). Without a bias there is no kappa
(LayerNorm's |beta| / |gamma|): the recovered x_hat is off by the rounding of y alone, u |x_hat|.

On CUDA the forward and backward run as Triton kernels (tempo/kernels/rmsnorm.py) with the same
rounding, gamma floor and clamp; the PyTorch paths here are their reference (and run on the CPU).

Autocast: as Tempo's LayerNorm, the math runs in float32 and y is returned (and kept) in the
autocast dtype, the copy the next Linear keeps.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._common import check_eps, check_float, chunks, opmath, use_triton
from ..layernorm_rows import _rows, gamma_floor
from ..sizes import CHUNK_ELEMS


def rms_norm_forward_torch(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd[rows]) over the last dim, row chunk by row chunk, as LlamaRMSNorm computes y."""
    rows, d = _rows(x, 1)
    f = opmath(x.dtype)
    x2 = x.reshape(rows, d)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    y2 = y.view(rows, d)
    rstd = torch.empty(rows, dtype=f, device=x.device)
    for _, part in chunks(rows, max(1, CHUNK_ELEMS // max(d, 1))):
        xf = x2[part].to(f)
        r = torch.rsqrt(xf.pow(2).mean(dim=1, keepdim=True) + eps)
        rstd[part] = r.reshape(-1)
        y2[part] = weight * (xf * r).to(x.dtype)
    return y, rstd


def rms_norm_backward_torch(grad: Tensor, y: Tensor, rstd: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dgamma) from the kept output (PyTorch path; the reference for a kernel)."""
    rows, d = _rows(y, 1)
    f = opmath(y.dtype)
    g_all, y_all, rstd_all = grad.reshape(rows, d), y.reshape(rows, d), rstd.reshape(rows, 1)
    w = weight.reshape(d).to(f)
    floor = gamma_floor(y.dtype)
    w_safe = torch.where(w.abs() < floor, torch.where(w < 0, -floor, floor), w)
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)  # fresh: a custom op's output is no view
    dx_all = dx.view(rows, d)
    dw = torch.zeros(d, dtype=f, device=y.device)
    for _, part in chunks(rows, max(1, CHUNK_ELEMS // max(d, 1))):
        g, yy = g_all[part].to(f), y_all[part].to(f)
        x_hat = torch.clamp(yy / w_safe, -math.sqrt(d), math.sqrt(d))
        mean_gy = (g * yy).mean(dim=1, keepdim=True)  # = mean(g gamma x_hat), exact
        dx_all[part] = rstd_all[part].to(f) * (g * w - x_hat * mean_gy)
        dw += (g * x_hat).sum(dim=0)
    return dx, dw.to(weight.dtype).reshape(weight.shape).clone()


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("tempo::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """RMSNorm over the last dim; returns (y, rstd[rows] in float32/64). ``x`` must be contiguous."""
    if use_triton(x, weight, float64=True):
        from ..kernels.rmsnorm import rms_norm_fwd_triton

        return rms_norm_fwd_triton(x, weight, eps)
    return rms_norm_forward_torch(x, weight, eps)


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    rows, _ = _rows(x, 1)
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(rows, dtype=opmath(x.dtype))


@torch.library.custom_op("tempo::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(grad: Tensor, y: Tensor, rstd: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    grad = grad.contiguous()
    if use_triton(grad, y, rstd, weight, float64=True):
        from ..kernels.rmsnorm import rms_norm_bwd_triton

        return rms_norm_bwd_triton(grad, y, rstd, weight)
    return rms_norm_backward_torch(grad, y, rstd, weight)


@rms_norm_bwd.register_fake
def _(grad, y, rstd, weight):
    return y.new_empty(y.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    _x, weight, _eps = inputs
    y, rstd = output
    ctx.save_for_backward(y, rstd, weight)
    ctx.x_dtype = _x.dtype


def _backward(ctx, grad_y: Tensor, _grad_rstd: Tensor | None):
    y, rstd, weight = ctx.saved_tensors
    dx, dw = rms_norm_bwd(grad_y, y, rstd, weight)
    return dx.to(ctx.x_dtype), dw, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """LlamaRMSNorm's output (``weight * (x * rstd).to(x.dtype)``) that keeps it, not its input,
    for backward. ``weight``: the last dim's scale (gamma)."""
    check_float("rms_norm input", x)
    check_float("rms_norm weight", weight)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have one dim equal to the input's last, got weight {list(weight.shape)} "
            f"for an input of shape {list(x.shape)}"
        )
    check_eps(eps)
    if torch.is_autocast_enabled(x.device.type):  # see the module docstring
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        y, _ = rms_norm_fwd(x.contiguous(), weight, float(eps))
    return y


class TempoRMSNorm(nn.Module):
    """Drop-in for a Llama-family RMSNorm module (``weight`` and ``variance_epsilon``, as HF's)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"

    @classmethod
    def from_rmsnorm(cls, norm: nn.Module) -> TempoRMSNorm:
        """A TempoRMSNorm sharing ``norm``'s weight (so optimizers keep working) and epsilon
        (HF's ``variance_epsilon``, or torch's ``nn.RMSNorm`` ``eps``)."""
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None:
            eps = torch.finfo(norm.weight.dtype).eps  # nn.RMSNorm's default: eps=None
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = norm.weight
        new.variance_epsilon = float(eps)
        return new
