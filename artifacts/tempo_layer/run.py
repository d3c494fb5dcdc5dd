"""Saved-for-backward bytes of one BERT-Large encoder layer: HF eager vs Tempo (and each
technique alone), measured exactly with measure.saved, next to the closed forms.

    python -m artifacts.tempo_layer.run [--seq 128 512] [--dtype bf16] [--batch 1]
                                        [--fresh] [--update-reference]

Baseline dropouts run as on CUDA (fused native_dropout, bool mask; see
measure.saved.cuda_like_dropout), so the bytes are those the layer keeps on a GPU.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer
from transformers.utils import logging as hf_logging

import tempo
from measure.saved import cuda_like_dropout, saved_bytes
from tempo.ops import gelu as tempo_gelu

from ..experiment import add_run_arguments, experiment_run
from . import EXPERIMENT

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VARIANTS = {  # name -> tempo.patch switches (None: HF eager, unpatched)
    "hf-eager": None,
    "tempo": dict(layernorm=True, gelu=True, attention=True, dropout=True),
    "gelu-only": dict(layernorm=False, gelu=True, attention=False, dropout=False),
    "layernorm-only": dict(layernorm=True, gelu=False, attention=False, dropout=False),
    "attention-only": dict(layernorm=False, gelu=False, attention=True, dropout=False),
    "dropout-only": dict(layernorm=False, gelu=False, attention=False, dropout=True),
}
# Closed forms in bytes for a half-precision layer, as (coefficient of s*b*h, coefficient of a*s^2*b),
# one layer measured alone (its input counted). Baseline: Korthikanti et al. 2022, 34sbh + 5as^2b.
# Tempo: GELU keeps y (shared with the next Linear) + 1 bit/elem of 4h (0.5sbh) instead of its
# 8sbh input; LayerNorm keeps y (shared with the next Linear for LN1) instead of its 2sbh input;
# dropouts keep a seed instead of 1-byte masks (2 x sbh); attention keeps P only (2as^2b of 5).
CLOSED_FORMS = {
    "hf-eager": (34.0, 5.0),
    "tempo": (22.5, 2.0),
    "gelu-only": (26.5, 5.0),
    "layernorm-only": (32.0, 5.0),
    "attention-only": (34.0, 2.0),
    "dropout-only": (32.0, 5.0),
}


def measure_layer(
    variant: str, seq: int, batch: int, dtype: torch.dtype, hidden: int = 1024, heads: int = 16
) -> dict:
    cfg = BertConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        attn_implementation="eager",
    )
    layer = BertLayer(cfg).to(dtype).train()
    switches = VARIANTS[variant]
    report = str(tempo.patch(layer, **switches)) if switches is not None else "HF eager (unpatched)"
    x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
    with cuda_like_dropout():
        r = saved_bytes(layer, x)
    sbh, as2b = seq * batch * hidden, heads * seq * seq * batch
    c_sbh, c_as2b = CLOSED_FORMS[variant]
    scale = torch.finfo(dtype).bits // 16  # the closed forms are for 2-byte activations
    return {
        "bytes": r.total_bytes,
        "bytes_per_sbh": r.total_bytes / sbh,
        "closed_form_bytes": scale * (c_sbh * sbh + c_as2b * as2b) if dtype != torch.float32 else None,
        "closed_form": f"{c_sbh:g}sbh + {c_as2b:g}as^2b" if dtype != torch.float32 else None,
        "by_module_type": r.by_module_type,
        "patch_report": report,
    }


def gelu_backward_error(dtype: torch.dtype, approximate: str, n: int, seed: int) -> dict:
    """Norm-wise error of Tempo's GELU backward (input recovered from the output) against autograd
    through torch's GELU, on ``n`` fresh normal inputs scaled by 3 (both branches, the minimum)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    grad = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    y, packed = tempo_gelu.gelu_fwd(x, approximate)
    ours = tempo_gelu.gelu_bwd(grad, y, packed, approximate).double()
    x_ref = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad(torch.nn.functional.gelu(x_ref, approximate=approximate), x_ref, grad)
    ref = ref.double()
    return {"relative_error": ((ours - ref).norm() / ref.norm()).item(), "elements": n}


def measure_layers(run, seqs: list[int], batch: int, dtype_name: str) -> None:
    model = {"hidden": 1024, "heads": 16, "intermediate": 4096, "dropout": 0.1}
    store = run.file("layer_saved_bytes.json", config={"model": "bert-large layer", **model})
    dtype = DTYPES[dtype_name]

    def key(seq: int, variant: str) -> dict:
        return {"layer": "bert-large", "seq": seq, "batch": batch, "dtype": dtype_name, "variant": variant}

    print(f"Saved-for-backward bytes of one BERT-Large encoder layer, {dtype_name}, batch {batch}")
    print(f"{'seq':>5} {'variant':<15} {'bytes':>12} {'= x sbh':>8} {'closed form':>18} {'vs HF eager':>12}")
    for seq in seqs:
        base = store.compute(key(seq, "hf-eager"), lambda s=seq: measure_layer("hf-eager", s, batch, dtype))
        for variant in VARIANTS:
            res = store.compute(key(seq, variant), lambda s=seq, v=variant: measure_layer(v, s, batch, dtype))
            saving = 1 - res["bytes"] / base["bytes"]
            match = (
                ""
                if res["closed_form_bytes"] is None
                else (
                    "  (=)"
                    if abs(res["bytes"] - res["closed_form_bytes"]) <= 0.001 * res["bytes"]
                    else "  (!=)"
                )
            )
            print(
                f"{seq:>5} {variant:<15} {res['bytes']:>12,} {res['bytes_per_sbh']:>8.2f} "
                f"{res['closed_form'] or '-':>18}{match} {saving:>+11.1%}"
            )
    print(f"results: {store.path}")
    print("(=): measured bytes equal the closed form within 0.1% (LayerNorm mean/rstd are the rest)")


GELU_CASES = [(torch.float32, "fp32"), (torch.float64, "fp64")]


def measure_gelu_backward(run) -> None:
    """Tempo's GELU backward against autograd (the paper's published kernel used a polynomial fit)."""
    store = run.file("gelu_backward.json")
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run, seed stored
    for dtype, name in GELU_CASES:
        for approximate in ("none", "tanh"):
            key = {"op": "gelu_backward", "dtype": name, "approximate": approximate, "elements": 1_000_000}
            r = store.compute(key, lambda d=dtype, a=approximate: {
                **gelu_backward_error(d, a, 1_000_000, seed), "seed": seed})  # fmt: skip
            print(
                f"GELU backward ({approximate}, {name}): relative error vs autograd {r['relative_error']:.1e}"
            )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    add_run_arguments(ap, EXPERIMENT)
    args = ap.parse_args(argv)
    if min(args.seq) < 1 or args.batch < 1:
        ap.error(f"--seq and --batch must be positive integers, got --seq {args.seq} --batch {args.batch}")
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    with experiment_run(args, EXPERIMENT) as run:
        measure_layers(run, args.seq, args.batch, args.dtype)
        measure_gelu_backward(run)


if __name__ == "__main__":
    main()
