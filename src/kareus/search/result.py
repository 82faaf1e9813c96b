"""What a search returns: its samples in the order taken, the frontier, the hypervolume
history and this run's accounting (measured, reused from the journal, profiling cost)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus import SCHEMA_VERSION
from kareus.core import Knobs, Measurement
from kareus.core.pareto import hypervolume, pareto_mask


@dataclass(frozen=True)
class Sample:
    knobs: Knobs
    measurement: Measurement
    reused: bool = False
    """Taken from the journal rather than measured by this run."""

    def to_dict(self) -> dict[str, Any]:
        return {"freq_mhz": self.knobs.freq_mhz, "sms": self.knobs.sms,
                "slot": self.knobs.slot, **self.measurement.to_dict(), "reused": self.reused}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Sample:
        return cls(Knobs(int(doc["freq_mhz"]), int(doc["sms"]), doc["slot"]),
                   Measurement.from_dict(doc), bool(doc.get("reused", False)))


@dataclass
class SearchResult:
    partition: str
    strategy: str
    seed: int
    samples: list[Sample]
    hv_history: list[tuple[int, float]]
    measured_this_run: int
    profiling_cost_s: float
    stopped: str
    """Why the search ended: "budget", "converged", "exhausted", or "journal" (a result
    read from a journal, not searched by this run)."""
    clock_changes: int = 0
    """Measurements this run took at another clock than the one before (each settles)."""

    @classmethod
    def from_journal(cls, partition: str,
                     samples: Sequence[tuple[Knobs, Measurement]]) -> SearchResult:
        """What a journal holds of a partition, as a result this run did not search."""
        return cls(partition, "journal", 0, [Sample(k, m, reused=True) for k, m in samples],
                   [], 0, 0.0, "journal")

    @property
    def frontier(self) -> list[Sample]:
        """Pareto set in (time, dynamic energy), fastest first."""
        pts = [(s.measurement.time_s, s.measurement.dynamic_energy_j) for s in self.samples]
        keep = pareto_mask(pts)
        front = [s for s, k in zip(self.samples, keep) if k]
        return sorted(front, key=lambda s: s.measurement.time_s)

    @property
    def hypervolume(self) -> float:
        """Of the frontier in (time, dynamic energy), each objective divided by its worst
        sampled value, reference point 1.1."""
        return frontier_hypervolume(
            [(s.measurement.time_s, s.measurement.dynamic_energy_j) for s in self.samples])

    @property
    def reused_from_journal(self) -> int:
        return sum(s.reused for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "partition": self.partition,
            "strategy": self.strategy,
            "seed": self.seed,
            "measured_this_run": self.measured_this_run,
            "reused_from_journal": self.reused_from_journal,
            "stopped": self.stopped,
            "samples": [s.to_dict() for s in self.samples],
            "frontier": [s.to_dict() for s in self.frontier],
            "hypervolume": self.hypervolume,
            "hypervolume_history": [{"samples": n, "hypervolume": hv}
                                    for n, hv in self.hv_history],
            "profiling_cost_s": self.profiling_cost_s,
            "clock_changes": self.clock_changes,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> SearchResult:
        """The inverse of `to_dict` (results cross process boundaries as dicts)."""
        return cls(str(doc["partition"]), str(doc["strategy"]), int(doc["seed"]),
                   [Sample.from_dict(s) for s in doc["samples"]],
                   [(int(h["samples"]), float(h["hypervolume"]))
                    for h in doc["hypervolume_history"]],
                   int(doc["measured_this_run"]), float(doc["profiling_cost_s"]),
                   str(doc["stopped"]), int(doc.get("clock_changes", 0)))


def frontier_hypervolume(points, worst=None) -> float:
    pts = np.asarray(points, dtype=float).reshape(-1, 2)
    if len(pts) == 0:
        return 0.0
    scale = np.asarray(worst if worst is not None else pts.max(axis=0), dtype=float)
    return hypervolume(pts / np.maximum(scale, 1e-300), (1.1, 1.1))
