"""`kareus profile`: measure partitions on real GPUs through the search loop, journal first.

Run under torchrun with as many processes as the partitions' TP/CP group: every rank runs
the kernels and the NCCL collective (one communicator per SM setting) in lockstep, every
rank reads the journal (so all skip the same settings already measured), and rank 0
writes it. On one process the collective is a single-GPU stand-in. Without
``allow_clock_changes`` only the GPU's current clock is measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kareus.backends.factory import BackendSpec, open_backend
from kareus.errors import KareusError
from kareus.partition import PartitionSet
from kareus.search.loop import SearchConfig, SearchResult, run_search
from kareus.spec import JobSpec
from kareus.store import Journal

ProfileProgress = Callable[[str, int, int], None]


def profile(job: JobSpec, keys: Sequence[str], journal: str, backend: BackendSpec,
            config: SearchConfig | None = None, progress: ProfileProgress | None = None
            ) -> list[SearchResult]:
    """Measure the partitions ``keys`` (every setting unless ``config`` says otherwise)."""
    from kareus.gpu.distributed import torchrun_group  # torch only where a GPU profiles

    cfg = config or SearchConfig(strategy="exhaustive")
    ps = PartitionSet.from_job(job)
    parts = [ps[k] for k in keys]
    backend.check(job)
    with torchrun_group() as group:
        for p in parts:
            if group.world_size > 1 and p.collective.group_size != group.world_size:
                raise KareusError(f"{p.key} runs over {p.collective.group_size} GPUs; launch "
                                  f"torchrun with --nproc-per-node {p.collective.group_size}")
        spec = replace(backend, gpu_index=group.local_rank) if backend.name == "nvml" else (
            backend)
        results = []
        with Journal(journal) as store, open_backend(job, spec, group.collectives) as be:
            jid = store.register_job(job)
            freqs = job.freqs_mhz if spec.allow_clock_changes or spec.name != "nvml" else (
                _current_clock(be),)
            for p in parts:
                report = (lambda d, n, k=p.key: progress(k, d, n)) if progress else None
                results.append(run_search(p, be, freqs, cfg, store, jid, progress=report,
                                          record=group.rank == 0))
        return results


def _current_clock(backend: object) -> int:
    from kareus.backends.nvml import NvmlBackend

    assert isinstance(backend, NvmlBackend)
    return backend.device.current_sm_clock_mhz()
