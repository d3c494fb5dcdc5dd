"""What the papers compare against.

Tempo's baselines are HuggingFace's own layers: eager attention, SDPA attention and activation
checkpointing. They are configurations of the unmodified HF models, defined next to Tempo's
in ``tempo.models.CONFIGURATIONS`` ("hf-eager", "hf-sdpa", "checkpointing"), so that every
variant is built by the same code. Mist's baselines (Megatron-LM grid, Aceso-style search,
ZeRO-3) are in ``baselines.megatron``; CTA-pipelining's (tensor parallelism, micro-batching)
arrive with issue #6.
"""
