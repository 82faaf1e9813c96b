"""Journal first, then measure: the one place where a measurement is looked up, taken,
recorded and counted.

Every consumer asks through a `JournaledBackend`: the search (a setting it decided on),
composition (each instruction step at each clock), profiling (what composition lacks) and
replay (a journal with nothing behind it that can measure). A question the journal answers
is served from it; otherwise the wrapped backend measures, the number is committed to the
journal, and only then returned, so nothing measured is lost and a later question gets the
same number. Each answer says where it came from (`Answer.origin`) and the wrapper counts
them, so a run's accounting (measured, reused, filled) has one source: a replay measures
nothing.

``record=False``: the journal is read, never written (the other ranks of a TP/CP group
measure in lockstep with rank 0, which records; a replay). ``fill``: what the journal
lacks comes from that backend instead (an explicit opt-in such as ``--fill-missing
emulator``), is never journaled, and is listed in ``filled``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from kareus.backends.base import Backend, JournalFirst, WrappedBackend, backend_info
from kareus.backends.needs import (
    Answer,
    Need,
    TransientRun,
    TransientUnmeasurable,
    measure_need,
)
from kareus.backends.registry import cost_model_kinds
from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.errors import KareusError
from kareus.job.hardware import GPUSpec
from kareus.store import JournalLike, in_use_note
from kareus.workload.ops import Op
from kareus.workload.partition import Partition


class MissingMeasurement(KareusError):
    """The journal holds no measurement of what was asked, and nothing can measure it."""


class JournaledBackend(WrappedBackend):
    """``inner``'s measurements, through ``journal`` under job ``job_id``. Opened through
    kareus.backends.measuring (the one factory), which says its policy."""

    def __init__(self, inner: Backend, journal: JournalLike, job_id: str, *,
                 record: bool = True, fill: Backend | None = None) -> None:
        super().__init__(inner)
        self.journal = journal
        self.job_id = job_id
        self.record = record
        self.fill = fill
        self._identity = inner.identity()
        if self.record:
            journal.register_backend(self._identity, backend_info(inner))
        self._partitions = journal.partition_samples(job_id, self._identity)
        self._ops = journal.op_samples(job_id, self._identity)
        self._fitted = journal.fitted(job_id, self._identity)
        self._fitted_used: dict[Need, None] = {}
        self.counts: Counter[str] = Counter()
        """Answers given, by origin ("journal", "measured", "filled")."""
        self._filled: dict[Need, None] = {}

    def identity(self) -> str:
        return self._identity

    # The Backend protocol -------------------------------------------------------------

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        return self.answer(Need.of_partition(partition, knobs)).measurement

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        return self.answer(Need.of_ops(ops, freq_mhz, sms or self.default_sms)).measurement

    # Journal first ----------------------------------------------------------------------

    def holds(self, need: Need) -> bool:
        """The journal (this one, or a journal-first backend inside) answers ``need``."""
        if self._lookup(need) is not None:
            return True
        return isinstance(self.inner, JournalFirst) and self.inner.holds(need)

    def lacks(self, needs: Iterable[Need]) -> list[Need]:
        """What of ``needs`` nothing journaled answers, in order, once each (a dry run:
        nothing is measured)."""
        return [n for n in dict.fromkeys(needs) if not self.holds(n)]

    def answer(self, need: Need) -> Answer:
        hit = self._lookup(need)
        if hit is not None:
            if self.fitted_error(need) is not None:
                self._fitted_used[need] = None
            return self._count(Answer(hit, "journal"))
        if self.fill is not None and not self.holds(need):
            self._filled[need] = None
            return self._count(Answer(measure_need(self.fill, need), "filled"))
        if isinstance(self.inner, JournalFirst):
            got = self.inner.answer(need)
        else:
            got = Answer(measure_need(self.inner, need), "measured")
        if got.origin != "filled":
            self._store(need, got.measurement)
        return self._count(got)

    @property
    def measured(self) -> int:
        """Measurements this wrapper took (a replay: 0)."""
        return self.counts["measured"]

    @property
    def filled(self) -> list[Need]:
        """What ``fill`` answered, in order."""
        return list(self._filled)

    @property
    def fitted_used(self) -> list[Need]:
        """The answers that were fitted numbers from the journal (not measurements), in
        order (kareus.profiling.step_fit)."""
        return list(self._fitted_used)

    def fitted_error(self, need: Need) -> tuple[float, float] | None:
        """The held-out (time, energy) errors of the fit that gave the journal's number for
        ``need``; None where it was measured (or is not journaled)."""
        return self._fitted.get(_fitted_key(need))

    def store_fitted(self, need: Need, m: Measurement, time_rel_error: float,
                     energy_rel_error: float, measured_freqs_mhz: Sequence[int]) -> None:
        """Journal a fitted number for ``need`` (and that it was fitted); later answers to
        ``need`` are it."""
        kind, key, _f, _n, _slot = fit_key = _fitted_key(need)
        if self.record:
            self.journal.record_fitted(self.job_id, self._identity, kind, key, need.knobs, m,
                                       time_rel_error, energy_rel_error, measured_freqs_mhz)
        self._remember(need, m)
        self._fitted[fit_key] = (time_rel_error, energy_rel_error)

    def samples(self, key: str) -> list[tuple[Knobs, Measurement]]:
        """Every journaled setting of partition ``key``, in a stable order (a search's
        samples, read back)."""
        found = [(k, m) for (p, k), m in self._partitions.items() if p == key]
        return sorted(found, key=lambda km: (-km[0].freq_mhz, km[0].sms, km[0].slot or ""))

    # Internals --------------------------------------------------------------------------

    def _lookup(self, need: Need) -> Measurement | None:
        if need.partition is not None:
            return self._partitions.get((need.partition, need.knobs))
        assert need.ops_key is not None
        return self._ops.get((need.ops_key, need.knobs.freq_mhz, need.knobs.sms))

    def _store(self, need: Need, m: Measurement) -> None:
        k = need.knobs
        if self.record and need.partition is not None:
            self.journal.record(self.job_id, need.partition, self._identity, k, m)
        elif self.record:
            assert need.ops_key is not None
            self.journal.record_ops(self.job_id, need.ops_key, self._identity, k.freq_mhz,
                                    k.sms, m)
        self._remember(need, m)

    def _remember(self, need: Need, m: Measurement) -> None:
        """``m`` answers ``need`` from now on (where `_lookup` finds it)."""
        k = need.knobs
        if need.partition is not None:
            self._partitions[(need.partition, k)] = m
        else:
            assert need.ops_key is not None
            self._ops[(need.ops_key, k.freq_mhz, k.sms)] = m

    def _count(self, a: Answer) -> Answer:
        self.counts[a.origin] += 1
        return a


def _fitted_key(need: Need) -> tuple[str, str, int, int, str | None]:
    k = need.knobs
    if need.partition is not None:
        return ("partition", need.partition, k.freq_mhz, k.sms, k.slot)
    assert need.ops_key is not None
    return ("ops", need.ops_key, k.freq_mhz, k.sms, None)


class JournalOnly:
    """What stands behind a replay: the description of a backend that measured into a
    journal (its identity, GPU, static power, default SMs, protocol), which can measure
    nothing; a question the journal does not answer is one clear error."""

    name = "replay"

    def __init__(self, identity: str, info: dict[str, object], gpu: GPUSpec, where: str
                 ) -> None:
        self._identity = identity
        self.gpu = gpu
        self.where = where
        self.static_power_w = float(info["static_power_w"])  # type: ignore[arg-type]
        self.default_sms = int(info["default_sms"])  # type: ignore[call-overload]
        pr = info.get("protocol") or {}
        self._transients = bool(info.get("transients", False))
        self.protocol = MeasurementProtocol(**pr)  # type: ignore[arg-type]

    @property
    def supported_freqs_mhz(self) -> tuple[int, ...]:
        return self.gpu.clock_table_mhz

    def identity(self) -> str:
        return self._identity

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        raise MissingMeasurement(
            f"journal {self.where} has no measurement of partition {partition.key} at "
            f"{knobs.label()} (backend {self._identity}); measure it with `kareus search` "
            f"or `kareus profile` into this journal{in_use_note(self.where)}")

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        need = Need.of_ops(ops, freq_mhz, sms or self.default_sms)
        raise MissingMeasurement(
            f"journal {self.where} has no measurement of the {need.what} at {freq_mhz} MHz "
            f"with {need.knobs.sms} SMs for collectives (backend {self._identity}); "
            f"measure it with `kareus profile` into this journal{in_use_note(self.where)}")

    def measure_transient(self, run: TransientRun, freq_mhz: int) -> Measurement:
        """Missing where the journal's backend measured wait transients (a replay must
        not charge a different plan than the run it replays); where it could not, none
        is (journals written before transients were measured, real GPUs)."""
        if not self._transients:
            raise TransientUnmeasurable(
                f"backend {self._identity} of journal {self.where} measured no wait "
                f"transients")
        raise MissingMeasurement(
            f"journal {self.where} has no measurement of the stage {run.stage} {run.direction}"
            f"'s wait transient after {run.wait_s * 1e3:g} ms at {freq_mhz} MHz (backend "
            f"{self._identity}): a profile measures the wait transients last, after every "
            f"step; measure them with `kareus profile` with this job's options and "
            f"--journal {self.where}, or pass --fill-missing "
            f"{' or '.join(cost_model_kinds())}"
            f"{in_use_note(self.where)}")
