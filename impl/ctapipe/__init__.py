"""CTA-pipelined GEMMs (arXiv 2607.07862): dependent GEMMs run concurrently, each consumer thread
block starting as soon as the producer tiles it reads are written. Every wait is bounded in time
(``WAIT_TIMEOUT_S`` by default); a tile that gives up makes the host raise ``StageTimeout``."""

from .gemm import (
    WAIT_TIMEOUT_S,
    PartitionedMLP,
    StageTimeout,
    TicketMLP,
    launch_stage,
    new_status,
    raise_if_gave_up,
    ticket_schedule,
)
from .tiling import INTERPRETER_TILING, Tiling

__all__ = [
    "INTERPRETER_TILING",
    "WAIT_TIMEOUT_S",
    "PartitionedMLP",
    "StageTimeout",
    "TicketMLP",
    "Tiling",
    "launch_stage",
    "new_status",
    "raise_if_gave_up",
    "ticket_schedule",
]
