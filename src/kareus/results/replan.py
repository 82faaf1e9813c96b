"""A result directory's frontier as the re-planning savings need it (kareus.plans.replan):
each plan's time, energy and windowed peak power, and the job's shape (its replicas, the
GPUs of one, the power a waiting GPU draws)."""

from __future__ import annotations

from typing import Optional

from kareus.errors import KareusError
from kareus.plans.power import trace_of
from kareus.plans.replan import FrontierPlan, JobShape
from kareus.results.choice import job_spec
from kareus.results.resultdir import ResultDir


def replan_inputs(rd: ResultDir, method: str, window_s: Optional[float] = None
                  ) -> tuple[list[FrontierPlan], JobShape]:
    """The method's frontier plans, fastest first (with their peak power over ``window_s``
    when given: each plan file is read), and the job's shape. The power a waiting GPU draws
    is the static power the plans' energy charges a rank that waits (kareus.plans.power)."""
    front = sorted(rd.frontier(method), key=lambda q: (q["time_s"], q["energy_j"]))
    first, job = rd.read_plan(front[0]["plan"])
    if first.power is None:
        raise KareusError(f"{rd.result_file} was written before plans recorded their power; "
                          f"run `kareus optimize` again")
    spec = job_spec(rd, job)
    dp = spec.dp or 1
    plans = []
    for q in front:
        peak = None
        if window_s is not None:
            p, _job = rd.read_plan(q["plan"])
            if p.power is None:
                raise KareusError(f"{rd.plan_file(p.id)} records no power; run `kareus "
                                  f"optimize` again")
            peak = trace_of(p.timeline, p.time_s, p.power).peak_w(window_s)
        plans.append(FrontierPlan(q["plan"], q["time_s"], q["energy_j"], peak))
    shape = JobShape(dp, spec.num_gpus // dp, first.power.static_power_w,
                     spec.gpu_spec.idle_power_w)
    return plans, shape
