"""HuggingFace drop-in: ``tempo.patch(model)`` swaps in Tempo's layers in place; ``unpatch`` undoes it.

What is replaced (each technique can be switched off, for ablations):
* every ``nn.LayerNorm`` -> TempoLayerNorm (same parameter objects, same eps);
* every GELU activation module -> TempoGELU, matched to its formula (BERT/RoBERTa ``gelu``: erf;
  GPT-2 ``gelu_new`` and ``gelu_pytorch_tanh``: tanh);
* the attention core, through transformers' attention-implementation registry (``"tempo"``);
* every ``nn.Dropout`` -> TempoDropout (the attention modules' own dropout is only read for p).

Parameters are shared, not copied, so an optimizer made before patching keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .ops.attention import scaled_dot_product_attention
from .ops.dropout import TempoDropout
from .ops.gelu import TempoGELU
from .ops.layernorm import TempoLayerNorm

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "gpt2")
ATTN_IMPLEMENTATION = "tempo"


def _gelu_kind(module: nn.Module) -> str | None:
    """'none' / 'tanh' for GELU modules Tempo can replace exactly, else None."""
    from transformers import activations as act

    if isinstance(module, nn.GELU):
        return module.approximate
    exact = [getattr(act, n) for n in ("GELUActivation",) if hasattr(act, n)]
    tanh = [getattr(act, n) for n in ("NewGELUActivation", "PytorchGELUTanh", "GELUTanh") if hasattr(act, n)]
    if any(type(module) is c for c in exact) and not getattr(module, "use_gelu_python", False):
        return "none"
    if any(type(module) is c for c in tanh):
        return "tanh"
    return None


def _tempo_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface signature; returns (B, S, H, D) like eager."""
    out, probs = scaled_dot_product_attention(
        query, key, value, attention_mask, scaling, dropout_p=dropout, training=module.training
    )
    return out.transpose(1, 2).contiguous(), probs


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _tempo_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)


@dataclass
class PatchReport:
    model_type: str
    layernorms: list[str] = field(default_factory=list)
    gelus: list[str] = field(default_factory=list)
    dropouts: list[str] = field(default_factory=list)
    attention_modules: list[str] = field(default_factory=list)
    previous_attn_implementation: str | None = None

    def counts(self) -> dict[str, int]:
        return {
            "layernorm": len(self.layernorms),
            "gelu": len(self.gelus),
            "attention": len(self.attention_modules),
            "dropout": len(self.dropouts),
        }

    def __str__(self) -> str:
        c = self.counts()
        attn = (
            f"{c['attention']} attention cores (attn_implementation "
            f"{self.previous_attn_implementation!r} -> {ATTN_IMPLEMENTATION!r})"
            if self.attention_modules
            else "attention left as it was"
        )
        return (
            f"tempo.patch({self.model_type}): replaced {c['layernorm']} LayerNorms, {c['gelu']} GELUs, "
            f"{c['dropout']} dropouts; {attn}"
        )


def _attention_modules(model: nn.Module) -> list[str]:
    return [
        n for n, m in model.named_modules() if type(m).__name__.endswith(("SelfAttention", "GPT2Attention"))
    ]


def _find_config(model: nn.Module):
    """The HF config of a model, or of a bare submodule (e.g. one BertLayer) via its children."""
    if getattr(model, "config", None) is not None:
        return model.config
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            return module.config
    return None


def _set_attn_implementation(model: nn.Module, config, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # a bare submodule: its attention modules read the shared config at call time
        config._attn_implementation = name


def patch(
    model: nn.Module,
    *,
    layernorm: bool = True,
    gelu: bool = True,
    attention: bool = True,
    dropout: bool = True,
) -> PatchReport:
    """Convert a HF BERT / RoBERTa / GPT-2 model (any size, any head), or a submodule of one such
    as a single encoder layer, to Tempo's layers in place. Returns what was replaced."""
    config = _find_config(model)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"tempo.patch supports HF models of type {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"got {type(model).__name__} (model_type={model_type!r})"
        )
    if getattr(model, "_tempo_originals", None) is not None:
        raise RuntimeError("model is already patched by tempo; call tempo.unpatch(model) first")
    if attention and model_type == "gpt2" and getattr(config, "reorder_and_upcast_attn", False):
        raise ValueError(
            "GPT-2 with reorder_and_upcast_attn=True bypasses the attention registry; set it False"
        )

    report = PatchReport(model_type=model_type)
    originals: list[tuple[nn.Module, str, nn.Module]] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            new: nn.Module | None = None
            if layernorm and type(child) is nn.LayerNorm:
                new = TempoLayerNorm.from_layernorm(child)
                report.layernorms.append(qualified)
            elif gelu and (kind := _gelu_kind(child)) is not None:
                new = TempoGELU(kind)
                report.gelus.append(qualified)
            elif dropout and type(child) is nn.Dropout:
                new = TempoDropout(child.p)
                new.train(child.training)
                report.dropouts.append(qualified)
            if new is not None:
                originals.append((parent, child_name, child))
                setattr(parent, child_name, new)

    report.previous_attn_implementation = config._attn_implementation
    if attention:
        _register_attention()
        _set_attn_implementation(model, config, ATTN_IMPLEMENTATION)
        report.attention_modules = _attention_modules(model)
    model._tempo_originals = originals
    model._tempo_report = report
    return report


def unpatch(model: nn.Module) -> None:
    """Restore the modules and attention implementation ``patch`` replaced (parameters kept)."""
    originals = getattr(model, "_tempo_originals", None)
    if originals is None:
        raise RuntimeError("model is not patched by tempo")
    for parent, name, original in originals:
        original.train(getattr(parent, name).training)
        setattr(parent, name, original)
    report: PatchReport = model._tempo_report
    if report.attention_modules:
        _set_attn_implementation(model, _find_config(model), report.previous_attn_implementation)
    del model._tempo_originals, model._tempo_report


def is_patched(model: nn.Module) -> bool:
    return getattr(model, "_tempo_originals", None) is not None


__all__ = ["SUPPORTED_MODEL_TYPES", "PatchReport", "is_patched", "patch", "unpatch"]
