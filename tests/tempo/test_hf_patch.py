"""tempo.patch on HuggingFace BERT / RoBERTa / GPT-2."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForPreTraining,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForMaskedLM,
)
from transformers.utils import logging as hf_logging

import tempo

from .copies import HOWS, copied

hf_logging.set_verbosity_error()


def tiny(kind: str, dropout: float = 0.0):
    encoder = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=120,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    if kind == "bert":
        return BertForPreTraining(BertConfig(**encoder))
    if kind == "roberta":
        return RobertaForMaskedLM(RobertaConfig(**encoder))
    cfg = GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=120,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(cfg)


def logits(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.prediction_logits


def batch():
    ids = torch.randint(3, 120, (3, 24))
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, 17:] = 0  # padding: exercises the additive attention mask
    return ids, mask


def test_bert_large_every_layer_is_replaced():
    cfg = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
    report = tempo.patch(model)
    assert report.counts() == {
        "layernorm": 24 * 2 + 2,
        "gelu": 24 + 1,
        "attention": 24,
        "dropout": 24 * 3 + 1,
        "rmsnorm": 0,
        "swiglu": 0,
        "loss": 0,
    }
    for layer in model.bert.encoder.layer:
        assert isinstance(layer.attention.output.LayerNorm, tempo.TempoLayerNorm)
        assert isinstance(layer.output.LayerNorm, tempo.TempoLayerNorm)
        assert isinstance(layer.intermediate.intermediate_act_fn, tempo.TempoGELU)
        assert isinstance(layer.output.dropout, tempo.TempoDropout)
        assert isinstance(layer.attention.output.dropout, tempo.TempoDropout)
        assert layer.attention.self.config._attn_implementation == "tempo"
    # Each attention module gets its own config saying "tempo"; the model's own is left alone.
    assert model.config._attn_implementation == "sdpa"
    assert "24 attention cores" in str(report)


# Parameters the logits do not depend on (BERT's NSP head and pooler): no gradient in either model.
UNUSED = {
    "bert": {
        "bert.pooler.dense.weight",
        "bert.pooler.dense.bias",
        "cls.seq_relationship.weight",
        "cls.seq_relationship.bias",
    },
    "roberta": set(),
    "gpt2": set(),
}
# Gradient exactly 0 in exact arithmetic: the key bias adds q . b_k to every score of a query, and
# softmax ignores a shift common to a row. Both models give roundoff there, so no relative check.
ZERO_GRADIENT_SUFFIX = "attention.self.key.bias"


@pytest.mark.parametrize("kind", ["bert", "roberta", "gpt2"])
def test_dropout_off_outputs_and_gradients_match(kind):
    """Each parameter's gradient against the unpatched model's, in float64. Tolerance 1e-6 per
    parameter (norm-wise): every patched op but the GELU matches torch's to float64 roundoff
    (~1e-15 seen); the GELU's recovered derivative is off by at most ~3e-8 (the conditioning
    bound in tempo/ops/gelu.py for a float64 y), and only at inputs right at GELU's minimum,
    where GELU' itself is ~0. (float32 is checked layer by layer in test_gelu.py & co.)"""
    model = tiny(kind).train().double()  # training mode, dropout probabilities 0
    ids, mask = batch()
    params = dict(model.named_parameters())
    ref = logits(model, ids, mask)
    g_ref = torch.autograd.grad(ref.square().mean(), list(params.values()), allow_unused=True)
    report = tempo.patch(model)
    assert report.counts()["attention"] == 2
    out = logits(model, ids, mask)
    g = torch.autograd.grad(out.square().mean(), list(params.values()), allow_unused=True)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-12
    assert {n for n, b in zip(params, g_ref, strict=True) if b is None} == UNUSED[kind]
    assert {n for n, a in zip(params, g, strict=True) if a is None} == UNUSED[kind]
    total = torch.stack([b.norm() for b in g_ref if b is not None]).norm()
    checked = 0
    for name, a, b in zip(params, g, g_ref, strict=True):
        if b is None:
            continue
        if name.endswith(ZERO_GRADIENT_SUFFIX):
            assert max(a.norm(), b.norm()) <= 1e-12 * total, name
            continue
        err = ((a - b).norm() / b.norm()).item()
        assert err <= 1e-6, f"{name}: relative error {err:.2e}"
        checked += 1
    assert checked >= len(params) - len(UNUSED[kind]) - 2


def test_gpt2_keeps_its_tanh_gelu_and_bert_its_erf_gelu():
    gpt2, bert = tiny("gpt2"), tiny("bert")
    tempo.patch(gpt2)
    tempo.patch(bert)
    assert gpt2.transformer.h[0].mlp.act.approximate == "tanh"
    assert bert.bert.encoder.layer[0].intermediate.intermediate_act_fn.approximate == "none"


def test_dropout_on_is_equivalent_in_distribution():
    """With dropout on, Tempo draws other (equally distributed) masks than torch: per-step
    outputs differ, their distribution does not. Compare mean and spread over many draws."""
    model = tiny("bert", dropout=0.1).train()
    ids, mask = batch()
    draws = 150

    def stats():
        with torch.no_grad():
            outs = torch.stack([logits(model, ids, mask) for _ in range(draws)])
        return outs.mean(0), outs.std(0)

    mean_ref, std_ref = stats()
    tempo.patch(model)
    mean, std = stats()
    # Standard error of each element's mean is std/sqrt(draws); compare in aggregate.
    z = (mean - mean_ref) / (std_ref * (2 / draws) ** 0.5).clamp_min(1e-6)
    assert z.abs().mean().item() < 1.0  # |z| of two equal means averages ~0.8
    assert abs((std.mean() / std_ref.mean()).item() - 1) < 0.05


def test_unpatch_restores_everything():
    model = tiny("bert").eval()
    ids, mask = batch()
    before = logits(model, ids, mask)
    impl = model.config._attn_implementation
    tempo.patch(model)
    assert tempo.is_patched(model)
    tempo.unpatch(model)
    assert not tempo.is_patched(model)
    assert model.config._attn_implementation == impl
    assert not any(type(m).__name__.startswith("Tempo") for m in model.modules())
    torch.testing.assert_close(logits(model, ids, mask), before, rtol=0, atol=0)


@pytest.mark.parametrize("training", [True, False])
def test_the_modules_tempo_puts_in_are_in_the_models_mode_and_unpatch_keeps_it(training):
    """TempoLayerNorm and TempoGELU were made in training mode whatever the model's, and unpatch
    copied that back: a model patched in eval mode came back with its norms and GELU training."""
    model = tiny("bert").train(training)
    tempo.patch(model)
    assert {m.training for m in model.modules() if type(m).__name__.startswith("Tempo")} == {training}
    tempo.unpatch(model)
    assert {m.training for m in model.modules()} == {training}


def test_patch_twice_and_unpatch_unpatched_are_refused():
    model = tiny("gpt2")
    with pytest.raises(RuntimeError, match="not patched"):
        tempo.unpatch(model)
    tempo.patch(model)
    with pytest.raises(RuntimeError, match="already patched"):
        tempo.patch(model)


def test_unsupported_model_lists_the_supported_ones():
    with pytest.raises(ValueError, match="bert, roberta, gpt2, llama, mistral, qwen2"):
        tempo.patch(nn.Sequential(nn.Linear(3, 3)))


@pytest.mark.slow
def test_torch_compile_matches_eager():
    model = tiny("bert").train()
    tempo.patch(model)
    ids, mask = batch()
    eager = logits(model, ids, mask)
    g_eager = torch.autograd.grad(eager.square().mean(), list(model.parameters()), allow_unused=True)
    compiled = torch.compile(model)
    out = logits(compiled, ids, mask)
    g = torch.autograd.grad(out.square().mean(), list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_eager, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["bert", "roberta", "gpt2"])
@pytest.mark.parametrize("how", HOWS)
def test_a_patched_model_survives_save_and_load(kind, how):
    """Every technique on (LayerNorm, GELU, attention core, dropout): the copy computes what the
    original does (eval and, with the same seed, training mode), is still patched, and unpatches to
    HF's modules with its own parameters."""
    ours = tiny(kind, dropout=0.1)
    tempo.patch(ours)
    twin = copied(ours, how)
    ids, mask = batch()
    assert tempo.is_patched(twin)
    with torch.no_grad():
        for model in (ours, twin):
            model.eval()
        assert torch.equal(logits(twin, ids, mask), logits(ours, ids, mask))
        for model in (ours, twin):
            model.train()
        torch.manual_seed(0)
        trained = logits(ours, ids, mask)
        torch.manual_seed(0)
        assert torch.equal(logits(twin, ids, mask), trained)  # the dropouts' seeds drawn alike
    tempo.unpatch(twin)
    assert not tempo.is_patched(twin) and tempo.is_patched(ours)
    assert not any(
        isinstance(m, tempo.TempoLayerNorm | tempo.TempoGELU | tempo.TempoDropout) for m in twin.modules()
    )
    with torch.no_grad():
        next(twin.parameters()).zero_()  # the copy's parameters are its own
        assert not torch.equal(next(twin.parameters()), next(ours.parameters()))
