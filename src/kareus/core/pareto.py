"""Pareto filtering of (time, energy)-like points: both objectives minimised."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def pareto_mask(points: Sequence[Sequence[float]] | np.ndarray) -> list[bool]:
    """True for each point no other point dominates (<= in both, < in one).

    Exact duplicates are all kept. O(n log n): sort by the first objective, sweep the
    second.
    """
    arr = np.asarray(points, dtype=float)
    n = len(arr)
    if n == 0:
        return []
    order = np.lexsort((arr[:, 1], arr[:, 0]))
    keep = np.zeros(n, dtype=bool)
    best_y = np.inf
    i = 0
    while i < n:
        # a run of points with the same first objective: only those with the run's minimum
        # second objective can survive, and only if it beats everything faster
        j = i
        x = arr[order[i], 0]
        while j < n and arr[order[j], 0] == x:
            j += 1
        run = order[i:j]
        y_min = arr[run, 1].min()
        if y_min < best_y:
            for k in run:
                if arr[k, 1] == y_min:
                    keep[k] = True
            best_y = y_min
        i = j
    return keep.tolist()


def pareto_front(items: Sequence[T], key: Callable[[T], tuple[float, float]]) -> list[T]:
    """The items no other dominates by ``key`` (both minimised; `pareto_mask`), by their
    first objective (ties in their order)."""
    mask = pareto_mask([key(x) for x in items])
    return sorted((x for x, keep in zip(items, mask) if keep), key=lambda x: key(x)[0])


def hypervolume(points: np.ndarray, ref: Sequence[float]) -> float:
    """Hypervolume dominated by ``points`` (minimised) up to ``ref``, via moocore."""
    import moocore

    pts = np.asarray(points, dtype=float).reshape(-1, len(ref))
    pts = pts[np.all(pts < np.asarray(ref), axis=1)]
    if len(pts) == 0:
        return 0.0
    return float(moocore.hypervolume(pts, ref=np.asarray(ref, dtype=float)))


def hypervolume_improvements(front: np.ndarray, candidates: np.ndarray,
                             ref: Sequence[float]) -> np.ndarray:
    """Hypervolume each candidate would add to ``front`` on its own (0 if dominated)."""
    front = np.asarray(front, dtype=float).reshape(-1, len(ref))
    cands = np.asarray(candidates, dtype=float).reshape(-1, len(ref))
    out = np.zeros(len(cands))
    inside = np.all(cands < np.asarray(ref), axis=1)
    if len(front):
        # weakly dominated by a front point: no improvement, skip the hypervolume call
        dominated = np.any(np.all(front[None, :, :] <= cands[:, None, :], axis=2), axis=1)
        inside &= ~dominated
    base = hypervolume(front, ref)
    for i in np.flatnonzero(inside):
        out[i] = hypervolume(np.vstack([front, cands[i]]), ref) - base
    return out
