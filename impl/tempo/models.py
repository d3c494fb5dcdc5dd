"""The models, task heads and configurations Tempo is evaluated on, in one place.

A ``ModelSpec`` names a HF architecture and its shape; ``build_model`` makes it with a task
head, an attention implementation and (optionally) Tempo patched in; ``make_batch`` makes a
matching random batch (token ids and labels); ``CONFIGURATIONS`` are the paper's side-by-side
variants (baselines, Tempo, each Tempo technique alone, activation checkpointing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from measure.checks import real, whole
from measure.presets import check_fields, count, flag, load_preset, text

from .hf import patch


@dataclass(frozen=True)
class ModelSpec:
    family: str  # bert | roberta | gpt2 | llama
    hidden: int
    layers: int
    heads: int
    vocab: int
    max_positions: int
    ffn: int | None = None  # MLP width; default 4 x hidden (Llama presets give theirs)
    kv_heads: int | None = None  # grouped-query attention (Llama); default: heads
    tie_embeddings: bool = False  # Llama-3.2-1B shares the embedding with the LM head

    def config(self, num_layers: int | None = None, attn: str = "eager", dropout: float = 0.1):
        """The HF config. Llama-family models train without dropout: ``dropout`` is not theirs."""
        layers = self.layers if num_layers is None else num_layers
        if self.family == "llama":
            from transformers import LlamaConfig

            return LlamaConfig(
                hidden_size=self.hidden,
                intermediate_size=self.ffn or 4 * self.hidden,
                num_hidden_layers=layers,
                num_attention_heads=self.heads,
                num_key_value_heads=self.kv_heads or self.heads,
                vocab_size=self.vocab,
                max_position_embeddings=self.max_positions,
                tie_word_embeddings=self.tie_embeddings,
                attn_implementation=attn,
            )
        if self.family == "gpt2":
            from transformers import GPT2Config

            return GPT2Config(
                n_embd=self.hidden,
                n_layer=layers,
                n_head=self.heads,
                vocab_size=self.vocab,
                n_positions=self.max_positions,
                resid_pdrop=dropout,
                embd_pdrop=dropout,
                attn_pdrop=dropout,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
                attn_implementation=attn,
            )
        from transformers import BertConfig, RobertaConfig

        cls = BertConfig if self.family == "bert" else RobertaConfig
        extra = {"pad_token_id": 1} if self.family == "roberta" else {}
        return cls(
            hidden_size=self.hidden,
            num_hidden_layers=layers,
            num_attention_heads=self.heads,
            intermediate_size=4 * self.hidden,
            vocab_size=self.vocab,
            max_position_embeddings=self.max_positions,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            attn_implementation=attn,
            **extra,
        )


MODELS_FILE = Path(__file__).parent / "presets" / "models.json"
FAMILIES = ("bert", "roberta", "gpt2", "llama")
# An entry's fields in models.json: ModelSpec's (ffn, kv_heads, tie_embeddings: where the model
# has them) and where the shape comes from
_REQUIRED = ("family", "hidden", "layers", "heads", "vocab", "max_positions", "source")
_OPTIONAL = ("ffn", "kv_heads", "tie_embeddings")


def _spec(path: Path | str, name: str, d: object) -> ModelSpec:
    """One entry, read strictly: exactly its fields, a known family, sizes whole numbers >= 1."""
    check_fields(path, name, d, _REQUIRED, _OPTIONAL)
    text(path, f"{name}.source", d["source"])
    if d["family"] not in FAMILIES:
        raise ValueError(
            f"{path}: {name}.family must be one of {', '.join(FAMILIES)}, got {d['family']!r:.40}"
        )
    sizes = {k: count(path, f"{name}.{k}", d[k]) for k in _REQUIRED[1:-1]}
    sizes |= {k: count(path, f"{name}.{k}", d[k]) for k in ("ffn", "kv_heads") if k in d}
    if "tie_embeddings" in d:
        sizes["tie_embeddings"] = flag(path, f"{name}.tie_embeddings", d["tie_embeddings"])
    hidden, heads, kv = sizes["hidden"], sizes["heads"], sizes.get("kv_heads", sizes["heads"])
    if hidden % heads or heads % kv:  # the HF config's own error would name no file
        raise ValueError(
            f"{path}: {name}: hidden ({hidden}) must be a multiple of heads ({heads}), "
            f"heads of kv_heads ({kv})"
        )
    return ModelSpec(d["family"], **sizes)


def read_models(path: Path) -> dict[str, ModelSpec]:
    """The model presets in ``path`` (models.json's form), read strictly: one line naming the
    file and the field for whatever is wrong."""
    d = load_preset(path)
    if not d:
        raise ValueError(f"{path}: no model (a mapping of model names to their shapes)")
    return {text(path, "a model's name", name): _spec(path, name, entry) for name, entry in d.items()}


@functools.cache
def models() -> dict[str, ModelSpec]:
    """The model presets by name (a HF architecture and its shape), read on first use; add one by
    adding an entry to presets/models.json."""
    return read_models(MODELS_FILE)


HEADS = ("pretraining", "classification", "qa")


@dataclass(frozen=True)
class Configuration:
    """One side-by-side variant: attention implementation, Tempo techniques, checkpointing."""

    attn: str = "eager"
    tempo: dict[str, bool] = field(default_factory=dict)  # tempo.patch switches; empty: unpatched
    checkpointing: bool = False
    families: tuple[str, ...] = FAMILIES  # the models it applies to
    heads: tuple[str, ...] = HEADS  # and the task heads


_ALL = dict(layernorm=True, gelu=True, attention=True, dropout=True, rmsnorm=True, swiglu=True)
_NONE = dict.fromkeys(_ALL, False)
_PAPER = ("bert", "roberta", "gpt2")  # the paper's techniques alone: nothing of theirs in a Llama
_LLAMA = ("llama",)
CONFIGURATIONS: dict[str, Configuration] = {
    "hf-eager": Configuration("eager"),
    "hf-sdpa": Configuration("sdpa"),
    "tempo": Configuration("eager", _ALL),
    "tempo+sdpa": Configuration("sdpa", {**_ALL, "attention": False}),
    "tempo-gelu": Configuration("eager", {**_NONE, "gelu": True}, families=_PAPER),
    "tempo-layernorm": Configuration("eager", {**_NONE, "layernorm": True}, families=_PAPER),
    "tempo-attention": Configuration("eager", {**_NONE, "attention": True}, families=_PAPER),
    "tempo-dropout": Configuration("eager", {**_NONE, "dropout": True}, families=_PAPER),
    "checkpointing": Configuration("eager", checkpointing=True),
    # Llama-family decoders: SDPA is their usual attention (Tempo's core is for eager attention)
    "checkpointing+sdpa": Configuration("sdpa", checkpointing=True),
    "tempo-rmsnorm": Configuration("sdpa", {**_NONE, "rmsnorm": True}, families=_LLAMA),
    "tempo-swiglu": Configuration("sdpa", {**_NONE, "swiglu": True}, families=_LLAMA),
    "tempo+sdpa+loss": Configuration(  # the LM loss: a causal LM's own head only
        "sdpa", {**_ALL, "attention": False, "loss": True}, families=_LLAMA, heads=("pretraining",)
    ),
}


def _check(name: str, table: dict, what: str) -> None:
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of: {', '.join(table)}")


def check_configuration(model: str, configuration: str, head: str = "pretraining") -> None:
    """Refuse a configuration that has nothing to change in ``model`` with ``head`` (e.g. GELU alone
    in a Llama, the LM loss under a QA head)."""
    _check(model, models(), "model")
    _check(configuration, CONFIGURATIONS, "configuration")
    family = models()[model].family
    if (
        family not in CONFIGURATIONS[configuration].families
        or head not in CONFIGURATIONS[configuration].heads
    ):
        fits = [name for name, c in CONFIGURATIONS.items() if family in c.families and head in c.heads]
        raise ValueError(
            f"configuration {configuration!r} does not apply to {model} ({family}) with the "
            f"{head} head; for it choose one of: {', '.join(fits)}"
        )


def build_model(
    model: str,
    head: str = "pretraining",
    configuration: str = "hf-eager",
    num_layers: int | None = None,
    dropout: float = 0.1,
) -> nn.Module:
    """A freshly initialised HF model (no download) with the head and configuration asked for."""
    _check(model, models(), "model")
    _check(configuration, CONFIGURATIONS, "configuration")
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of: {', '.join(HEADS)}")
    if num_layers is not None and not whole(num_layers, 1):
        raise ValueError(f"num_layers must be a whole number >= 1 (None: the preset's), got {num_layers!r}")
    if not real(dropout) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    spec, conf = models()[model], CONFIGURATIONS[configuration]
    check_configuration(model, configuration, head)
    cfg = spec.config(num_layers, conf.attn, dropout)
    import transformers as tf

    classes = {
        ("bert", "pretraining"): tf.BertForPreTraining,
        ("roberta", "pretraining"): tf.RobertaForMaskedLM,
        ("gpt2", "pretraining"): tf.GPT2LMHeadModel,
        ("bert", "classification"): tf.BertForSequenceClassification,
        ("roberta", "classification"): tf.RobertaForSequenceClassification,
        ("gpt2", "classification"): tf.GPT2ForSequenceClassification,
        ("bert", "qa"): tf.BertForQuestionAnswering,
        ("roberta", "qa"): tf.RobertaForQuestionAnswering,
        ("gpt2", "qa"): tf.GPT2ForQuestionAnswering,
        ("llama", "pretraining"): tf.LlamaForCausalLM,
        ("llama", "classification"): tf.LlamaForSequenceClassification,
        ("llama", "qa"): tf.LlamaForQuestionAnswering,
    }
    m = classes[(spec.family, head)](cfg)
    if conf.tempo:
        patch(m, **conf.tempo)
    if conf.checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.24
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # the name before (transformers 5.17 on the GPU machine)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return m


# Where each family's HF model holds its Transformer layers, under ``model.base_model``
LAYER_LISTS = ("encoder.layer", "h", "layers")  # BERT/RoBERTa, GPT-2, Llama


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The Transformer layers of a model ``build_model`` built (its embedding, head and loss are
    the rest)."""
    for path in LAYER_LISTS:
        found = model.base_model
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, nn.ModuleList):
            return list(found)
    raise ValueError(f"no Transformer layer list ({', '.join(LAYER_LISTS)}) in {type(model).__name__}")


def make_batch(
    model: str, head: str, batch: int, seq: int, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Random token ids and labels for ``head`` (every position labelled for LM/MLM: worst case)."""
    _check(model, models(), "model")
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of: {', '.join(HEADS)}")
    if not (whole(batch, 1) and whole(seq, 1)):
        raise ValueError(f"batch and seq must be whole numbers >= 1, got {batch!r}, {seq!r}")
    spec = models()[model]
    if seq > spec.max_positions:
        raise ValueError(f"{model} takes at most {spec.max_positions} positions, got seq={seq}")
    ids = torch.randint(0, spec.vocab, (batch, seq), device=device)
    out = {"input_ids": ids}
    if head == "pretraining":
        out["labels"] = torch.randint(0, spec.vocab, (batch, seq), device=device)
        if spec.family == "bert":
            out["next_sentence_label"] = torch.randint(0, 2, (batch,), device=device)
    elif head == "classification":
        out["labels"] = torch.randint(0, 2, (batch,), device=device)
    else:
        out["start_positions"] = torch.randint(0, seq, (batch,), device=device)
        out["end_positions"] = torch.randint(0, seq, (batch,), device=device)
    return out
