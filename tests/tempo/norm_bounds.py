"""Rounding bounds for Tempo's LayerNorm and RMSNorm gradients, against the float64 closed form.

Both rebuild x_hat from the kept output (x_hat = (y - beta) / gamma), so their gradients carry
that output's rounding, amplified by kappa = |beta| / |gamma| (ops/layernorm.py), on top of the
float32 (float64) arithmetic of the forward and backward. For the exact float64 values from the
same inputs,

    mu = mean(x) (0 for RMSNorm),  r = 1 / sqrt(mean((x - mu)^2) + eps),  x_hat = (x - mu) r,
    dx = r (g gamma - mean(g gamma) - x_hat mean(g gamma x_hat))   (no mean(g gamma) for RMSNorm),
    dgamma = sum over rows of g x_hat,   dbeta = sum over rows of g,

each computed element is within a worst-case count of its roundings, u_c the compute dtype's unit
roundoff (float32, float64 for float64), d the row length:

    r, from a sum of d positive terms:            e_r = (d/2 + 3) u_c, relative
    x_hat, recovered:                             e_xhat = u_y (|x_hat| + kappa) + e_r |x_hat|
                                                           + (d + 1) u_c r mean|x| + 3 u_c (|x_hat| + kappa)
    dx:    r [(e_r + 4 u_c)(|g gamma| + M1 + |x_hat| M2) + (d + 2) u_c (M1 + |x_hat| M2)
              + e_xhat M2 + |x_hat| mean(|g gamma| e_xhat)] + u_out |dx|
    dgamma: sum_rows |g| e_xhat + (rows + 1) u_c sum_rows |g x_hat| + u_out |dgamma|
    dbeta:  (rows + 1) u_c sum_rows |g| + u_out |dbeta|

with M1 = mean|g gamma|, M2 = mean|g gamma x_hat| per row, u_y the stored output's rounding (one
unit roundoff of its dtype; RMSNorm, as HF's, rounds x_hat to x's dtype first: two), u_out the
result's (rounded to y's dtype, then to the parameter's or input's). The bound is twice this
count: rsqrt, exp-free divisions and reductions in another order each add an ulp or so.
"""

from __future__ import annotations

import torch


def unit(dtype: torch.dtype) -> float:
    """The unit roundoff: half the distance from 1 to the next number."""
    return torch.finfo(dtype).eps / 2


def exact_and_bounds(x, w, b, gy, eps: float, *, centred: bool, u_y: float, u_c: float, u_out: dict):
    """{name: (exact float64 gradient, its bound)} for dx, dgamma and (with ``b``) dbeta. ``x`` and
    ``gy`` have the normalised dim last; ``b`` None for RMSNorm. ``u_out``: name -> unit roundoff
    of that result's roundings."""
    d = x.shape[-1]
    x, w, g = x.double().reshape(-1, d), w.double(), gy.double().reshape(-1, d)
    rows = x.shape[0]
    kappa = (b.double().abs() / w.abs()) if b is not None else torch.zeros_like(w)
    mu = x.mean(-1, keepdim=True) if centred else torch.zeros_like(x[:, :1])
    r = torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps)
    x_hat = (x - mu) * r
    gw = g * w
    m1 = gw.mean(-1, keepdim=True) if centred else torch.zeros_like(r)
    m2 = (gw * x_hat).mean(-1, keepdim=True)
    dx = r * (gw - m1 - x_hat * m2)
    big_m1 = gw.abs().mean(-1, keepdim=True) if centred else torch.zeros_like(r)
    big_m2 = (gw * x_hat).abs().mean(-1, keepdim=True)

    e_r = (d / 2 + 3) * u_c
    e_xhat = (
        u_y * (x_hat.abs() + kappa)
        + e_r * x_hat.abs()
        + (d + 1) * u_c * r * x.abs().mean(-1, keepdim=True)
        + 3 * u_c * (x_hat.abs() + kappa)
    )
    count_dx = r * (
        (e_r + 4 * u_c) * (gw.abs() + big_m1 + x_hat.abs() * big_m2)
        + (d + 2) * u_c * (big_m1 + x_hat.abs() * big_m2)
        + e_xhat * big_m2
        + x_hat.abs() * (gw.abs() * e_xhat).mean(-1, keepdim=True)
    )
    dw = (g * x_hat).sum(0)
    count_dw = (g.abs() * e_xhat).sum(0) + (rows + 1) * u_c * (g * x_hat).abs().sum(0)
    out = {
        "dx": (dx, 2 * (count_dx + u_out["dx"] * dx.abs())),
        "dgamma": (dw, 2 * (count_dw + u_out["dgamma"] * dw.abs())),
    }
    if b is not None:
        db = g.sum(0)
        out["dbeta"] = (db, 2 * ((rows + 1) * u_c * g.abs().sum(0) + u_out["dbeta"] * db.abs()))
    return out


def assert_within(computed: dict, bounds: dict, factor: float = 1.0) -> None:
    """Every element of each computed gradient within ``factor`` times its bound of the exact one."""
    for name, (exact, bound) in bounds.items():
        ours = computed[name].double().reshape(exact.shape)
        assert torch.isfinite(ours).all(), f"{name}: not finite"
        limit = factor * bound + torch.finfo(torch.float64).tiny
        worst = ((ours - exact).abs() / limit).max().item() if exact.numel() else 0.0
        assert worst <= 1.0, f"{name}: an element exceeds its rounding bound by {worst:.2f}x"
