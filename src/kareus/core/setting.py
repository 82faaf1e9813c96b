"""How a partition runs: its collective's SMs and launch slot, alone or at a clock.

A partition is the compute of one nanobatch's segment overlapped with the other
nanobatch's collective (docs/workload.md). Its setting is the number of SMs (NCCL CTAs)
the collective gets and the compute slot before which it is launched; ``slot=None`` means
no overlap (the collective starts after the partition's last compute op). The clock is the
instruction's, so plans store settings per key and the clock per instruction; what a
backend measures is a setting at a clock (`Knobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

LAUNCH_FIRST = "first"
"""Slot of a plan's default setting: launch the collective as soon as its input is ready
(before the partition's first compute op), as Nanobatching does; resolved to the
partition's first slot name where the partition is known."""


@dataclass(frozen=True)
class PartitionSetting:
    """A partition's collective: ``sms`` SMs, launched before ``slot`` (None: no overlap)."""

    sms: int
    slot: str | None

    def label(self) -> str:
        return f"{self.sms} SMs, {self.slot or 'none'}"


@dataclass(frozen=True)
class Knobs:
    """A partition setting at an SM clock: the three knobs, what a backend measures."""

    freq_mhz: int
    sms: int
    slot: str | None

    @classmethod
    def at(cls, freq_mhz: int, setting: PartitionSetting) -> Knobs:
        return cls(freq_mhz, setting.sms, setting.slot)

    @property
    def setting(self) -> PartitionSetting:
        return PartitionSetting(self.sms, self.slot)

    def label(self) -> str:
        return f"{self.freq_mhz} MHz, {self.sms} SMs, {self.slot or 'none'}"
