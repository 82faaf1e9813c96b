"""The journal-replay backend: measurements made elsewhere (a cluster, another run),
served from a journal. It never measures. What the journal does not hold is, by choice:

- one clear error naming it (the default);
- listed in ``missing`` and answered with a placeholder (``collect=True``: a dry run that
  learns everything a composition lacks before reporting it at once);
- taken from a ``fallback`` backend (an explicit opt-in such as ``--fill-missing
  emulator``) and listed in ``filled``, so that a result can say which numbers are not
  measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kareus.backends.base import Backend
from kareus.backends.needs import PLACEHOLDER, Need
from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.errors import KareusError
from kareus.job.hardware import GPUSpec
from kareus.job.spec import JobSpec
from kareus.store import Journal, job_id
from kareus.workload.ops import Op, ops_signature
from kareus.workload.partition import Partition


class MissingMeasurement(KareusError):
    """The journal holds no measurement of what was asked."""


class ReplayBackend:
    name = "replay"

    def __init__(self, journal: str | Path, job: JobSpec, identity: str | None = None, *,
                 collect: bool = False, fallback: Backend | None = None) -> None:
        path = Path(journal)
        if not path.is_file():
            raise KareusError(f"journal not found: {path}")
        self.path = path
        self.job = job
        self.collect = collect
        self.fallback = fallback
        self._missing: dict[Need, None] = {}
        self._filled: dict[Need, None] = {}
        jid = job_id(job)
        with Journal(path) as j:
            identity = _choose_identity(j, path, jid, identity)
            info = j.backend_info(identity)
            if info is None:
                raise KareusError(f"journal {path} does not describe backend {identity!r}; "
                                  f"backends with measurements of this job: "
                                  f"{', '.join(j.identities(jid)) or 'none'}")
            self._partitions = j.partition_samples(jid, identity)
            self._ops = j.op_samples(jid, identity)
        self._identity = identity
        self.gpu: GPUSpec = job.gpu_spec
        if info.get("gpu") != self.gpu.name:
            raise KareusError(f"journal {path}: backend {identity} measured a "
                              f"{info.get('gpu')}, the job runs on {self.gpu.name}")
        self.static_power_w = float(info["static_power_w"])  # type: ignore[arg-type]
        self.default_sms = int(info["default_sms"])  # type: ignore[call-overload]
        pr = info.get("protocol") or {}
        self.protocol = MeasurementProtocol(**pr)  # type: ignore[arg-type]

    @property
    def supported_freqs_mhz(self) -> tuple[int, ...]:
        return self.gpu.clock_table_mhz

    def identity(self) -> str:
        return self._identity

    @property
    def missing(self) -> list[Need]:
        """``collect``: what composition asked for and the journal lacks, in order."""
        return list(self._missing)

    @property
    def filled(self) -> list[Need]:
        """What the fallback answered, in order."""
        return list(self._filled)

    def partition_keys(self) -> set[str]:
        """The partitions the journal holds measurements of (for this job and backend)."""
        return {key for key, _knobs in self._partitions}

    def samples(self, key: str) -> list[tuple[Knobs, Measurement]]:
        """Every journaled setting of partition ``key``, in a stable order."""
        found = [(k, m) for (p, k), m in self._partitions.items() if p == key]
        return sorted(found, key=lambda km: (-km[0].freq_mhz, km[0].sms, km[0].slot or ""))

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        hit = self._partitions.get((partition.key, knobs))
        if hit is not None:
            return hit
        need = Need.of_partition(partition.key, knobs)
        if self.fallback is not None:
            return self._fill(need, self.fallback.measure(partition, knobs))
        if self.collect:
            return self._collect(need)
        raise MissingMeasurement(
            f"journal {self.path} has no measurement of partition {partition.key} at "
            f"{knobs.label()} (backend {self._identity}); measure it with `kareus "
            f"search` or `kareus profile` into this journal")

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        n = sms or self.default_sms
        sig = ops_signature(ops)
        hit = self._ops.get((sig, freq_mhz, n))
        if hit is not None:
            return hit
        need = Need.of_ops(ops, freq_mhz, n)
        if self.fallback is not None:
            return self._fill(need, self.fallback.measure_ops(ops, freq_mhz, n))
        if self.collect:
            return self._collect(need)
        raise MissingMeasurement(
            f"journal {self.path} has no measurement of the ops {sig} at {freq_mhz} MHz "
            f"with {n} SMs for collectives (backend {self._identity}); measure it with "
            f"`kareus profile` into this journal")

    def _collect(self, need: Need) -> Measurement:
        self._missing[need] = None
        return PLACEHOLDER

    def _fill(self, need: Need, m: Measurement) -> Measurement:
        self._filled[need] = None
        return m


def _choose_identity(j: Journal, path: Path, jid: str, identity: str | None) -> str:
    if identity is not None:
        return identity
    found = j.identities(jid)
    if len(found) != 1:
        raise KareusError(
            f"journal {path} holds {'no' if not found else 'several backends'}"
            f" measurements of this job{': ' + ', '.join(found) if found else ''}"
            f"{'; choose one with --replay-identity' if found else ''}")
    return found[0]
