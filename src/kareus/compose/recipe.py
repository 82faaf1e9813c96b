"""What an instruction option is made of, before any number is known.

Composition first writes down, for every method, stage, direction and clock, which
measurements each option adds up (a `Total` of `Need`s, some repeated `Scaled` times) and
which partition keys it combines. The union of those needs is what composing asks of a
backend: listed without measuring (a dry run), measured in any order (a profile), or
looked up (a replay). Then each recipe is evaluated once over the answers. A `Total` adds
its parts in order exactly as a running sum would, so the numbers are the same bit for bit
whichever way they were fetched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from kareus.backends.needs import Need
from kareus.compose.instruction import InstructionOption, KeyOption, combine
from kareus.core import ZERO, Measurement, PartitionSetting

Answers = Mapping[Need, Measurement]


@dataclass(frozen=True)
class Scaled:
    """``part`` run ``factor`` times back to back (a layer, times the stage's layers)."""

    part: Total
    factor: float


@dataclass(frozen=True)
class Total:
    """The parts' measurements added in order (from zero, or from the first part)."""

    parts: tuple[Need | Total | Scaled, ...]
    from_zero: bool = True

    def needs(self) -> Iterator[Need]:
        for p in self.parts:
            if isinstance(p, Need):
                yield p
            elif isinstance(p, Scaled):
                yield from p.part.needs()
            else:
                yield from p.needs()

    def value(self, answers: Answers) -> Measurement:
        values = [_value(p, answers) for p in self.parts]
        if not self.from_zero and values:
            acc, rest = values[0], values[1:]
        else:
            acc, rest = ZERO, values
        for v in rest:
            acc = acc + v
        return acc


def _value(part: Need | Total | Scaled, answers: Answers) -> Measurement:
    if isinstance(part, Need):
        return answers[part]
    if isinstance(part, Scaled):
        return part.part.value(answers).scaled(part.factor)
    return part.value(answers)


@dataclass(frozen=True)
class Whole:
    """An option that is one measured total: Nanobatching's default overlap, or Megatron-
    LM's sequential instruction."""

    freq_mhz: int
    total: Total
    sequential: bool = False

    def needs(self) -> Iterator[Need]:
        yield from self.total.needs()

    def options(self, answers: Answers) -> list[InstructionOption]:
        m = self.total.value(answers)
        return [InstructionOption(m.time_s, m.dynamic_energy_j, self.freq_mhz,
                                  sequential=self.sequential)]


@dataclass(frozen=True)
class KeyChoice:
    """A partition key in an instruction: ``count`` occurrences, each one of ``front``
    (the searched options at this clock) or, where the key was never searched at this
    clock, ``default`` measured as ``fallback``."""

    count: int
    front: tuple[KeyOption, ...] = ()
    fallback: Need | None = None
    default: PartitionSetting | None = None

    def options(self, answers: Answers) -> list[KeyOption]:
        if self.front:
            return list(self.front)
        assert self.fallback is not None and self.default is not None
        m = answers[self.fallback]
        return [KeyOption(m.time_s, m.dynamic_energy_j, self.default)]


@dataclass(frozen=True)
class Combined:
    """Kareus's options at a clock: the fixed steps plus, per key, one of its options (the
    Pareto-pruned sum of kareus.compose.instruction.combine)."""

    freq_mhz: int
    fixed: tuple[Need, ...]
    keys: dict[str, KeyChoice] = field(hash=False)

    def needs(self) -> Iterator[Need]:
        yield from self.fixed
        for choice in self.keys.values():
            if not choice.front and choice.fallback is not None:
                yield choice.fallback

    def options(self, answers: Answers) -> list[InstructionOption]:
        t0 = e0 = 0.0
        for need in self.fixed:
            m = answers[need]
            t0 += m.time_s
            e0 += m.dynamic_energy_j
        per_key = {k: (c.count, c.options(answers)) for k, c in self.keys.items()}
        return combine(t0, e0, self.freq_mhz, per_key)


Recipe = Whole | Combined
