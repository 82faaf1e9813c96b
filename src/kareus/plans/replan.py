"""What re-planning while training saves, planned (issue 39): a straggler scenario and a
power-cap schedule, computed from a method's frontier alone (no file, no GPU).

Straggler. ``replicas`` data-parallel replicas run the operator's plan P0 (time T0); one
slows by ``slowdown`` f for ``duration_iterations`` N. Every replica waits at the gradient
sync for the slowest, so an iteration takes f.T0 either way. Without re-planning the other
replicas finish at T0 and wait f.T0 - T0; with re-planning they run P1, the least-energy
plan whose time is at most f.T0 (what the runtime's pace trigger picks), and wait
f.T0 - T1. A runtime learns the pace at the end of an iteration and moves to a slower plan
only once the pace has held (its patience), so the others switch ``switch_in_iterations``
L_in after the slowdown starts (never, when the slowdown is no longer than that), and
switch back ``reaction_iterations`` L after it ends (moving faster is not delayed beyond
learning the pace): in those L iterations after the recovery the others still run P1 and
the iteration takes T1 (the recovered straggler waits). 0 and 0 is the ideal bound (the
run's time unchanged).

Energy of one replica-iteration of a plan: the plan's energy over the replicas its result
covers (a result's energy is the whole job's: every data-parallel replica, each running
the same pipeline). A waiting GPU draws ``wait_power_w``: the static power the plan's own
energy charges a GPU that waits in a pipeline bubble (kareus.plans.power). The straggler
does P0's work slowed: its energy is P0's plus the wait power over the extra (f - 1).T0,
the same in both runs; what slows it and what it draws are unknown.

Power-cap schedule. Steps (iteration, cap or None). With re-planning the run switches to
the fastest plan under the new cap at the next iteration boundary: the iteration in which
the step arrives still runs the old plan. Restarting: the run stops at the same boundary
and starts again on the new plan after ``restart_s`` (checkpoint, relaunch, load: the
user's figure), its GPUs at ``idle_power_w``. A step without a cap runs P0. Neither way
charges the clock change of a switch: a plan changes clocks at every instruction and its
time charges none of those either.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kareus.errors import KareusError, SpecError
from kareus.plans.power import under_cap

PACE_ROUNDING = 1e-9
"""A plan this fraction slower than the pace still fits it: the pace (T0 x f, the
runtime's base time x slowest / own) lands an ulp under a plan whose time it equals
(1.2 s x 1.5 is 1.7999999999999998 s), which still meets it."""


@dataclass(frozen=True)
class FrontierPlan:
    """A frontier plan as the computation needs it: its time and energy per iteration of
    the whole job, and the peak of its cluster power (None: not recorded)."""

    id: str
    time_s: float
    energy_j: float
    peak_w: float | None = None


@dataclass(frozen=True)
class JobShape:
    """What the result's job is: ``result_replicas`` data-parallel replicas of
    ``gpus_per_replica`` GPUs each, a waiting GPU drawing ``wait_power_w``, an idle one
    (a restart) ``idle_power_w``."""

    result_replicas: int
    gpus_per_replica: int
    wait_power_w: float
    idle_power_w: float = 0.0

    def replica_energy_j(self, p: FrontierPlan) -> float:
        return p.energy_j / self.result_replicas

    def wait_w(self) -> float:
        """One replica's power while it waits."""
        return self.gpus_per_replica * self.wait_power_w


@dataclass(frozen=True)
class StragglerSavings:
    p0: FrontierPlan
    p1: FrontierPlan
    replicas: int
    slowdown: float
    duration_iterations: int
    reaction_iterations: int
    switch_in_iterations: int
    iterations: int
    """The iterations the scenario covers: the slowdown's and the reaction after it."""
    time_without_s: float
    time_with_s: float
    energy_without_j: float
    energy_with_j: float
    wait_without_j: float
    """Energy the replicas spend waiting at the sync (Perseus's extrinsic energy bloat)."""
    wait_with_j: float

    @property
    def saved_j(self) -> float:
        return self.energy_without_j - self.energy_with_j

    @property
    def saved_fraction(self) -> float:
        return self.saved_j / self.energy_without_j if self.energy_without_j > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"p0": self.p0.id, "p0_time_s": self.p0.time_s, "p1": self.p1.id,
                "p1_time_s": self.p1.time_s, "replicas": self.replicas,
                "slowdown": self.slowdown, "duration_iterations": self.duration_iterations,
                "reaction_iterations": self.reaction_iterations,
                "switch_in_iterations": self.switch_in_iterations,
                "iterations": self.iterations, "time_without_s": self.time_without_s,
                "time_with_s": self.time_with_s, "energy_without_j": self.energy_without_j,
                "energy_with_j": self.energy_with_j, "wait_without_j": self.wait_without_j,
                "wait_with_j": self.wait_with_j, "saved_j": self.saved_j,
                "saved_fraction": self.saved_fraction}


def plan_by_id(plans: Sequence[FrontierPlan], plan_id: str | None) -> FrontierPlan:
    """The plan ``plan_id``, or the fastest (None)."""
    if not plans:
        raise KareusError("the frontier is empty")
    if plan_id is None:
        return min(plans, key=lambda p: (p.time_s, p.energy_j))
    for p in plans:
        if p.id == plan_id:
            return p
    raise KareusError(f"no plan {plan_id!r} on the frontier (plans: {plans[0].id} ... "
                      f"{plans[-1].id})")


class Timed(Protocol):
    """A plan as the pace rule reads it (`FrontierPlan`, `kareus.plans.plan.Plan`)."""

    @property
    def time_s(self) -> float: ...

    @property
    def energy_j(self) -> float: ...


P = TypeVar("P", bound=Timed)


def pace_plan(plans: Iterable[P], p0: P, pace_s: float) -> P:
    """The least-energy plan (the faster of equals) among ``p0`` and the ``plans`` whose
    time is at most ``pace_s`` (up to PACE_ROUNDING); ``p0`` where the pace is faster than
    P0's own time. The one rule of the runtime's pace trigger
    (`kareus.runtime.plan_switcher.PlanSwitcher.for_pace`) and of the straggler here."""
    limit = pace_s * (1 + PACE_ROUNDING)
    if limit < p0.time_s:
        return p0
    return min([p0, *(p for p in plans if p.time_s <= limit)],
               key=lambda p: (p.energy_j, p.time_s))


def straggler_savings(plans: Sequence[FrontierPlan], shape: JobShape, replicas: int,
                      slowdown: float, duration_iterations: int,
                      p0_id: str | None = None, reaction_iterations: int = 1,
                      switch_in_iterations: int | None = None) -> StragglerSavings:
    """The straggler scenario with and without re-planning (module docstring);
    ``switch_in_iterations`` None: ``reaction_iterations``."""
    lag_in = reaction_iterations if switch_in_iterations is None else switch_in_iterations
    if replicas < 1:
        raise SpecError(f"--replicas must be at least 1, got {replicas}")
    if not (slowdown > 0 and math.isfinite(slowdown)):
        raise SpecError(f"--slowdown must be a positive factor, got {slowdown:g}")
    if duration_iterations < 1:
        raise SpecError(f"--duration-iterations must be at least 1, got "
                        f"{duration_iterations}")
    if reaction_iterations < 0 or lag_in < 0:
        raise SpecError(f"--reaction-iterations and --switch-in-iterations must be 0 or "
                        f"more, got {reaction_iterations} and {lag_in}")
    p0 = plan_by_id(plans, p0_id)
    f = max(slowdown, 1.0)  # a faster replica sets no pace: the others set it
    t0 = p0.time_s
    pace = f * t0
    p1 = pace_plan(plans, p0, pace) if replicas > 1 and slowdown > 1 else p0
    e0, e1, w = shape.replica_energy_j(p0), shape.replica_energy_j(p1), shape.wait_w()
    n, lag, others = duration_iterations, reaction_iterations, replicas - 1
    straggler_j = e0 + w * (pace - t0)  # P0's work slowed: the same in both runs
    # iterations by (straggler slow?, others on P1?): slow and not yet switched, slow and
    # switched, recovered and still switched, recovered on P0 (the others never switched:
    # the slowdown was no longer than L_in)
    a, b = min(n, lag_in), max(0, n - lag_in)
    c = lag if b > 0 else 0
    d = lag - c
    iterations = n + lag
    time_without = n * pace + lag * t0
    energy_without = n * (straggler_j + others * (e0 + w * (pace - t0))) + lag * replicas * e0
    wait_without = n * others * w * (pace - t0)
    t_rec = max(p1.time_s, t0)  # the recovered straggler waits for the others on P1
    time_with = (a + b) * pace + c * t_rec + d * t0
    energy_with = (a * (straggler_j + others * (e0 + w * (pace - t0)))
                   + b * (straggler_j + others * (e1 + w * (pace - p1.time_s)))
                   + c * (e0 + w * (t_rec - t0) + others * (e1 + w * (t_rec - p1.time_s)))
                   + d * replicas * e0)
    wait_with = (a * others * w * (pace - t0) + b * others * w * (pace - p1.time_s)
                 + c * (w * (t_rec - t0) + others * w * (t_rec - p1.time_s)))
    if p1 == p0:  # nothing switches: the same run (not the same sum's rounding)
        time_with, energy_with, wait_with = time_without, energy_without, wait_without
    return StragglerSavings(p0, p1, replicas, slowdown, n, lag, lag_in, iterations,
                            time_without, time_with, energy_without, energy_with,
                            wait_without, wait_with)


# Power-cap schedule -------------------------------------------------------------------


@dataclass(frozen=True)
class CapStep:
    start_iteration: int
    cap_w: float | None


def parse_cap_schedule(text: str) -> list[CapStep]:
    """``"0:none,2000:4.5,5000:none"``: from iteration 0 no cap, from 2000 a 4.5 kW cap,
    from 5000 none again. Starts strictly increasing, the first at iteration 0."""
    steps: list[CapStep] = []
    for item in text.split(","):
        start, sep, cap = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            it = int(start)
            kw = None if cap.strip().lower() == "none" else float(cap)
        except ValueError:
            raise SpecError(f"--cap-schedule: {item.strip()!r} is not ITERATION:KW or "
                            f"ITERATION:none (e.g. 0:none,2000:4.5,5000:none)") from None
        if kw is not None and not (kw > 0 and math.isfinite(kw)):
            raise SpecError(f"--cap-schedule: a cap must be a positive number of kW, got "
                            f"{cap.strip()!r}")
        if it < 0 or (steps and it <= steps[-1].start_iteration):
            raise SpecError(f"--cap-schedule: iterations must start at 0 and increase, got "
                            f"{it} after {steps[-1].start_iteration if steps else 'nothing'}")
        steps.append(CapStep(it, None if kw is None else kw * 1e3))
    if steps[0].start_iteration != 0:
        raise SpecError("--cap-schedule must start at iteration 0 (e.g. 0:none,...)")
    return steps


@dataclass(frozen=True)
class Segment:
    """Iterations ``start`` .. ``end`` (excluded) on ``plan``."""

    start: int
    end: int
    plan: FrontierPlan


@dataclass(frozen=True)
class CapScheduleRun:
    iterations: int
    restart_s: float
    plans: list[FrontierPlan]
    """Per step, the plan its cap selects."""
    switches: int
    """Steps that change the plan: a switch with re-planning, a restart without."""
    time_replan_s: float
    energy_replan_j: float
    time_restart_s: float
    energy_restart_j: float
    time_static_s: float
    """One plan for the whole run: the fastest under every cap of the schedule."""
    energy_static_j: float
    static_plan: FrontierPlan
    over_cap_iterations: int
    """Iterations that run the old plan under a new, lower cap (one per such step)."""

    def to_dict(self) -> dict[str, object]:
        return {"iterations": self.iterations, "restart_s": self.restart_s,
                "plans": [p.id for p in self.plans], "switches": self.switches,
                "replan": {"time_s": self.time_replan_s, "energy_j": self.energy_replan_j},
                "restart": {"time_s": self.time_restart_s,
                            "energy_j": self.energy_restart_j},
                "one_plan": {"plan": self.static_plan.id, "time_s": self.time_static_s,
                             "energy_j": self.energy_static_j},
                "over_cap_iterations": self.over_cap_iterations}


def fastest_under(plans: Sequence[FrontierPlan], cap_w: float | None, p0: FrontierPlan,
                  window_s: float) -> FrontierPlan:
    """The fastest plan whose peak stays under ``cap_w`` (as `kareus plan --power-cap-kw`
    selects); P0 without a cap. One KareusError where no plan fits."""
    if cap_w is None:
        return p0
    if any(p.peak_w is None for p in plans):
        raise KareusError("the plans do not record their power; run `kareus optimize` again "
                          "for a power cap")
    ok = under_cap([{"p": p} for p in plans], cap_w, [float(p.peak_w or 0.0) for p in plans],
                   window_s)
    return min((d["p"] for d in ok), key=lambda p: (p.time_s, p.energy_j))


def cap_schedule_run(plans: Sequence[FrontierPlan], shape: JobShape, steps: Sequence[CapStep],
                     iterations: int, restart_s: float, p0_id: str | None = None,
                     window_s: float = 1.0) -> CapScheduleRun:
    """The run under the cap schedule, re-planned at iteration boundaries against
    restarting at each change of plan, and against one plan for the whole run."""
    if iterations < 1:
        raise SpecError(f"--iterations must be at least 1, got {iterations}")
    if not (restart_s >= 0 and math.isfinite(restart_s)):
        raise SpecError(f"--restart-s must be a number of seconds >= 0, got {restart_s:g}")
    if not steps or steps[0].start_iteration != 0:
        raise SpecError("a cap schedule starts at iteration 0")
    late = [s.start_iteration for s in steps if s.start_iteration >= iterations]
    if late:
        raise SpecError(f"--cap-schedule has a step at iteration {late[0]}, after the run's "
                        f"last ({iterations - 1}); give more --iterations")
    p0 = plan_by_id(plans, p0_id)
    chosen = [fastest_under(plans, s.cap_w, p0, window_s) for s in steps]
    caps = [s.cap_w for s in steps if s.cap_w is not None]
    static = fastest_under(plans, min(caps), p0, window_s) if caps else p0
    bounds = [s.start_iteration for s in steps] + [iterations]
    segments: list[Segment] = []
    switches = over = 0
    for k, p in enumerate(chosen):
        start, end = bounds[k], bounds[k + 1]
        changed = k > 0 and p.id != chosen[k - 1].id
        switches += changed
        cap = steps[k].cap_w
        if changed and cap is not None and (chosen[k - 1].peak_w or 0.0) > cap:
            over += 1
        # the iteration a step arrives in ends on the old plan, both ways (a restart
        # stops at the same boundary)
        segments.append(Segment(start + (k > 0), end + (k + 1 < len(chosen)), p))
    t_run = sum((s.end - s.start) * s.plan.time_s for s in segments)
    e_run = sum((s.end - s.start) * s.plan.energy_j for s in segments)
    gpus = shape.result_replicas * shape.gpus_per_replica
    return CapScheduleRun(
        iterations, restart_s, chosen, switches, t_run, e_run,
        t_run + switches * restart_s,
        e_run + switches * restart_s * gpus * shape.idle_power_w,
        iterations * static.time_s, iterations * static.energy_j, static, over)
