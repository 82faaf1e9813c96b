"""Instruction options: the Pareto set of (time, dynamic energy) ways to run one pipeline
instruction (a microbatch's forward or backward on a stage).

At one clock, an instruction is its fixed steps (ops outside partitions, the solo first
segment, the exposed last collective) plus, for each partition key, ``count`` occurrences
of that key run with one setting. Each key offers its own Pareto set at that clock, so the
instruction's set is the Pareto-pruned Minkowski sum of the keys' sets, each scaled by its
count: never the Cartesian product.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kareus.core import PartitionSetting
from kareus.core.pareto import pareto_mask

if TYPE_CHECKING:
    from kareus.compose.transient import Transient


@dataclass(frozen=True)
class KeyOption:
    """One setting of a partition key at one clock, with what it costs."""

    time_s: float
    dynamic_energy_j: float
    setting: PartitionSetting


@dataclass(frozen=True)
class InstructionOption:
    time_s: float
    dynamic_energy_j: float
    freq_mhz: int
    settings: tuple[tuple[str, PartitionSetting], ...] = field(default=())
    """Per partition key, its setting (sorted by key)."""
    sequential: bool = False
    """The instruction runs Megatron-style: the microbatch is not split and every
    collective blocks the compute stream (no partition settings)."""
    transient: Transient | None = field(default=None, compare=False, repr=False)
    """What the option costs beyond its steady state after its rank waited
    (kareus.compose.transient; None: nothing, e.g. options built by hand)."""

    def setting_dict(self) -> dict[str, PartitionSetting]:
        return dict(self.settings)


def pareto_front(options: Iterable, key=lambda o: (o.time_s, o.dynamic_energy_j)) -> list:
    """The Pareto-optimal options, fastest first; of exact ties, the first is kept."""
    opts = list(options)
    if not opts:
        return []
    mask = pareto_mask([key(o) for o in opts])
    seen, out = set(), []
    for o, keep in sorted(zip(opts, mask), key=lambda x: key(x[0])):
        if keep and key(o) not in seen:
            seen.add(key(o))
            out.append(o)
    return out


def combine(fixed_time_s: float, fixed_dynamic_j: float, freq_mhz: int,
            per_key: dict[str, tuple[int, list[KeyOption]]]) -> list[InstructionOption]:
    """Pareto-pruned sum: fixed part + sum over keys of count x (one option of the key)."""
    partial: list[tuple[float, float, tuple]] = [(fixed_time_s, fixed_dynamic_j, ())]
    for key in sorted(per_key):
        count, options = per_key[key]
        if count == 0:
            continue
        grown = [(t + count * o.time_s, e + count * o.dynamic_energy_j,
                  (*settings, (key, o.setting)))
                 for t, e, settings in partial for o in options]
        partial = pareto_front(grown, key=lambda x: (x[0], x[1]))
    return [InstructionOption(t, e, freq_mhz, settings) for t, e, settings in partial]
