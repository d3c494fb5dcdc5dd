"""One ParallelBlockLayer (mist/engine/layers.py) against its formula, in float64.

Run by tests/mist/test_mist_run.py in a process of its own (``torchrun --nproc-per-node 1 -m
tests.mist.parallel_block_check --out FILE``): megatron-core's CPU stand-ins patch torch.cuda for
the whole process. Writes the largest error of y against x + attention(norm(x)) + mlp(norm(x))
(the layer's own submodules, on one norm), of the gradient of x against the same formula's, and,
as the negative control, how far megatron-core's sequential layer with the same weights is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    args = ap.parse_args()

    from mist.engine import cpu_shim
    from mist.engine.layers import layer_spec

    cpu_shim.install()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization=args.normalization,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
    )
    layer = build_module(layer_spec(args.normalization, parallel_block=True), config=config, layer_number=1)
    sequential = build_module(
        get_gpt_layer_local_spec(normalization=args.normalization), config=config, layer_number=1
    ).to(torch.float64)  # megatron-core's torch LayerNorm ignores params_dtype
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))  # the norm's gamma off 1 (and beta off 0): it matters
        theirs = dict(sequential.named_parameters())  # the same weights; its second norm a copy of the one
        for name, p in layer.named_parameters():
            theirs[name].copy_(p)
            if name.startswith("input_layernorm."):
                theirs[name.replace("input_layernorm", "pre_mlp_layernorm")].copy_(p)

    x = torch.randn(8, 2, 32, dtype=torch.float64, requires_grad=True)  # [seq, batch, hidden]
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril().logical_not()  # causal; True: masked out
    y = layer(x, attention_mask=mask)[0]
    normed = layer.input_layernorm(x)
    expected = x + layer.self_attention(normed, attention_mask=mask)[0] + layer.mlp(normed)[0]
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    (dx_expected,) = torch.autograd.grad(expected, x, g)
    y_sequential = sequential(x, attention_mask=mask)[0]
    result = {
        "output_error": _relative(y.detach(), expected.detach()),
        "gradient_error": _relative(dx, dx_expected),
        "sequential_differs_by": _relative(y_sequential.detach(), expected.detach()),
        "second_norm": type(layer.pre_mlp_layernorm).__name__,
    }
    Path(args.out).write_text(json.dumps(result))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
