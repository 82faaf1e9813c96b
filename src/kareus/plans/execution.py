"""How an iteration is to be executed: the knobs a plan fixes, independent of any backend.

An ExecutionPlan says, for every pipeline instruction (a microbatch's forward or backward
on a stage), the SM clock, and for every partition key the collective's SMs and launch
slot (optionally different per clock, since Kareus chooses partition settings per
frequency). ``overlap=False`` is the Megatron-LM execution: microbatches are not split,
every collective blocks the compute stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kareus import SCHEMA_VERSION
from kareus.core import InstructionId, PartitionSetting
from kareus.errors import SpecError


@dataclass
class ExecutionPlan:
    name: str
    overlap: bool
    default_freq_mhz: int
    instruction_freqs: dict[InstructionId, int] = field(default_factory=dict)
    knobs: dict[str, PartitionSetting] = field(default_factory=dict)
    """Per partition key, for every clock without a more specific entry."""
    knobs_by_freq: dict[tuple[str, int], PartitionSetting] = field(default_factory=dict)
    default_sms: int | None = None
    """SMs of collectives the plan does not tune (None: the backend's NCCL-like default)."""
    default_slot: str | None = None
    """Slot of partitions without knobs: None means no overlap; "first" launches the
    collective as soon as its input is ready (before the partition's first op)."""
    instruction_knobs: dict[InstructionId, dict[str, PartitionSetting]] = field(
        default_factory=dict)
    """Per instruction, per key: the most specific setting (a composed plan may run a key
    differently in two instructions at the same clock)."""
    sequential: frozenset[InstructionId] = frozenset()
    """Instructions that run Megatron-style (no nanobatch split) although the plan overlaps
    elsewhere: where overlap does not pay."""

    def freq(self, stage: int, microbatch: int, direction: str) -> int:
        return self.instruction_freqs.get((stage, microbatch, direction), self.default_freq_mhz)

    def choice(self, key: str, freq_mhz: int, default_sms: int,
               instruction: InstructionId | None = None) -> PartitionSetting:
        if instruction is not None:
            c = self.instruction_knobs.get(instruction, {}).get(key)
            if c is not None:
                return c
        c = self.knobs_by_freq.get((key, freq_mhz)) or self.knobs.get(key)
        if c is not None:
            return c
        return PartitionSetting(self.default_sms or default_sms, self.default_slot)

    def runs_sequential(self, stage: int, direction: str, microbatch: int | None = None
                        ) -> bool:
        return not self.overlap or (stage, microbatch, direction) in self.sequential

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "overlap": self.overlap,
            "default_freq_mhz": self.default_freq_mhz,
            "default_sms": self.default_sms,
            "default_slot": self.default_slot,
            "instruction_freqs": [
                {"stage": s, "microbatch": m, "direction": d, "freq_mhz": f}
                for (s, m, d), f in sorted(self.instruction_freqs.items())
            ],
            "knobs": {k: {"sms": c.sms, "slot": c.slot} for k, c in self.knobs.items()},
            "knobs_by_freq": [
                {"key": k, "freq_mhz": f, "sms": c.sms, "slot": c.slot}
                for (k, f), c in sorted(self.knobs_by_freq.items())
            ],
            "instruction_knobs": [
                {"stage": s, "microbatch": m, "direction": d,
                 "knobs": {k: {"sms": c.sms, "slot": c.slot} for k, c in sorted(kn.items())}}
                for (s, m, d), kn in sorted(self.instruction_knobs.items())
            ],
            "sequential": [{"stage": s, "microbatch": m, "direction": d}
                           for s, m, d in sorted(self.sequential)],
        }

    @classmethod
    def from_dict(cls, doc: dict) -> ExecutionPlan:
        try:
            if doc.get("schema_version") != SCHEMA_VERSION:
                raise SpecError(f"unsupported plan schema_version {doc.get('schema_version')!r}")
            return cls(
                name=str(doc["name"]),
                overlap=bool(doc["overlap"]),
                default_freq_mhz=int(doc["default_freq_mhz"]),
                default_sms=doc.get("default_sms"),
                default_slot=doc.get("default_slot"),
                instruction_freqs={
                    (int(e["stage"]), int(e["microbatch"]), str(e["direction"])):
                        int(e["freq_mhz"]) for e in doc.get("instruction_freqs", [])
                },
                knobs={k: PartitionSetting(int(v["sms"]), v["slot"])
                       for k, v in doc.get("knobs", {}).items()},
                knobs_by_freq={
                    (str(e["key"]), int(e["freq_mhz"])): PartitionSetting(int(e["sms"]),
                                                                         e["slot"])
                    for e in doc.get("knobs_by_freq", [])
                },
                instruction_knobs={
                    (int(e["stage"]), int(e["microbatch"]), str(e["direction"])): {
                        str(k): PartitionSetting(int(v["sms"]), v["slot"])
                        for k, v in e["knobs"].items()}
                    for e in doc.get("instruction_knobs", [])
                },
                sequential=frozenset(
                    (int(e["stage"]), int(e["microbatch"]), str(e["direction"]))
                    for e in doc.get("sequential", [])),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, SpecError):
                raise
            raise SpecError(f"corrupt plan: {type(exc).__name__}: {exc}") from None
