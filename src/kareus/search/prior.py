"""The emulator prior's part of a search: its prediction of every setting, and an initial
design spread along its predicted frontier (docs/search.md, "Emulator-informed search")."""

from __future__ import annotations

import numpy as np

from kareus.backends.base import CostModel
from kareus.core.pareto import pareto_mask
from kareus.search.design import initial_design
from kareus.search.space import KnobSpace


def prior_values(space: KnobSpace, prior: CostModel) -> np.ndarray:
    """(time, dynamic energy) of every setting of ``space`` as ``prior`` predicts them."""
    rows = []
    for k in space.settings:
        m = prior.predict(space.partition, k)
        rows.append((max(m.time_s, 1e-12), max(m.dynamic_energy_j, 1e-12)))
    return np.asarray(rows)


def prior_design(space: KnobSpace, prior_y: np.ndarray, n: int, rng: np.random.Generator,
                 exclude: set[int]) -> list[int]:
    """Half of the settings spread along the prior's predicted (time, dynamic energy)
    frontier, half space-filling."""
    pts = prior_y
    front = [i for i in np.flatnonzero(pareto_mask(pts)) if i not in exclude]
    front.sort(key=lambda i: pts[i, 0])
    k = min(len(front), (n + 1) // 2)
    picks = ([front[round(j)] for j in np.linspace(0, len(front) - 1, k)] if k else [])
    picks = list(dict.fromkeys(picks))
    rest = initial_design(space, n - len(picks), rng, exclude | set(picks))
    return picks + rest
