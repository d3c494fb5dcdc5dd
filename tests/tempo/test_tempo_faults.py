"""Issue #13, Tempo's part: each reported fault, with a test that fails without its fix.

(LayerNorm's gradient accuracy with small gamma, item 5, is in test_layernorm.py.)
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import re
import signal
import subprocess
import sys
import types

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining, GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import tempo
from measure.memory import PeakReport, search_max_batch
from tempo import hf, maxbatch, models
from tests.measure.test_interrupts import as_from_a_terminal

hf_logging.set_verbosity_error()


def tiny_bert(attn: str = "sdpa", layers: int = 3) -> BertForPreTraining:
    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=50,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation=attn,
    )
    return BertForPreTraining(cfg).double()


def tiny_gpt2(attn: str = "sdpa") -> GPT2LMHeadModel:
    cfg = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=50,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation=attn,
    )
    return GPT2LMHeadModel(cfg).double()


def batch(padded: bool = True):
    ids = torch.randint(3, 50, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    if padded:
        mask[1, 9:] = 0
    return ids, mask


def logits(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.prediction_logits


@pytest.fixture
def tempo_cores(monkeypatch):
    """Counts the attention modules that run Tempo's core in a forward."""
    calls = []
    real = hf.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "scaled_dot_product_attention", spy)
    return calls


# ---------------------------------------------------------------- 1. patching a sub-module


def tempo_layers(model) -> list[bool]:
    """Per encoder layer: are its LayerNorms, GELU, dropouts and attention core all Tempo's? (None
    where they disagree, which no patch sequence should produce.)"""
    out = []
    for layer in model.bert.encoder.layer:
        kinds = [
            isinstance(layer.attention.output.LayerNorm, tempo.TempoLayerNorm),
            isinstance(layer.output.LayerNorm, tempo.TempoLayerNorm),
            isinstance(layer.intermediate.intermediate_act_fn, tempo.TempoGELU),
            isinstance(layer.output.dropout, tempo.TempoDropout),
            layer.attention.self.config._attn_implementation == "tempo",
        ]
        out.append(kinds[0] if len(set(kinds)) == 1 else None)
    return out


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_patching_one_layer_changes_that_layer_only(attn, tempo_cores):
    model = tiny_bert(attn).eval()
    ids, mask = batch()
    with torch.no_grad():
        ref = logits(model, ids, mask)
    report = tempo.patch(model.bert.encoder.layer[0])
    assert report.counts() == {
        "layernorm": 2,
        "gelu": 1,
        "attention": 1,
        "dropout": 3,
        "rmsnorm": 0,
        "swiglu": 0,
        "loss": 0,
    }
    assert "1 attention cores" in str(report)
    assert tempo_layers(model) == [True, False, False]
    assert model.config._attn_implementation == attn  # the shared config is left alone
    with torch.no_grad():
        out = logits(model, ids, mask)
    assert len(tempo_cores) == 1  # ...so only the patched layer runs Tempo's core
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)  # float64; padding mask used


# Every order of patch/unpatch of the model (M) and of its first layer (L0), each unpatch after
# its patch: the state must depend only on which patches are live.
STEPS = ["patch L0", "patch M", "unpatch L0", "unpatch M"]
ORDERS = [
    o
    for o in itertools.permutations(STEPS)
    if o.index("patch L0") < o.index("unpatch L0") and o.index("patch M") < o.index("unpatch M")
]


@pytest.mark.parametrize("order", ORDERS, ids=[" / ".join(o) for o in ORDERS])
def test_patch_and_unpatch_compose_in_any_order(order, tempo_cores):
    model = tiny_bert().eval()
    layers = model.bert.encoder.layer
    ids, mask = batch()
    modules_before = [(n, m) for n, m in model.named_modules()]
    with torch.no_grad():
        before = logits(model, ids, mask)
    live = set()
    for step in order:
        verb, target = step.split()
        (tempo.patch if verb == "patch" else tempo.unpatch)(model if target == "M" else layers[0])
        (live.add if verb == "patch" else live.discard)(target)
        expected = ["M" in live or ("L0" in live and i == 0) for i in range(3)]
        assert tempo_layers(model) == expected, step
        assert tempo.is_patched(model) == bool(live)
        assert tempo.is_patched(layers[0]) == bool(live)
        assert tempo.is_patched(layers[1]) == ("M" in live)
        tempo_cores.clear()
        with torch.no_grad():
            out = logits(model, ids, mask)
        assert len(tempo_cores) == sum(expected), step
        torch.testing.assert_close(out, before, rtol=1e-12, atol=1e-12)
    # Back to the very same modules and config objects.
    assert [(n, m) for n, m in model.named_modules()] == modules_before
    assert all(layer.attention.self.config is model.config for layer in layers)


def test_patches_with_different_techniques_compose():
    model = tiny_bert()
    layers = model.bert.encoder.layer
    tempo.patch(model, attention=False)
    report = tempo.patch(layers[0])  # adds attention to layer 0, holds its other layers too
    assert report.counts() == {
        "layernorm": 0,
        "gelu": 0,
        "attention": 1,
        "dropout": 0,
        "rmsnorm": 0,
        "swiglu": 0,
        "loss": 0,
    }
    assert "6 already Tempo's" in str(report)
    tempo.unpatch(model)
    assert tempo_layers(model) == [True, False, False]
    tempo.unpatch(layers[0])
    assert tempo_layers(model) == [False, False, False] and not tempo.is_patched(model)


def test_unpatch_of_a_module_patched_only_through_another_says_which():
    model = tiny_bert()
    tempo.patch(model.bert.encoder.layer[1])
    with pytest.raises(RuntimeError, match=r"sub-module\(s\) bert\.encoder\.layer\.1"):
        tempo.unpatch(model)
    assert tempo_layers(model) == [False, True, False]


def test_unpatch_refuses_when_a_patched_layer_was_replaced_since_and_changes_nothing():
    model = tiny_bert()
    tempo.patch(model)
    layers = model.bert.encoder.layer
    layers[2].output.LayerNorm = nn.LayerNorm(32)  # someone swapped a Tempo layer out
    with pytest.raises(RuntimeError, match=r"bert\.encoder\.layer\.2\.output\.LayerNorm is no longer"):
        tempo.unpatch(model)
    assert tempo.is_patched(model) and tempo_layers(model)[:2] == [True, True]


@pytest.mark.parametrize("target", ["model", "first block"])
def test_gpt2_sdpa_without_padding_stays_causal(target, tempo_cores):
    """HF's SDPA masks leave causality implicit (no mask, is_causal) when nothing is padded: the
    Tempo core in a model built for SDPA must apply it itself."""
    model = tiny_gpt2("sdpa").eval()
    ids, mask = batch(padded=False)
    with torch.no_grad():
        ref = logits(model, ids, mask)
    tempo.patch(model if target == "model" else model.transformer.h[0])
    with torch.no_grad():
        out = logits(model, ids, mask)
    assert len(tempo_cores) == (2 if target == "model" else 1)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_attention_implementations_without_masks_tempo_reads_are_refused_before_any_change():
    model = tiny_bert("eager")
    model.bert.encoder.layer[0].attention.self.config = BertConfig(attn_implementation="flex_attention")
    with pytest.raises(ValueError, match=r"one of eager, sdpa, tempo .* flex_attention"):
        tempo.patch(model)
    assert not tempo.is_patched(model)


# ---------------------------------------------------------------- 2. not a model


@pytest.mark.parametrize("fn", [tempo.patch, tempo.unpatch, tempo.is_patched])
def test_a_non_module_is_refused_with_what_is_accepted(fn):
    with pytest.raises(TypeError, match=r"takes a HuggingFace model .*torch\.nn\.Module.*got str 'bert'"):
        fn("bert")


def test_every_technique_off_is_refused():
    with pytest.raises(ValueError, match="nothing to patch"):
        tempo.patch(
            tiny_bert(),
            layernorm=False,
            gelu=False,
            attention=False,
            dropout=False,
            rmsnorm=False,
            swiglu=False,
        )
    # the Llama techniques alone find nothing in BERT: said, not silently done
    with pytest.raises(ValueError, match="found nothing to replace"):
        tempo.patch(tiny_bert(), layernorm=False, gelu=False, attention=False, dropout=False)


# ---------------------------------------------------------------- 3. empty shapes


def grads(fn, *inputs):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    out = out[0] if isinstance(out, tuple) else out
    return out, torch.autograd.grad(out, xs, torch.randn_like(out), allow_unused=True)


def test_layer_norm_over_an_empty_last_dim_matches_torch():
    x, w, b = torch.randn(3, 0, dtype=torch.float64), torch.randn(0, dtype=torch.float64), torch.randn(0)
    y, g = grads(lambda x, w, b: tempo.layer_norm(x, (0,), w, b.double()), x, w, b)
    y_ref, g_ref = grads(lambda x, w, b: nn.functional.layer_norm(x, (0,), w, b.double()), x, w, b)
    assert y.shape == y_ref.shape == (3, 0)
    assert [t.shape for t in g] == [t.shape for t in g_ref]
    with pytest.raises(ValueError, match="at least one trailing dim"):
        tempo.layer_norm(torch.randn(()), ())


@pytest.mark.parametrize(("sq", "sk", "dv"), [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 3)])
def test_attention_core_with_empty_sequences_matches_torch(sq, sk, dv):
    scores, value = (
        torch.randn(2, 3, sq, sk, dtype=torch.float64),
        torch.randn(2, 3, sk, dv, dtype=torch.float64),
    )
    out, g = grads(lambda s, v: tempo.attention_core(s, v), scores, value)
    out_ref, g_ref = grads(lambda s, v: torch.softmax(s, -1) @ v, scores, value)
    torch.testing.assert_close(out, out_ref)  # Sk = 0: zeros, as torch's empty sum
    for a, r in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, torch.zeros_like(a) if r is None else r)


def test_attention_core_refuses_one_dim_inputs_clearly():
    with pytest.raises(ValueError, match=r"at least 2-D each; got shapes \[4\] and \[4, 2\]"):
        tempo.attention_core(torch.randn(4), torch.randn(4, 2))


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: tempo.dropout(torch.randn(4), "0.1"), r"must be a number in \[0, 1\), got '0.1'"),
        (lambda: tempo.TempoDropout(None), r"probability must be a number in \[0, 1\), got None"),
        (lambda: tempo.attention_core(torch.randn(2, 3), torch.randn(3, 4), True), "got True"),
        (lambda: tempo.layer_norm(torch.randn(4, 8), 8), r"normalized_shape must be a tuple of ints"),
        (
            lambda: tempo.scaled_dot_product_attention(*[_qkv()] * 3, attention_mask=[[0.0]]),
            "attention_mask must be a tensor or None, got list",
        ),
        (lambda: tempo.scaled_dot_product_attention(*[_qkv()] * 3, scaling="x"), "scaling must be a finite"),
        (
            lambda: tempo.linear_cross_entropy(torch.randn(5, 3), torch.randn(7, 3), [1, 2, 3, 4, 5]),
            "labels must be a tensor of integers, got list",
        ),
        (
            lambda: tempo.linear_cross_entropy(
                torch.randn(5, 3), torch.randn(7, 3), torch.zeros(5, dtype=torch.long), rows_per_chunk=1.5
            ),
            "rows_per_chunk must be a whole number >= 1, got 1.5",
        ),
    ],
    ids=["dropout str", "module None", "attention bool", "norm int", "mask", "scaling", "labels", "chunk"],
)
def test_a_public_op_refuses_a_wrong_kind_of_value_in_one_line(call, says):
    """A string, None or list where a number or tensor belongs: a ValueError saying what is
    accepted (a TypeError from inside the op before; 1.5 rows a chunk ran as 1). From a review."""
    with pytest.raises(ValueError, match=says):
        call()


# ---------------------------------------------------------------- 4. in-place changes to outputs


def test_dropout_output_changed_in_place_then_backward_like_torch():
    """torch's dropout keeps its mask, not its output, so its output may be changed in place before
    backward; Tempo's keeps a seed only, so the same must hold, with the same gradient."""
    p = 0.3
    w = torch.randn(4, 300, dtype=torch.float64)
    for fn in (nn.functional.dropout, tempo.dropout):
        x = torch.randn(4, 300, dtype=torch.float64, requires_grad=True)
        y = fn(x, p)
        keep = (y != 0).detach()  # x has no zeros
        y.mul_(3)
        y[0].zero_()
        (y * w).sum().backward()
        expected = 3 * w * keep / (1 - p)
        expected[0] = 0
        torch.testing.assert_close(x.grad, expected, msg=fn.__module__)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_attention_output_changed_in_place_then_backward_like_torch(p):
    """The core keeps P and V, not its output: out may change in place (as torch's matmul output
    may); P may not (as torch's softmax output may not), and autograd says so."""
    scores = torch.randn(2, 6, 6, dtype=torch.float64, requires_grad=True)
    value = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 6, 3, dtype=torch.float64)
    torch.manual_seed(5)
    out, probs = tempo.attention_core(scores, value, p)
    out.mul_(2)
    (out * w).sum().backward()
    torch.manual_seed(5)
    (ref,) = torch.autograd.grad((2 * tempo.attention_core(scores, value, p)[0] * w).sum(), scores)
    torch.testing.assert_close(scores.grad, ref)
    _, probs = tempo.attention_core(scores, value, p)
    probs.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        probs.sum().backward()


# ---------------------------------------------------------------- 6. python -m tempo.maxbatch


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu-mem", "infGB"], "--gpu-mem: memory size"),
        (["--gpu-mem=-4GB"], "--gpu-mem: memory size"),
        (["--gpu-mem", "nanGB"], "--gpu-mem: memory size 'nanGB' must be a positive, finite amount"),
        (["--seq", "0"], "--seq: takes a positive integer, got '0'"),
        (["--seq", "-3"], "--seq: takes a positive integer, got '-3'"),
        (["--seq", "513"], "bert-mini takes at most 512 positions"),
        (["--fragmentation", "-0.1"], "--fragmentation: takes a finite number >= 0"),
        (["--fragmentation", "1"], r"--fragmentation: takes a fraction in \[0, 1\)"),
        (["--context-gb", "-1"], "--context-gb: takes a finite number >= 0"),
        (["--context-gb", "inf"], "--context-gb: takes a finite number >= 0"),
        (["--model", "nope"], "--model: invalid choice: 'nope'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_maxbatch_refuses_bad_values_before_any_work(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(maxbatch, "estimator", lambda *a, **kw: pytest.fail("work started"))
    argv = ["--model", "bert-mini", "--seq", "16", "--gpu-mem", "4GB", *flags]
    with pytest.raises(SystemExit) as e:
        maxbatch.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err  # one line: the error, no usage block above it
    assert err.startswith("python -m tempo.maxbatch: error: ")
    assert re.search(message, err), err


def peak_of(bytes_per_sequence: int):
    return lambda b: PeakReport(
        b, 1000 + b * bytes_per_sequence, "backward", {}, {"backward": 1000 + b * bytes_per_sequence}
    )


def test_search_stops_at_its_cap_and_says_so():
    assert search_max_batch(peak_of(10), 10**12, limit=maxbatch.SEARCH_CAP)[0] == maxbatch.SEARCH_CAP
    assert search_max_batch(peak_of(10), 1000 + 10 * 777, limit=maxbatch.SEARCH_CAP)[0] == 777


def test_maxbatch_at_the_cap_says_the_cap_was_hit(capsys, monkeypatch):
    class Stub:
        def max_batch(self, usable, limit):
            return search_max_batch(peak_of(10), usable, limit)

    monkeypatch.setattr(maxbatch, "estimator", lambda *a, **kw: Stub())
    assert maxbatch.main(["--model", "bert-mini", "--seq", "16", "--gpu-mem", "1e9GB"]) == 0
    out = capsys.readouterr().out
    assert f"max batch: at least {maxbatch.SEARCH_CAP}, the search's cap" in out
    assert f"max batch: {maxbatch.SEARCH_CAP} " not in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_maxbatch_interrupted_in_its_search_ends_in_one_line(sig):
    """Ctrl-C or ``kill`` during the search (BERT-large at seq 512 in 80 GB: ~12 s here): one line and
    status 130 (the probe round: a 58-line KeyboardInterrupt traceback, or SIGTERM's silent 143)."""
    command = [sys.executable, "-m", "tempo.maxbatch", "--model", "bert-large", "--seq", "512"]
    proc = subprocess.Popen(
        [*command, "--gpu-mem", "80GB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    try:
        assert proc.stdout.readline().startswith("bert-large"), proc.communicate()  # searching now
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # a no-op once it has ended
    assert proc.returncode == 130 and err.splitlines() == [
        "python -m tempo.maxbatch: interrupted (it saves nothing: the same command searches again)"
    ], err


# ---------------------------------------------------------------- 7. artifacts.tempo_bert.run --cases


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--cases", "bert-mini/1000"],
            r"a case is MODEL/SEQ, one of .*bert-mini \(SEQ 1-512\).*'bert-mini/1000'",
        ),
        (["--cases", "bert-mini/0"], r"got 'bert-mini/0'"),
        (["--cases", "bert-tiny/32"], r"got 'bert-tiny/32'"),
        (["--parts", "activation", "--cases", "bert-mini/32"], "apply to the throughput part only"),
        (["--parts", "activation", "--corpus", "wikitext-2"], "applies to the training part only"),
        (["--parts", "throughput", "--gpu-mem", "infGB"], "--gpu-mem: memory size 'infGB' must be"),
        (["--parts", "throughput", "--gpu-mem", "0"], "--gpu-mem: memory size '0' must be"),
        (
            ["--parts", "throughput", "--scale", "paper", "--gpu-mem", "512MiB"],
            "nothing is left for the model",
        ),
        # a prefix test took these, and the run opened before torch refused them (probe round 5)
        (["--device", "cpux"], "--device must be cpu or cuda\\[:N\\], got 'cpux'"),
        (["--device", "cudafoo"], "got 'cudafoo'"),
        (["--device", "cpu:abc"], "got 'cpu:abc'"),
        (["--cases", "bert-mini/16", "bert-mini/16"], "--cases: bert-mini/16 given twice"),  # F26
        # a device index never checked (a traceback later) nor made current (Triton's kernels and
        # the timing's events on device 0 with another's tensors): one line, as tempo_layer's
        pytest.param(
            ["--device", "cuda:7"],
            "--device cuda:7: no such CUDA device here",
            marks=pytest.mark.skipif(torch.cuda.device_count() > 7, reason="a cuda:7 is here"),
        ),
    ],
)
def test_run_refuses_bad_cases_before_any_work(argv, message, capsys, monkeypatch, tmp_path):
    from artifacts.tempo_bert import run

    monkeypatch.setattr(run, "experiment_run", lambda *a: pytest.fail("work started"))
    with pytest.raises(SystemExit) as e:
        run.main([*argv, "--results", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, err), err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "gpu"], "--device must be cpu or cuda\\[:N\\], got 'gpu'"),
        (["--device", "cuda:x"], "got 'cuda:x'"),
        (["--compile-only", "--no-compile"], "--no-compile leaves out the only rows"),
        (["--compile-only", "--dtype", "fp16"], "--dtype applies to the layer rows"),
        (["--dtype", "fp32"], "gives the layer rows the compile rows' keys: add --no-compile"),
        pytest.param(
            ["--device", "cuda"],
            "no such CUDA device here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here"),
        ),
    ],
)
def test_tempo_layer_refuses_a_bad_device_or_contradictory_rows_before_any_work(
    argv, message, capsys, monkeypatch, tmp_path
):
    from artifacts.tempo_layer import run

    monkeypatch.setattr(run, "experiment_run", lambda *a: pytest.fail("work started"))
    with pytest.raises(SystemExit) as e:
        run.main([*argv, "--results", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and re.search(message, err[0]), err


def test_tempo_layer_on_a_gpu_runs_the_compile_rows_only(monkeypatch, tmp_path):
    """--device cuda:N (the GPU check's part compile) measures torch.compile's rows alone, on
    that device (made current: the timing's events are the current device's), in bf16, into
    compile_cuda.json; --compile-only the same rows on this CPU, float32, into
    layer_saved_bytes.json (control: the default run measures every part). The rows' own
    functions are stubbed: what is checked is where each run sends them."""
    from artifacts.tempo_layer import run

    calls, current = [], []
    monkeypatch.setattr(run.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(run.torch.cuda, "set_device", current.append)
    for name in ("measure_layers", "measure_gelu_backward"):
        monkeypatch.setattr(run, name, lambda *a, _n=name: calls.append((_n, a[1:])))
    monkeypatch.setattr(
        run, "measure_layer", lambda v, s, b, dtype, device: calls.append((v, dtype, device)) or {}
    )
    monkeypatch.setattr(run, "eager_step_s", lambda *a, **k: 1.0)
    monkeypatch.setattr(
        run, "measure_compiled", lambda v, s, b, dtype, budget, device: {"bytes": 1, "step_s": 1.0}
    )

    class Store:
        def __init__(self, name, device):
            self.name, self.device, self.results = name, device, {}

        def compute(self, key, fn):
            return self.results.setdefault(
                json.dumps(key, sort_keys=True), {"bytes": 1, "step_s": 1.0, **fn()}
            )

        def get(self, key):
            return types.SimpleNamespace(result=self.results[json.dumps(key, sort_keys=True)])

    stores = []

    class Run:
        def file(self, name, device="cpu", config=None):
            stores.append(Store(name, device))
            return stores[-1]

    monkeypatch.setattr(run, "experiment_run", lambda *a: contextlib.nullcontext(Run()))
    run.main(["--device", "cuda:1", "--seq", "16", "--results", str(tmp_path)])
    assert current == [1] and [(s.name, s.device) for s in stores] == [("compile_cuda.json", "cuda:1")], (
        stores
    )
    assert ("hf-eager", torch.bfloat16, "cuda:1") in calls and not any(
        c[0].startswith("measure_") for c in calls
    )
    calls.clear(), stores.clear()
    run.main(["--compile-only", "--seq", "16", "--results", str(tmp_path)])
    assert [(s.name, s.device) for s in stores] == [("layer_saved_bytes.json", "cpu")], stores
    assert ("tempo", torch.float32, "cpu") in calls and not any(c[0].startswith("measure_") for c in calls)
    calls.clear()
    run.main(["--seq", "16", "--results", str(tmp_path)])
    assert [c[0] for c in calls if c[0].startswith("measure_")] == ["measure_layers", "measure_gelu_backward"]


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("tempo_layer", ["--seq", "16", "16", "--no-compile"], "--seq: 16 given twice"),
        ("tempo_layer", ["--seq", "16", "32", "16"], "--seq: 16 given twice"),
        ("tempo_llama", ["--parts", "maxbatch", "maxbatch"], "--parts: maxbatch given twice"),
    ],
)
def test_a_value_given_twice_is_refused_before_any_work(module, argv, message, capsys, monkeypatch, tmp_path):
    """``--seq 16 16`` computed and printed every row twice, ``--parts sim sim`` ran once without a
    word (probe round 5 F26): every experiment's many-valued option refuses a repeat in one line
    (experiment.given_once). Control: the values once each reach the run."""
    run = importlib.import_module(f"artifacts.{module}.run")

    class Started(Exception):
        pass

    def started(*a):
        raise Started

    monkeypatch.setattr(run, "experiment_run", started)
    with pytest.raises(SystemExit) as e:
        run.main([*argv, "--results", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err and "give each value once" in err, (
        err
    )
    with pytest.raises(Started):
        run.main([*dict.fromkeys(argv), "--results", str(tmp_path)])


def test_jobs_above_the_usable_cores_are_refused_before_any_work(capsys, monkeypatch, tmp_path):
    """``--jobs 500`` on 2 cores started 24 workers (+1.6 GB in 10 s; probe round 5 F34): refused
    above the cores this process may use (its affinity), in one line. Control: at the bound it
    runs, and the default is that bound."""
    from artifacts import experiment
    from artifacts.tempo_llama import run

    class Started(Exception):
        pass

    def started(args, _):
        raise Started(args.jobs)

    monkeypatch.setattr(experiment, "usable_cores", lambda: 3)
    monkeypatch.setattr(run, "experiment_run", started)
    with pytest.raises(SystemExit) as e:
        run.main(["--parts", "maxbatch", "--jobs", "4", "--results", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "--jobs takes a whole number from 1 to the 3 cores this process may use, got '4'" in err, err
    for argv, jobs in ((["--jobs", "3"], 3), ([], 3)):
        with pytest.raises(Started) as got:
            run.main(["--parts", "maxbatch", *argv, "--results", str(tmp_path)])
        assert got.value.args == (jobs,)


def _qkv(shape=(1, 2, 8, 16), dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: (_qkv(), _qkv((1, 2, 8, 8)), _qkv()), ValueError, "must agree on the leading dims and D"),
        (lambda: (_qkv(), _qkv((2, 2, 8, 16)), _qkv()), ValueError, "must agree on the leading dims and D"),
        (lambda: (_qkv(), _qkv((2, 8, 16)), _qkv((2, 8, 16))), ValueError, "must agree on the leading dims"),
        (lambda: (_qkv(), _qkv(dtype=torch.float64), _qkv()), TypeError, "must share a dtype"),
        (lambda: (_qkv().int(), _qkv().int(), _qkv().int()), TypeError, "accept floating tensors only"),
        (lambda: (_qkv(), _qkv(), _qkv(), torch.zeros(1, 1, 8, 9)), ValueError, "must broadcast to"),
    ],
)
def test_attention_refuses_what_it_cannot_compute_in_one_line(make, error, message):
    """tempo.scaled_dot_product_attention checks its operands as attention_core does: never a
    matmul's error from inside, naming what it takes."""
    with pytest.raises(error, match=message) as e:
        tempo.scaled_dot_product_attention(*make())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq", "100000"], r"--seq 100000 --batch 1: HF's layer keeps [\d.]+ GiB for backward"),
        (["--seq", "512", "--batch", "100000"], r"--seq 512 --batch 100000: HF's layer keeps"),
        (["--seq", "0"], "must be positive integers"),
    ],
)
def test_layer_run_refuses_what_memory_cannot_hold_before_any_work(
    argv, message, capsys, monkeypatch, tmp_path
):
    """tempo_layer with a shape no machine here can hold failed in the allocator after printing
    its first rows: refused by the closed form of what HF's layer keeps, before any work. The
    machine's memory is set to 24 GiB so the test says the same on every runner. Control: the
    default shapes start."""
    from artifacts.tempo_layer import run

    class Started(Exception):
        pass

    def started(*a):
        raise Started

    monkeypatch.setattr(run, "experiment_run", started)
    monkeypatch.setattr(run, "machine_memory_bytes", lambda: 24 * 2**30)
    with pytest.raises(SystemExit) as e:
        run.main([*argv, "--results", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err
    with pytest.raises(Started):
        run.main(["--results", str(tmp_path)])


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: models.build_model("bert-mini", num_layers=0),
            ValueError,
            "num_layers must be a whole number",
        ),
        (
            lambda: models.build_model("bert-mini", num_layers=-1),
            ValueError,
            "num_layers must be a whole number",
        ),
        (
            lambda: models.build_model("bert-mini", dropout=float("nan")),
            ValueError,
            "dropout must be a probability",
        ),
        (
            lambda: models.make_batch("bert-mini", "pretraining", 0, 16),
            ValueError,
            "batch and seq must be whole",
        ),
        (
            lambda: models.make_batch("bert-mini", "pretraining", 2, 0),
            ValueError,
            "batch and seq must be whole",
        ),
        (
            lambda: models.make_batch("bert-mini", "pretraining", -1, 16),
            ValueError,
            "batch and seq must be whole",
        ),
        (lambda: models.make_batch("bert-mini", "bogus", 2, 8), ValueError, "unknown head 'bogus'"),
        (
            lambda: maxbatch.estimator("nope", "pretraining", 16, "fp32", "hf-eager"),
            ValueError,
            "unknown model",
        ),
        (lambda: maxbatch.estimator("bert-mini", "pretraining", 0, "fp32", "hf-eager"), ValueError, "whole"),
        (lambda: search_max_batch(_no_peak, 2**30, limit=0), ValueError, "limit must be a whole number"),
        (lambda: search_max_batch(_no_peak, float("nan")), ValueError, "usable_bytes must be a finite"),
        (
            lambda: tempo.patch(torch.nn.Linear(2, 2), layernorm="no"),
            TypeError,
            "layernorm must be True or False",
        ),
        (lambda: tempo.patch(torch.nn.Linear(2, 2), gelu=None), TypeError, "gelu must be True or False"),
    ],
)
def test_library_functions_refuse_impossible_sizes_in_one_line(call, error, message):
    """Found by the probe round: 0 or -1 layers built a model, a batch of 0 made empty tensors and
    -1 a torch error, an unknown head was taken as the QA head, an unknown model a KeyError, a
    NaN budget searched to batch 0, and patch(layernorm="no") patched the LayerNorms."""
    with pytest.raises(error, match=message):
        call()


def _no_peak(b):
    pytest.fail("searched")


def test_numpy_integers_are_sizes_as_python_integers_are():
    import numpy as np

    batch = models.make_batch("bert-mini", "pretraining", np.int64(2), np.int64(8))
    assert batch["input_ids"].shape == (2, 8)
    assert search_max_batch(lambda b: PeakReport(b, b, "forward"), np.int64(10), limit=np.int64(64))[0] == 10


@pytest.mark.parametrize(
    "call",
    [
        lambda x: tempo.layer_norm(x, (4,), eps=-1.0),
        lambda x: tempo.layer_norm(x, (4,), eps=float("nan")),
        lambda x: tempo.TempoLayerNorm(4, eps=-1.0)(x),
        lambda x: tempo.rms_norm(x, torch.ones(4), eps=float("inf")),
    ],
)
def test_a_norms_epsilon_is_checked(call):
    """A negative or NaN epsilon gave NaN rows without a word (the fourth probe round)."""
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        call(x)
    assert torch.isfinite(tempo.layer_norm(x, (4,), eps=0.0)).all()  # control: 0 is taken


def test_training_flags_are_true_or_false():
    """dropout(x, 0.5, training="no") applied dropout: "no" is truthy."""
    x = torch.randn(8, 8)
    with pytest.raises(ValueError, match="training must be True or False, got 'no'"):
        tempo.dropout(x, 0.5, training="no")
    with pytest.raises(ValueError, match="training must be True or False"):
        tempo.attention_core(torch.randn(2, 3, 3), torch.randn(2, 3, 4), 0.1, training=1)
    assert torch.equal(tempo.dropout(x, 0.5, training=False), x)  # control


def _bert_dropping(**probabilities) -> BertForPreTraining:
    cfg = tiny_bert().config.to_dict() | {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    return BertForPreTraining(BertConfig(**(cfg | probabilities)))


def test_a_dropout_of_p_one_is_refused_saying_how_to_patch_around_it():
    """The probe round: HF takes p = 1 (every element zeroed); tempo.patch said only "dropout
    probability must be in [0, 1), got 1.0". Now it names the module and the switch that keeps HF's
    dropout; the model is left untouched, and patched with that switch it runs as HF's."""
    bert = _bert_dropping(hidden_dropout_prob=1.0)
    with pytest.raises(
        ValueError, match=r"^tempo.patch: bert.embeddings.dropout is an nn.Dropout with p=1.0"
    ) as e:
        tempo.patch(bert)
    assert "patch with dropout=False" in str(e.value) and "\n" not in str(e.value)
    assert not tempo.is_patched(bert)
    report = tempo.patch(bert, dropout=False)  # the way around it: HF's dropout stays
    assert not report.dropouts and report.layernorms
    ids = torch.randint(0, 50, (1, 8))
    assert bert.train()(input_ids=ids).prediction_logits.isfinite().all()
    probabilities = _bert_dropping(attention_probs_dropout_prob=1.0)
    with pytest.raises(
        ValueError, match=re.escape("attention.self.dropout is an nn.Dropout with p=1.0")
    ) as e:
        tempo.patch(probabilities)
    assert "dropout=False" in str(e.value) and "attention=False" in str(e.value)
    with pytest.raises(ValueError, match=re.escape("drops its attention probabilities with p=1.0")) as e:
        tempo.patch(probabilities, dropout=False)
    assert "pass attention=False" in str(e.value)
    assert tempo.patch(probabilities, dropout=False, attention=False).layernorms
    assert tempo.patch(_bert_dropping(hidden_dropout_prob=0.5)).dropouts  # control: p < 1 is Tempo's


def test_a_sub_module_without_its_config_is_refused_without_claiming_sub_modules_are_taken():
    """tempo.patch(bert.embeddings) said sub-modules are supported while refusing one: a sub-module
    is taken where it holds its model's config, and the refusal now says so and what to patch."""
    bert = tiny_bert()
    with pytest.raises(ValueError, match="or a sub-module of one that holds its config") as e:
        tempo.patch(bert.bert.embeddings)
    assert "got BertEmbeddings (no HF config in it): patch the model or layer that holds it" in str(e.value)
    assert tempo.patch(bert.bert.encoder.layer[0]).layernorms  # control: a layer holds its config


def test_float64_takes_the_pytorch_path_where_the_kernels_compute_float32():
    """On CUDA, GELU's, LayerNorm's, dropout's and the attention core's kernels compute in float32:
    float64 (the tests' reference precision) came back float32-rounded. It now takes their PyTorch
    paths; RMSNorm's and SwiGLU's kernels compute float64 and keep it. (A stand-in for a CUDA
    tensor: what use_triton reads of one.)"""
    from tempo import _common
    from tempo.kernels import TRITON_AVAILABLE

    def cuda(dtype):
        return types.SimpleNamespace(is_cuda=True, numel=lambda: 8, dtype=dtype)

    assert _common.use_triton(cuda(torch.float64)) is False
    assert _common.use_triton(cuda(torch.float32), cuda(torch.float64)) is False
    assert _common.use_triton(cuda(torch.float64), float64=True) is TRITON_AVAILABLE
    assert _common.use_triton(cuda(torch.bfloat16)) is TRITON_AVAILABLE  # the control
