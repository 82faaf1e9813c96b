"""A Backend that measures each thing once: journal first, then use.

Composition asks for the same instruction steps many times (every method, every clock).
This wrapper answers from the journal when it holds the measurement, and otherwise
measures through the wrapped backend, records the result (committed) and only then
returns it: nothing measured is lost, and every later question gets the same number.

``dry_run``: nothing is measured; what the journal lacks is listed in ``missing`` (and
answered with a placeholder), so that a caller learns every need before measuring one.
``record=False``: the journal is read, never written (the other ranks of a TP/CP group
under torchrun measure in lockstep with rank 0, which records).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kareus.backends.base import Backend, WrappedBackend, backend_info
from kareus.backends.needs import PLACEHOLDER, Need
from kareus.core import Knobs, Measurement
from kareus.store import JournalLike
from kareus.workload.ops import Op, ops_signature
from kareus.workload.partition import Partition

MeasuredHook = Callable[[Need], None]
"""Called after each measurement taken (not found in the journal)."""


class JournaledBackend(WrappedBackend):
    """``inner``'s measurements, through ``journal`` under job ``job_id``."""

    def __init__(self, inner: Backend, journal: JournalLike, job_id: str, *,
                 record: bool = True, dry_run: bool = False,
                 on_measured: MeasuredHook | None = None) -> None:
        super().__init__(inner)
        self.journal = journal
        self.job_id = job_id
        self.record = record and not dry_run
        self.dry_run = dry_run
        self.on_measured = on_measured
        self._identity = inner.identity()
        if self.record:
            journal.register_backend(self._identity, backend_info(inner))
        self._partitions = journal.partition_samples(job_id, self._identity)
        self._ops = journal.op_samples(job_id, self._identity)
        self.measured = 0
        """Measurements taken (not found in the journal) by this wrapper."""
        self._missing: dict[Need, None] = {}

    def identity(self) -> str:
        return self._identity

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        key = (partition.key, knobs)
        hit = self._partitions.get(key)
        if hit is None:
            need = Need.of_partition(partition.key, knobs)
            if self.dry_run:
                return self._lacks(need)
            hit = self.inner.measure(partition, knobs)
            if self.record:
                self.journal.record(self.job_id, partition.key, self._identity, knobs, hit)
            self._partitions[key] = hit
            self._measured(need)
        return hit

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        n = sms or self.default_sms
        key = (ops_signature(ops), freq_mhz, n)
        hit = self._ops.get(key)
        if hit is None:
            need = Need.of_ops(ops, freq_mhz, n)
            if self.dry_run:
                return self._lacks(need)
            hit = self.inner.measure_ops(ops, freq_mhz, n)
            if self.record:
                self.journal.record_ops(self.job_id, key[0], self._identity, freq_mhz, n,
                                        hit)
            self._ops[key] = hit
            self._measured(need)
        return hit

    @property
    def missing(self) -> list[Need]:
        """Dry run: what the journal lacks, in the order composition asked for it."""
        return list(self._missing)

    def _lacks(self, need: Need) -> Measurement:
        self._missing[need] = None
        return PLACEHOLDER

    def _measured(self, need: Need) -> None:
        self.measured += 1
        if self.on_measured is not None:
            self.on_measured(need)
