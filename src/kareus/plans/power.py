"""A plan's cluster power over time, from its composed timeline (issue 26).

Every bar of a timeline (kareus.plans.plan.TimelineEntry) holds its dynamic energy on one
GPU of its stage, so while it runs it adds ``dynamic_energy_j / time_s`` watts per GPU
of the stage's rank; every GPU draws the static power throughout (a rank that waits draws
static power alone). The cluster's power at a moment is the sum over ranks of the rank's
GPUs times that; its mean over the iteration is the plan's energy over its time.

Datacenter power caps act on seconds, not kernels, so a cap is checked against the peak of
the moving average over a window (``window_s``, 1 s by default). Training runs iteration
after iteration, so the trace repeats with the iteration's period and a window may span
iterations. What no timeline holds (the split of a stage's transfer and end-of-iteration
energy between its bars, power within a bar) is spread evenly: a bar draws its mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kareus.errors import KareusError, SpecError
from kareus.plans.plan import PlanPower, TimelineEntry

DEFAULT_WINDOW_S = 1.0
CAP_TOLERANCE = 1e-9
"""A peak this fraction over a cap still meets it (float rounding of the same number)."""


@dataclass(frozen=True)
class PowerTrace:
    """Cluster power, piecewise constant: ``watts[i]`` from ``times_s[i]`` to
    ``times_s[i + 1]`` (the last step ends at ``period_s``), repeating every period."""

    times_s: np.ndarray
    watts: np.ndarray
    period_s: float

    @classmethod
    def of(cls, timeline: Sequence[TimelineEntry], iteration_s: float, pp: int,
           gpus_per_rank: int, static_power_w: float) -> PowerTrace:
        """The trace of a plan's timeline: ``pp`` ranks of ``gpus_per_rank`` GPUs each (a
        bar's stage runs on rank stage % pp)."""
        if not iteration_s > 0:
            raise SpecError(f"an iteration takes a positive time, got {iteration_s}")
        edges: dict[float, float] = {0.0: 0.0}
        for e in timeline:
            if e.time_s <= 0 or e.dynamic_energy_j == 0:
                continue
            watts = gpus_per_rank * e.dynamic_energy_j / e.time_s
            start = min(max(e.start_s, 0.0), iteration_s)
            end = min(e.start_s + e.time_s, iteration_s)
            if end <= start:
                continue
            edges[start] = edges.get(start, 0.0) + watts
            edges[end] = edges.get(end, 0.0) - watts
        times = np.array(sorted(t for t in edges if t < iteration_s))
        steps = np.cumsum([edges[t] for t in times])
        base = pp * gpus_per_rank * static_power_w
        return cls(times, base + steps, float(iteration_s))

    @property
    def energy_j(self) -> float:
        """Energy of one period."""
        return float(np.sum(self.watts * np.diff(np.append(self.times_s, self.period_s))))

    @property
    def mean_w(self) -> float:
        return self.energy_j / self.period_s

    @property
    def max_w(self) -> float:
        """The instantaneous peak (every bar at its mean power)."""
        return float(self.watts.max())

    def at(self, t: np.ndarray) -> np.ndarray:
        """The power at each of ``t`` (within one period; a step holds from its start)."""
        idx = np.searchsorted(self.times_s, t, side="right") - 1
        return self.watts[np.clip(idx, 0, len(self.watts) - 1)]

    def energy_to_j(self, t: np.ndarray) -> np.ndarray:
        """Energy from 0 to each of ``t`` (any real times: the trace repeats)."""
        ends = np.append(self.times_s, self.period_s)
        acc = np.concatenate([[0.0], np.cumsum(self.watts * np.diff(ends))])
        k, r = np.divmod(t, self.period_s)
        return k * acc[-1] + np.interp(r, ends, acc)

    def peak_w(self, window_s: float = DEFAULT_WINDOW_S) -> float:
        """The largest mean power over any ``window_s`` seconds."""
        if not window_s > 0:
            raise SpecError(f"the power window must be positive, got {window_s} s")
        # the window's energy is piecewise linear in its start: its largest value is at a
        # start or an end on a step of the trace
        starts = np.concatenate([self.times_s, np.mod(self.times_s - window_s,
                                                      self.period_s)])
        energy = self.energy_to_j(starts + window_s) - self.energy_to_j(starts)
        return float(energy.max() / window_s)

    def moving_average_w(self, t: np.ndarray, window_s: float) -> np.ndarray:
        """The mean power over the ``window_s`` centred on each of ``t``."""
        half = window_s / 2
        return (self.energy_to_j(t + half) - self.energy_to_j(t - half)) / window_s

    def sample(self, points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
        """(times, watts) on an even grid over one period (for a picture)."""
        t = np.linspace(0.0, self.period_s, points, endpoint=False)
        return t, self.at(t)


def plan_power(timeline: Sequence[TimelineEntry], iteration_s: float, pp: int,
               gpus_per_rank: int, static_power_w: float,
               window_s: float = DEFAULT_WINDOW_S) -> PlanPower:
    """A plan's mean power and windowed peak, from its timeline."""
    trace = PowerTrace.of(timeline, iteration_s, pp, gpus_per_rank, static_power_w)
    return PlanPower(trace.mean_w, trace.peak_w(window_s), window_s, pp, gpus_per_rank,
                     static_power_w)


def trace_of(timeline: Sequence[TimelineEntry], iteration_s: float, power: PlanPower
             ) -> PowerTrace:
    """The trace of a plan whose power was recorded (its ranks and static power)."""
    return PowerTrace.of(timeline, iteration_s, power.pp, power.gpus_per_rank,
                         power.static_power_w)


def under_cap(frontier: list[dict], cap_w: float, peaks_w: Sequence[float],
              window_s: float) -> list[dict]:
    """The frontier points whose windowed peak (``peaks_w``, in the frontier's order) stays
    within ``cap_w``; none: one KareusError with the range of peaks the frontier spans."""
    if not cap_w > 0:
        raise SpecError(f"a power cap must be positive, got {cap_w:g} W")
    ok = [p for p, peak in zip(frontier, peaks_w, strict=True)
          if peak <= cap_w * (1 + CAP_TOLERANCE)]
    if not ok:
        lo, hi = min(peaks_w), max(peaks_w)
        raise KareusError(f"no plan stays under {cap_w / 1e3:.2f} kW ({window_s:g} s peak): "
                          f"the plans' peaks range from {lo / 1e3:.2f} kW to {hi / 1e3:.2f} "
                          f"kW")
    return ok
