"""Fused Triton kernels for Tempo's ops (GPU). Tested on CPU with TRITON_INTERPRET=1."""

try:
    import triton  # noqa: F401

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - e.g. macOS / aarch64 without a triton wheel
    TRITON_AVAILABLE = False
