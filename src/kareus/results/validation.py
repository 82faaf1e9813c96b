"""The plans of composed frontiers, and their validation: a stratified sample of each
method's frontier simulated as one whole iteration, against the composed numbers.

Each frontier point becomes a Plan (its execution plan, 1F1B timeline and power over
time); where a backend simulates whole iterations (`PlanSimulator`), ``per_method`` of
them are simulated and the largest relative error between composed and simulated time or
energy is the result's ``validation_max_error``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kareus.backends.base import PlanSimulator
from kareus.compose.pipeline import PipelineCosts, PipelinePoint
from kareus.compose.plans import timeline, to_execution_plan
from kareus.plans.methods import Method
from kareus.plans.plan import Plan
from kareus.plans.power import plan_power

Solved = dict[str, list[PipelinePoint]]


def default_validation_sample(costs: PipelineCosts) -> int:
    """Plans per method the emulator simulates by default: 12 on the paper's jobs (32
    instructions; a frontier holds ~100), 4 at 128 instructions, 1 (the fastest, where the
    power limiter acts most) from 512 on (the 70B job): a whole-iteration simulation grows
    with the pipeline, and validation should cost at most a quarter of the composition
    (2 per method took a third of it on the 70B job)."""
    instructions = 2 * costs.stages * costs.microbatches
    return max(1, min(12, 512 // instructions))


def validation_sample(plans: int, per_method: int) -> list[int]:
    """Which of a frontier's ``plans`` (fastest first) to simulate: a stratified sample of
    ``per_method``: the fastest, then the least-energy, then evenly between."""
    if per_method >= plans:
        return list(range(plans))
    if per_method <= 0:
        return []
    if per_method == 1:
        return [0]
    return sorted({round(i * (plans - 1) / (per_method - 1)) for i in range(per_method)})


def frontier_plans(methods: Sequence[Method], solved: Solved, f_max: int,
                   simulator: PlanSimulator | None, costs: PipelineCosts,
                   per_method: int = 1 << 30, timings: dict[str, float] | None = None
                   ) -> tuple[dict[str, list[Plan]], float | None]:
    """Each frontier point as a Plan; a stratified sample of ``per_method`` plans of each
    method (`validation_sample`) simulated as one whole iteration where a simulator is
    given (their seconds added to ``timings["validate"]``); the largest relative error
    between composed and simulated time or energy."""
    plans: dict[str, list[Plan]] = {}
    worst: float | None = None if simulator is None else 0.0
    for method in methods:
        plans[method.name] = []
        sample = set(validation_sample(len(solved[method.name]), per_method))
        for i, pt in enumerate(solved[method.name]):
            execution = to_execution_plan(f"{method.name}-{i:03d}", pt.picks, f_max,
                                          method.overlap)
            sim_t = sim_e = None
            if simulator is not None and worst is not None and i in sample:
                t0 = time.perf_counter()
                r = simulator.run(execution)
                if timings is not None:
                    timings["validate"] = timings.get("validate", 0.0) + (
                        time.perf_counter() - t0)
                sim_t, sim_e = r.time_s, r.energy_j
                worst = max(worst, abs(sim_t / pt.time_s - 1), abs(sim_e / pt.energy_j - 1))
            bars = timeline(pt, costs, f_max)
            power = plan_power(bars, pt.time_s, costs.pp, costs.gpus // costs.pp,
                               costs.static_power_w)
            plans[method.name].append(Plan(execution.name, method.name, pt.time_s,
                                           pt.energy_j, execution, sim_t, sim_e, bars,
                                           power))
    return plans, worst
