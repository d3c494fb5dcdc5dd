"""Tempo's ops: one file each (math, custom op, autograd); kernels live in tempo/kernels."""
