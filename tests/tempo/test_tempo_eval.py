"""Tempo's evaluation pieces: model presets and heads, the max-batch command, the closed forms."""

from __future__ import annotations

import pytest
import torch
from transformers.utils import logging as hf_logging

from tempo import maxbatch
from tempo.models import CONFIGURATIONS, HEADS, MODELS_FILE, build_model, make_batch, models, read_models
from tests.preset_copies import corrupted, drop_field, refused_in_one_line, set_field

hf_logging.set_verbosity_error()


@pytest.mark.parametrize("family_model", ["bert-base", "roberta-base", "gpt2"])
@pytest.mark.parametrize("head", HEADS)
def test_every_head_trains_one_step(family_model, head):
    """Every trainable parameter gets a finite gradient through Tempo's patched layers. None is
    exempt: each of these heads uses all its parameters (BERT's pooler feeds NSP and
    classification, and the QA heads and RoBERTa's heads are built without one; tied LM-head
    weights are one parameter), so a missing gradient means a patched layer cut the graph."""
    m = build_model(family_model, head, "tempo", num_layers=1).train()
    loss = m(**make_batch(family_model, head, 2, 16)).loss
    loss.backward()
    assert torch.isfinite(loss)
    trainable = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    assert len(trainable) > 10
    assert [n for n, p in trainable if p.grad is None] == [], "parameters without a gradient"
    assert [n for n, p in trainable if not torch.isfinite(p.grad).all()] == [], "non-finite gradients"


def _checkpointing(model) -> bool:
    # transformers 5.24's name, and 5.17's (the GPU machine's)
    name = (
        "is_activation_checkpointing"
        if hasattr(model, "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return getattr(model, name)


def test_configurations_are_what_they_say():
    with torch.device("meta"):
        eager = build_model("bert-large", configuration="hf-eager")
        ours = build_model("bert-large", configuration="tempo+sdpa")
        ckpt = build_model("bert-large", configuration="checkpointing")
    assert eager.config._attn_implementation == "eager"
    assert ours.config._attn_implementation == "sdpa" and ours._tempo_report.counts()["attention"] == 0
    assert ours._tempo_report.counts()["gelu"] == 25
    assert _checkpointing(ckpt) and not _checkpointing(eager)
    assert set(CONFIGURATIONS) >= {"hf-eager", "hf-sdpa", "tempo", "tempo+sdpa", "checkpointing"}


def test_bad_names_list_the_choices():
    with pytest.raises(ValueError, match="bert-large"):
        build_model("bert-huge")
    with pytest.raises(ValueError, match="pretraining, classification, qa"):
        build_model("bert-base", "ner")
    with pytest.raises(ValueError, match="at most 512 positions"):
        make_batch("bert-base", "qa", 1, 1024)


@pytest.mark.slow
def test_maxbatch_command(capsys):
    assert (
        maxbatch.main(
            [
                "--model",
                "bert-mini",  # the command, not the model: bert-base took 23-55 s here
                "--seq",
                "64",
                "--precision",
                "fp16",
                "--gpu-mem",
                "1GB",
                "--tempo",
                "--no-verify",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "max batch:" in out and "tempo" in out
    assert (
        maxbatch.main(["--model", "gpt2-xl", "--seq", "1024", "--precision", "fp32", "--gpu-mem", "2GB"]) == 1
    )
    assert "does not fit" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        maxbatch.main(["--model", "bert-base", "--seq", "64", "--gpu-mem", "lots"])


def test_maxbatch_command_under_compile(capsys):
    """--compile: the scale torch.compile's partition keeps, then a batch no smaller than eager's
    (GPT-2 compiled keeps less); a checkpointed model under compile is refused before any work."""
    args = ["--model", "gpt2-mini", "--seq", "256", "--gpu-mem", "1GB", "--no-verify"]
    assert maxbatch.main(args) == 0
    eager = int(capsys.readouterr().out.split("max batch: ")[1].split()[0])
    assert maxbatch.main([*args, "--compile"]) == 0
    out = capsys.readouterr().out
    assert "torch.compile keeps x0." in out and " in the layers, x0." in out  # less in both parts
    assert int(out.split("max batch: ")[1].split()[0]) > eager  # the scale was applied
    with pytest.raises(SystemExit) as exit_:
        maxbatch.main([*args, "--config", "checkpointing+sdpa", "--compile"])
    assert exit_.value.code == 2
    assert "checkpointed model under torch.compile" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("configuration", "sbh", "as2b"), [("hf-eager", 34, 5), ("tempo", 20.5, 2), ("checkpointing", 2, 0)]
)
def test_closed_forms_per_layer_inside_the_model(configuration, sbh, as2b):
    from artifacts.tempo_bert.run import activation_point

    r = activation_point("bert-base", configuration, 128)
    assert r["closed_form_bytes"]["sbh"] == pytest.approx(sbh, abs=0.02)
    assert r["closed_form_bytes"]["as2b"] == pytest.approx(as2b, abs=0.01)
    assert r["closed_form_error"] < 1e-3
    assert models()["bert-base"].layers * r["per_layer_bytes"] < r["per_model_bytes"]


@pytest.mark.parametrize("configuration", ["checkpointing", "hf-sdpa", "tempo+sdpa"])
def test_estimator_runs_every_configuration(configuration):
    """Checkpointing recomputes the forward inside backward: the CUDA-like substitutions must hold
    there too (checkpoint checks that recomputed tensors match the saved ones)."""
    from measure.memory import DepthExtrapolatedEstimator
    from tempo.ops import workspace_bytes

    est = DepthExtrapolatedEstimator(
        lambda n: build_model("bert-base", "pretraining", configuration, num_layers=n),
        lambda b: make_batch("bert-base", "pretraining", b, 64),
        "fp16",
        num_layers=12,
        op_workspace=workspace_bytes,
    )
    assert est.peak(4).peak_bytes < est.peak(8).peak_bytes


@pytest.mark.slow
def test_offline_corpus_and_pretraining_batches(tmp_path):
    from artifacts.tempo_bert import data

    docs = data.corpus(tmp_path)
    assert len(docs) > 1000 and all(len(d) >= 2 for d in docs)
    batches = data.bert_batches(3, 8, 64, seed=1, cache_dir=tmp_path)
    tok = data.tokenizer("wordpiece", cache_dir=tmp_path)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    for b in batches:
        assert (b["input_ids"][:, 0] == cls_id).all()
        assert ((b["input_ids"] == sep_id).sum(1) == 2).all()  # [CLS] A [SEP] B [SEP]
        real = b["attention_mask"].bool() & (b["input_ids"] != cls_id) & (b["input_ids"] != sep_id)
        rate = ((b["labels"] != -100) & real).sum() / real.sum()
        assert 0.05 < rate < 0.30  # 15% masked, on a small sample
        assert ((b["labels"] == -100) | real).all()  # never a label on special or padding tokens
    lm = data.gpt2_batches(2, 4, 32, seed=0, cache_dir=tmp_path)
    assert lm[0]["input_ids"].shape == (4, 32) and lm[0]["labels"].equal(lm[0]["input_ids"])


def test_hf_corpus_option_parses_wikitext_and_explains_failures(monkeypatch, tmp_path):
    import sys
    import types

    from artifacts.tempo_bert import data

    lines = [
        " = Alpha = ",
        " The first sentence is here. The second one follows it. ",
        " = = Part = = ",
        " A third sentence talks on. ",
        " = Beta = ",
        " Only one short sentence here. ",
        " = Gamma = ",
        " Gamma has two sentences now. And this is the other one. ",
    ]
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda path, config, split: {"text": lines}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    docs = data.corpus(tmp_path, "wikitext-2")
    assert docs == [  # Beta has one sentence: not a pair for NSP, dropped
        ["The first sentence is here.", "The second one follows it.", "A third sentence talks on."],
        ["Gamma has two sentences now.", "And this is the other one."],
    ]
    assert (tmp_path / "wikitext-2.json").exists()

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub")

    fake.load_dataset = offline
    with pytest.raises(RuntimeError, match=r"needs network access.*--corpus stdlib"):
        data.corpus(tmp_path, "wikitext-103")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[data\]'"):
        data.corpus(tmp_path, "wikitext-103")
    with pytest.raises(ValueError, match="corpus must be one of"):
        data.corpus(tmp_path, "c4")


def test_float64_control_loss_is_hf_loss_computed_in_the_logits_dtype(rng):
    """The same-training float64 control computes the causal-LM loss itself: in float32 it equals
    HF's (which casts the logits to float32), in float64 it stays float64 and agrees with HF's to
    float32's rounding only (the reason it exists)."""
    from measure.training import causal_lm_loss

    torch.manual_seed(int(rng.integers(2**31)))
    model = build_model("gpt2-mini", "pretraining", "hf-eager", dropout=0.0).train()
    batch = make_batch("gpt2-mini", "pretraining", 2, 32)
    batch["labels"][0, int(rng.integers(1, 32))] = -100  # an ignored position counts nowhere
    ours, hf = causal_lm_loss(model, batch), model(**batch).loss
    assert ours.dtype == torch.float32 and torch.allclose(ours, hf, rtol=1e-6, atol=0)
    model = model.double()
    ours64 = causal_lm_loss(model, batch)
    assert ours64.dtype == torch.float64 and model(**batch).loss.dtype == torch.float32
    assert abs(ours64.item() - hf.item()) < 1e-4


@pytest.mark.slow
def test_compile_rows_estimate_a_compiled_steps_measured_peak():
    """The maxbatch part's torch.compile rows count the eager step with its saved activations at
    what the compiled model keeps. Checked against real steps on this CPU (inductor's code,
    allocator events): the eager estimate within the estimator's 0.2% (the control), the compiled
    one within 2% (one batch in fifty of a max-batch answer)."""
    from artifacts.tempo_bert.compile_check import CheckCase, compile_check_point

    r = compile_check_point("hf-eager", CheckCase("bert-mini", 128, 4))
    assert r["compiled"]["kept_bytes"] < r["eager"]["kept_bytes"]  # compile keeps less: a real test
    assert abs(r["eager_error"]) <= 0.002, r
    assert abs(r["compiled_error"]) <= 0.02, r
    # negative control: the eager step taken as the compiled one's estimate misses by more
    assert r["eager"]["estimated_bytes"] / r["compiled"]["measured_bytes"] - 1 > 0.02, r


def test_compile_rows_max_batch_counts_what_compile_keeps(monkeypatch):
    """A compile row's max batch is its eager model's step with kept_scale = compiled over eager
    kept bytes, in the layers and the rest (batch 1): at GPT-2's shape compile keeps less in
    both, so its step's peak is lower than eager's by at most what it keeps less, and a larger
    batch fits (an unapplied scale would fit the same)."""
    from artifacts.tempo_bert import run
    from artifacts.tempo_bert.run import maxbatch_point
    from tempo.maxbatch import compile_kept_scale, estimator, saved_bytes_by_part

    scale = compile_kept_scale("gpt2-mini", "hf-eager", 256, "fp16")
    layer, rest = saved_bytes_by_part("gpt2-mini", "hf-eager", 256, "fp16", compiled=False)
    assert scale.layers < 1 and scale.rest < 1
    eager = estimator("gpt2-mini", "pretraining", 256, "fp16", "hf-eager").peak(8).peak_bytes
    compiled = (
        estimator("gpt2-mini", "pretraining", 256, "fp16", "hf-eager", kept_scale=scale).peak(8).peak_bytes
    )
    less = 8 * ((1 - scale.layers) * 2 * layer + (1 - scale.rest) * rest)  # gpt2-mini: 2 layers
    assert 0 < eager - compiled <= less * 1.01  # rounding of 512-byte blocks
    monkeypatch.setattr(run, "GPUS", {"2GB": "2GB"})  # one small GPU: a short search
    row = maxbatch_point("gpt2-mini", "pretraining", 256, "fp16", "hf-eager+compile")
    plain = maxbatch_point("gpt2-mini", "pretraining", 256, "fp16", "hf-eager")
    assert row["kept_scale"] == {"layers": round(scale.layers, 6), "rest": round(scale.rest, 6)}
    assert row["2GB"]["max_batch"] > plain["2GB"]["max_batch"]
    with pytest.raises(ValueError, match="needs the default budget"):
        maxbatch_point("gpt2-mini", "pretraining", 256, "fp16", "hf-eager+compile-at-tempo")


_MODEL_CASES = [
    (
        "unknown family",
        set_field("bert-base", "family", value="t5"),
        "bert-base.family must be one of bert, roberta, gpt2, llama",
    ),
    (
        "string size",
        set_field("bert-base", "hidden", value="768"),
        "bert-base.hidden must be a whole number >= 1",
    ),
    ("true for a number", set_field("gpt2", "layers", value=True), "gpt2.layers must be a whole number >= 1"),
    ("float size", set_field("gpt2", "vocab", value=50257.0), "gpt2.vocab must be a whole number >= 1"),
    ("no layers", set_field("bert-mini", "layers", value=0), "bert-mini.layers must be a whole number >= 1"),
    (
        "absurd positions",
        set_field("gpt2", "max_positions", value=10**30),
        "gpt2.max_positions must be a whole number >= 1, at most",
    ),
    (
        "tie not a bool",
        set_field("llama-3.2-1b", "tie_embeddings", value=1),
        "llama-3.2-1b.tie_embeddings must be true or false",
    ),
    (
        "heads not dividing",
        set_field("bert-base", "heads", value=7),
        "bert-base: hidden (768) must be a multiple of heads (7)",
    ),
    (
        "kv heads not dividing",
        set_field("llama-3-8b", "kv_heads", value=5),
        "llama-3-8b: hidden (4096) must be a multiple of heads (32), heads of kv_heads (5)",
    ),
    ("no source", drop_field("gpt2-xl", "source"), "gpt2-xl: missing source"),
    ("unknown field", set_field("gpt2", "dropout", value=0.1), "gpt2: unknown field(s) dropout"),
    ("empty", lambda d: d.clear(), "no model"),
    ("duplicate", None, "key 'bert-base' given twice"),
    ("truncated", None, "not a readable preset"),
    ("nested too deep", None, "nested deeper than Python's parser follows"),
]


@pytest.mark.parametrize(("case", "edit", "said"), _MODEL_CASES, ids=[c[0] for c in _MODEL_CASES])
def test_a_corrupted_model_preset_is_refused_in_one_line(tmp_path, case, edit, said):
    refused_in_one_line(read_models, MODELS_FILE, tmp_path / "models.json", case, edit, said)


def test_the_shipped_model_presets_read():
    """The control: the shipped file passes the reader that refuses the copies above."""
    presets = read_models(MODELS_FILE)
    assert presets == models() and list(presets)[:2] == ["bert-base", "bert-large"]
    assert presets["llama-3.2-1b"].tie_embeddings and presets["llama-mini"].kv_heads == 2
    assert presets["gpt2-xl"].ffn is None and presets["roberta-base"].max_positions == 514


def test_a_corrupted_model_preset_stops_maxbatch_in_one_line(tmp_path, capsys, monkeypatch):
    """`--model`'s choices are the presets: a broken file is one line, status 2. Control: a copy as
    shipped gets as far as the next bad argument."""
    from tempo import models as tempo_models

    copy = tmp_path / "models.json"
    monkeypatch.setattr(tempo_models, "MODELS_FILE", copy)
    argv = ["--model", "bert-mini", "--seq", "0", "--gpu-mem", "16GB"]
    try:
        copy.write_text(MODELS_FILE.read_text())
        models.cache_clear()
        with pytest.raises(SystemExit) as e:
            maxbatch.main(argv)
        assert e.value.code == 2 and "--seq" in capsys.readouterr().err  # the control
        copy.write_text(corrupted(MODELS_FILE, "edit", set_field("bert-mini", "vocab", value=None)))
        models.cache_clear()
        with pytest.raises(SystemExit) as e:
            maxbatch.main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.count("\n") == 0 and f"{copy}: bert-mini.vocab must be" in err, err
    finally:
        models.cache_clear()
