"""In-place LayerNorm (Tempo §3.2): keep the output, not the input.

The output y is what the next Linear keeps anyway, so LayerNorm's own input and mean need not
be kept: backward rebuilds x_hat = (y - beta) / gamma from y and the affine parameters, and
uses rstd (one float per row). Everything is accumulated in float32 (float64 for float64).

gamma ~ 0: x_hat is then lost (y - beta rounds to 0). We divide by gamma clamped away from 0
by magnitude (|gamma| >= gamma_floor, sign kept) and clamp |x_hat| <= sqrt(D) (a LayerNorm
output can never exceed that), so nothing becomes inf/NaN; the term gamma * x_hat itself is
taken as y - beta, exact whatever gamma is. Channels whose |gamma| is at the floor get an
approximate x_hat (their d_gamma and their x_hat * mean(g * (y - beta)) part of dx).

Accuracy: small gamma against beta. y is kept rounded to its dtype, y = (gamma x_hat + beta)(1 + d)
with |d| <= u, the unit roundoff (2^-11 float16, 2^-8 bfloat16, 2^-24 float32). The recovered
x_hat = (y - beta) / gamma is then off by d (x_hat + beta / gamma): per element

    |x_hat' - x_hat| <= u (|x_hat| + kappa),   kappa = |beta| / |gamma|  (per channel).

The first term is the rounding any half-precision output has; the second grows with kappa. It
reaches d_gamma_c = sum_rows g x_hat (at most u * sum |g| (|x_hat| + kappa_c) off) and, through
the x_hat * mean(g gamma x_hat) term only, dx; d_beta and the forward are unaffected. Rounding
errors are uncorrelated with g, so d_gamma_c is typically off by ~0.4 u sqrt(1 + kappa_c^2)
relative. Measured (fp64 reference from the same rounded inputs, 1024 rows, D = 768, x, g and
beta ~ N(0, 1), mean of 5 draws): gamma = 0.05 (kappa_rms = 20), d_gamma is 0.41% off in float16
and 3.4% in bfloat16 (0.42 u sqrt(1 + kappa^2)_rms), dx as torch's (0.03% / 0.24%); gamma =
0.05 |N(0, 1)| (a few channels with tiny gamma), d_gamma 7% and 17-20%, dx 0.27% / 0.7%. torch's
own CPU backward (it keeps x) is 0.33% / 2.6% off on d_gamma in both (its error grows with the
number of rows); keep_input 0.021% / 0.17%, the rounding of the result itself.

Remedy: ``keep_input=True`` (TempoLayerNorm attribute, ``layer_norm`` argument) keeps x, as
torch does, instead of y; backward takes x_hat = (x - mean) * rstd in float32, as accurate
whatever gamma and beta are (and the output may then be changed in place, as torch's may). It
costs what torch's LayerNorm keeps, so use it on the layers whose kappa
(``recovery_amplification``) times u is more than the gradient error you accept. A higher gamma
floor is no remedy: dividing by a floor larger than |gamma| scales x_hat by gamma / floor,
trading the noise for a bias.

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

from .._common import check_eps, check_float, chunks, opmath, use_triton
from ..layernorm_rows import _rows, gamma_floor
from ..sizes import CHUNK_ELEMS


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: round-to-nearest into ``dtype`` moves a value v by at most u * |v|."""
    return torch.finfo(dtype).eps / 2


def layer_norm_backward_torch(
    grad: Tensor,
    src: Tensor,
    rstd: Tensor,
    weight: Tensor,
    bias: Tensor,
    normalized_ndim: int,
    from_input: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch implementation of the backward (CPU; the reference for the Triton kernel).

    ``src`` is the output y (x_hat recovered from it), or with ``from_input`` the input x
    (x_hat = (x - mean) * rstd, as torch's own backward)."""
    rows, d = _rows(src, normalized_ndim)
    f = opmath(src.dtype)
    g_all, s_all, rstd_all = grad.reshape(rows, d), src.reshape(rows, d), rstd.reshape(rows, 1)
    w = weight.reshape(d).to(f)
    b = bias.reshape(d).to(f)
    floor = gamma_floor(src.dtype)
    w_safe = torch.where(w.abs() < floor, torch.where(w < 0, -floor, floor), w)
    # Fresh tensors in the final shapes (not views of flat ones): a custom op's outputs must not be views.
    dx = torch.empty(src.shape, dtype=src.dtype, device=src.device)
    dx_all = dx.view(rows, d)
    dw = torch.zeros(d, dtype=f, device=src.device)
    db = torch.zeros(d, dtype=f, device=src.device)
    for _, part in chunks(rows, max(1, CHUNK_ELEMS // max(d, 1))):
        g = g_all[part].to(f)
        s = s_all[part].to(f)
        if from_input:
            x_hat = (s - s.mean(dim=1, keepdim=True)) * rstd_all[part].to(f)
            centred = x_hat * w
        else:
            centred = s - b  # = gamma * x_hat, exact even where gamma ~ 0
            x_hat = torch.clamp(centred / w_safe, -math.sqrt(d), math.sqrt(d))
        gw = g * w
        mean_gw = gw.mean(dim=1, keepdim=True)
        mean_gwx = (g * centred).mean(dim=1, keepdim=True)
        dx_all[part] = rstd_all[part].to(f) * (gw - mean_gw - x_hat * mean_gwx)
        dw += (g * x_hat).sum(dim=0)
        db += g.sum(dim=0)
    dw = dw.to(weight.dtype).reshape(weight.shape).clone()  # clone: never a view (custom op output)
    return dx, dw, db.to(bias.dtype).reshape(bias.shape).clone()


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
    x: Tensor, weight: Tensor, bias: Tensor, normalized_ndim: int, eps: float, keep_input: bool = False
) -> tuple[Tensor, Tensor]:
    """LayerNorm over the last ``normalized_ndim`` dims; returns (y, rstd[rows] in float32/64).
    ``keep_input``: backward from x (kept) instead of from y (see the module docstring)."""
    if use_triton(x, weight, bias):
        from ..kernels.layernorm import layer_norm_fwd_triton

        return layer_norm_fwd_triton(x, weight, bias, normalized_ndim, eps)
    return layer_norm_forward_torch(x, weight, bias, normalized_ndim, eps)


@layer_norm_fwd.register_fake
def _(x, weight, bias, normalized_ndim, eps, keep_input=False):
    rows, _ = _rows(x, normalized_ndim)
    return torch.empty_like(x), x.new_empty(rows, dtype=opmath(x.dtype))


@torch.library.custom_op("tempo::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    grad: Tensor,
    src: Tensor,
    rstd: Tensor,
    weight: Tensor,
    bias: Tensor,
    normalized_ndim: int,
    from_input: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``src``: y, or x with ``from_input``."""
    grad = grad.contiguous()
    if use_triton(grad, src, rstd, weight, bias):
        from ..kernels.layernorm import layer_norm_bwd_triton

        return layer_norm_bwd_triton(grad, src, rstd, weight, bias, normalized_ndim, from_input)
    return layer_norm_backward_torch(grad, src, rstd, weight, bias, normalized_ndim, from_input)


@layer_norm_bwd.register_fake
def _(grad, src, rstd, weight, bias, normalized_ndim, from_input=False):
    return src.new_empty(src.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, normalized_ndim, _eps, keep_input = inputs
    y, rstd = output
    ctx.save_for_backward(x if keep_input else y, rstd, weight, bias)
    ctx.normalized_ndim = normalized_ndim
    ctx.keep_input = keep_input


def _backward(ctx, grad_y: Tensor, _grad_rstd: Tensor | None):
    src, rstd, weight, bias = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd(grad_y, src, rstd, weight, bias, ctx.normalized_ndim, ctx.keep_input)
    return dx, dw, db, None, None, None


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public API


def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    keep_input: bool = False,
) -> Tensor:
    """Drop-in for ``torch.nn.functional.layer_norm`` that keeps its output, not its input.

    ``keep_input=True`` keeps the input instead (as torch does: no memory saved), for layers whose
    x_hat cannot be recovered accurately enough from a half-precision output (see the module
    docstring and ``recovery_amplification``).
    """
    check_float("layer_norm input", x)
    check_eps(eps)
    if not isinstance(normalized_shape, (tuple, list, torch.Size)):  # torch refuses an int here too
        raise ValueError(f"normalized_shape must be a tuple of ints (as torch's), got {normalized_shape!r}")
    normalized_shape = tuple(normalized_shape)
    if not normalized_shape:
        raise ValueError("normalized_shape must name at least one trailing dim (as in torch), got ()")
    nd = len(normalized_shape)
    if x.dim() < nd or tuple(x.shape[x.dim() - nd :]) != normalized_shape:
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
        y, _ = layer_norm_fwd(x, weight, bias, len(normalized_shape), float(eps), bool(keep_input))
    return y


def recovery_amplification(weight: Tensor, bias: Tensor) -> Tensor:
    """kappa per channel: |beta| / |gamma| (gamma at its floor where smaller), float32/64.

    Recovering x_hat from a y rounded to unit roundoff u is off by at most u * (|x_hat| + kappa)
    per element (module docstring); a layer whose kappa is large for its dtype is one to run with
    ``keep_input=True``.
    """
    f = opmath(weight.dtype)
    w, b = weight.detach().to(f), bias.detach().to(f)
    return b.abs() / w.abs().clamp_min(gamma_floor(weight.dtype))


class TempoLayerNorm(nn.LayerNorm):
    """Drop-in for ``nn.LayerNorm`` (same parameters and state dict).

    ``keep_input``: keep the input for backward instead of the output (torch's memory, and an
    x_hat exact to float32 whatever gamma and beta are); an attribute, so it can be switched per
    module after ``tempo.patch``.
    """

    def __init__(self, *args, keep_input: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keep_input = keep_input

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(
            x, self.normalized_shape, self.weight, self.bias, self.eps, keep_input=self.keep_input
        )

    def recovery_amplification(self) -> Tensor:
        """kappa per channel for this module's current parameters (see ``recovery_amplification``)."""
        d = math.prod(self.normalized_shape)
        w = self.weight if self.weight is not None else torch.ones(d)
        b = self.bias if self.bias is not None else torch.zeros(d, dtype=w.dtype, device=w.device)
        return recovery_amplification(w, b)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", keep_input=True" if self.keep_input else "")

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm, keep_input: bool = False) -> TempoLayerNorm:
        """A TempoLayerNorm sharing ``ln``'s parameters (so optimizers keep working) and eps."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = ln.normalized_shape
        new.eps = ln.eps
        new.elementwise_affine = ln.elementwise_affine
        new.weight = ln.weight
        new.bias = ln.bias
        new.keep_input = keep_input
        return new
