"""A search in progress: the settings it decided on and what the journal-first backend
answered for each.

The search keeps no journal of its own. Every setting is asked of a `JournalFirst`
backend (kareus.backends.journaled), which answers from its journal or measures, journals
and only then answers; `Answer.origin` says which. So a rerun of an unchanged search
(same seed, same stored values) takes the same path and measures nothing, and a replay,
whose answers all come from its journal, reports 0 measured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from kareus.backends.base import JournalFirst
from kareus.backends.needs import Need
from kareus.core import Knobs
from kareus.search.result import Sample, frontier_hypervolume
from kareus.search.space import KnobSpace
from kareus.workload.partition import Partition

Progress = Callable[[int, int], None]
"""progress(samples so far, budget)."""

AgreeBatch = Callable[[list[Knobs]], list[Knobs]]
"""Rank 0's batch on every rank of a group (kareus.gpu.distributed's ``agree``)."""


class SearchState:
    """The samples a search took, in order, and this run's accounting.

    ``agree``: the ranks of a group profiled together take rank 0's batch (its surrogates
    decided it), so that a rank whose own fit differed by a rounding cannot pick other
    settings and deadlock the group's collectives."""

    def __init__(self, partition: Partition, backend: JournalFirst, space: KnobSpace,
                 budget: int, progress: Progress | None = None,
                 agree: AgreeBatch | None = None) -> None:
        self.partition = partition
        self.backend = backend
        self.space = space
        self.budget = budget
        self.progress = progress
        self.agree = agree
        self.samples: dict[Knobs, Sample] = {}
        """In the order the search took them."""
        self.history: list[tuple[int, float]] = []
        """(samples, hypervolume) after the initial design and after each batch."""
        self.measured = 0
        """Answers measured by this run (not from a journal, not filled in)."""
        self.cost_s = 0.0
        """Profiling cost of what this run measured: window and cooldown per setting, a
        settle per clock change."""
        self.clock_changes = 0
        """Measured settings at another clock than the one measured before."""
        self._last_freq: int | None = None

    @property
    def full(self) -> bool:
        return len(self.samples) >= len(self.space)

    def take(self, batch: Iterable[Knobs]) -> None:
        """Ask the backend for each setting of ``batch`` not taken yet, one clock at a time
        (highest first), so the GPU settles once per clock change."""
        settings = list(batch)
        if self.agree is not None:  # every rank of a group takes rank 0's batch
            settings = self.agree(settings)
        for k in sorted(settings, key=lambda k: (-k.freq_mhz, k.sms, k.slot or "")):
            if k in self.samples:
                continue
            got = self.backend.answer(Need.of_partition(self.partition, k))
            self.samples[k] = Sample(k, got.measurement, reused=got.reused)
            if got.origin == "measured":
                self.measured += 1
                changed = k.freq_mhz != self._last_freq
                self.cost_s += self.backend.protocol.cost_s(clock_changed=changed)
                self.clock_changes += int(changed)
                self._last_freq = k.freq_mhz
            if self.progress is not None:
                self.progress(len(self.samples), self.budget)

    def hypervolume(self, worst: np.ndarray | None = None) -> float:
        """Of the samples' frontier in (time, dynamic energy), each objective divided by
        ``worst`` (default: its worst sampled value), reference point 1.1."""
        return frontier_hypervolume([(s.measurement.time_s, s.measurement.dynamic_energy_j)
                                     for s in self.samples.values()], worst)

    def record_hypervolume(self, worst: np.ndarray | None = None) -> float:
        """Append the current hypervolume to the history, and return it."""
        hv = self.hypervolume(worst)
        self.history.append((len(self.samples), hv))
        return hv
