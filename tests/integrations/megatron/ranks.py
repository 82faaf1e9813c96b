"""The multi-process scaffolding the Megatron integration tests share: each test spawns
processes over gloo on the CPU (`spawn_ranks`), each process sets up torch.distributed and
Megatron's model-parallel state (`megatron_ranks`), computes its results and saves them,
and the test reads them back per rank.

Not a test module (no ``test_`` prefix): pytest does not collect it.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    """A free TCP port on the loopback interface, for the processes' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def megatron_ranks(rank: int, world: int, port: int, out_dir: str | None = None, *,
                   tp: int = 1, cp: int = 1, seed: int | None = None,
                   cpu_allocation: bool = False) -> Iterator[dict]:
    """One spawned process's torch.distributed and Megatron model-parallel state: warnings
    off, the gloo process group of ``world`` ranks at 127.0.0.1:``port``, Megatron's
    parallel state at TP ``tp`` x CP ``cp`` (after `allocate_on_cpu` where
    ``cpu_allocation``), its RNG tracker seeded with ``seed`` (none where None). Yields the
    process's results dict; on leaving, saves it to ``out_dir``/rank{rank}.pt (where
    ``out_dir`` is given, whatever happened), then destroys the model-parallel state and
    the process group."""
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if cpu_allocation:
        from kareus.integrations.megatron.cpu import allocate_on_cpu

        allocate_on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             context_parallel_size=cp)
    if seed is not None:
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    res: dict = {}
    try:
        yield res
    finally:
        if out_dir is not None:
            torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def spawn_ranks(worker: Callable, world: int, out_dir, *args) -> list[dict]:
    """Runs ``worker(rank, world, port, out_dir, *args)`` in ``world`` processes on a free
    port and returns each rank's saved results (``out_dir``/rank{r}.pt), in rank order."""
    mp.spawn(worker, args=(world, _port(), str(out_dir), *args), nprocs=world, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
            for r in range(world)]
