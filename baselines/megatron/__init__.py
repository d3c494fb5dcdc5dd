"""Mist's baselines, each costed with Mist's own model: the Megatron-LM grid (grid.py), an
Aceso-style bottleneck-alleviation search (aceso.py) and ZeRO-3 data parallelism (zero3.py)."""
