"""Plain PyTorch references: the activations the kernels implement and a chain of GEMMs."""

from __future__ import annotations

import torch

ACTIVATION_NAMES = ("none", "relu", "gelu")


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "none":
        return x
    if act == "relu":
        return torch.relu(x)
    if act == "gelu":
        return torch.nn.functional.gelu(x, approximate="tanh")
    raise ValueError(f"activation {act!r} unknown; accepted: {', '.join(ACTIVATION_NAMES)}")


def chain(x: torch.Tensor, weights: list[torch.Tensor], acts: list[str]) -> torch.Tensor:
    for w, a in zip(weights, acts, strict=True):
        x = activation(x @ w, a)
    return x
