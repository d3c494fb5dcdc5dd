"""A rank for test_fork_launch and test_launch: ``main([mode])`` sums its rank over a gloo group and
prints it; mode "fail1" makes rank 1 exit with status 2 before the collective (rank 0 would wait forever),
"sleep" sleeps past any test's timeout."""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    (mode,) = argv
    rank = int(os.environ["RANK"])
    if mode == "fail1" and rank == 1:
        print("rank 1 gives up", file=sys.stderr)
        return 2
    if mode == "sleep":
        time.sleep(600)
    dist.init_process_group("gloo")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    world, threads = os.environ["WORLD_SIZE"], torch.get_num_threads()
    print(f"rank {rank} of {world}: sum {total.item():.0f}, threads {threads}")
    dist.destroy_process_group()
    return 0


def preload() -> None:
    import torch.distributed  # noqa: F401


if __name__ == "__main__":  # under torchrun (tests/measure/test_launch.py)
    sys.exit(main(sys.argv[1:]))
