"""What one rank of a Ray unit runs (kareus.profiling.ray_driver): the journal as a rank
sees it (`ProxyJournal`: a snapshot to read, a queue to the driver to write), the task it
is given (`RankTask`) and the actor that runs it (`RankActor`) in the unit's own process
group.

The driver side (placement groups, retries, the queue drained into the journal) is
`kareus.profiling.ray_driver`.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from kareus.backends.measuring import JournalPolicy, open_measuring
from kareus.backends.registry import BackendSpec, open_prior
from kareus.core import Knobs, Measurement
from kareus.errors import KareusError
from kareus.profiling.profile import COMPOSITION, measure_composition
from kareus.profiling.step_fit import FitPolicy
from kareus.ray_support import import_ray
from kareus.search.loop import SearchConfig, run_search
from kareus.store import Journal, StoredSample
from kareus.workload.workload import Workload

Parts = dict[str, dict[tuple[str, Knobs], Measurement]]
Ops = dict[str, dict[tuple[str, int, int], Measurement]]


class ProxyJournal:
    """A `JournalLike` away from the journal: reads come from a snapshot (per backend
    identity) and its own writes; writes go to ``sink`` as messages the driver journals."""

    def __init__(self, jid: str, partitions: Parts, ops: Ops) -> None:
        self.jid, self.partitions, self.ops = jid, partitions, ops
        self.sink: Any = None
        """Has ``put(message)`` (a Ray queue); None: a rank that never writes."""

    @classmethod
    def snapshot(cls, journal: Journal, jid: str, identities: Iterable[str],
                 key: str | None) -> ProxyJournal:
        """What ``journal`` holds of partition ``key`` (None: all partitions, and ops)."""
        parts = {i: {k: m for k, m in journal.partition_samples(jid, i).items()
                     if key in (None, k[0])} for i in identities}
        return cls(jid, parts, {i: journal.op_samples(jid, i) for i in parts if not key})

    def _send(self, *msg: Any) -> None:
        if self.sink is None:
            raise KareusError("only rank 0 writes the journal")
        self.sink.put(msg)

    def register_backend(self, identity: str, info: dict[str, object]) -> None:
        self._send("backend", identity, info)

    def record(self, jid: str, partition: str, backend: str, knobs: Knobs, m: Measurement
               ) -> None:
        self._send("record", jid, partition, backend, knobs, m)
        self.partitions.setdefault(backend, {}).setdefault((partition, knobs), m)

    def record_ops(self, jid: str, ops: str, backend: str, freq_mhz: int, sms: int,
                   m: Measurement) -> None:
        self._send("ops", jid, ops, backend, freq_mhz, sms, m)
        self.ops.setdefault(backend, {}).setdefault((ops, freq_mhz, sms), m)

    def record_fitted(self, jid: str, backend: str, kind: str, key: str, knobs: Knobs,
                      m: Measurement, time_rel_error: float, energy_rel_error: float,
                      measured_freqs_mhz: Sequence[int]) -> None:
        self._send("fitted", jid, backend, kind, key, knobs, m, time_rel_error,
                   energy_rel_error, tuple(measured_freqs_mhz))
        if kind == "partition":
            self.partitions.setdefault(backend, {}).setdefault((key, knobs), m)
        else:
            self.ops.setdefault(backend, {}).setdefault((key, knobs.freq_mhz, knobs.sms), m)

    def fitted(self, jid: str, backend: str) -> dict[tuple[str, str, int, int, str | None],
                                                     tuple[float, float]]:
        """None from the snapshot: a rank asks only to know what it answers from the
        journal, and the steps (all that is fitted) are measured by one unit."""
        return {}

    def samples(self, jid: str, partition: str, backend: str) -> list[StoredSample]:
        return [StoredSample(k, m) for (p, k), m in
                self.partition_samples(jid, backend).items() if p == partition]

    def partition_samples(self, jid: str, backend: str
                          ) -> dict[tuple[str, Knobs], Measurement]:
        return dict(self.partitions.get(backend, {})) if jid == self.jid else {}

    def op_samples(self, jid: str, backend: str) -> dict[tuple[str, int, int], Measurement]:
        return dict(self.ops.get(backend, {})) if jid == self.jid else {}

    def progress(self, label: str) -> Callable[[int, int], None]:
        """A progress callback, reported to the driver under ``label``."""
        return lambda done, total: self._send("progress", label, done, total)


@dataclass(frozen=True)
class RankTask:
    """What one rank of a unit (a partition key, or `COMPOSITION`) runs."""

    job: dict[str, Any]
    key: str
    rank: int
    world: int
    backend: BackendSpec
    config: SearchConfig
    sink: Any
    die_after: int | None = None
    policy: FitPolicy = field(default_factory=FitPolicy)
    """How the steps outside partitions are measured (the `COMPOSITION` unit)."""
    prior: str | None = None  # the cost model informing the search and the fits


class RankActor:
    """One rank of a unit: a Ray actor in one bundle of the unit's placement group."""

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0 hosts the process group)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return str(import_ray().util.get_node_ip_address()), int(s.getsockname()[1])

    def run(self, address: tuple[str, int], journal: ProxyJournal, task: RankTask
            ) -> dict[str, Any] | None:
        """The unit's search (or the composition steps); rank 0 returns its result."""
        workload = Workload.from_job_dict(task.job)  # once per rank, on its own machine
        with _rank_group(task, address) as group:
            spec = (task.backend.for_rank(group.local_rank, group.device)
                    if task.backend.capabilities.process_per_gpu else task.backend)
            record = task.rank == 0
            journal.sink = task.sink if record else None
            report = journal.progress(task.key) if record else None
            model = open_prior(task.prior, workload.job)
            journaling = JournalPolicy.rank(task.rank, _agree(group, task.die_after))
            with open_measuring(spec, workload, journal, group=group, policy=journaling,
                                jid=journal.jid) as be:
                # without clock changes the job's one clock (the spec's check), as in
                # kareus.profiling.profile: nvml refuses while the GPU runs another
                if task.key == COMPOSITION:
                    outcome = measure_composition(workload, be, report, task.policy, model)
                    return {**outcome.to_dict(), "backend": be.identity()} if record else None
                result = run_search(workload[task.key], be, workload.job.freqs_mhz,
                                    task.config, model, progress=report, agree=group.agree)
                return result.to_dict() if record else None


@contextmanager
def _rank_group(task: RankTask, address: tuple[str, int]) -> Iterator[Any]:
    """The unit's process group as a `TorchrunGroup` (``local_rank``: the GPU index). Ray
    shows an actor only its own GPU: the node's are made visible again (NCCL then connects
    the group's GPUs directly; Zeus, NVML and torch agree on indices)."""
    from kareus.gpu.distributed import TorchrunGroup
    from kareus.gpu.nccl import NcclCollectives

    gpu = task.backend.capabilities.real_gpu
    gid = str(import_ray().get_gpu_ids()[0]) if gpu else ""  # a UUID: keep Ray's view
    if gid.isdigit():
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # before CUDA is initialised
    index = (int(gid) if gid.isdigit() else 0) if gpu else task.rank
    device = f"cuda:{index}" if gpu else "cpu"
    if task.world == 1:
        yield TorchrunGroup(0, 1, index, None, device)
        return
    import torch
    import torch.distributed as dist

    if gpu:
        torch.cuda.set_device(index)
    dist.init_process_group("nccl" if gpu else "gloo", init_method="tcp://{}:{}".format(
        *address), rank=task.rank, world_size=task.world, timeout=timedelta(minutes=10))
    try:
        yield TorchrunGroup(task.rank, task.world, index, NcclCollectives(device), device)
    finally:
        dist.destroy_process_group()


def _agree(group: Any, die_after: int | None) -> Callable[[Measurement], Measurement]:
    count = itertools.count(1)

    def agree(m: Measurement) -> Measurement:
        if die_after is not None and next(count) > die_after:
            os._exit(1)  # the test hook: this rank's node dies
        return group.agree(m)

    return agree
