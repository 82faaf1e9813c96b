"""A `PlanSwitcher` over a result directory's plans: the frontier of one method (the start
plan's), so that every plan it may switch to is a plan of the same job and the same
search, comparable in time and energy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kareus.errors import KareusError
from kareus.plans.methods import PROPOSED
from kareus.plans.plan import Plan
from kareus.results.resultdir import ResultDir
from kareus.runtime.plan_switcher import PlanSwitcher


def result_plans(result: str | Path, start: str | None = None, method: str = PROPOSED
                 ) -> tuple[list[Plan], str, dict[str, Any]]:
    """The plans of ``start``'s method (without ``start``: ``method``'s, starting on its
    fastest), the start plan's id and the job they are for."""
    rd = ResultDir(Path(result))
    if start is not None:
        method = rd.read_plan(start)[0].method
    read = [rd.read_plan(point["plan"]) for point in rd.frontier(method)]
    plans = [plan for plan, _job in read]
    if start is None:
        start = min(plans, key=lambda p: (p.time_s, p.energy_j)).id
    jobs = [job for _plan, job in read]
    if any(job != jobs[0] for job in jobs):  # a result holds one job; a switch keeps it
        raise KareusError(f"{rd.result_file}: the plans of {method} are for different jobs")
    return plans, start, jobs[0]


def switcher_from_result(result: str | Path, start: str | None = None,
                         log_path: str | Path | None = None, **kwargs: Any
                         ) -> PlanSwitcher:
    """A switcher over `result_plans` (``kwargs``: PlanSwitcher's hysteresis, patience),
    logging its switches to ``log_path``."""
    plans, start, _job = result_plans(result, start)
    return PlanSwitcher(plans, start, log_path=log_path, **kwargs)
