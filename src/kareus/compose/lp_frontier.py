"""The pipeline's time-energy tradeoff as a linear program, solved at target times.

Each instruction's options, as (time, dynamic energy), have a lower convex hull; the least
dynamic energy of the whole pipeline at an iteration time ``T`` over that hull is a linear
program (the classic time-cost tradeoff with convex piecewise-linear costs):

    minimise    sum_i c_i
    subject to  c_i >= e_k + slope_k (x_i - t_k)      each hull segment k of i
                t_first(i) <= x_i <= t_last(i)        the duration stays on the hull
                S_j >= S_i + x_i + send_i             each dependency i -> j (the schedule's)
                S_l + x_l + send_l + end_r <= T       each rank's last instruction l
                S_i >= 0

It is solved with HiGHS (``highspy``) at evenly spaced targets between the fastest and the
slowest plan; each solve starts from the last one's basis, so after the first only a few
simplex iterations are needed. Phillips-Dessouky (kareus.compose.phillips_dessouky) walks
the same hull one time unit at a time with a min-cut per unit; at a target it reaches the
same optimum, but its cost grows with the number of units, this one's with the number of
targets. A solution's duration may fall between two hull vertices: the instruction takes
its slowest option that is no slower (so the iteration stays within ``T``), and slack
filling (kareus.compose.slack) then moves what can move.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kareus.compose.instruction import InstructionOption
from kareus.compose.pipeline_costs import PipelineCosts
from kareus.core import InstructionId
from kareus.errors import KareusError

Hull = list[tuple[float, float]]


def default_targets(costs: PipelineCosts) -> int:
    """Target times between the fastest and the slowest plan: 120 for small pipelines, 60
    for the largest (each target costs one slack fill, linear in the pipeline's size)."""
    instructions = 2 * costs.stages * costs.microbatches
    return max(60, min(120, 120_000 // instructions))


def lower_hull(points: list[tuple[float, float]]) -> Hull:
    """The lower convex hull of (time, energy) points, fastest first, as far as the point
    of least energy (the slower part of a hull never pays)."""
    pts = sorted(set(points))
    hull: Hull = []
    for p in pts:
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
            hull.pop()
        hull.append(p)
    least = min(range(len(hull)), key=lambda i: (hull[i][1], hull[i][0]))
    return hull[:least + 1]


def lp_choices(options: dict[tuple[int, str], list[InstructionOption]],
               costs: PipelineCosts, fastest_s: float, slowest_s: float,
               targets: int | None = None) -> Iterator[dict[InstructionId, int]]:
    """Per target time, from fastest to slowest, the choice of option per instruction."""
    n_targets = targets or default_targets(costs)
    model = _PipelineLp(options, costs)
    # the fastest time too: the least energy at it is not every instruction at its fastest
    for target_s in np.linspace(fastest_s, slowest_s, n_targets + 1)[:-1]:
        durations = model.solve(float(target_s))
        if durations is not None:
            yield model.choice(durations)


class _PipelineLp:
    """The linear program of one pipeline and one set of options, kept in HiGHS so that
    each target's solve starts from the previous basis.

    A duration is its hull's fastest time plus one bounded column per hull segment
    (``x_i = t_0 + sum_k y_ik``, ``0 <= y_ik <= t_(k+1) - t_k``, cost ``slope_k`` per
    second): the slopes rise along a convex hull, so a minimum fills the segments in order,
    and the rows are the dependencies alone (bounds are cheap for the simplex, rows not).
    """

    def __init__(self, options: dict[tuple[int, str], list[InstructionOption]],
                 costs: PipelineCosts) -> None:
        import highspy

        inf = highspy.kHighsInf
        c = costs.shape
        self.ids = c.ids
        self.times = {k: np.array([o.time_s for o in v]) for k, v in options.items()}
        hulls = {k: lower_hull([(o.time_s, o.dynamic_energy_j) for o in v])
                 for k, v in options.items()}
        n = len(c.ids)
        out_delay = c.out_delays(costs.send_activation_s, costs.send_grad_s)
        rank_end = c.rank_end_s(costs.end_s)
        # columns: S_i (n), then each instruction's segments
        lo, hi, cost = [0.0] * n, [inf] * n, [0.0] * n
        segs: list[list[int]] = []
        self.t0 = np.empty(n)
        for i, (s, _m, d) in enumerate(c.ids):
            hull = hulls[(s, d)]
            self.t0[i] = hull[0][0]
            first = len(lo)
            for (t0, e0), (t1, e1) in itertools.pairwise(hull):
                lo.append(0.0)
                hi.append(t1 - t0)
                cost.append((e1 - e0) / (t1 - t0))
            segs.append(list(range(first, len(lo))))
        self.segs = segs
        rows: list[tuple[list[int], list[float], float, float]] = []
        for i in range(n):
            for p in c.preds[i]:  # S_i - S_p - sum_k y_pk >= send_p + t0_p
                rows.append(([i, p, *segs[p]], [1.0, -1.0, *[-1.0] * len(segs[p])],
                             out_delay[p] + self.t0[p], inf))
        self.end_rows: list[tuple[int, float]] = []
        for i in range(n):
            if c.last_on_rank[i]:  # S_l + sum_k y_lk <= T - send_l - end_r - t0_l
                self.end_rows.append((len(rows),
                                      out_delay[i] + rank_end[c.rank[i]] + self.t0[i]))
                rows.append(([i, *segs[i]], [1.0] * (1 + len(segs[i])), -inf, 0.0))
        self.h = _highs(np.array(lo), np.array(hi), np.array(cost), rows)
        self.n = n

    def solve(self, target_s: float) -> np.ndarray | None:
        """Durations at the least dynamic energy within ``target_s``; None if infeasible."""
        import highspy

        for row, fixed_s in self.end_rows:
            self.h.changeRowBounds(row, -highspy.kHighsInf, target_s - fixed_s)
        self.h.run()
        status = self.h.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return None
        if status != highspy.HighsModelStatus.kOptimal:
            raise KareusError(f"the pipeline LP (HiGHS) ended with "
                              f"{self.h.modelStatusToString(status)} at {target_s:.4f} s")
        y = np.asarray(self.h.getSolution().col_value)
        return self.t0 + np.array([y[k].sum() for k in self.segs])

    def choice(self, durations: np.ndarray) -> dict[InstructionId, int]:
        """Per instruction, its slowest option no slower than its LP duration."""
        out: dict[InstructionId, int] = {}
        for iid, x in zip(self.ids, durations, strict=True):
            times = self.times[(iid[0], iid[2])]
            tol = 1e-9 * max(1.0, float(times[-1]))
            out[iid] = max(0, int(np.searchsorted(times, x + tol, side="right")) - 1)
        return out


def _highs(col_lo: np.ndarray, col_hi: np.ndarray, col_cost: np.ndarray,
           rows: list[tuple[list[int], list[float], float, float]]):  # -> highspy.Highs
    """A quiet HiGHS instance minimising ``col_cost`` over bounded columns and ``rows``
    (column indices, coefficients, lower, upper)."""
    import highspy

    with _stdout_silenced():  # HiGHS prints its banner from C++ when constructed
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 0)
    ncol = len(col_lo)
    h.addVars(ncol, col_lo, col_hi)
    h.changeColsCost(ncol, np.arange(ncol, dtype=np.int32), col_cost)
    starts = np.cumsum([0] + [len(r[0]) for r in rows[:-1]]).astype(np.int32)
    index = np.array([j for r in rows for j in r[0]], dtype=np.int32)
    value = np.array([v for r in rows for v in r[1]], dtype=float)
    h.addRows(len(rows), np.array([r[2] for r in rows]), np.array([r[3] for r in rows]),
              len(index), starts, index, value)
    return h


@contextmanager
def _stdout_silenced() -> Iterator[None]:
    """File descriptor 1 goes to /dev/null inside the block (C-level prints included)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])
