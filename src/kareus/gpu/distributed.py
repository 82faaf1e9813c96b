"""torchrun's process group, for profiling partitions on several GPUs.

`torchrun_group()` reads the ranks torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK; a plain
process is rank 0 of 1), and with more than one process initialises the NCCL process group,
pins this process to its local GPU and builds the per-SM-setting NCCL collectives. Without
CUDA (or with KAREUS_DIST_BACKEND=gloo) the group is gloo on the CPU: the fake-GPU path
that tests the whole multi-process profile on any machine. The process group is destroyed
however the block exits. torch is imported only when there is a group to create.

`agree(value)` gives every rank rank 0's value: ranks of a TP group time the same
lockstep run slightly differently, and a search that decided on each rank's own numbers
would diverge and deadlock in the next collective.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from kareus.gpu.nccl import NcclCollectives

T = TypeVar("T")


@dataclass(frozen=True)
class TorchrunGroup:
    rank: int
    world_size: int
    local_rank: int
    collectives: NcclCollectives | None
    """None on a single process (the backend then uses the single-GPU stand-in)."""
    device: str = "cuda:0"
    """The torch device of this rank: ``cuda:<local rank>``, or ``cpu`` on gloo."""

    def agree(self, value: T) -> T:
        """Rank 0's ``value`` on every rank (a no-op on one process)."""
        if self.world_size <= 1:
            return value
        import torch.distributed as dist

        box: list[object] = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]


@contextmanager
def torchrun_group() -> Iterator[TorchrunGroup]:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size <= 1:
        yield TorchrunGroup(rank, world_size, local_rank, None, f"cuda:{local_rank}")
        return
    import torch
    import torch.distributed as dist

    gloo = (os.environ.get("KAREUS_DIST_BACKEND") == "gloo"
            or not torch.cuda.is_available())
    if gloo:
        device = "cpu"
        dist.init_process_group("gloo")
    else:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
    try:
        yield TorchrunGroup(rank, world_size, local_rank, NcclCollectives(device), device)
    finally:
        dist.destroy_process_group()
