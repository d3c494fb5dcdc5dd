"""CPU offloading for mist.engine.run, around megatron-core's modules.

* Optimizer state (``offload_optimizer``, ZeRO-Offload, Ren et al. 2021): the fp32 master weights
  and Adam moments of that fraction of the parameters this rank steps (largest first; with ZeRO,
  of its share) live on the host. Their gradients go down, the host steps them (torch's fused CPU
  AdamW), and the new half-precision weights come back up. The rest step on the device as usual.
* Activations (``offload_activations``): the tensors that layers keep for backward are moved to
  the host as they are saved and brought back when backward needs them
  (``torch.autograd.graph.save_on_cpu``). This covers that fraction of the stage's layers that
  are not recomputed, rounded to whole layers.

On a CPU-only machine "host" and "device" are the same memory, so only the mechanics and the
training run there (tests). What they save is measured on a GPU (the engine check).
"""

from __future__ import annotations

import torch
from torch import nn

from measure.training import MasterWeightAdamW


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a ZeRO-3 (FSDP2) parameter or gradient is a DTensor, whose local
    shard is what this rank holds and steps (under no_grad, the very storage)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def split_by_fraction(params: list[nn.Parameter], fraction: float) -> tuple[list, list]:
    """(host, device): the largest parameters go to the host until ``fraction`` of the elements
    this rank holds (a ZeRO-3 parameter: its shard)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the offloaded fraction must be in [0, 1], got {fraction}")
    total = sum(local(p).numel() for p in params)
    host, moved = [], 0
    for p in sorted(params, key=lambda q: local(q).numel(), reverse=True):
        if moved + local(p).numel() <= fraction * total + 0.5:
            host.append(p)
            moved += local(p).numel()
    chosen = {id(p) for p in host}
    return host, [p for p in params if id(p) not in chosen]


class OffloadedMasterAdamW:
    """Mixed-precision AdamW with the optimizer of a fraction of the parameters on the host. The
    parameters may be this rank's share under ZeRO-1/2 (ShardedMasterAdamW steps its share with
    one) or ZeRO-3 DTensors (their local shards are stepped)."""

    def __init__(self, params, fraction: float, lr: float, weight_decay: float = 0.01) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        host, device = split_by_fraction(self.model_params, fraction)
        self.device_opt = (
            MasterWeightAdamW(device, lr=lr, weight_decay=weight_decay, fused=True) if device else None
        )
        self.host_params = host
        pin = torch.cuda.is_available()
        self.host_master = [local(p).detach().to("cpu", torch.float32, copy=True) for p in host]
        if pin:
            self.host_master = [m.pin_memory() for m in self.host_master]
        for m in self.host_master:
            m.requires_grad_(True)
        self.host_opt = (
            torch.optim.AdamW(self.host_master, lr=lr, weight_decay=weight_decay, fused=True)
            if host
            else None
        )
        held = sum(local(p).numel() for p in self.model_params)
        self.host_fraction = sum(local(p).numel() for p in host) / max(1, held)

    @torch.no_grad()
    def step(self) -> None:
        if self.device_opt is not None:
            self.device_opt.step()
        if self.host_opt is None:
            return
        for p, master in zip(self.host_params, self.host_master, strict=True):
            master.grad = None if p.grad is None else local(p.grad).to("cpu", torch.float32)  # down
        self.host_opt.step()
        for p, master in zip(self.host_params, self.host_master, strict=True):
            local(p).copy_(master, non_blocking=True)  # up, cast to the model's dtype
            master.grad = None

    def zero_grad(self) -> None:
        if self.device_opt is not None:
            self.device_opt.zero_grad()
        for p in self.host_params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer tensors on the device (the host ones are in host_tensors)."""
        return self.device_opt.state_tensors() if self.device_opt is not None else []

    def host_tensors(self) -> list[torch.Tensor]:
        state = [t for s in (self.host_opt.state.values() if self.host_opt else []) for t in s.values()]
        return [*self.host_master, *(t for t in state if isinstance(t, torch.Tensor))]


def offload_layer_activations(model, recompute: int, fraction: float) -> int:
    """Wrap round(fraction x non-recomputed layers) layers (those after the recomputed ones) so
    what they save for backward waits on the host; returns how many layers were wrapped."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload_activations must be in [0, 1], got {fraction}")
    layers = list(model.decoder.layers)
    count = round(fraction * (len(layers) - recompute))
    pin = torch.cuda.is_available()
    for layer in layers[recompute : recompute + count]:
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return _forward(*args, **kwargs)

        layer.forward = wrapped
    return count
