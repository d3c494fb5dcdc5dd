"""Shared measurement for every experiment: saved-for-backward bytes, fake-tensor peak memory of
a training step, timing, provenance and atomic, resumable result files."""
