"""Tempo (Andoorveedu et al., NeurIPS 2022, arXiv 2210.10246): Transformer layers that keep less
for the backward pass, so larger batches fit. Drop-in ops, modules and a HuggingFace patcher.

The names below load their modules (and torch) on first use, not at ``import tempo``: a part of
the package that needs no torch imports without it (``tempo.sizes``, with which Mist's planner
prices Tempo's layers).
"""

from __future__ import annotations

import importlib

# each public name and the module that defines it
_HOMES = {
    "SUPPORTED_MODEL_TYPES": "hf",
    "PatchReport": "hf",
    "is_patched": "hf",
    "patch": "hf",
    "unpatch": "hf",
    "attention_core": "ops.attention",
    "scaled_dot_product_attention": "ops.attention",
    "TempoDropout": "ops.dropout",
    "dropout": "ops.dropout",
    "TempoGELU": "ops.gelu",
    "gelu": "ops.gelu",
    "TempoLayerNorm": "ops.layernorm",
    "layer_norm": "ops.layernorm",
    "linear_cross_entropy": "ops.linear_ce",
    "TempoRMSNorm": "ops.rmsnorm",
    "rms_norm": "ops.rmsnorm",
    "swiglu_down": "ops.swiglu",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tempo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
