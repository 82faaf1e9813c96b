"""Steps outside partitions fitted through a prior: the curve's shape from a cost model,
its level from two measured clocks (issue 25).

`kareus.profiling.step_fit` fits a step's series with a shape of its own (time ``a + b/f``,
dynamic energy a quadratic in f), which takes five measured clocks and a sixth held out.
A cost model of the GPU (the emulator, nominal or calibrated) already knows the shape of
each step in the clock: its SM-bound and memory-bound parts, its collectives, its power.
What it gets wrong on a real GPU is mostly a level (a kernel's efficiency, a link's
bandwidth) that drifts slowly over the clock range. So each series is measured at the two
ends of its range and one clock held out in the middle, and the ratio measured / predicted
is fitted as a line in the clock (for time and for dynamic energy apart). The fit is kept
when the held-out error is within the tolerance, or within three standard deviations of
the held-out errors of all the job's series where the measurements are noisier (their
median absolute value over 0.6745; a step whose ratio bends has a large error of its own,
which must not loosen its own check). A series that fails, or whose range free of the
power limiter is too short to fit, goes back to step_fit's own shape. Clocks the limiter
holds (as the prior predicts, or as measured) are measured, never fitted
(`kareus.profiling.step_fit._fit_through_prior`).

Three measurements a series instead of six. A prior that is wrong in kind for some step
costs the fallback's measurements for that step, never a wrong number: a step is fitted
only where the measurements at its ends and middle agree with the prior's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kareus.backends.base import CostModel
from kareus.backends.needs import Need, measure_need
from kareus.core import Knobs, Measurement
from kareus.workload.ops import Op
from kareus.workload.partition import Partition

HELD_OUT_SPREAD = 0.6745
"""The median absolute value of a standard normal: |error| median over this is its std."""


@dataclass(frozen=True)
class RatioCheck:
    """A series' held-out check through the prior."""

    time_error: float
    """Predicted / measured - 1 of time at the held-out clock (fit without it)."""
    energy_error: float
    """The same of dynamic energy."""


@dataclass(frozen=True)
class Ratios:
    """The lines measured / predicted of time and dynamic energy, in the clock (GHz)."""

    time: np.ndarray
    energy: np.ndarray

    @classmethod
    def fit(cls, points: Sequence[tuple[int, Measurement, Measurement]]) -> Ratios:
        """``points``: (clock, measured, predicted), at least two clocks."""
        f = np.array([p[0] for p in points], dtype=float) / 1e3
        basis = np.c_[np.ones_like(f), f]
        rt = np.array([m.time_s / p.time_s for _f, m, p in points])
        re = np.array([m.dynamic_energy_j / p.dynamic_energy_j if p.dynamic_energy_j > 0
                       else 1.0 for _f, m, p in points])
        return cls(np.linalg.lstsq(basis, rt, rcond=None)[0],
                   np.linalg.lstsq(basis, re, rcond=None)[0])

    def over(self, predicted: Mapping[int, Measurement]
             ) -> Callable[[int], tuple[float, float]]:
        """(time, dynamic energy) at a clock of ``predicted`` (clock: the prediction)."""
        return lambda f: self.apply(f, predicted[f])

    def apply(self, freq_mhz: int, predicted: Measurement) -> tuple[float, float]:
        """(time, dynamic energy) at ``freq_mhz``: the prediction times the ratios."""
        x = freq_mhz / 1e3
        return (predicted.time_s * float(self.time[0] + self.time[1] * x),
                predicted.dynamic_energy_j * float(self.energy[0] + self.energy[1] * x))


Predict = Callable[[Need], Measurement]


def prior_predictor(prior: CostModel) -> Predict:
    """A need's prediction by ``prior`` (a partition at its knobs, or a run of ops)."""
    return lambda need: measure_need(_AsBackend(prior), need)


class _AsBackend:
    """A cost model asked as `measure_need` asks a backend."""

    def __init__(self, model: CostModel) -> None:
        self.model = model

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        return self.model.predict(partition, knobs)

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        return self.model.predict_ops(ops, freq_mhz, sms)


def informed_range(series: Mapping[int, Need], predicted: Mapping[int, Measurement],
                   held_down: Callable[[Measurement, int], bool]) -> list[int]:
    """The clocks of ``series`` (descending) below every clock the prior predicts held down
    by the power limiter: where its shape is that of the clock alone."""
    ceiling = min((f for f, m in predicted.items() if held_down(m, f)), default=None)
    return sorted((f for f in series if ceiling is None or f < ceiling), reverse=True)


def check_series(points: Sequence[tuple[int, Measurement, Measurement]], check: int
                 ) -> RatioCheck:
    """Fit the ratios without the clock ``check`` and compare at it."""
    rest = [p for p in points if p[0] != check]
    held = next(p for p in points if p[0] == check)
    t, e = Ratios.fit(rest).apply(check, held[2])
    m = held[1]
    return RatioCheck(t / m.time_s - 1,
                      e / m.dynamic_energy_j - 1 if m.dynamic_energy_j else 0.0)


def noise_allowance(checks: Iterable[RatioCheck], tolerance: float) -> tuple[float, float]:
    """What a held-out error may be (time, energy): ``tolerance``, or three standard
    deviations of the job's held-out errors where that is larger (fewer than three
    series: the tolerance alone)."""
    cs = list(checks)
    if len(cs) < 3:
        return tolerance, tolerance
    spread_t = float(np.median([abs(c.time_error) for c in cs])) / HELD_OUT_SPREAD
    spread_e = float(np.median([abs(c.energy_error) for c in cs])) / HELD_OUT_SPREAD
    return max(tolerance, 3 * spread_t), max(tolerance, 3 * spread_e)


def passes(check: RatioCheck, allowance: tuple[float, float]) -> bool:
    return (abs(check.time_error) <= allowance[0]
            and abs(check.energy_error) <= allowance[1])
