"""A Backend whose every answer is rank 0's: the ranks of a TP/CP group profiled together
run each measurement in lockstep (the collective needs all of them) but time it slightly
differently. A search that decided on each rank's own numbers would pick different next
settings and deadlock in the next collective; composition would journal numbers only
rank 0 saw. The ``agree`` function (kareus.gpu.distributed: a broadcast from rank 0) makes
every rank decide on the same numbers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kareus.backends.base import Backend
from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.hardware import GPUSpec
from kareus.partition import Partition
from kareus.workload.ops import Op

Agree = Callable[[Measurement], Measurement]


class AgreedBackend:
    def __init__(self, inner: Backend, agree: Agree) -> None:
        self.inner = inner
        self.agree = agree
        self.name = inner.name

    @property
    def gpu(self) -> GPUSpec:
        return self.inner.gpu

    @property
    def static_power_w(self) -> float:
        return self.inner.static_power_w

    @property
    def protocol(self) -> MeasurementProtocol:
        return self.inner.protocol

    @property
    def default_sms(self) -> int:
        return self.inner.default_sms

    @property
    def supported_freqs_mhz(self) -> tuple[int, ...]:
        return self.inner.supported_freqs_mhz

    def identity(self) -> str:
        return self.inner.identity()

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        return self.agree(self.inner.measure(partition, knobs))

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        return self.agree(self.inner.measure_ops(ops, freq_mhz, sms))
