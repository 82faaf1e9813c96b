"""The journal-replay backend: measurements made elsewhere (a cluster, another run),
served from a journal. It never measures: a setting or a run of ops the journal does not
hold is one clear error naming what is missing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.errors import KareusError
from kareus.hardware import GPUSpec
from kareus.partition import Partition
from kareus.spec import JobSpec
from kareus.store import Journal, job_id
from kareus.workload.ops import Op, ops_signature


class MissingMeasurement(KareusError):
    """The journal holds no measurement of what was asked."""


class ReplayBackend:
    name = "replay"

    def __init__(self, journal: str | Path, job: JobSpec, identity: str | None = None
                 ) -> None:
        path = Path(journal)
        if not path.is_file():
            raise KareusError(f"journal not found: {path}")
        self.path = path
        self.job = job
        jid = job_id(job)
        with Journal(path) as j:
            found = j.identities(jid)
            if identity is None:
                if len(found) != 1:
                    raise KareusError(
                        f"journal {path} holds {'no' if not found else 'several backends'}"
                        f" measurements of this job{': ' + ', '.join(found) if found else ''}"
                        f"{'; choose one with --replay-identity' if found else ''}")
                identity = found[0]
            info = j.backend_info(identity)
            if info is None:
                raise KareusError(f"journal {path} does not describe backend {identity!r}; "
                                  f"backends with measurements of this job: "
                                  f"{', '.join(found) or 'none'}")
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

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        hit = self._partitions.get((partition.key, knobs))
        if hit is None:
            raise MissingMeasurement(
                f"journal {self.path} has no measurement of partition {partition.key} at "
                f"{knobs.label()} (backend {self._identity}); measure it with `kareus "
                f"search` or `kareus profile` into this journal")
        return hit

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        n = sms or self.default_sms
        sig = ops_signature(ops)
        hit = self._ops.get((sig, freq_mhz, n))
        if hit is None:
            raise MissingMeasurement(
                f"journal {self.path} has no measurement of the ops {sig} at {freq_mhz} MHz "
                f"with {n} SMs for collectives (backend {self._identity}); run `kareus "
                f"optimize` with the measuring backend and this journal to record it")
        return hit
