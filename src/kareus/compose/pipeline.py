"""The iteration frontier: the pipeline DAG solved for its time-energy tradeoff.

Every instruction (stage, microbatch, direction) is an operation whose execution options
are its stage's instruction options for that direction. A solver picks one option per
instruction for a range of iteration times at the least dynamic energy: by default a
linear program over the options' convex hull at evenly spaced target times
(kareus.compose.lp_frontier, HiGHS), or Phillips-Dessouky one time unit at a time through
the `lowtime` package (kareus.compose.phillips_dessouky, the solver Perseus uses, kept for
parity). Each solution's slack is filled (kareus.compose.slack) and the plan is evaluated
exactly (the same list schedule the emulator uses, with the options' real times):
iteration time, and energy = GPUs per stage x sum of dynamic energies + GPUs x time x
static power. The frontier is the Pareto set of the plans met on the way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from kareus.compose.instruction import InstructionOption, pareto_front
from kareus.compose.pipeline_costs import Options, PipelineCosts
from kareus.compose.slack import fill_slack
from kareus.compose.transient import WAIT_HORIZON_S
from kareus.core import InstructionId
from kareus.errors import SpecError
from kareus.plans.schedule import Compiled, run_times, run_times_at

__all__ = ["Options", "PipelineCosts", "PipelinePoint", "Solver", "evaluate", "solve_frontier"]

Solver = Literal["lp", "phillips-dessouky"]
SOLVERS: tuple[Solver, ...] = ("lp", "phillips-dessouky")


@dataclass(frozen=True)
class PipelinePoint:
    time_s: float
    energy_j: float
    dynamic_energy_j: float
    choice: dict[InstructionId, int]
    """Per instruction, the index of its option in the (pruned) option list it was solved
    with; `picks` holds the options themselves."""
    picks: dict[InstructionId, InstructionOption]
    options: dict[tuple[int, str], list[InstructionOption]] = field(
        default_factory=dict, compare=False, repr=False)
    """The option lists ``choice`` indexes (shared, not copied)."""


def evaluate(options: Options, costs: PipelineCosts, choice: dict[InstructionId, int]
             ) -> PipelinePoint:
    """The plan's iteration time (the list schedule) and energy. A power-limited option
    is charged its wait transient (kareus.compose.transient) after the idle time before it
    on its rank; where no pick is power-limited, the options' steady costs alone."""
    c = costs.shape
    picks = {iid: options[(iid[0], iid[2])][choice[iid]] for iid in c.ids}
    _durations, energies, t = _charged(c, [picks[iid] for iid in c.ids], costs)
    dynamic = costs.gpus // costs.pp * (sum(energies) + sum(costs.fixed_dynamic_j))
    return PipelinePoint(t, dynamic + costs.gpus * t * costs.static_power_w, dynamic,
                         {iid: choice[iid] for iid in c.ids}, picks, options)


def charged_costs(point: PipelinePoint, costs: PipelineCosts
                  ) -> dict[InstructionId, tuple[float, float]]:
    """Each instruction's (duration, dynamic energy on one GPU of its stage) as `evaluate`
    charged them, wait transients included."""
    c = costs.shape
    durations, energies, _t = _charged(c, [point.picks[iid] for iid in c.ids], costs)
    return dict(zip(c.ids, zip(durations, energies, strict=True), strict=True))


def _charged(c: Compiled, ordered: list[InstructionOption], costs: PipelineCosts
             ) -> tuple[list[float], list[float], float]:
    """Per instruction (``c.ids`` order) its charged duration and dynamic energy (one GPU
    of its stage), and the iteration time."""
    out_delay = c.out_delays(costs.send_activation_s, costs.send_grad_s)
    rank_end = c.rank_end_s(costs.end_s)
    if any(o.transient is not None and o.transient.throttled for o in ordered):
        return _with_transients(c, ordered, out_delay, rank_end)
    durations = [o.time_s for o in ordered]
    _start, _finish, ends = run_times(c, durations, out_delay, rank_end)
    return durations, [o.dynamic_energy_j for o in ordered], max(ends)


def _with_transients(c: Compiled, ordered: list[InstructionOption], out_delay: list[float],
                     rank_end: list[float]) -> tuple[list[float], list[float], float]:
    """`run_times` with each instruction's duration its option's time plus its transient
    after the wait since its rank's previous instruction finished (a rank's first: the
    horizon, an idle GPU): the durations, the dynamic energies (one GPU) and the iteration
    time. Durations are asked in each rank's order (`run_times_at`), so the rank's
    previous instruction is the last one of that rank met."""
    durations = [0.0] * len(ordered)
    energies = [0.0] * len(ordered)
    last_finish: list[float | None] = [None] * c.pp

    def duration_at(i: int, start: float) -> float:
        o, r = ordered[i], c.rank[i]
        dt, de = 0.0, 0.0
        if o.transient is not None:
            prev = last_finish[r]
            dt, de = o.transient.delta(WAIT_HORIZON_S if prev is None else start - prev)
        durations[i] = o.time_s + dt
        energies[i] = o.dynamic_energy_j + de
        last_finish[r] = start + durations[i]
        return durations[i]

    _start, _finish, ends = run_times_at(c, duration_at, out_delay, rank_end)
    return durations, energies, max(ends)


def evaluate_filled(options: Options, costs: PipelineCosts,
                    choice: dict[InstructionId, int], exact_rounds: int | None = None
                    ) -> PipelinePoint:
    """``choice`` with its slack filled (kareus.compose.slack), evaluated."""
    return evaluate(options, costs, fill_slack(
        options, costs.pp, costs.microbatches, costs.send_activation_s, costs.send_grad_s,
        costs.end_s, choice, costs.vp, exact_rounds))


def uniform(options: Options, costs: PipelineCosts, fastest: bool) -> dict[InstructionId, int]:
    """Every instruction at its fastest (or slowest) option."""
    return {iid: 0 if fastest else len(options[(iid[0], iid[2])]) - 1
            for iid in costs.instructions()}


def default_steps(costs: PipelineCosts) -> int:
    """Phillips-Dessouky's steps between the slowest and the fastest plan: 400 for small
    pipelines, fewer for large ones (each step costs time proportional to the DAG's size;
    lowtime spends ~0.13 s per step on a 512-instruction pipeline here), never under 120."""
    instructions = 2 * costs.stages * costs.microbatches
    return max(120, min(400, 60_000 // instructions))


def pd_unit_s(costs: PipelineCosts, range_s: float, max_steps: int | None = None) -> float:
    """Phillips-Dessouky's time unit over a time range of ``range_s``: 1 ms or coarser."""
    return max(1e-3, range_s / (max_steps or default_steps(costs)))


def solve_frontier(options: Options, costs: PipelineCosts, max_steps: int | None = None,
                   solver: Solver = "lp") -> list[PipelinePoint]:
    """Pareto frontier of (iteration time, energy) plans.

    ``options[(stage, direction)]`` must be Pareto-sorted, fastest first. ``max_steps``:
    how finely the time range between the fastest and the slowest plan is walked (LP
    targets, or Phillips-Dessouky's steps; each solver has its default).
    """
    if solver not in SOLVERS:
        raise SpecError(f"unknown pipeline solver {solver!r}; known: {', '.join(SOLVERS)}")
    options = {k: drop_wasteful(pareto_front(v), costs.static_power_w)
               for k, v in options.items()}
    # every point is the least-energy plan found for its iteration time: slack filled
    fastest = evaluate_filled(options, costs, uniform(options, costs, fastest=True))
    slowest = evaluate(options, costs, uniform(options, costs, fastest=False))
    points = [fastest, slowest]
    if all(len(v) == 1 for v in options.values()):
        return _frontier(points)
    from kareus.compose.lp_frontier import lp_choices

    # an LP optimum rounded to options: one exact round of slack filling gets the rest
    if solver == "lp":
        points += [evaluate_filled(options, costs, c, 1) for c in lp_choices(
            options, costs, fastest.time_s, slowest.time_s, max_steps)]
        return _frontier(points)
    from kareus.compose.phillips_dessouky import pd_choices

    unit = pd_unit_s(costs, slowest.time_s - fastest.time_s, max_steps)
    # Phillips-Dessouky's plans: fill every slack (parity with before)
    walked = [evaluate_filled(options, costs, c) for c in pd_choices(options, costs, unit)]
    points += walked
    # The exact final step. The walk sees times in units: options closer than one (1410
    # and 1380 MHz on kareus-2) round to one time, so it stops where no unit can be cut,
    # short of the fastest plan (24 ms on kareus-2, unit 2.4 ms), and the frontier's fast
    # end would be the straight line to the all-fastest plan (+1.83% energy at equal time).
    # The LP at a unit's spacing over that last stretch closes it, at every scale (a 1 ms
    # unit, the Perseus artifact's, also closes it but multiplies the steps on large jobs).
    last_s = min((p.time_s for p in walked), default=slowest.time_s)
    if last_s > fastest.time_s + unit / 2:
        targets = max(2, math.ceil((last_s - fastest.time_s) / unit) + 1)
        points += [evaluate_filled(options, costs, c, 1) for c in lp_choices(
            options, costs, fastest.time_s, last_s, targets)]
    return _frontier(points)


def drop_wasteful(options: list[InstructionOption], static_power_w: float
                  ) -> list[InstructionOption]:
    """Drop options slower than the one with the least energy on its own GPU (dynamic +
    static power x time): running slower than that costs that GPU more energy than it
    saves whether or not the instruction is on the critical path. Without them the
    solver's time range covers only the useful range, so the frontier is finer where it
    matters."""
    if not options:
        return options
    best = min(options, key=lambda o: o.dynamic_energy_j + static_power_w * o.time_s)
    return [o for o in options if o.time_s <= best.time_s]


def merge_frontiers(*fronts: list[PipelinePoint]) -> list[PipelinePoint]:
    """The Pareto set of several solves' plans."""
    return _frontier([p for f in fronts for p in f])


def _frontier(points: list[PipelinePoint]) -> list[PipelinePoint]:
    return pareto_front(points, key=lambda p: (p.time_s, p.energy_j))
