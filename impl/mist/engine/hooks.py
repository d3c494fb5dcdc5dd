"""Gradient hooks that hold their owner weakly.

A hook registered on a tensor (``register_post_accumulate_grad_hook``) is kept by the tensor's
autograd metadata in C++, where Python's cyclic collector cannot see it. A hook that is an
object's bound method then makes parameter -> hook -> object -> parameter a cycle that is never
freed: an optimizer and every parameter it steps stay alive for the life of the process, and with
them its process group (a gloo group's 3 threads: a seed-sweep worker piled up 2,400 of them).
Through this helper the tensor holds only a weak reference to the hook's owner.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


def after_gradient_accumulated(
    tensor: torch.Tensor, method: Callable[..., None], *args: Any
) -> RemovableHandle:
    """Call the bound ``method(tensor, *args)`` each time backward has accumulated ``tensor``'s
    gradient, for as long as the method's object lives (then nothing: no one reads its work)."""
    owner_method = weakref.WeakMethod(method)  # a TypeError for anything but a bound method

    def hook(t: torch.Tensor) -> None:
        bound = owner_method()
        if bound is not None:
            bound(t, *args)

    return tensor.register_post_accumulate_grad_hook(hook)
