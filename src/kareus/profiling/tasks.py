"""A partition's search as plain data (`SearchTask`: the job as JSON, the partition key,
the search settings, the backend spec, the journal path), so that it crosses process
boundaries (a pool's workers, Ray tasks), and how a process runs such tasks: each backend
opened once for the tasks that share it, through the one factory
(kareus.backends.measuring), journal first.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kareus.backends.base import CostModel
from kareus.backends.journaled import JournaledBackend
from kareus.backends.measuring import open_measuring
from kareus.backends.registry import BackendSpec, default_spec, open_prior, spec_from_dict
from kareus.job.spec import JobSpec
from kareus.search.loop import SearchConfig, SearchResult, run_search
from kareus.store import Journal
from kareus.workload.workload import Workload


@dataclass(frozen=True)
class SearchTask:
    """One partition's search, as plain data."""

    job: dict[str, Any]
    partition: str
    config: dict[str, Any]
    backend: dict[str, Any] = field(default_factory=lambda: default_spec().to_dict())
    journal: str | None = None
    prior: str | None = None
    """"emulator": the nominal emulator's predictions inform the search."""
    job_id: str = ""
    """The job's id in the journal (`kareus.store.job_id`), computed and registered once
    for all tasks (`make_tasks`); empty: the worker registers the job itself."""

    @property
    def runs_on_gpu(self) -> bool:
        """One GPU measures one partition at a time: such searches run in this process."""
        return spec_from_dict(self.backend).capabilities.real_gpu


def make_task(job: JobSpec | Workload, partition: str, config: SearchConfig,
              backend: BackendSpec | None = None, journal: str | None = None,
              prior: str | None = None) -> SearchTask:
    """One partition's search as plain data (its worker registers the job)."""
    doc = job.to_job_dict() if isinstance(job, Workload) else job.model_dump(mode="json")
    return SearchTask(job=doc, partition=partition,
                      config=asdict(config), backend=(backend or default_spec()).to_dict(),
                      journal=journal, prior=prior)


def make_tasks(workload: Workload, keys: Sequence[str], config: SearchConfig,
               backend: BackendSpec, journal: str | None = None, prior: str | None = None
               ) -> list[SearchTask]:
    """Every partition of ``keys`` as a task; the job is serialised, named and registered
    in ``journal`` (which must open) once, here, for all of them."""
    doc, cfg, spec = workload.to_job_dict(), asdict(config), backend.to_dict()
    jid = workload.job.id
    if journal is not None:
        with Journal(journal) as j:
            j.register_job_doc(jid, doc)
    return [SearchTask(job=doc, partition=key, config=cfg, backend=spec, journal=journal,
                       prior=prior, job_id=jid) for key in keys]


def _config(doc: dict[str, Any]) -> SearchConfig:
    return SearchConfig.from_dict(doc)


def run_task(task: SearchTask, progress: Callable[[int, int], None] | None = None,
             workload: Workload | None = None) -> SearchResult:
    """Run one partition's search (``workload``: the task's, already built here), journal
    first: through the task's journal, or one in memory."""
    with OpenedTasks() as opened:
        return opened.run(task, progress, workload)


class OpenedTasks(contextlib.ExitStack):
    """What the searches run in one process measure through, opened once for the tasks
    that share it (the job, the backend spec, the journal, the prior): the backend through
    the factory (kareus.backends.measuring), and the prior's cost model."""

    def __init__(self) -> None:
        super().__init__()
        self._open: dict[str, tuple[Workload, JournaledBackend, CostModel | None]] = {}

    def run(self, task: SearchTask, progress: Callable[[int, int], None] | None = None,
            workload: Workload | None = None) -> SearchResult:
        key = json.dumps([task.job, task.backend, task.journal, task.prior, task.job_id],
                         sort_keys=True)
        hit = self._open.get(key)
        if hit is None:
            wl = workload or Workload.from_job_dict(task.job)
            prior = open_prior(task.prior, wl.job) if task.prior else None
            measured = self.enter_context(open_measuring(
                spec_from_dict(task.backend), wl, task.journal or ":memory:",
                jid=task.job_id or None))
            hit = self._open[key] = (wl, measured, prior)
        wl, measured, prior = hit
        return run_search(wl[task.partition], measured, wl.job.freqs_mhz,
                          _config(task.config), prior, progress)
