"""Tempo (Andoorveedu et al., NeurIPS 2022, arXiv 2210.10246): Transformer layers that keep less
for the backward pass, so larger batches fit. Drop-in ops, modules and a HuggingFace patcher."""

from .hf import SUPPORTED_MODEL_TYPES, PatchReport, is_patched, patch, unpatch
from .ops.attention import attention_core, scaled_dot_product_attention
from .ops.dropout import TempoDropout, dropout
from .ops.gelu import TempoGELU, gelu
from .ops.layernorm import TempoLayerNorm, layer_norm
from .ops.linear_ce import linear_cross_entropy
from .ops.rmsnorm import TempoRMSNorm, rms_norm
from .ops.swiglu import swiglu_down

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "PatchReport",
    "TempoDropout",
    "TempoGELU",
    "TempoLayerNorm",
    "TempoRMSNorm",
    "attention_core",
    "dropout",
    "gelu",
    "is_patched",
    "layer_norm",
    "linear_cross_entropy",
    "patch",
    "rms_norm",
    "scaled_dot_product_attention",
    "swiglu_down",
    "unpatch",
]
