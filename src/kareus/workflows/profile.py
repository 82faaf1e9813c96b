"""`kareus profile`: measure everything composition needs, journal first.

1. The partitions, through the search loop (MBO by default; exhaustive on request).
2. Every other number composing the iteration takes, per clock of the search list: each
   instruction's fixed steps (ops outside partitions, the solo first segment, the exposed
   last collective, embedding and LM head with the loss, forward and backward), the
   sequential Megatron-LM execution the baselines use, the default-overlap settings of the
   Nanobatching baselines, the pipeline send/receive and the data-parallel sync. These are
   found by a dry run of the composition itself (`Composer.ask_all` on a journal that
   answers placeholders), so the list is exactly what `kareus optimize --measurements`
   will ask for, and nothing is measured twice.

Under torchrun every rank of the TP/CP group runs the kernels and the collective in
lockstep, every rank decides on rank 0's numbers (`AgreedBackend`), and rank 0 journals.
On one process the collective is a single-GPU stand-in. Without ``allow_clock_changes``
no clock is touched: the job's one clock (``--freqs``) must be the one the GPU runs at,
and a measurement at another is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kareus.backends.agreed import AgreedBackend
from kareus.backends.base import Backend
from kareus.backends.factory import BackendSpec, open_backend
from kareus.backends.journaled import JournaledBackend
from kareus.backends.needs import Need
from kareus.compose.options import Composer, key_frontiers
from kareus.errors import KareusError
from kareus.job.spec import JobSpec
from kareus.plans.methods import all_methods
from kareus.search.loop import SearchConfig, SearchResult, run_search
from kareus.store import Journal, JournalLike
from kareus.workload.partition import PartitionSet

ProfileProgress = Callable[[str, int, int], None]
"""progress(partition key or COMPOSITION, done, total)."""

COMPOSITION = "composition steps"
"""The progress label of the measurements outside partitions."""


@dataclass
class ProfileResult:
    searches: list[SearchResult]
    composition_needed: int = 0
    """Measurements outside the searches that composition uses (0: not profiled)."""
    composition_measured: int = 0
    """Of those, measured by this run (the others were in the journal)."""
    identity: str = ""
    """The measuring backend's identity: its measurements' key in the journal."""

    def to_dict(self) -> dict[str, Any]:
        return {"searches": [s.to_dict() for s in self.searches],
                "composition_needed": self.composition_needed,
                "composition_measured": self.composition_measured,
                "backend": self.identity}


def profile(job: JobSpec, journal: str, backend: BackendSpec,
            config: SearchConfig | None = None, keys: Sequence[str] | None = None,
            progress: ProfileProgress | None = None, composition: bool = True
            ) -> ProfileResult:
    """Profile the partitions ``keys`` (default: all) and, with ``composition``, every
    number composing the job's iteration needs."""
    from kareus.gpu.distributed import torchrun_group  # torch only where a group runs

    cfg = config or SearchConfig()
    ps = PartitionSet.from_job(job)
    parts = [ps[k] for k in (keys or ps.keys)]
    backend.check(job)
    with torchrun_group() as group:
        for p in parts:
            if group.world_size > 1 and p.collective.group_size != group.world_size:
                raise KareusError(f"{p.key} runs over {p.collective.group_size} GPUs; launch "
                                  f"torchrun with --nproc-per-node {p.collective.group_size}")
        spec = backend
        if backend.name in ("nvml", "fakegpu"):
            several = group.world_size > 1
            spec = replace(backend,
                           gpu_index=group.local_rank if several else backend.gpu_index,
                           torch_device=backend.torch_device or (
                               group.device if several else None))
        record = group.rank == 0
        with Journal(journal) as store, open_backend(
                job, spec, group.collectives, group.agree) as raw:
            be: Backend = AgreedBackend(raw, group.agree) if group.world_size > 1 else raw
            jid = store.register_job(job)
            # without clock changes the job's one clock (BackendSpec.check): the nvml
            # backend refuses to measure while the GPU runs another
            freqs = job.freqs_mhz
            searches = []
            for p in parts:
                report = (lambda d, n, k=p.key: progress(k, d, n)) if progress else None
                searches.append(run_search(
                    p, be, freqs, cfg, store, jid, progress=report, record=record,
                    agree=group.agree if group.world_size > 1 else None))
            result = ProfileResult(searches, identity=be.identity())
            if composition:
                group.agree(True)  # every rank reads the journal after rank 0's last write
                needed, measured = measure_composition(
                    ps, be, store, jid, freqs, record,
                    (lambda d, n: progress(COMPOSITION, d, n)) if progress else None)
                result.composition_needed, result.composition_measured = needed, measured
        return result


def composition_needs(ps: PartitionSet, backend: Backend, journal: JournalLike, jid: str,
                      freqs_mhz: tuple[int, ...]) -> list[Need]:
    """What composing every method from ``journal``'s partition measurements asks of
    ``backend`` and the journal lacks (a dry run: nothing is measured)."""
    dry = JournaledBackend(backend, journal, jid, dry_run=True)
    Composer(ps, dry, freqs_mhz).ask_all(all_methods(), journal_frontiers(
        ps, journal, jid, backend.identity()))
    return dry.missing


def journal_frontiers(ps: PartitionSet, journal: JournalLike, jid: str, identity: str
                      ) -> dict[str, dict[int, list[Any]]]:
    """Each partition's per-clock fronts from every setting ``journal`` holds of it."""
    return key_frontiers({k: [(s.knobs, s.measurement)
                              for s in journal.samples(jid, k, identity)]
                          for k in ps.keys})


def measure_composition(ps: PartitionSet, be: Backend, journal: JournalLike, jid: str,
                        freqs: tuple[int, ...], record: bool,
                        report: Callable[[int, int], None] | None = None
                        ) -> tuple[int, int]:
    """Measure what `composition_needs` lists, journaling each number (``record``: this
    rank writes); ``report(done, total)`` after each. Returns (needed, measured)."""
    todo = len(composition_needs(ps, be, journal, jid, freqs))
    done = 0

    def tick(_need: Need) -> None:
        nonlocal done
        done += 1
        if report is not None:
            report(done, todo)

    if report is not None:
        report(0, todo)
    real = JournaledBackend(be, journal, jid, record=record, on_measured=tick)
    Composer(ps, real, freqs).ask_all(all_methods(), journal_frontiers(
        ps, journal, jid, be.identity()))
    return todo, real.measured
