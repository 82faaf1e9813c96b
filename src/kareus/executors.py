"""Searching many partitions at once: a local process pool (default) or Ray tasks.

A task carries only plain data (the job as JSON, the partition key, the search settings,
the backend spec, the journal path); each worker rebuilds the job, its backend and its
own journal connection, and returns its SearchResult as a dict, turned back into a
SearchResult here. Emulator noise depends on (seed, setting), not on call order, and
each search is seeded, so the results are identical whichever executor runs them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from kareus.backends.factory import BackendSpec, open_backend, open_prior
from kareus.errors import KareusError, SpecError
from kareus.partition import PartitionSet
from kareus.search.loop import SearchConfig, SearchResult, run_search
from kareus.search.surrogate import SurrogateConfig
from kareus.spec import JobSpec, validate_job
from kareus.store import Journal

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class ExecutorSpec:
    """Where searches run: ``local`` (a process pool of ``workers``) or ``ray``."""

    name: str = "local"
    workers: int | None = None
    ray_address: str | None = None

    def check(self) -> None:
        if self.name not in EXECUTORS:
            raise SpecError(f"unknown executor {self.name!r}; known: {', '.join(EXECUTORS)}")
        if self.workers is not None and self.workers < 1:
            raise SpecError(f"--workers must be at least 1, got {self.workers}")


@dataclass(frozen=True)
class SearchTask:
    """One partition's search, as plain data."""

    job: dict[str, Any]
    partition: str
    config: dict[str, Any]
    backend: dict[str, Any] = field(default_factory=lambda: BackendSpec().to_dict())
    journal: str | None = None
    prior: str | None = None
    """"emulator": the nominal emulator's predictions inform the search."""

    @property
    def runs_on_gpu(self) -> bool:
        return self.backend.get("name") == "nvml"


def make_task(job: JobSpec, partition: str, config: SearchConfig,
              backend: BackendSpec | None = None, journal: str | None = None,
              prior: str | None = None) -> SearchTask:
    return SearchTask(job=job.model_dump(mode="json"), partition=partition,
                      config=asdict(config), backend=(backend or BackendSpec()).to_dict(),
                      journal=journal, prior=prior)


def _config(doc: dict[str, Any]) -> SearchConfig:
    cfg = dict(doc)
    cfg["surrogate"] = SurrogateConfig(**cfg.get("surrogate", {}))
    cfg["shares"] = tuple(cfg["shares"])
    return SearchConfig(**cfg)


def run_task(task: SearchTask, progress: Callable[[int, int], None] | None = None
             ) -> SearchResult:
    """Run one partition's search."""
    job = validate_job(task.job)
    ps = PartitionSet.from_job(job)
    prior = open_prior(task.prior, job)
    config = _config(task.config)
    journal = Journal(task.journal) if task.journal else None
    try:
        jid = journal.register_job(job) if journal is not None else ""
        with open_backend(job, BackendSpec.from_dict(task.backend)) as backend:
            return run_search(ps[task.partition], backend, job.freqs_mhz, config, journal,
                              jid, prior, progress)
    finally:
        if journal is not None:
            journal.close()


def _run_task_as_dict(task: SearchTask) -> dict[str, Any]:
    return run_task(task).to_dict()


# Workers report progress through a queue the parent polls.
_QUEUE = None


def _init_worker(queue) -> None:
    global _QUEUE
    _QUEUE = queue


def _run_in_worker(task: SearchTask) -> dict[str, Any]:
    queue = _QUEUE

    def report(done: int, total: int) -> None:
        if queue is not None:
            queue.put((task.partition, done, total))

    return run_task(task, report).to_dict()


TaskProgress = Callable[[str, int, int], None]
"""progress(partition key, samples so far, budget)."""


def run_tasks(tasks: list[SearchTask], executor: ExecutorSpec | None = None,
              progress: TaskProgress | None = None) -> list[SearchResult]:
    """Run every task; results in the order of ``tasks``."""
    ex = executor or ExecutorSpec()
    ex.check()
    if ex.name == "ray":
        return _run_ray(tasks, ex.ray_address, progress)
    # one GPU measures one partition at a time: real-GPU searches run in this process
    if len(tasks) == 1 or ex.workers == 1 or any(t.runs_on_gpu for t in tasks):
        return [run_task(t, _for_key(progress, t.partition)) for t in tasks]
    return _run_pool(tasks, ex.workers or min(len(tasks), os.cpu_count() or 1), progress)


def _for_key(progress: TaskProgress | None, key: str) -> Callable[[int, int], None] | None:
    if progress is None:
        return None
    return lambda done, total: progress(key, done, total)


def _run_pool(tasks: list[SearchTask], workers: int, progress: TaskProgress | None
              ) -> list[SearchResult]:
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # no forked copies of XGBoost or SQLite state
    manager = ctx.Manager()
    q = manager.Queue()
    results: dict[int, SearchResult] = {}
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                 initializer=_init_worker, initargs=(q,)) as pool:
            futures = {pool.submit(_run_in_worker, t): i for i, t in enumerate(tasks)}
            pending = set(futures)
            while pending:
                done = {f for f in pending if f.done()}
                for f in done:
                    try:
                        results[futures[f]] = SearchResult.from_dict(f.result())
                    except BaseException:
                        # one search failed: do not start the others, report at once
                        pool.shutdown(wait=False, cancel_futures=True)
                        raise
                pending -= done
                try:
                    while True:
                        key, d, n = q.get(timeout=0.05)
                        if progress is not None:
                            progress(key, d, n)
                except queue_mod.Empty:
                    pass
    finally:
        manager.shutdown()
    return [results[i] for i in range(len(tasks))]


def _run_ray(tasks: list[SearchTask], address: str | None, progress: TaskProgress | None
             ) -> list[SearchResult]:
    try:
        import ray
    except ImportError:
        raise KareusError("the ray executor needs Ray: pip install 'kareus[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False,
                     include_dashboard=False, logging_level=logging.ERROR)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise KareusError(f"cannot reach the Ray cluster: {exc}") from None
    try:
        remote = ray.remote(_run_task_as_dict)
        refs = [remote.remote(t) for t in tasks]
        index = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, SearchResult] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = index[ref]
                results[i] = SearchResult.from_dict(ray.get(ref))
                if progress is not None:
                    n = len(results[i].samples)
                    progress(tasks[i].partition, n, n)
        return [results[i] for i in range(len(tasks))]
    finally:
        if started_here:
            ray.shutdown()
