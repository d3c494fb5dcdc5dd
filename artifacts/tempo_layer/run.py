"""Saved-for-backward bytes of one BERT-Large encoder layer: HF eager vs Tempo (and each
technique alone), measured exactly with measure.saved, next to the closed forms.

    python -m artifacts.tempo_layer.run [--seq 128 512] [--dtype bf16] [--batch 1]

Baseline dropouts run as on CUDA (fused native_dropout, bool mask; see
measure.saved.cuda_like_dropout), so the bytes are those the layer keeps on a GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer
from transformers.utils import logging as hf_logging

import tempo
from measure.results import ResultFile, provenance
from measure.saved import cuda_like_dropout, saved_bytes

RESULTS = Path(__file__).parent / "results" / "layer_saved_bytes.json"
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--force", action="store_true", help="recompute points already in the result file")
    args = ap.parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)

    config = {
        "seq": args.seq,
        "batch": args.batch,
        "dtype": args.dtype,
        "model": "bert-large layer (h1024, a16)",
    }
    store = ResultFile(args.out, provenance(config), force=args.force)
    dtype = DTYPES[args.dtype]
    print(f"Saved-for-backward bytes of one BERT-Large encoder layer, {args.dtype}, batch {args.batch}")
    print(f"{'seq':>5} {'variant':<15} {'bytes':>12} {'= x sbh':>8} {'closed form':>18} {'vs HF eager':>12}")
    for seq in args.seq:
        base = store.compute(
            f"seq{seq}/hf-eager", lambda s=seq: measure_layer("hf-eager", s, args.batch, dtype)
        )
        for variant in VARIANTS:
            res = store.compute(
                f"seq{seq}/{variant}", lambda s=seq, v=variant: measure_layer(v, s, args.batch, dtype)
            )
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
    print(f"results: {args.out}")
    print("(=): measured bytes equal the closed form within 0.1% (LayerNorm mean/rstd are the rest)")
    return store.points


if __name__ == "__main__":
    main()
