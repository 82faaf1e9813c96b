"""The curves a step's time and dynamic energy follow in the SM clock, where the GPU runs
the clock it was set to (kareus.profiling.step_fit fits them):

- time ``t(f) = a + b / f``: the part bound by the SM clock scales with 1/f, the rest
  (memory, links, launch) does not;
- dynamic energy ``e(f) = c0 + c1 f + c2 f^2``: dynamic power grows with the clock and the
  voltage, which rises with it, so energy per step is convex in the clock.

Both are fitted by least squares on relative errors; a fit's residual spread per degree
of freedom measures how well the shape follows the numbers, and its median over a job's
steps is the measurements' noise (`pooled_spread`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kareus.core import Measurement


@dataclass(frozen=True)
class Curves:
    """A series' two curves: the coefficients of time (a, b) and of dynamic energy
    (c0, c1, c2), MHz scaled to GHz."""

    time: np.ndarray
    energy: np.ndarray

    @classmethod
    def fit(cls, points: Sequence[tuple[int, Measurement]]) -> Curves:
        f = np.array([p[0] for p in points], dtype=float)
        t = np.array([p[1].time_s for p in points])
        e = np.array([p[1].dynamic_energy_j for p in points])
        return cls(_relative_lstsq(_time_basis(f), t), _relative_lstsq(_energy_basis(f), e))

    def predict(self, freq_mhz: float) -> tuple[float, float]:
        f = np.array([float(freq_mhz)])
        return (float((_time_basis(f) @ self.time)[0]),
                float((_energy_basis(f) @ self.energy)[0]))

    def spread(self, points: Sequence[tuple[int, Measurement]]) -> tuple[float, float]:
        """The residuals' relative spread (time, energy), per degree of freedom."""
        rt, re = [], []
        for f, m in points:
            t, e = self.predict(f)
            rt.append(t / m.time_s - 1)
            re.append(e / m.dynamic_energy_j - 1 if m.dynamic_energy_j else 0.0)
        return (_rms(rt, len(points) - len(self.time)),
                _rms(re, len(points) - len(self.energy)))


@dataclass(frozen=True)
class HeldOut:
    """A fit checked against a clock held out of it: its relative errors there."""

    time_error: float
    energy_error: float
    spread: tuple[float, float]
    """The fit's relative residual spread (time, energy), per degree of freedom."""


def pooled_spread(checks: Sequence[HeldOut]) -> tuple[float, float]:
    """The measurements' noise, as the median over every step of its fit's residual
    spread (time, energy): a step whose curve the shape cannot follow has a large spread
    of its own, which must not loosen its own check; the median over the job's steps is
    the noise they share. Zero with fewer than three steps (no noise allowance)."""
    if len(checks) < 3:
        return 0.0, 0.0
    return (float(np.median([c.spread[0] for c in checks])),
            float(np.median([c.spread[1] for c in checks])))


def _time_basis(f: np.ndarray) -> np.ndarray:
    return np.c_[np.ones_like(f), 1e3 / f]


def _energy_basis(f: np.ndarray) -> np.ndarray:
    x = f / 1e3
    return np.c_[np.ones_like(x), x, x * x]


def _relative_lstsq(basis: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of the relative errors (each row divided by its value)."""
    scale = np.where(np.abs(y) > 0, np.abs(y), 1.0)
    coef, *_ = np.linalg.lstsq(basis / scale[:, None], y / scale, rcond=None)
    return coef


def _rms(residuals: list[float], dof: int) -> float:
    if dof <= 0:
        return 0.0
    return float(np.sqrt(np.sum(np.square(residuals)) / dof))
