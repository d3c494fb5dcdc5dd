"""A model copied the three ways a user copies one (the save/load tests of tempo.patch)."""

from __future__ import annotations

import copy
import io
import pickle

import torch

HOWS = ("torch.save", "pickle", "deepcopy")


def copied(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """``model`` through ``torch.save``/``torch.load``, pickle, or ``copy.deepcopy``."""
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)
