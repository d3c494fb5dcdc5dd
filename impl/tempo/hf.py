"""HuggingFace drop-in: ``tempo.patch(model)`` swaps in Tempo's layers in place; ``unpatch`` undoes it.

What is replaced (each technique can be switched off, for ablations):
* every ``nn.LayerNorm`` -> TempoLayerNorm (same parameter objects, same eps);
* every GELU activation module -> TempoGELU, matched to its formula (BERT/RoBERTa ``gelu``: erf;
  GPT-2 ``gelu_new`` and ``gelu_pytorch_tanh``: tanh);
* the attention core of each attention module, through transformers' attention-implementation
  registry (``"tempo"``);
* every ``nn.Dropout`` -> TempoDropout (the attention modules' own dropout is only read for p);
* Llama-family decoders (Llama, Mistral, Qwen2; beyond the paper): every RMSNorm -> TempoRMSNorm
  (same weight, same epsilon) and every SiLU-gated MLP -> TempoSwiGLUMLP (the same projection
  modules; its tail keeps gate and up only). Their attention is left to the model's own
  implementation (SDPA), which keeps no probabilities.
* ``loss=True`` (off by default: it changes the output): a ``*ForCausalLM`` called with labels
  computes its loss with ``tempo.linear_cross_entropy`` (the head's matmul and the cross-entropy
  a chunk of rows at a time) and returns ``logits=None``: the float32 logits of the whole batch,
  4 x vocabulary bytes a token, are never made. The loss is HF's (labels shifted, -100 ignored,
  ``num_items_in_batch`` honoured); without labels the model's own forward runs. As a tuple
  (``return_dict=False``, or a config's ``return_dict`` false) the output keeps HF's layout,
  ``(loss, None, cache, ...)``: None in the logits' place (HF's ``to_tuple`` drops every None,
  which would put the cache at ``[1]``, where a caller reads the logits).

Only the module given is changed, whatever else shares its HF config. HF attention modules
read the implementation from ``self.config``, and one config object is shared by every layer of
a model, so switching it would switch all of them. Instead each patched attention module gets its
own shallow copy of the config that says ``"tempo"``, and ``unpatch`` gives the original back.
The model's config, and the masks the model builds from it (eager: additive; SDPA: boolean or
None with causality implied), are left alone; the Tempo core takes either kind.

A mask of None means what it means to HF's SDPA path: causal where the module is (``is_causal``).
Inside a model the three agree, since the model always builds its mask. A bare decoder block
called without one differs: HF's eager attention then attends bidirectionally (it applies no mask
at all), while HF's SDPA and Tempo's core attend causally (measured on a GPT-2 block in float64:
outputs ~2e-3 apart). Give a bare block its causal mask to have all three agree.

Patches of nested modules compose in any order: a layer is Tempo's while at least one live
``patch`` covers it (a patch covers every layer of the switched-on kinds in its module, whether it
replaced it or found it already replaced by another patch), and ``unpatch`` restores a layer when
the last patch covering it goes. So the model's state depends only on which patches are live, and
``is_patched(m)`` says whether ``m`` holds any layer a live patch put there.

Parameters are shared, not copied, so an optimizer made before patching keeps working.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from .ops.attention import scaled_dot_product_attention
from .ops.dropout import TempoDropout
from .ops.gelu import TempoGELU
from .ops.layernorm import TempoLayerNorm
from .ops.rmsnorm import TempoRMSNorm
from .ops.swiglu import TempoSwiGLUMLP

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "gpt2", "llama", "mistral", "qwen2")
# The Llama-family modules patch() replaces (their forwards are LlamaRMSNorm's and LlamaMLP's).
RMSNORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
GATED_MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
CAUSAL_LM_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ATTN_IMPLEMENTATION = "tempo"
# Implementations whose masks the Tempo core understands: eager's additive float masks, SDPA's
# boolean ones (or None, causality then implied by the module), and Tempo's own (eager masks).
MASK_COMPATIBLE = ("eager", "sdpa", ATTN_IMPLEMENTATION)
_TEMPO_MODULES = {
    "layernorm": TempoLayerNorm,
    "gelu": TempoGELU,
    "dropout": TempoDropout,
    "rmsnorm": TempoRMSNorm,
    "swiglu": TempoSwiGLUMLP,
}
_SLOT = "_tempo_slot"  # on every module a patch() put in, and on every attention module it switched
_RECORD = "_tempo_patch"  # on the module patch() was called on


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


def _is_silu(module: nn.Module) -> bool:
    from transformers import activations as act

    silu = [nn.SiLU, *(getattr(act, n) for n in ("SiLUActivation",) if hasattr(act, n))]
    return any(type(module) is c for c in silu)


def _attention_mask(module, query, key, attention_mask, is_causal) -> torch.Tensor | None:
    """The (B, 1|H, Sq, Sk) mask Tempo's attention takes (additive, or boolean: True attends, as
    SDPA reads it), from whatever mask the model made.

    Only the patched modules run Tempo's core; the model keeps building masks for its own
    implementation. SDPA's are boolean, or None where SDPA would be told ``is_causal`` instead
    (made here, additive); eager's are additive.
    """
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        sq, sk = query.shape[-2], key.shape[-2]
        if causal and sq > 1:  # as HF's sdpa_attention_forward decides, with SDPA's top-left alignment
            full = torch.full((sq, sk), torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
            return full.triu(1)
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise ValueError(
            f"Tempo's attention takes 4-D additive or boolean masks (those of the 'eager' and 'sdpa' "
            f"implementations), got {type(attention_mask).__name__} "
            f"{list(getattr(attention_mask, 'shape', []))}"
        )
    return attention_mask  # a boolean one (True: attend) is made additive by the op, as SDPA reads it


def _tempo_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs
):
    """transformers AttentionInterface signature; returns (B, S, H, D) like eager."""
    mask = _attention_mask(module, query, key, attention_mask, is_causal)
    out, probs = scaled_dot_product_attention(
        query, key, value, mask, scaling, dropout_p=dropout, training=module.training
    )
    return out.transpose(1, 2).contiguous(), probs


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _tempo_attention)
    # Only used by a model whose own config says "tempo" (set by hand); patch() never sets it.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)


@dataclass
class PatchReport:
    model_type: str
    layernorms: list[str] = field(default_factory=list)
    gelus: list[str] = field(default_factory=list)
    dropouts: list[str] = field(default_factory=list)
    rmsnorms: list[str] = field(default_factory=list)
    swiglus: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)  # causal LMs whose loss is linear_cross_entropy
    attention_modules: list[str] = field(default_factory=list)
    previous_attn_implementation: str | None = None
    # Tempo layers found in place (put there by another live patch, or by hand): left as they are;
    # those another patch put there are held by this one too (see the module docstring).
    already_tempo: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {
            "layernorm": len(self.layernorms),
            "gelu": len(self.gelus),
            "attention": len(self.attention_modules),
            "dropout": len(self.dropouts),
            "rmsnorm": len(self.rmsnorms),
            "swiglu": len(self.swiglus),
            "loss": len(self.losses),
        }

    def __str__(self) -> str:
        c = self.counts()
        attn = (
            f"{c['attention']} attention cores (attn_implementation "
            f"{self.previous_attn_implementation!r} -> {ATTN_IMPLEMENTATION!r})"
            if self.attention_modules
            else "attention left as it was"
        )
        n_already = len(self.already_tempo)
        already = f"; {n_already} already Tempo's" if n_already else ""
        return (
            f"tempo.patch({self.model_type}): replaced {c['layernorm']} LayerNorms, {c['gelu']} GELUs, "
            f"{c['dropout']} dropouts, {c['rmsnorm']} RMSNorms, {c['swiglu']} SwiGLU MLPs, "
            f"{c['loss']} LM losses; {attn}{already}"
        )


@dataclass(eq=False)
class _Record:
    """What one patch() call holds (eq=False: records are compared by identity)."""

    report: PatchReport
    slots: list[_Slot]


@dataclass(eq=False)
class _Slot:
    """One Tempo replacement (a module in ``parent.name``, an attention module's own config, or a
    causal LM's own ``forward``) and the live patches holding it; it is undone when the last of them
    unpatches."""

    name: str
    parent: nn.Module | None  # module slot: where the replacement sits; None for an attention slot
    child_name: str
    original: object  # the HF module, or the attention module's original (shared) config
    replacement: object  # the Tempo module, or the attention module's own "tempo" config
    attention_module: nn.Module | None = None
    forward_of: nn.Module | None = None  # the causal LM whose instance forward is the replacement
    holders: list[_Record] = field(default_factory=list)

    def in_place(self) -> bool:
        if self.attention_module is not None:
            return self.attention_module.config is self.replacement
        if self.forward_of is not None:
            return self.forward_of.__dict__.get("forward") is self.replacement
        return getattr(self.parent, self.child_name, None) is self.replacement

    def undo(self) -> None:
        if self.attention_module is not None:
            self.attention_module.config = self.original
            del self.attention_module.__dict__[_SLOT]
        elif self.forward_of is not None:
            del self.forward_of.__dict__["forward"], self.forward_of.__dict__[_SLOT]
        else:
            self.original.train(self.replacement.training)
            setattr(self.parent, self.child_name, self.original)
            del self.replacement.__dict__[_SLOT]


_SIGNATURES: dict[type, inspect.Signature] = {}  # a causal LM class's forward signature, read once


def _forward_signature(cls: type) -> inspect.Signature:
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward)
    return _SIGNATURES[cls]


class _LeanLossForward:
    """A causal LM's instance ``forward`` under ``tempo.patch(loss=True)``: ``_lean_loss_forward``
    bound to the module. A class rather than a bound method because pickle stores a bound method
    by its name on the instance, which a loaded model does not have (torch.save worked, torch.load
    failed); deepcopy and pickle re-bind this one to the copy."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return _lean_loss_forward(self.module, *args, **kwargs)


def _lean_loss_forward(self, *args, **kwargs):
    """A causal LM's forward (bound to it as its own ``forward``, so copies re-bind to the copy)
    that computes the loss with linear_cross_entropy when labels are given."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from .ops.linear_ce import IGNORE_INDEX, linear_cross_entropy

    original = type(self).forward
    arguments = dict(_forward_signature(type(self)).bind(self, *args, **kwargs).arguments)
    labels = arguments.get("labels")
    if labels is None:
        return original(self, *args, **kwargs)
    del arguments["self"], arguments["labels"]
    arguments.pop("logits_to_keep", None)  # no logits are made
    extra = arguments.pop("kwargs", {})
    num_items = extra.pop("num_items_in_batch", None)
    shift_labels = extra.pop("shift_labels", None)
    return_dict = extra.pop("return_dict", None)  # None: the config's, as HF's can_return_tuple reads it
    as_tuple = not (getattr(self.config, "return_dict", True) if return_dict is None else return_dict)
    out = self.model(**arguments, **extra, return_dict=True)
    if shift_labels is None:  # as HF's ForCausalLMLoss: position t predicts label t + 1
        shift_labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    h, weight = out.last_hidden_state, self.lm_head.weight
    device = h.device.type
    if torch.is_autocast_enabled(device):  # the head's matmul in the autocast dtype, as F.linear's
        dtype = torch.get_autocast_dtype(device)
        h, weight = h.to(dtype), weight.to(dtype)
    if num_items is None:
        loss = linear_cross_entropy(h, weight, shift_labels)
    else:  # HF's reduction then: the sum over counted tokens / num_items (no counted token: 0)
        loss = linear_cross_entropy(h, weight, shift_labels, reduction="sum") / num_items
    # the base model's other outputs as they are (the cache's field name differs across versions)
    rest = {k: v for k, v in out.items() if k != "last_hidden_state"}
    result = CausalLMOutputWithPast(loss=loss, logits=None, **rest)
    if as_tuple:  # HF's layout, (loss, logits, cache, ...): to_tuple() drops the None logits, and
        # out[1] was then the cache where a caller reads the logits; None holds their place
        return (loss, None, *result.to_tuple()[1:])
    return result


def _lean_loss_refusal(lm: nn.Module) -> str | None:
    """Why ``lm``'s loss cannot be linear_cross_entropy (None: it can)."""
    if type(lm.lm_head) is not nn.Linear:  # e.g. a LoRA or quantised head: its weight is not the map
        return f"its LM head is a {type(lm.lm_head).__name__}, not a plain nn.Linear"
    if lm.lm_head.bias is not None:
        return "its LM head has a bias"
    if getattr(lm.config, "final_logit_softcapping", None) is not None:
        return "its logits are soft-capped"
    return None


def _is_attention(module: nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith(("SelfAttention", "CrossAttention", "GPT2Attention")) and hasattr(module, "config")


def _find_config(model: nn.Module):
    """The HF config of a model, or of a bare submodule (e.g. one BertLayer) via its children."""
    if getattr(model, "config", None) is not None:
        return model.config
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            return module.config
    return None


def _check_module(fn: str, model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"tempo.{fn} takes a HuggingFace model or one of its sub-modules (a torch.nn.Module; model "
            f"types {', '.join(SUPPORTED_MODEL_TYPES)}), got {type(model).__name__} {model!r:.60}"
        )


def _qualified(parent_name: str, child_name: str) -> str:
    return f"{parent_name}.{child_name}" if parent_name else child_name


# One function a technique: the Tempo module that replaces ``child``, or None when it is not that
# technique's HF module (the patcher's table, as Liger-Kernel keeps one apply_* a model family).
def _replace_layernorm(child: nn.Module) -> nn.Module | None:
    return TempoLayerNorm.from_layernorm(child) if type(child) is nn.LayerNorm else None


def _replace_gelu(child: nn.Module) -> nn.Module | None:
    approximate = _gelu_kind(child)
    return None if approximate is None else TempoGELU(approximate)


def _replace_dropout(child: nn.Module) -> nn.Module | None:
    if type(child) is not nn.Dropout:
        return None
    if child.p == 1:  # HF takes p = 1 (every element zeroed); Tempo's dropout keeps elements at p < 1
        raise ValueError(
            "an nn.Dropout with p=1.0 (it zeroes every element), which Tempo's dropout does not take "
            "(p in [0, 1)): patch with dropout=False to keep HF's dropout modules"
        )
    return TempoDropout(child.p)


def _replace_rmsnorm(child: nn.Module) -> nn.Module | None:
    return TempoRMSNorm.from_rmsnorm(child) if type(child).__name__ in RMSNORM_CLASSES else None


def _replace_swiglu(child: nn.Module) -> nn.Module | None:
    if type(child).__name__ not in GATED_MLP_CLASSES or not _is_silu(child.act_fn):
        return None
    return TempoSwiGLUMLP(child.gate_proj, child.up_proj, child.down_proj)


_Named = tuple[str, nn.Module]  # a module and its qualified name
# tried in this order on each child module
_REPLACEMENTS = {
    "layernorm": _replace_layernorm,
    "gelu": _replace_gelu,
    "dropout": _replace_dropout,
    "rmsnorm": _replace_rmsnorm,
    "swiglu": _replace_swiglu,
}


def _check_patchable(model: nn.Module, switched_on: dict[str, bool]):
    """(config, model_type) of a model ``patch`` can take; refuses one it cannot, before any change."""
    _check_module("patch", model)
    config = _find_config(model)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        # a sub-module is taken where it holds its model's config (a layer, an attention module);
        # one without any (BERT's embeddings) cannot say which model it is part of
        found = "no HF config in it" if config is None else f"model_type={model_type!r}"
        raise ValueError(
            f"tempo.patch takes an HF model of type {', '.join(SUPPORTED_MODEL_TYPES)}, or a sub-module "
            f"of one that holds its config (a layer, an attention module); got {type(model).__name__} "
            f"({found}): patch the model or layer that holds it"
        )
    if getattr(model, _RECORD, None) is not None:
        raise RuntimeError("model is already patched by tempo; call tempo.unpatch(model) first")
    if not any(switched_on.values()):
        raise ValueError(
            "every technique is switched off (layernorm, gelu, attention, dropout, rmsnorm, swiglu, "
            "loss): nothing to patch"
        )
    return config, model_type


def _plan_modules(model: nn.Module, switched_on: dict[str, bool], report: PatchReport) -> tuple[list, list]:
    """(new slots, slots of other patches this one joins) for the child modules Tempo replaces."""
    lists = {
        "layernorm": report.layernorms,
        "gelu": report.gelus,
        "dropout": report.dropouts,
        "rmsnorm": report.rmsnorms,
        "swiglu": report.swiglus,
    }
    new_slots: list[_Slot] = []
    joined: list[_Slot] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            qualified = _qualified(parent_name, child_name)
            kind = next((k for k, cls in _TEMPO_MODULES.items() if isinstance(child, cls)), None)
            if kind is not None:  # already Tempo's: hold it too if another patch put it there
                if switched_on[kind]:
                    report.already_tempo.append(qualified)
                    if (slot := child.__dict__.get(_SLOT)) is not None:
                        joined.append(slot)
                continue
            for kind, replace in _REPLACEMENTS.items():
                try:
                    new = replace(child) if switched_on[kind] else None
                except ValueError as e:  # a module Tempo's cannot stand in for, named; nothing changed yet
                    also = _probabilities_dropout(parent) is child
                    raise ValueError(
                        f"tempo.patch: {qualified} is {e}"
                        + (" and attention=False (its attention core reads the same p)" if also else "")
                    ) from None
                if new is not None:
                    # in the mode of the module it stands in for (unpatch copies it back: a model
                    # patched in eval mode came back with its norms and GELU in training mode)
                    new.train(child.training)
                    lists[kind].append(qualified)
                    new_slots.append(_Slot(qualified, parent, child_name, child, new))
                    break
    return new_slots, joined


def _probabilities_dropout(module: nn.Module) -> nn.Module | None:
    """The dropout whose ``p`` an HF attention module passes to its attention core (BERT's and
    RoBERTa's ``dropout``, GPT-2's ``attn_dropout``), or None for any other module."""
    if not _is_attention(module):
        return None
    found = getattr(module, "attn_dropout", None) or getattr(module, "dropout", None)
    return found if isinstance(found, nn.Module) else None


def _plan_loss(model: nn.Module, report: PatchReport, joined: list[_Slot]) -> list[_Slot]:
    """New slots for the causal LMs' lean loss forward (``loss=True``); appends to ``joined``."""
    new_slots = []
    for name, module in model.named_modules():
        if type(module).__name__ not in CAUSAL_LM_CLASSES:
            continue
        name = name or type(module).__name__
        if (slot := module.__dict__.get(_SLOT)) is not None:
            report.already_tempo.append(name)
            joined.append(slot)
        elif (why := _lean_loss_refusal(module)) is not None:
            raise ValueError(f"tempo.patch(loss=True) cannot take {name}: {why}; pass loss=False")
        else:
            lean = _LeanLossForward(module)
            new_slots.append(_Slot(name, None, "forward", None, lean, forward_of=module))
            report.losses.append(name)
    if not report.losses and not any(s.forward_of is not None for s in joined):
        raise ValueError(
            f"tempo.patch(loss=True) takes a causal LM ({', '.join(CAUSAL_LM_CLASSES)}) or a module "
            f"holding one; {type(model).__name__} holds none: pass loss=False"
        )
    return new_slots


def _plan_attention(model: nn.Module, report: PatchReport, joined: list[_Slot]) -> list[_Named]:
    """The attention modules whose core Tempo's replaces (appends those another patch holds to
    ``joined``); refuses implementations and options whose masks Tempo's core cannot read."""
    targets: list[_Named] = []
    for name, module in model.named_modules():
        if not _is_attention(module):
            continue
        name = name or type(module).__name__
        if (slot := module.__dict__.get(_SLOT)) is not None:
            report.already_tempo.append(name)
            joined.append(slot)
        else:
            targets.append((name, module))
    implementations = sorted({m.config._attn_implementation or "eager" for _, m in targets})
    if unsupported := [i for i in implementations if i not in MASK_COMPATIBLE]:
        raise ValueError(
            f"tempo.patch(attention=True) takes models whose attention implementation is one of "
            f"{', '.join(MASK_COMPATIBLE)} (their masks are what Tempo's core reads); this one uses "
            f"{', '.join(unsupported)}: set_attn_implementation('eager') first, or pass attention=False"
        )
    for name, m in targets:  # HF's cores take p = 1 (every probability zeroed); Tempo's, p < 1
        if getattr(_probabilities_dropout(m), "p", 0.0) == 1:
            raise ValueError(
                f"tempo.patch: {name} drops its attention probabilities with p=1.0 (all of them), which "
                "Tempo's attention core does not take (p in [0, 1)): pass attention=False to keep HF's"
            )
    if any(getattr(m, "reorder_and_upcast_attn", False) for _, m in targets):  # GPT-2 only
        raise ValueError(
            "GPT-2 with reorder_and_upcast_attn=True bypasses the attention registry; set it False"
        )
    return targets


def _attention_slots(targets: list[_Named], report: PatchReport) -> list[_Slot]:
    """A slot per attention module: its own copy of the config, naming Tempo's implementation."""
    if targets:
        _register_attention()
    slots = []
    for name, module in targets:
        # A copy, not the shared object: only this module is to run Tempo's core.
        own = copy.copy(module.config)
        # The field itself, not the setter: that one also sets the (shared) sub-configs.
        own._attn_implementation_internal = ATTN_IMPLEMENTATION
        slots.append(_Slot(name, None, "config", module.config, own, attention_module=module))
        report.attention_modules.append(name)
    return slots


def _install(slot: _Slot) -> None:
    """Put a slot's replacement in place: a config, a forward or a child module."""
    if slot.attention_module is not None:
        slot.attention_module.config = slot.replacement
        slot.attention_module.__dict__[_SLOT] = slot
    elif slot.forward_of is not None:
        slot.forward_of.__dict__["forward"] = slot.replacement
        slot.forward_of.__dict__[_SLOT] = slot
    else:
        setattr(slot.parent, slot.child_name, slot.replacement)
        slot.replacement.__dict__[_SLOT] = slot


def patch(
    model: nn.Module,
    *,
    layernorm: bool = True,
    gelu: bool = True,
    attention: bool = True,
    dropout: bool = True,
    rmsnorm: bool = True,
    swiglu: bool = True,
    loss: bool = False,
) -> PatchReport:
    """Convert a HF BERT / RoBERTa / GPT-2 or Llama / Mistral / Qwen2 model (any size, any head),
    or a submodule of one such as a single layer, to Tempo's layers in place. Only ``model``
    changes (not the other layers that share its config). Returns what was replaced."""
    switched_on = {
        "layernorm": layernorm,
        "gelu": gelu,
        "dropout": dropout,
        "rmsnorm": rmsnorm,
        "swiglu": swiglu,
        "attention": attention,
        "loss": loss,
    }
    for name, on in switched_on.items():  # "no" would be truthy: patched as on
        if not isinstance(on, bool):
            raise TypeError(f"tempo.patch's {name} must be True or False, got {on!r}")
    config, model_type = _check_patchable(model, switched_on)
    # Plan everything first, so a refusal leaves the model untouched.
    report = PatchReport(model_type=model_type)
    new_slots, joined = _plan_modules(model, switched_on, report)
    if loss:
        new_slots += _plan_loss(model, report, joined)
    targets = _plan_attention(model, report, joined) if attention else []
    if not new_slots and not targets and not joined:
        raise ValueError(
            f"found nothing to replace in {type(model).__name__} with the techniques switched on"
        )
    implementations = sorted({m.config._attn_implementation or "eager" for _, m in targets})
    report.previous_attn_implementation = (
        ", ".join(implementations) if targets else getattr(config, "_attn_implementation", None)
    )
    new_slots += _attention_slots(targets, report)
    record = _Record(report, new_slots + joined)
    for slot in new_slots:
        _install(slot)
    for slot in record.slots:
        slot.holders.append(record)
    setattr(model, _RECORD, record)
    model._tempo_report = report
    return report


def unpatch(model: nn.Module) -> None:
    """Undo this module's ``patch``: each layer it covered goes back to the HF module (parameters
    kept) unless another live patch still covers it."""
    _check_module("unpatch", model)
    record: _Record | None = getattr(model, _RECORD, None)
    if record is None:
        if not is_patched(model):
            raise RuntimeError(f"{type(model).__name__} is not patched by tempo")
        inner = [n for n, m in model.named_modules() if n and getattr(m, _RECORD, None) is not None]
        where = (
            f"tempo.patch of its sub-module(s) {', '.join(inner)}: unpatch those"
            if inner
            else "tempo.patch of a module that contains it: unpatch that one"
        )
        raise RuntimeError(
            f"{type(model).__name__} is not patched by tempo itself; its Tempo layers come from {where}"
        )
    last = [slot for slot in record.slots if all(h is record for h in slot.holders)]
    # Check before undoing anything, so a refusal leaves the model as it was.
    for slot in last:
        if not slot.in_place():
            raise RuntimeError(
                f"cannot unpatch: {slot.name} is no longer what tempo.patch put there (replaced since); "
                "nothing was restored"
            )
    for slot in record.slots:
        slot.holders = [h for h in slot.holders if h is not record]
    for slot in last:
        slot.undo()
    delattr(model, _RECORD)
    del model._tempo_report


def is_patched(model: nn.Module) -> bool:
    """Does ``model`` hold any layer that a live ``tempo.patch`` (of it, of a sub-module, or of a
    module containing it) put there?"""
    _check_module("is_patched", model)
    return any(_SLOT in m.__dict__ for m in model.modules())


__all__ = ["SUPPORTED_MODEL_TYPES", "PatchReport", "is_patched", "patch", "unpatch"]
