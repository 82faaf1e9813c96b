"""torchrun's process group, for profiling partitions on several GPUs.

`torchrun_group()` reads the ranks torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK; a plain
process is rank 0 of 1), and with more than one process initialises the NCCL process group,
pins this process to its local GPU and builds the per-SM-setting NCCL collectives. The
process group is destroyed however the block exits. torch is imported only when there is
a group to create.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kareus.gpu.nccl import NcclCollectives


@dataclass(frozen=True)
class TorchrunGroup:
    rank: int
    world_size: int
    local_rank: int
    collectives: NcclCollectives | None
    """None on a single process (the backend then uses the single-GPU stand-in)."""

    @property
    def device(self) -> str:
        return f"cuda:{self.local_rank}"


@contextmanager
def torchrun_group() -> Iterator[TorchrunGroup]:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size <= 1:
        yield TorchrunGroup(rank, world_size, local_rank, None)
        return
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    try:
        yield TorchrunGroup(rank, world_size, local_rank,
                            NcclCollectives(f"cuda:{local_rank}"))
    finally:
        dist.destroy_process_group()
