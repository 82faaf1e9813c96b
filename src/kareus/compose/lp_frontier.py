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
from typing import Any

import numpy as np

from kareus.compose.instruction import InstructionOption
from kareus.compose.pipeline_costs import PipelineCosts
from kareus.core import InstructionId
from kareus.errors import KareusError
from kareus.plans.schedule import run_times

Hull = list[tuple[float, float]]


def default_targets(costs: PipelineCosts) -> int:
    """Target times between the fastest and the least-energy plan: 120 for small pipelines,
    fewer for large ones, never under 24 (each target costs one warm-started LP solve and
    one slack fill, both growing with the pipeline's size; 58 for 512 instructions)."""
    instructions = 2 * costs.stages * costs.microbatches
    return max(24, min(120, 30_000 // instructions))


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
    """Per target time, from the least-energy time down to the fastest, the choice of
    option per instruction. The targets span the fastest time to the time of least total
    energy (static power included): a slower plan costs more energy and takes longer, so
    no target goes there."""
    n_targets = targets or default_targets(costs)
    model = _PipelineLp(options, costs)
    # The LP prices steady durations; the evaluated ends may be faster (wait transients,
    # kareus.compose.transient), and a target below the LP's own fastest time is infeasible.
    fastest_s = max(fastest_s, model.fastest_time_s)
    least_s = model.least_energy_time(fastest_s, slowest_s)
    if least_s is None:
        return
    # the fastest time too: the least energy at it is not every instruction at its fastest
    for target_s in np.linspace(least_s, fastest_s, n_targets):
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
    The iteration time ``T`` is the last column.
    """

    def __init__(self, options: dict[tuple[int, str], list[InstructionOption]],
                 costs: PipelineCosts) -> None:
        import highspy

        inf = highspy.kHighsInf
        c = costs.shape
        self.ids = c.ids
        keys = sorted(options)
        key_of = {k: j for j, k in enumerate(keys)}
        self.key_index = np.array([key_of[(s, d)] for s, _m, d in c.ids])
        self.times = [np.array([o.time_s for o in options[k]]) for k in keys]
        hulls = {k: lower_hull([(o.time_s, o.dynamic_energy_j) for o in v])
                 for k, v in options.items()}
        n = len(c.ids)
        out_delay = c.out_delays(costs.send_activation_s, costs.send_grad_s)
        rank_end = c.rank_end_s(costs.end_s)
        # columns: S_i (n), then each instruction's segments, then T
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
        self.seg_owner = np.repeat(np.arange(n), [len(g) for g in segs])
        self.seg_cols = np.arange(n, len(lo))
        self.t_col = len(lo)
        lo.append(0.0)
        hi.append(inf)
        cost.append(0.0)
        rows: list[tuple[list[int], list[float], float, float]] = []
        for i in range(n):
            for p in c.preds[i]:  # S_i - S_p - sum_k y_pk >= send_p + t0_p
                rows.append(([i, p, *segs[p]], [1.0, -1.0, *[-1.0] * len(segs[p])],
                             out_delay[p] + self.t0[p], inf))
            if c.last_on_rank[i]:  # S_l + sum_k y_lk - T <= -(send_l + end_r + t0_l)
                rows.append(([i, *segs[i], self.t_col], [1.0] * (1 + len(segs[i])) + [-1.0],
                             -inf, -(out_delay[i] + rank_end[c.rank[i]] + self.t0[i])))
        self.h = _highs(np.array(lo), np.array(hi), np.array(cost), rows)
        _s, _f, ends = run_times(c, self.t0.tolist(), out_delay, rank_end)
        self.fastest_time_s = max(ends)
        """Every instruction at its hull's fastest time: the least T the program allows."""
        # the whole energy per rank's GPU: dynamic (the columns) + pp x static power x T
        self.static_w = costs.pp * costs.static_power_w

    def least_energy_time(self, fastest_s: float, slowest_s: float) -> float | None:
        """The iteration time of least total energy, between the two ends."""
        self.h.changeColCost(self.t_col, self.static_w)
        self.h.changeColBounds(self.t_col, fastest_s, slowest_s)
        durations = self._run(slowest_s)
        self.h.changeColCost(self.t_col, 0.0)
        if durations is None:
            return None
        return float(np.clip(self.h.getSolution().col_value[self.t_col], fastest_s, slowest_s))

    def solve(self, target_s: float) -> np.ndarray | None:
        """Durations at the least dynamic energy within ``target_s``; None if infeasible."""
        self.h.changeColBounds(self.t_col, 0.0, target_s)
        return self._run(target_s)

    def _run(self, target_s: float) -> np.ndarray | None:
        import highspy

        solve_answering_signals(self.h)
        status = self.h.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return None
        if status != highspy.HighsModelStatus.kOptimal:
            raise KareusError(f"the pipeline LP (HiGHS) ended with "
                              f"{self.h.modelStatusToString(status)} at {target_s:.4f} s")
        y = np.asarray(self.h.getSolution().col_value)[self.seg_cols]
        return self.t0 + np.bincount(self.seg_owner, weights=y, minlength=len(self.t0))

    def choice(self, durations: np.ndarray) -> dict[InstructionId, int]:
        """Per instruction, its slowest option no slower than its LP duration."""
        pick = np.zeros(len(durations), dtype=int)
        for j, times in enumerate(self.times):
            rows = np.flatnonzero(self.key_index == j)
            tol = 1e-9 * max(1.0, float(times[-1]))
            pick[rows] = np.searchsorted(times, durations[rows] + tol, side="right") - 1
        return dict(zip(self.ids, np.maximum(pick, 0).tolist(), strict=True))


def _highs(col_lo: np.ndarray, col_hi: np.ndarray, col_cost: np.ndarray,
           rows: list[tuple[list[int], list[float], float, float]]):  # -> highspy.Highs
    """A quiet HiGHS instance minimising ``col_cost`` over bounded columns and ``rows``
    (column indices, coefficients, lower, upper)."""
    import highspy

    with _stdout_silenced():  # HiGHS prints its banner from C++ when constructed
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 0)
    h.HandleUserInterrupt = True  # cancelSolve stops a solve (solve_answering_signals)
    ncol = len(col_lo)
    h.addVars(ncol, col_lo, col_hi)
    h.changeColsCost(ncol, np.arange(ncol, dtype=np.int32), col_cost)
    starts = np.cumsum([0] + [len(r[0]) for r in rows[:-1]]).astype(np.int32)
    index = np.array([j for r in rows for j in r[0]], dtype=np.int32)
    value = np.array([v for r in rows for v in r[1]], dtype=float)
    h.addRows(len(rows), np.array([r[2] for r in rows]), np.array([r[3] for r in rows]),
              len(index), starts, index, value)
    return h


SIGNAL_POLL_S = 0.1
"""How often the waiting thread wakes while HiGHS solves: a signal is answered within it."""


def solve_answering_signals(h: Any) -> None:
    """``h.run()`` in HiGHS's own thread (highspy's startSolve, which releases the GIL)
    while this one waits in steps of `SIGNAL_POLL_S`: SIGTERM and Ctrl-C raise here at
    once, and HiGHS is told to stop before the exception goes on. In this thread a solve
    held every signal for its whole length (issue 34: one solve of 16 stages x 1,024
    microbatches took 33 s)."""
    thread = h.startSolve()
    try:
        while not h.wait(SIGNAL_POLL_S)[0]:
            pass
    except BaseException:
        h.cancelSolve()  # HiGHS checks it between iterations: it stops within ~10 ms
        thread.join(1.0)
        raise


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
