"""``mist profile``: measure one GPT-3-style layer op by op on this machine's device.

Writes a profile directory in the Mist artifact's format (see model/profile_data.py), so ``mist
calibrate`` fits a runtime model for this device exactly as for the shipped GPU data:

    python -m mist profile --out profiles/h200 --name h200 --device cuda --hidden 2048 --heads 16 \
        --seq 2048 --micro-batches 1 2 4 --tp 1 2

TP is emulated on one device by giving the layer one rank's share (heads / t of the model's head
size, ffn / t); its collectives are not included (they come from the collective benchmarks).
Every op is timed in isolation, forward and backward, on fresh random inputs, median of several
repeats. Then megatron-core's own layer (the one mist.engine.run trains) is timed whole, and what it
costs beyond the sum of its ops (framework overhead) is written as one more row, and so is the
gradient accumulation's add (an in-place add per parameter of that layer, as the engine's
autograd makes it), which no op's time holds.

``--collectives 2 4`` also benchmarks all-reduce, all-gather and reduce-scatter among that many
local processes (gloo on a CPU, NCCL on GPUs), written as the artifact's ``prim_gpt_*`` files,
so collectives are priced by this machine's measured lines rather than the preset's link, and
three mechanisms as the engine runs them, on whole layers: ZeRO-2 (its reductions of each
layer's gradients to the layer's owner, ``prim_gpt_local_grad_shard_layer_*``) and ZeRO-3 (FSDP2,
``prim_gpt_local_fsdp_layer_*``) at two sizes, and tensor parallelism (megatron-core's layer split
over the processes, per micro-batch, ``prim_gpt_local_tp_layer[_forward]_*``), which price such a
layer by what it measurably adds rather than by its collectives timed back to back; and ZeRO-1/2's
step collectives as the engine issues them (``prim_gpt_local_zero_grad_sum_*``,
``prim_gpt_local_zero_weight_sync_*``: an all-reduce of the gradient buffer, a broadcast per
owner, where Megatron-LM reduce-scatters and all-gathers). Every such
point is the median of interleaved rounds (on a CPU gloo's latency drifts between modes over
seconds), and with ``launches`` of several launches (it settles into a mode for a launch's life).

One module per benchmark: ``layer`` (the per-op profile), ``collectives``, ``zero_layers``,
``zero_sync``, ``tp_layers``, ``host`` (the CPU Adam step); ``among`` runs every multi-process one
in order; ``ranks`` (forked ranks, interleaved timing) and ``megatron_layer`` (megatron-core's
layer as they build it) are what they share.
"""

from .among import write_rank_benchmarks
from .collectives import COLLECTIVES, profile_collectives, write_collectives
from .host import profile_cpu_adam
from .layer import megatron_edge_rows, megatron_layer_seconds, profile_layer, write_profiles
from .tp_layers import profile_tp_layers, write_tp_layers
from .zero_layers import profile_zero_layers, write_zero_layers
from .zero_sync import profile_zero_sync, sizes_for_layer, write_zero_sync

__all__ = [
    "COLLECTIVES",
    "megatron_edge_rows",
    "megatron_layer_seconds",
    "profile_collectives",
    "profile_cpu_adam",
    "profile_layer",
    "profile_tp_layers",
    "profile_zero_layers",
    "profile_zero_sync",
    "sizes_for_layer",
    "write_collectives",
    "write_profiles",
    "write_rank_benchmarks",
    "write_tp_layers",
    "write_zero_layers",
    "write_zero_sync",
]
