"""Run megatron-core on a CPU-only torch: the one place that stands in for CUDA.

megatron-core asks the CUDA runtime for its current device, synchronises streams and keeps a
"CUDA" random-number-generator state per parallel region (the model-parallel tracker that
gives each TP rank its own dropout stream). On a CPU these map onto the CPU: tensors are made on
"cpu", synchronisation is a no-op (gloo collectives are synchronous), and the tracker's states
are states of the CPU generator (so the tracker still gives each region its own stream).
Nothing here changes anything when CUDA is available.
"""

from __future__ import annotations

import logging

import torch

_INSTALLED = False


def install() -> None:
    """Idempotent; call before importing megatron.core modules that read these at import time."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.manual_seed = lambda seed, *args, **kwargs: torch.manual_seed(seed)
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # The tracker warns when the CPU generator moves inside a "CUDA" RNG region; here the two
    # are the same generator, so it always would.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _INSTALLED = True
