"""`kareus profile --executor ray`: each partition's TP/CP group profiled on a Ray cluster.

A partition is a unit: a STRICT_PACK placement group (one node) with a bundle per rank
(``{"GPU": 1, "CPU": 1}``, or ``{"CPU": 1}`` off GPUs), an actor per bundle; the actors set
up their own process group and search as `kareus.profiling.profile.profile` does under torchrun.
Units run in parallel as resources allow. The journal stays on the driver: ranks read a
snapshot (`ProxyJournal`) and send writes to a queue the driver drains and commits as it
waits (what a rank runs: `kareus.profiling.ray_rank`). A unit whose actor or node dies,
or that is not placed in time, is retried from a fresh snapshot: it measures only what is
not journaled yet. Then the steps outside
partitions run as one more unit on the job's largest TP/CP group (collectives need the group;
the driver need not have GPUs). Emulator and replay units have one rank each.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kareus.backends.registry import BackendSpec, check_prior
from kareus.core import MeasurementProtocol
from kareus.errors import KareusError, SpecError
from kareus.job.spec import JobSpec
from kareus.profiling.cost import StepsOutcome
from kareus.profiling.executors import ExecutorSpec
from kareus.profiling.profile import COMPOSITION, ProfileProgress, ProfileResult, check_profile
from kareus.profiling.ray_rank import ProxyJournal, RankActor, RankTask
from kareus.profiling.step_fit import FitPolicy
from kareus.ray_support import ray_session
from kareus.search.loop import SearchConfig, SearchResult
from kareus.store import Journal
from kareus.workload.workload import Workload

DIE_ENV = "KAREUS_TEST_RAY_DIE"
"""Test hook, read by the driver: ``KEY:RANK:N`` makes rank RANK of unit KEY exit after N
measurements, on the unit's first attempt only (a node dying mid-search)."""


def profile_ray(job: JobSpec | Workload, journal: str, backend: BackendSpec,
                config: SearchConfig | None = None, keys: Sequence[str] | None = None,
                progress: ProfileProgress | None = None, composition: bool = True,
                executor: ExecutorSpec | None = None, retries: int = 2,
                placement_timeout_s: float = 600.0, checked: bool = False,
                policy: FitPolicy | None = None, prior: str | None = None) -> ProfileResult:
    """`kareus.profiling.profile.profile` with each partition's TP/CP group a unit of work on
    the Ray cluster at ``executor.ray_address`` (default: a local Ray), units in parallel;
    the journal is written here only. A unit whose node dies is retried up to ``retries``
    times, reusing what it journaled before. ``checked``: the caller checked the inputs;
    ``prior``: as profile's, opened on each rank."""
    cfg = config or SearchConfig.profiling(prior is not None)
    workload = job if isinstance(job, Workload) else Workload.build(job)
    ex = executor or ExecutorSpec("ray")
    if checked:
        keys = list(keys or workload.keys)
    else:
        if retries < 0:
            raise SpecError(f"--ray-retries must be >= 0, got {retries}")
        check_prior(prior)
        # the driver need not have a GPU: a real GPU is checked where it opens, on a rank
        keys = check_profile(workload, backend, cfg, keys, False, prior is not None)
        ex.check()
    one = not backend.capabilities.process_per_gpu  # one rank a unit
    size_of = {k: 1 if one else workload[k].collective.group_size for k in workload.keys}
    with ray_session(ex.ray_address) as ray, Journal(journal) as store:
        driver = _Driver(ray, store, workload, backend, cfg, progress, retries,
                         placement_timeout_s, policy or FitPolicy(), prior)
        try:
            docs = driver.run_all([_Unit(k, size_of[k]) for k in keys])
            result = ProfileResult([SearchResult.from_dict(docs[k]) for k in keys])
            if composition:
                size = max(size_of.values())
                doc = driver.run_all([_Unit(COMPOSITION, size)])[COMPOSITION]
                result.steps = StepsOutcome.from_dict(doc)
                result.identity = str(doc.get("backend", ""))
            driver.drain()
            cost = result.summarise(workload, backend.protocol or MeasurementProtocol(),
                                    parallel_groups=max(1, len(keys)))
            store.record_profile_run(driver.jid, result.identity or backend.name,
                                     cost.to_dict())
        finally:
            driver.drain()
            ray.kill(driver.queue.actor)
        return result


@dataclass
class _Unit:
    key: str
    size: int
    attempt: int = 0
    pg: Any = None
    ready: Any = None
    since: float = 0.0
    actors: list[Any] = field(default_factory=list)
    refs: list[Any] = field(default_factory=list)


class _Driver:
    """Starts units, journals what their ranks send, retries units that died."""

    def __init__(self, ray: Any, store: Journal, workload: Workload, backend: BackendSpec,
                 config: SearchConfig, progress: ProfileProgress | None, retries: int,
                 placement_timeout_s: float, policy: FitPolicy, prior: str | None) -> None:
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.ray, self.store, self.backend, self.config = ray, store, backend, config
        self.policy, self.prior = policy, prior
        self.job, self.jid = workload.to_job_dict(), store.register_job(workload.job)
        self.progress, self.retries, self.timeout_s = progress, retries, placement_timeout_s
        self.gpu = backend.capabilities.real_gpu
        self.actor = ray.remote(RankActor)
        here = ray.get_runtime_context().get_node_id()  # the queue dies only with us
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy":
                                          NodeAffinitySchedulingStrategy(here, soft=False)})
        self.last_end = time.monotonic()
        x = ray.exceptions
        self.death = (x.RayActorError, x.NodeDiedError, x.WorkerCrashedError,
                      x.ObjectLostError, x.ActorPlacementGroupRemoved)

    def run_all(self, units: list[_Unit]) -> dict[str, dict[str, Any]]:
        """Run ``units`` to the end; rank 0's result of each."""
        done: dict[str, dict[str, Any]] = {}
        live = list(units)
        try:
            for u in live:
                self._start(u)
            while live:
                refs = [r for u in live for r in u.refs]
                self.ray.wait(refs, num_returns=len(refs), timeout=0.2)
                self.drain()
                for u in list(live):
                    if (doc := self._poll(u)) is not None:
                        done[u.key] = doc
                        live.remove(u)
                        self._stop(u)
        finally:
            for u in live:
                self._stop(u)
        return done

    def drain(self) -> None:
        """Journal (committed) what the ranks sent so far; report their progress."""
        while n := self.queue.size():
            for kind, *rest in self.queue.get_nowait_batch(n):
                act: Any = {
                    "backend": self.store.register_backend, "record": self.store.record,
                    "ops": self.store.record_ops,
                    "fitted": self.store.record_fitted}.get(kind, self.progress)
                if act is not None:
                    act(*rest)

    def _start(self, u: _Unit) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as In

        bundle = {"GPU": 1, "CPU": 1} if self.gpu else {"CPU": 1}
        u.pg = placement_group([dict(bundle) for _ in range(u.size)], strategy="STRICT_PACK")
        u.ready, u.since = u.pg.ready(), time.monotonic()
        u.actors = [self.actor.options(num_cpus=1, num_gpus=int(self.gpu), max_restarts=0,
                                       scheduling_strategy=In(u.pg, placement_group_bundle_index=i)
                                       ).remote() for i in range(u.size)]
        address = u.actors[0].address.remote()
        ids = self.store.identities(self.jid)  # (one that measured nothing: no reuse)
        hook = os.environ.get(DIE_ENV, "::").rsplit(":", 2)  # [key, rank, after]
        snap = self.ray.put(ProxyJournal.snapshot(self.store, self.jid, ids,
                                                  None if u.key == COMPOSITION else u.key))
        u.refs = [a.run.remote(address, snap, RankTask(
            self.job, u.key, r, u.size, self.backend, self.config, self.queue,
            int(hook[2]) if hook[:2] == [u.key, str(r)] and not u.attempt else None,
            self.policy, self.prior))
            for r, a in enumerate(u.actors)]

    def _poll(self, u: _Unit) -> dict[str, Any] | None:
        """Rank 0's result once every rank ended; None while it runs (or was restarted)."""
        ready, _ = self.ray.wait(u.refs, num_returns=len(u.refs), timeout=0)
        if not ready:
            placed, _ = self.ray.wait([u.ready], timeout=0)
            if not placed and time.monotonic() - max(u.since, self.last_end) > self.timeout_s:
                self._retry(u, f"no node hosted {u.size} ranks within {self.timeout_s:g} s")
            return None
        if not self._errors(ready):
            return self.ray.get(u.refs[0]) if len(ready) == len(u.refs) else None
        # a rank failed: give its peers a moment to show whether one of them died
        ready, _ = self.ray.wait(u.refs, num_returns=len(u.refs), timeout=5.0)
        errors = self._errors(ready)
        dead = [e for e in errors if isinstance(e, self.death)]
        if dead:
            self._retry(u, str(dead[0]).splitlines()[0])
            return None
        self._stop(u)
        cause = getattr(errors[0], "cause", None)
        if isinstance(cause, KareusError):  # a user error on a rank: its own one line
            raise KareusError(f"profiling {u.key}: {cause}") from None
        raise KareusError(f"profiling {u.key} failed: {errors[0]}") from errors[0]

    def _errors(self, refs: list[Any]) -> list[BaseException]:
        errors = []
        for ref in refs:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:
                errors.append(exc)
        return errors

    def _retry(self, u: _Unit, why: str) -> None:
        self._stop(u)
        u.attempt += 1
        if u.attempt > self.retries:
            raise KareusError(f"profiling {u.key} failed {u.attempt} times; last: {why}")
        logging.getLogger(__name__).warning("profiling %s: %s; retry %d of %d", u.key, why,
                                            u.attempt, self.retries)
        self.drain()  # the retry's snapshot holds what the failed attempt journaled
        self._start(u)

    def _stop(self, u: _Unit) -> None:
        from ray.util.placement_group import remove_placement_group

        for a in u.actors:
            self.ray.kill(a, no_restart=True)
        if u.pg is not None:
            remove_placement_group(u.pg)
        u.pg, u.ready, u.actors, u.refs = None, None, [], []
        self.last_end = time.monotonic()
