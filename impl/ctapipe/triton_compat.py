"""Triton 3.6's interpreter (``TRITON_INTERPRET=1``: the kernels on a CPU) makes a loop bound that
is a runtime argument or a program id into an index with ``int()`` of a one-element array, which
numpy 2 refuses; Triton 3.7 squeezes the array first. ``interpreter_compat`` gives the older
interpreter 3.7's conversion, once, before the first launch. Compiled kernels (a GPU) and Triton
3.7 and later are left as they are."""

from __future__ import annotations

import functools


def interpreting() -> bool:
    """Whether Triton runs its kernels in the interpreter, as Triton itself reads TRITON_INTERPRET
    ("1", "true", "yes", "on": comparing with "1" recorded a "yes" run as compiled)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


@functools.cache
def interpreter_compat() -> bool:
    """Apply the fix where it is needed; returns whether it was applied."""
    if not interpreting():
        return False
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) >= (3, 7):
        return False
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor  # patches tl.tensor's Python methods at each launch

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
