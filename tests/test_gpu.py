"""GPU checks (marked `gpu`; run by `nox -s gpu_check`, skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForPreTraining
from transformers.models.bert.modeling_bert import BertLayer
from transformers.utils import logging as hf_logging

import tempo
from measure.memory import StepMemoryEstimator
from measure.saved import saved_bytes
from measure.training import Precision, make_optimizer, train_step
from tempo.ops import workspace_bytes

hf_logging.set_verbosity_error()
pytestmark = pytest.mark.gpu


def test_ops_dispatch_to_triton_and_match_cpu():
    from tempo._common import use_triton

    x = torch.randn(4, 128, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert use_triton(x)
    for fn in (tempo.gelu, lambda t: tempo.layer_norm(t, (1024,))):
        y = fn(x)
        (g,) = torch.autograd.grad(y.float().square().sum(), x)
        xc = x.detach().cpu().requires_grad_()
        yc = fn(xc)
        (gc,) = torch.autograd.grad(yc.float().square().sum(), xc)
        torch.testing.assert_close(y.cpu().float(), yc.float(), rtol=1e-2, atol=1e-2)
        assert ((g.cpu().float() - gc.float()).norm() / gc.float().norm()).item() < 2e-2


def test_patched_bert_matches_on_cuda():
    cfg = BertConfig(num_hidden_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    ref = model(input_ids=ids).prediction_logits
    tempo.patch(model)
    out = model(input_ids=ids).prediction_logits
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize(("seq", "least"), [(128, 0.35), (512, 0.45)])
def test_bert_large_layer_saving_on_cuda(seq, least):
    cfg = BertConfig(
        hidden_size=1024, num_attention_heads=16, intermediate_size=4096, attn_implementation="eager"
    )
    res = {}
    for variant in ("eager", "tempo"):
        layer = BertLayer(cfg).cuda().to(torch.bfloat16).train()
        if variant == "tempo":
            tempo.patch(layer)
        x = torch.randn(1, seq, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        res[variant] = saved_bytes(layer, x).total_bytes
    assert 1 - res["tempo"] / res["eager"] >= least


@pytest.mark.parametrize("with_tempo", [False, True], ids=["hf-eager", "tempo"])
def test_estimator_against_cuda_allocator(with_tempo):
    """Fake-tensor estimate vs torch.cuda.max_memory_allocated of a real step (BERT-base, bf16)."""

    def build():
        m = BertForPreTraining(BertConfig(attn_implementation="eager"))
        if with_tempo:
            tempo.patch(m)
        return m

    def batch(b, device="cpu"):
        return {
            "input_ids": torch.randint(0, 30522, (b, 512), device=device),
            "labels": torch.randint(0, 30522, (b, 512), device=device),
            "next_sentence_label": torch.randint(0, 2, (b,), device=device),
        }

    est = (
        StepMemoryEstimator(build, batch, "bf16", target="cuda", op_workspace=workspace_bytes)
        .peak(8)
        .peak_bytes
    )
    p = Precision("bf16")
    torch.cuda.empty_cache()
    model = build().cuda().to(p.model_dtype)
    opt = make_optimizer(model, p)
    train_step(model, batch(1, "cuda"), opt, p)
    real_batch = batch(8, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, real_batch, opt, p)
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated()
    print(f"estimate {est / 2**30:.3f} GiB, measured {real / 2**30:.3f} GiB ({(est - real) / real:+.1%})")
    assert abs(est - real) <= 0.05 * real


@pytest.mark.parametrize("configuration", ["hf-eager", "tempo"])
def test_compile_estimate_against_cuda_allocator(configuration):
    """The max-batch estimate under torch.compile (the eager step keeping what the compiled model
    keeps) against torch.cuda.max_memory_allocated of a compiled step (inductor's Triton code),
    BERT-base seq 512 batch 8 bf16; the eager step is the control, held to the same 5% as the
    estimator alone (test_estimator_against_cuda_allocator)."""
    from artifacts.tempo_bert.compile_check import CheckCase, compile_check_point

    torch.cuda.empty_cache()
    r = compile_check_point(configuration, CheckCase("bert-base", 512, 8, "bf16", "cuda"))
    print(
        f"{configuration}: compiled keeps {r['kept_scale']}; compiled step "
        f"{r['compiled']['measured_bytes'] / 2**30:.3f} GiB measured, estimate {r['compiled_error']:+.1%}; "
        f"eager control {r['eager_error']:+.1%}"
    )
    assert abs(r["eager_error"]) <= 0.05, r
    assert abs(r["compiled_error"]) <= 0.05, r
