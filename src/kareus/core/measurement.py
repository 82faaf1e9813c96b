"""What a measurement of a partition or of a run of ops yields, and what it costs to take.

Energies follow the Kareus accounting: dynamic energy = energy - static power x time,
where static power is what the GPU draws while blocked in communication.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


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

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Measurement:
        return cls(**{k: float(doc[k]) for k in FIELDS})


FIELDS = ("time_s", "energy_j", "static_energy_j", "dynamic_energy_j", "avg_power_w",
          "effective_freq_mhz")

ZERO = Measurement(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class MeasurementProtocol:
    """How a real GPU is measured; the emulator reports the same so that searches can state
    their profiling cost (the public Kareus artifact: 5 s window, 5 s cooldown, 2 s settle
    after a clock change; docs/anchors.md)."""

    window_s: float = 5.0
    cooldown_s: float = 5.0
    settle_s: float = 2.0

    def cost_s(self, clock_changed: bool = True) -> float:
        """One measurement after another: its window, and the cooldown after the previous
        one, inside which a clock change settles (kareus.backends.nvml)."""
        return self.window_s + max(self.cooldown_s, self.settle_s if clock_changed else 0.0)
