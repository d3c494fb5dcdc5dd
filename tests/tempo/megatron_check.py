"""Tempo's megatron-core layer (tempo/megatron.py) against the plain one, in float64, on every rank.

Run by tests/tempo/test_tempo_megatron.py under torchrun (``--nproc-per-node 1`` or ``2``: the TP
size) in processes of their own: megatron-core's CPU stand-ins patch torch.cuda for the whole
process. The plain layer is megatron-core's local spec with norms that allow sequence parallelism
(mist.engine.layers; megatron-core's torch norm refuses it); both get the same weights (the norms'
moved off 1 and 0) and the same input. Rank 0 writes, as JSON:

* with no dropout, the largest relative error of the Tempo layer's output, input gradient and every
  parameter gradient against the plain layer's, over all ranks;
* with dropout (attention and hidden), the error of a central finite difference of <g, y> along a
  random direction of x against <dx, direction>, relative to |dx| |direction| (each evaluation from
  the same seeds: the masks are a function of them), and how far the output is from the same
  layer's with its dropouts off (the negative control: the dropouts drop);
* the bytes each layer keeps for backward on each rank (measure.saved), to be held against the
  closed forms in the test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQ, BATCH, HIDDEN, HEADS, FFN = 8, 2, 32, 4, 64


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _config(args, dropout: float):
    from megatron.core.transformer.transformer_config import TransformerConfig

    swiglu = args.mlp == "swiglu"
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        add_bias_linear=args.bias,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        normalization=args.normalization,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
        tensor_model_parallel_size=dist.get_world_size(),
        sequence_parallel=args.sequence_parallel,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
    )


def _layers(args, dropout: float):
    from megatron.core.transformer.spec_utils import build_module

    from mist.engine.layers import layer_spec
    from tempo.megatron import tempo_layer_spec

    config = _config(args, dropout)
    plain = build_module(layer_spec(args.normalization, parallel_block=False), config=config, layer_number=1)
    tempo = build_module(tempo_layer_spec(args.normalization), config=config, layer_number=1)
    plain, tempo = plain.to(torch.float64), tempo.to(torch.float64)
    # the same draws on every rank: a parameter replicated over the TP group (a norm's, the row-
    # parallel layers' biases) must stay one value; the sharded ones differ by their initialisation
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        theirs = dict(tempo.named_parameters())
        assert sorted(theirs) == sorted(n for n, _ in plain.named_parameters()), (sorted(theirs), plain)
        for name, p in plain.named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator, dtype=p.dtype))  # norms off 1 and 0
            theirs[name].copy_(p)
    return plain, tempo


def _inputs(args):
    """This rank's input (its sequence shard under sequence parallelism), mask and output gradient."""
    generator = torch.Generator().manual_seed(args.seed + 1000)  # the same full tensors on every rank
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)
    g = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)
    direction = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)
    if args.sequence_parallel:
        shard = SEQ // dist.get_world_size()
        part = slice(dist.get_rank() * shard, (dist.get_rank() + 1) * shard)
        # storages of their own: a view of the whole tensor would be counted whole as the layer's input
        x, g, direction = x[part].clone(), g[part].clone(), direction[part].clone()
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()  # causal; True: masked out
    return x, g, direction, mask


def _seeded(args) -> None:
    """The same dropout seeds for each evaluation: torch's and the TP RNG tracker's."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def _run(layer, x, mask):
    from megatron.core import tensor_parallel

    from measure.saved import SavedTensorsMeter

    x = x.detach().requires_grad_()
    # under sequence parallelism megatron-core's block runs its layers in the tracker's fork
    fork = tensor_parallel.get_cuda_rng_tracker().fork() if layer.config.sequence_parallel else _nothing()
    with SavedTensorsMeter(layer, inputs=(x,)) as meter, fork:
        y = layer(x, attention_mask=mask)[0]
    return x, y, meter.report().total_bytes


def _watch_value_layout() -> list[bool]:
    """Whether each V the Tempo layer hands its attention core flattens into one batch as a view
    (so Mist's planner is right to price no copy of it: tempo.sizes), filled as the layers run."""
    import tempo.megatron
    from tempo.ops import value_flattens

    seen, core = [], tempo.megatron.attention_core

    def watched(scores, value, *rest):
        seen.append(value_flattens(value))
        return core(scores, value, *rest)

    tempo.megatron.attention_core = watched
    return seen


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    ap.add_argument("--mlp", default="gelu", choices=["gelu", "swiglu"])
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--bias", action="store_true", help="biases in the linear layers")
    args = ap.parse_args(argv)

    from mist.engine import cpu_shim

    cpu_shim.install()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    _seeded(args)
    x, g, direction, mask = _inputs(args)
    result: dict = {"value_flattens": _watch_value_layout()}

    # no dropout: the Tempo layer is the plain one, output and gradients
    plain, tempo = _layers(args, dropout=0.0)
    xp, yp, result["plain_bytes"] = _run(plain, x, mask)
    xt, yt, result["tempo_bytes"] = _run(tempo, x, mask)
    yp.backward(g)
    yt.backward(g)
    errors = {"output": _relative(yt.detach(), yp.detach()), "input_gradient": _relative(xt.grad, xp.grad)}
    theirs = dict(plain.named_parameters())
    for name, p in tempo.named_parameters():
        errors[name] = _relative(p.grad, theirs[name].grad)
    result["errors"] = {k: _max_over_ranks(v) for k, v in errors.items()}

    # dropout: the gradient against a central difference of <g, y> (same seeds each evaluation)
    _, tempo = _layers(args, dropout=0.3)

    def objective(at: torch.Tensor) -> torch.Tensor:
        _seeded(args)
        return (_run(tempo, at, mask)[1] * g).sum()

    _seeded(args)
    xd, yd, result["tempo_dropout_bytes"] = _run(tempo, x, mask)
    (yd * g).sum().backward()
    step = 1e-5
    with torch.no_grad():
        difference = (objective(x + step * direction) - objective(x - step * direction)) / (2 * step)
    # <dx, direction> and the difference summed over the ranks' shards (a sequence-parallel input),
    # the error relative to |dx| |direction| (Cauchy-Schwarz: <dx, direction> itself may be ~0)
    exact, squares = (xd.grad * direction).sum(), torch.stack([xd.grad.pow(2).sum(), direction.pow(2).sum()])
    if args.sequence_parallel:
        for t in (difference, exact, squares):
            dist.all_reduce(t)
    scale = float(squares.prod().sqrt())
    result["dropout_gradient_error"] = _max_over_ranks(abs(float(difference - exact)) / scale)
    # the negative control: the same layer with its dropouts off (eval mode) is far from it
    tempo.eval()
    _, y_off, _ = _run(tempo, x, mask)
    result["dropout_changes_output_by"] = _max_over_ranks(_relative(yd.detach(), y_off.detach()))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
