"""What every backend offers: measure a partition at some knobs, or one op at a clock.

A Backend turns (partition, knobs) into a Measurement. The emulator computes it; the NVML
backend (real GPUs) measures it. Energies follow the Kareus accounting: dynamic energy =
energy - static power x time, where static power is what the GPU draws while blocked in
communication.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from kareus.hardware import GPUSpec
from kareus.partition import Partition
from kareus.workload.ops import Op


@dataclass(frozen=True, order=True)
class Knobs:
    """The three knobs of a partition: SM clock, collective SMs, launch slot (None: no
    overlap, the collective starts after the partition's last compute op)."""

    freq_mhz: int
    sms: int
    slot: str | None

    def label(self) -> str:
        return f"{self.freq_mhz} MHz, {self.sms} SMs, {self.slot or 'none'}"


@dataclass(frozen=True)
class Measurement:
    time_s: float
    energy_j: float
    static_energy_j: float
    dynamic_energy_j: float
    avg_power_w: float
    effective_freq_mhz: float
    """Time-weighted mean SM clock actually run (below the set clock when power-throttled)."""

    @classmethod
    def from_time_energy(cls, time_s: float, energy_j: float, static_power_w: float,
                         effective_freq_mhz: float) -> Measurement:
        static = static_power_w * time_s
        return cls(
            time_s=time_s,
            energy_j=energy_j,
            static_energy_j=static,
            dynamic_energy_j=energy_j - static,
            avg_power_w=energy_j / time_s if time_s > 0 else 0.0,
            effective_freq_mhz=effective_freq_mhz,
        )

    def __add__(self, other: Measurement) -> Measurement:
        t = self.time_s + other.time_s
        e = self.energy_j + other.energy_j
        s = self.static_energy_j + other.static_energy_j
        f = ((self.effective_freq_mhz * self.time_s + other.effective_freq_mhz * other.time_s)
             / t if t > 0 else self.effective_freq_mhz)
        return Measurement(t, e, s, e - s, e / t if t > 0 else 0.0, f)

    def scaled(self, factor: float) -> Measurement:
        """This measurement repeated ``factor`` times back to back."""
        return Measurement(self.time_s * factor, self.energy_j * factor,
                           self.static_energy_j * factor, self.dynamic_energy_j * factor,
                           self.avg_power_w, self.effective_freq_mhz)

    def to_dict(self) -> dict:
        return asdict(self)


ZERO = Measurement(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class MeasurementProtocol:
    """How a real GPU is measured; the emulator reports the same so that searches can state
    their profiling cost (FACTS §4: 5 s window, 5 s cooldown, 2 s settle after a clock
    change)."""

    window_s: float = 5.0
    cooldown_s: float = 5.0
    settle_s: float = 2.0

    def cost_s(self, clock_changed: bool = True) -> float:
        return self.window_s + self.cooldown_s + (self.settle_s if clock_changed else 0.0)


@runtime_checkable
class Backend(Protocol):
    name: str
    gpu: GPUSpec
    static_power_w: float
    protocol: MeasurementProtocol

    @property
    def supported_freqs_mhz(self) -> tuple[int, ...]: ...

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        """One partition: its compute on the compute stream and its collective on the
        communication stream with ``knobs.sms`` SMs, launched before ``knobs.slot``."""
        ...

    def measure_op(self, op: Op, freq_mhz: int) -> Measurement:
        """One op outside partitions (embedding, LM head, loss, P2P, a solo segment op)."""
        ...
