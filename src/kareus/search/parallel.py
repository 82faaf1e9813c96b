"""Searching many partitions at once: a local process pool (default) or Ray tasks.

A task carries only plain data (the job as JSON, the partition key, the search settings,
the backend settings, the journal path); each worker rebuilds the job, its backend and its
own journal connection. Emulator noise depends on (seed, setting), not on call order, and
each search is seeded, so the results are identical whichever executor runs them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from kareus.errors import KareusError, SpecError

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class SearchTask:
    job: dict
    partition: str
    config: dict
    backend: str = "emulator"
    noise: float = 0.0
    seed: int = 0
    calibration: str | None = None
    journal: str | None = None
    allow_clock_changes: bool = False
    gpu_index: int = 0
    prior: str | None = None
    """"emulator": the nominal emulator's predictions inform the search."""


def make_task(job, partition: str, config, **backend_settings) -> SearchTask:
    return SearchTask(job=job.model_dump(mode="json"), partition=partition,
                      config=asdict(config), **backend_settings)


def run_task(task: SearchTask, progress: Callable[[int, int], None] | None = None) -> dict:
    """Run one partition's search; returns the SearchResult as a JSON-ready dict."""
    from kareus.backends.emulator import EmulatorBackend
    from kareus.backends.factory import open_backend
    from kareus.partition import PartitionSet
    from kareus.search.loop import SearchConfig, run_search
    from kareus.search.surrogate import SurrogateConfig
    from kareus.spec import validate_job
    from kareus.store import Journal

    job = validate_job(task.job)
    ps = PartitionSet.from_job(job)
    prior = None
    if task.prior == "emulator":
        prior = EmulatorBackend(job)
    elif task.prior not in (None, "none"):
        raise SpecError(f"unknown prior {task.prior!r}; available: emulator")
    cfg = dict(task.config)
    cfg["surrogate"] = SurrogateConfig(**cfg.get("surrogate", {}))
    cfg["shares"] = tuple(cfg["shares"])
    config = SearchConfig(**cfg)
    journal = Journal(task.journal) if task.journal else None
    try:
        jid = journal.register_job(job) if journal is not None else ""
        with open_backend(job, task.backend, noise=task.noise, seed=task.seed,
                          calibration=task.calibration,
                          allow_clock_changes=task.allow_clock_changes,
                          gpu_index=task.gpu_index) as backend:
            result = run_search(ps[task.partition], backend, job.freqs_mhz, config, journal,
                                jid, prior, progress)
    finally:
        if journal is not None:
            journal.close()
    return result.to_dict()


# Workers report progress through a queue the parent polls.
_QUEUE = None


def _init_worker(queue) -> None:
    global _QUEUE
    _QUEUE = queue


def _run_in_worker(task: SearchTask) -> dict:
    queue = _QUEUE

    def report(done: int, total: int) -> None:
        if queue is not None:
            queue.put((task.partition, done, total))

    return run_task(task, report)


def run_tasks(tasks: list[SearchTask], executor: str = "local", workers: int | None = None,
              ray_address: str | None = None,
              progress: Callable[[str, int, int], None] | None = None) -> list[dict]:
    """Run every task; results in the order of ``tasks``."""
    if executor not in EXECUTORS:
        raise SpecError(f"unknown executor {executor!r}; known: {', '.join(EXECUTORS)}")
    if workers is not None and workers < 1:
        raise SpecError(f"--workers must be at least 1, got {workers}")
    if executor == "ray":
        return _run_ray(tasks, ray_address, progress)
    # one GPU measures one partition at a time: real-GPU searches run in this process
    if len(tasks) == 1 or workers == 1 or any(t.backend != "emulator" for t in tasks):
        return [run_task(t, (lambda d, n, k=t.partition: progress(k, d, n)) if progress
                         else None) for t in tasks]
    return _run_pool(tasks, workers or min(len(tasks), os.cpu_count() or 1), progress)


def _run_pool(tasks, workers, progress) -> list[dict]:
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # no forked copies of XGBoost or SQLite state
    manager = ctx.Manager()
    q = manager.Queue()
    results: dict[int, dict] = {}
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                 initializer=_init_worker, initargs=(q,)) as pool:
            futures = {pool.submit(_run_in_worker, t): i for i, t in enumerate(tasks)}
            pending = set(futures)
            while pending:
                done = {f for f in pending if f.done()}
                for f in done:
                    try:
                        results[futures[f]] = f.result()
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


def _run_ray(tasks, address, progress) -> list[dict]:
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
        remote = ray.remote(run_task)
        refs = [remote.remote(t) for t in tasks]
        index = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, dict] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = index[ref]
                results[i] = ray.get(ref)
                if progress is not None:
                    n = len(results[i]["samples"])
                    progress(tasks[i].partition, n, n)
        return [results[i] for i in range(len(tasks))]
    finally:
        if started_here:
            ray.shutdown()
