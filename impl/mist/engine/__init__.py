"""Mist's engine: runs a plan with megatron-core (run), translates plans into Megatron settings
(megatron: one translation and one refusal list, shared with the Megatron-LM baseline), places each
rank in its stage (layout), offloads (offload) and profiles ops on this machine for the cost model
(profiler)."""
