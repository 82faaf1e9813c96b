"""How close a set of measured settings comes to the true frontier.

The score of a search is the hypervolume of the *true* (time, dynamic energy) values of the
settings it measured, relative to the hypervolume of the exhaustive true frontier. Both are
normalised by the true frontier's ideal and nadir points with the reference 10% beyond the
nadir, so the score measures coverage of the frontier itself, ends included; a reference
at the worst setting of the whole space would give even a poor search a ratio near 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kareus.core.pareto import hypervolume, pareto_mask


class FrontierQuality:
    def __init__(self, true_points: Sequence[Sequence[float]]) -> None:
        pts = np.asarray(true_points, dtype=float)
        front = pts[np.asarray(pareto_mask(pts))]
        self.ideal = front.min(axis=0)
        self.span = np.maximum(front.max(axis=0) - self.ideal, 1e-300)
        self.best = hypervolume(self._norm(front), (1.1, 1.1))

    def _norm(self, pts: np.ndarray) -> np.ndarray:
        return (np.asarray(pts, dtype=float).reshape(-1, 2) - self.ideal) / self.span

    def ratio(self, points: Iterable[Sequence[float]]) -> float:
        """Hypervolume ratio of ``points`` (true values of measured settings)."""
        pts = list(points)
        if not pts or self.best <= 0:
            return 0.0
        return hypervolume(self._norm(np.asarray(pts)), (1.1, 1.1)) / self.best
