"""Choosing among a result's plans beyond the frontier's own order: the plans whose
cluster power stays under a cap (each plan's peak from its own timeline,
kareus.plans.power), and what a training run costs with a plan against Megatron-LM at max
clock (kareus.plans.run_cost)."""

from __future__ import annotations

from typing import Any, Optional

from kareus.errors import KareusError
from kareus.job.spec import JobSpec
from kareus.plans.methods import THROUGHPUT_BASELINE
from kareus.plans.plan import Plan, select
from kareus.plans.power import trace_of, under_cap
from kareus.plans.run_cost import DEFAULT_CURRENCY, RunCost, iterations_of
from kareus.results.resultdir import ResultDir


def run_cost(rd: ResultDir, p: Plan, job: dict[str, Any], iterations: Optional[int],
              train_tokens: Optional[float], price_per_kwh: Optional[float],
              g_co2_per_kwh: Optional[float], currency: str = DEFAULT_CURRENCY) -> RunCost:
    """The training run with plan ``p`` against Megatron-LM's plan (its one clock: the
    highest) over as many iterations."""
    if iterations is None and train_tokens is None:
        raise KareusError("--price-per-kwh and --grid-g-co2-per-kwh need --iterations or "
                          "--train-tokens")
    n = iterations_of(job_spec(rd, job), iterations, train_tokens)
    ref = select(rd.frontier(THROUGHPUT_BASELINE), "max-throughput")
    return RunCost.of(n, p.time_s, p.energy_j, float(ref["time_s"]),
                      float(ref["energy_j"]), price_per_kwh, g_co2_per_kwh, currency)


def job_spec(rd: ResultDir, job: dict[str, Any]) -> JobSpec:
    """The job a plan is for, as the result recorded it; one line where it is not one."""
    try:
        return JobSpec.model_validate(job)
    except ValueError as exc:  # pydantic's ValidationError is one
        raise KareusError(f"{rd.result_file}: its job is not a valid job "
                          f"({str(exc).splitlines()[0]}); rerun `kareus optimize`") from None


def plans_under_cap(rd: ResultDir, frontier: list[dict[str, Any]], cap_kw: Optional[float],
               cap_w_per_gpu: Optional[float], window_s: float) -> list[dict[str, Any]]:
    """The frontier's plans whose peak power over ``window_s`` stays under the cap, each
    peak from the plan's timeline (kareus.plans.power)."""
    peaks, gpus = [], 0
    for point in frontier:
        p, _job = rd.read_plan(point["plan"])
        if p.power is None:
            raise KareusError(f"{rd.result_file} was written before plans recorded their "
                              f"power; run `kareus optimize` again for a power cap")
        peaks.append(trace_of(p.timeline, p.time_s, p.power).peak_w(window_s))
        gpus = p.power.pp * p.power.gpus_per_rank
    cap_w = cap_kw * 1e3 if cap_kw is not None else float(cap_w_per_gpu or 0.0) * gpus
    return under_cap(frontier, cap_w, peaks, window_s)


def cap_given(cap_kw: Optional[float], cap_w_per_gpu: Optional[float]) -> bool:
    """Whether a power cap is given; KareusError when both of its forms are."""
    if cap_kw is not None and cap_w_per_gpu is not None:
        raise KareusError("give one of --power-cap-kw and --power-cap-w-per-gpu")
    return cap_kw is not None or cap_w_per_gpu is not None


def chosen_point(rd: ResultDir, method: str, objective: str, value: Optional[float],
                 cap_kw: Optional[float], cap_w_per_gpu: Optional[float], window_s: float
                 ) -> dict[str, Any]:
    """The point of ``method``'s frontier that ``objective`` picks (kareus.plans.plan
    .select), among the plans under the power cap when one is given."""
    frontier = rd.frontier(method)
    capped = cap_given(cap_kw, cap_w_per_gpu)
    if capped:
        frontier = plans_under_cap(rd, frontier, cap_kw, cap_w_per_gpu, window_s)
    try:
        return select(frontier, objective, value)
    except KareusError as exc:
        if not capped:
            raise
        raise KareusError(f"{exc}, among the {len(frontier)} plans under the power cap"
                          ) from None
