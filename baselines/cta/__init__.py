"""What CTA-pipelining is compared against: back-to-back GEMMs, micro-batching (row chunks
pipelined across devices) and Megatron-style tensor parallelism, with torch.distributed (NCCL on
GPUs, gloo on a CPU), plus their single-GPU forms."""
