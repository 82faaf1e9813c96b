"""A Backend whose every answer is rank 0's: the ranks of a TP/CP group profiled together
run each measurement in lockstep (the collective needs all of them) but time it slightly
differently. A search that decided on each rank's own numbers would pick different next
settings and deadlock in the next collective; composition would journal numbers only
rank 0 saw. The ``agree`` function (kareus.gpu.distributed: a broadcast from rank 0) makes
every rank decide on the same numbers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kareus.backends.base import Backend, WrappedBackend
from kareus.core import Knobs, Measurement
from kareus.workload.ops import Op
from kareus.workload.partition import Partition

Agree = Callable[[Measurement], Measurement]


class AgreedBackend(WrappedBackend):
    def __init__(self, inner: Backend, agree: Agree) -> None:
        super().__init__(inner)
        self.agree = agree

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        return self.agree(self.inner.measure(partition, knobs))

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        return self.agree(self.inner.measure_ops(ops, freq_mhz, sms))
