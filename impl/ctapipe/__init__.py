"""CTA-pipelined GEMMs (arXiv 2607.07862): dependent GEMMs run concurrently, each consumer thread
block starting as soon as the producer tiles it reads are written."""

from .gemm import INTERPRETER_TILING, PartitionedMLP, TicketMLP, Tiling, launch_stage, ticket_schedule

__all__ = ["INTERPRETER_TILING", "PartitionedMLP", "TicketMLP", "Tiling", "launch_stage", "ticket_schedule"]
