"""Searching many partitions at once: a local process pool (default) or Ray tasks.

A task carries only plain data (kareus.profiling.tasks); a worker process builds its
workload, backend and journal connection, and returns its SearchResult as a dict, turned
back into a SearchResult here. Tasks run in this process use the workload already built
and open each backend once. Emulator noise depends on (seed, setting),
not on call order, and each search is seeded, so the results are identical whichever
executor runs them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.backends.registry import (
    BackendSpec,
    check_prior,
)
from kareus.core.lock import Lock
from kareus.errors import KareusError, SpecError
from kareus.profiling.tasks import OpenedTasks, SearchTask, make_tasks, run_task
from kareus.ray_support import ray_session
from kareus.search.loop import SearchConfig, SearchResult
from kareus.store import (
    JournalError,
    journal_exists,
    journal_lock_file,
    recognise,
)
from kareus.workload.workload import Workload

EXECUTORS = ("local", "ray")
MAX_WORKERS = 1024
"""Local processes: a pool starts all of its workers at once (issue 34: --workers 10^8
tried to), and one machine has at most a few hundred CPUs."""


@dataclass(frozen=True)
class ExecutorSpec:
    """Where searches run: ``local`` (a process pool of ``workers``) or ``ray``."""

    name: str = "local"
    workers: int | None = None
    ray_address: str | None = None
    ray_timeout_s: float = 30.0
    """How long to try reaching the Ray cluster before one clear error."""

    @property
    def distributed(self) -> bool:
        """Work runs on a Ray cluster rather than in local processes."""
        return self.name == "ray"

    def check(self) -> None:
        """Bad settings, and an unreachable Ray cluster, fail here: before any work starts
        and before anything is written."""
        if self.name not in EXECUTORS:
            raise SpecError(f"unknown executor {self.name!r}; known: {', '.join(EXECUTORS)}")
        if self.workers is not None and self.workers < 1:
            raise SpecError(f"--workers must be at least 1, got {self.workers}")
        if self.workers is not None and self.workers > MAX_WORKERS:
            raise SpecError(f"--workers {self.workers} is over Kareus's limit of "
                            f"{MAX_WORKERS:,}")
        if self.ray_timeout_s <= 0:
            raise SpecError(f"--ray-timeout must be positive, got {self.ray_timeout_s}")
        if self.name == "ray" and self.ray_address not in (None, "auto", "local"):
            _probe(self.ray_address, self.ray_timeout_s)


def _probe(address: str, timeout_s: float) -> None:
    """Reach the cluster's address (GCS "host:port" or Ray Client "ray://host:port") with
    a plain TCP connection: Ray's own client retries an unreachable address for minutes."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise SpecError(f"--ray-address must be host:port or ray://host:port, got {address!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as exc:
            if time.monotonic() + 1.0 > deadline:
                raise KareusError(f"cannot reach the Ray cluster at {address} within "
                                  f"{timeout_s:g} s: {exc}") from None
            time.sleep(1.0)


def _run_task_as_dict(task: SearchTask) -> dict[str, Any]:
    return run_task(task).to_dict()


# Workers report progress through a queue the parent polls.
_QUEUE: Any = None

_PARENT_POLL_S = 0.5


_OPENED: OpenedTasks | None = None
"""A worker's backends, opened once for its tasks. Never closed: the pool ends its
workers, and every measurement was committed as it was taken."""


def _init_worker(queue: Any, parent_pid: int) -> None:
    global _QUEUE, _OPENED
    _QUEUE = queue
    _OPENED = OpenedTasks()
    # A worker dies with its parent, SIGKILL of the parent included: a daemon thread polls
    # the parent and ends this process when it is gone (no parent-death signal is used:
    # on Linux it fires when the spawning *thread* exits, not the process). A journal row
    # is one committed transaction, so an exit never leaves a partial row.
    threading.Thread(target=_exit_with, args=(parent_pid,), daemon=True).start()


def _exit_with(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _run_in_worker(task: SearchTask) -> dict[str, Any]:
    queue = _QUEUE

    def report(done: int, total: int) -> None:
        if queue is not None:
            queue.put((task.partition, done, total))

    if _OPENED is None:
        return run_task(task, report).to_dict()
    return _OPENED.run(task, report).to_dict()


TaskProgress = Callable[[str, int, int], None]
"""progress(partition key, samples so far, budget)."""


def run_tasks(tasks: list[SearchTask], executor: ExecutorSpec | None = None,
              progress: TaskProgress | None = None, workload: Workload | None = None
              ) -> list[SearchResult]:
    """Run every task; results in the order of ``tasks``. ``workload``: the tasks' own,
    for those run in this process."""
    ex = executor or ExecutorSpec()
    ex.check()
    if ex.distributed:
        return _run_ray(tasks, ex.ray_address, progress)
    # one GPU measures one partition at a time: real-GPU searches run in this process
    if len(tasks) == 1 or ex.workers == 1 or any(t.runs_on_gpu for t in tasks):
        with OpenedTasks() as opened:  # each backend opened once for the tasks it measures
            return [opened.run(t, _for_key(progress, t.partition), workload) for t in tasks]
    # never more processes than tasks: a pool starts all of its workers at once
    return _run_pool(tasks, min(len(tasks), ex.workers or os.cpu_count() or 1), progress)


def _for_key(progress: TaskProgress | None, key: str) -> Callable[[int, int], None] | None:
    if progress is None:
        return None
    return lambda done, total: progress(key, done, total)


def _run_pool(tasks: list[SearchTask], workers: int, progress: TaskProgress | None
              ) -> list[SearchResult]:
    """A pool of spawned processes (no forked copies of XGBoost or SQLite state). Leaving
    the pool's block terminates its workers whatever happened: a failed search, Ctrl-C or
    SIGTERM stops the others at once instead of waiting for them to finish."""
    q = mp.get_context("spawn").Queue()
    results: dict[int, SearchResult] = {}
    with contextlib.ExitStack() as stack:
        pool = spawn_pool(stack, workers, _init_worker, (q, os.getpid()))
        pending = {i: pool.apply_async(_run_in_worker, (t,)) for i, t in enumerate(tasks)}
        while pending:
            for i in [i for i, r in pending.items() if r.ready()]:
                results[i] = SearchResult.from_dict(pending.pop(i).get())  # raises its error
            _drain(q, progress, timeout_s=0.05)
        _drain(q, progress, timeout_s=0.0)
    return [results[i] for i in range(len(tasks))]


def spawn_pool(stack: contextlib.ExitStack, workers: int,
               initializer: Callable[..., object] | None = None,
               initargs: tuple[Any, ...] = ()) -> Any:
    """A pool of ``workers`` spawned processes, entered into ``stack`` (leaving it
    terminates them), started with SIGINT blocked (`_sigint_deferred`): Ctrl-C is answered
    by this process alone, which then stops them. A Ctrl-C during the start is raised
    once the pool is in ``stack``."""
    with _sigint_deferred():
        return stack.enter_context(mp.get_context("spawn").Pool(
            workers, initializer=initializer, initargs=initargs))


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """SIGINT held off meanwhile, then raised as KeyboardInterrupt if it came.

    The signal is blocked in this thread: processes started in the block inherit the mask
    through exec and Python never unblocks it, so Ctrl-C, which the terminal sends to the
    whole process group, reaches only the parent, which stops the pool (without it a
    worker still importing printed its own KeyboardInterrupt traceback: issue 21). Another
    thread of this process (rich's refresh thread) may still take the signal, so a Python
    handler records it instead of raising in the middle of the pool's start."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    handler = signal.signal(signal.SIGINT, lambda signum, _frame: came.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending one: recorded
        signal.signal(signal.SIGINT, handler)
    if came:  # what this process does on Ctrl-C, now
        if callable(handler):
            handler(signal.SIGINT, None)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


def _drain(q: Any, progress: TaskProgress | None, timeout_s: float) -> None:
    try:
        while True:
            key, done, total = q.get(timeout=timeout_s) if timeout_s else q.get_nowait()
            if progress is not None:
                progress(key, done, total)
    except queue_mod.Empty:
        pass


def _run_ray(tasks: list[SearchTask], address: str | None, progress: TaskProgress | None
             ) -> list[SearchResult]:
    with ray_session(address) as ray:
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


@dataclass
class SearchRun:
    """`kareus search`'s tasks, checked, with the journal's lock held for the run."""

    tasks: list[SearchTask]
    lock: Lock | None = None

    def run(self, executor: ExecutorSpec, progress: TaskProgress | None = None,
            workload: Workload | None = None) -> list[SearchResult]:
        """Every task (`run_tasks`); the journal's lock is released at the end."""
        try:
            return run_tasks(self.tasks, executor, progress, workload)
        finally:
            if self.lock is not None:
                self.lock.release()


def prepare_search(workload: Workload, keys: Sequence[str] | None, config: SearchConfig,
                   backend: BackendSpec, executor: ExecutorSpec,
                   journal: str | None = None, prior: str | None = None) -> SearchRun:
    """`kareus search`'s tasks: every partition of ``keys`` (default: all). Unknown keys,
    bad settings, an unknown prior and an unreadable journal fail here, before any work
    starts, before any progress is shown and before anything is created; then the journal
    is locked for the run (`journal_lock`: one writer at a time)."""
    chosen = list(keys or workload.keys)
    if not chosen:
        raise SpecError(f"nothing to search: {workload.partitions.none_reason}")
    check_prior(prior)
    with_prior = prior not in (None, "none")
    for key in chosen:
        config.check(workload[key].knob_space_size(len(workload.job.freqs_mhz)), with_prior)
    backend.check(workload.job)
    executor.check()
    if journal is None:
        return SearchRun(make_tasks(workload, chosen, config, backend, None,
                                    prior if with_prior else None))
    check_journal(journal)
    held = journal_lock(journal)
    try:
        return SearchRun(make_tasks(workload, chosen, config, backend, journal,
                                    prior if with_prior else None), held)
    except BaseException:
        held.release()
        raise


def check_journal(journal: str) -> None:
    """A journal that exists must be one (`recognise`: read, nothing written; an empty
    file or another application's database is refused); one that does not is made by the
    run, in a directory that must exist and be writable. Nothing is created here."""
    path = Path(journal)
    if journal_exists(path):
        recognise(path)
        return
    path = Path(os.path.realpath(path))  # a link is made where it leads
    parent = path.parent
    if not parent.is_dir():
        raise JournalError(f"cannot create journal {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise JournalError(f"cannot create journal {path}: {parent} is not writable")


def journal_lock(journal: str) -> Lock:
    """The journal locked for one writer (`kareus profile`, or `kareus optimize` writing
    the result directory it lies in): another one is refused, naming its PID. The lock
    is the file's a link leads to (`journal_lock_file`): two names, one lock."""
    return Lock.take(journal_lock_file(journal), f"journal {journal}")


def search_partitions(workload: Workload, keys: Sequence[str] | None, config: SearchConfig,
                      backend: BackendSpec, executor: ExecutorSpec,
                      journal: str | None = None, prior: str | None = None,
                      progress: TaskProgress | None = None) -> list[SearchResult]:
    """`prepare_search`, then every search, journal first (``journal``, or one in memory
    per search)."""
    return prepare_search(workload, keys, config, backend, executor, journal, prior).run(
        executor, progress, workload)
