"""`kareus plan replan-savings`: what re-planning while training saves, planned, for a
straggler scenario and a power-cap schedule (kareus.plans.replan; docs/runtime.md)."""

from typing import Annotated, Optional

import typer

from kareus.cli.app import JsonFlag, console, print_json, table
from kareus.cli.options import float_option
from kareus.cli.plan import PowerWindowOpt, ResultOpt, _method_name, plan_app
from kareus.errors import KareusError
from kareus.plans.methods import PROPOSED
from kareus.plans.replan import (
    CapScheduleRun,
    StragglerSavings,
    cap_schedule_run,
    parse_cap_schedule,
    plan_by_id,
    straggler_savings,
)
from kareus.plans.run_cost import MAX_ITERATIONS
from kareus.plans.units import (
    format_duration_s,
    format_energy_j,
    format_run_energy_j,
    format_time_s,
)
from kareus.results.replan import replan_inputs
from kareus.results.resultdir import ResultDir
from kareus.runtime.plan_switcher import DEFAULT_PATIENCE


@plan_app.command("replan-savings")
def replan_savings(
    result: ResultOpt,
    slowdown: Annotated[Optional[float], float_option(
        "--slowdown", positive=True, help="Straggler scenario: one data-parallel replica "
        "runs this many times slower (e.g. 1.5).")] = None,
    duration_iterations: Annotated[Optional[int], typer.Option(
        "--duration-iterations", help="Straggler scenario: for this many iterations.")
    ] = None,
    replicas: Annotated[Optional[int], typer.Option(
        "--replicas", help="Data-parallel replicas (default: the job's DP).")] = None,
    reaction_iterations: Annotated[int, typer.Option(
        "--reaction-iterations", help="Iterations the others still run the slower plan "
        "after the slowdown ends (1: the runtime learns the pace at the end of an "
        "iteration; 0: the ideal bound).")] = 1,
    switch_in_iterations: Annotated[int, typer.Option(
        "--switch-in-iterations", help="Slow iterations before the others move to the "
        "slower plan (the runtime switcher's patience; 0: the ideal bound).")
    ] = DEFAULT_PATIENCE,
    cap_schedule: Annotated[Optional[str], typer.Option(
        "--cap-schedule", help="Power-cap schedule: ITERATION:KW or ITERATION:none steps, "
        "e.g. 0:none,2000:4.5,5000:none.")] = None,
    iterations: Annotated[Optional[int], typer.Option(
        "--iterations", help="Power-cap schedule: the run's iterations.")] = None,
    restart_s: Annotated[Optional[float], float_option(
        "--restart-s", help="Power-cap schedule: seconds a restart costs (checkpoint, "
        "relaunch, load): your cluster's figure, no default.")] = None,
    plan_id: Annotated[Optional[str], typer.Option(
        "--plan", help="The plan the job runs (default: the fastest of --method).")] = None,
    method: Annotated[str, typer.Option("--method", help="Whose frontier.")] = PROPOSED,
    power_window_s: PowerWindowOpt = 1.0,
    json_out: JsonFlag = False,
) -> None:
    """Energy of a run with and without re-planning while it trains, planned from a
    result's frontier: a straggler (--slowdown, --duration-iterations) and a power-cap
    schedule (--cap-schedule, --iterations, --restart-s) against restarting. Nothing is
    measured or written (docs/runtime.md, "Re-planning while training")."""
    straggler = slowdown is not None or duration_iterations is not None
    capped = cap_schedule is not None or iterations is not None or restart_s is not None
    if not (straggler or capped):
        raise KareusError("give a straggler scenario (--slowdown, --duration-iterations) or "
                          "a power-cap schedule (--cap-schedule, --iterations, --restart-s)")
    if straggler and (slowdown is None or duration_iterations is None):
        raise KareusError("a straggler scenario needs --slowdown and --duration-iterations")
    if capped and (cap_schedule is None or iterations is None or restart_s is None):
        raise KareusError("a power-cap schedule needs --cap-schedule, --iterations and "
                          "--restart-s (a restart's cost is your cluster's figure)")
    if iterations is not None and not 1 <= iterations <= MAX_ITERATIONS:
        raise KareusError(f"--iterations must be 1..{MAX_ITERATIONS:,}, got {iterations}")
    steps = parse_cap_schedule(cap_schedule) if cap_schedule is not None else None
    rd = ResultDir(result)
    plans, shape = replan_inputs(rd, _method_name(method),
                                 power_window_s if steps is not None else None)
    if plan_id is not None and plan_id not in {p.id for p in plans}:
        raise KareusError(f"{rd.result_file}: {method}'s frontier has no plan {plan_id!r}; "
                          f"`kareus plan list --result {result}` lists its plans")
    plan_by_id(plans, plan_id)
    out: dict[str, object] = {"result": result, "method": method}
    strag = run = None
    if straggler:
        assert slowdown is not None and duration_iterations is not None
        strag = straggler_savings(plans, shape, replicas if replicas is not None
                                  else shape.result_replicas, slowdown,
                                  duration_iterations, plan_id, reaction_iterations,
                                  switch_in_iterations)
        out["straggler"] = {**strag.to_dict(), "wait_power_w_per_gpu": shape.wait_power_w,
                            "gpus_per_replica": shape.gpus_per_replica}
    if steps is not None:
        assert iterations is not None and restart_s is not None
        run = cap_schedule_run(plans, shape, steps, iterations, restart_s, plan_id,
                               power_window_s)
        out["cap_schedule"] = {**run.to_dict(), "power_window_s": power_window_s,
                               "idle_power_w_per_gpu": shape.idle_power_w}
    if json_out:
        print_json(out)
        return
    if strag is not None:
        _print_straggler(strag, shape.wait_power_w)
    if run is not None:
        _print_caps(run, shape.idle_power_w, power_window_s)


def _print_straggler(s: StragglerSavings, wait_w: float) -> None:
    t = table(f"Straggler: 1 of {s.replicas} replicas {s.slowdown:g}x slower for "
              f"{s.duration_iterations:,} iterations ({s.iterations:,} affected)",
              ("run", "others' plan", "time", "energy", "waiting"), left=("run",
                                                                          "others' plan"))
    t.add_row("without re-planning", f"{s.p0.id} ({format_time_s(s.p0.time_s)})",
              format_duration_s(s.time_without_s), format_run_energy_j(s.energy_without_j),
              format_run_energy_j(s.wait_without_j))
    t.add_row("re-planned", f"{s.p1.id} ({format_time_s(s.p1.time_s)})",
              format_duration_s(s.time_with_s), format_run_energy_j(s.energy_with_j),
              format_run_energy_j(s.wait_with_j))
    console.print(t)
    console.print(f"saved {format_run_energy_j(s.saved_j)} ({s.saved_fraction * 100:.2f}%); "
                  f"time {format_duration_s(s.time_with_s - s.time_without_s)} longer "
                  f"re-planned; waiting GPUs at {wait_w:g} W (the plans' static power); "
                  f"the others switch after {s.switch_in_iterations} slow iteration(s) and "
                  f"back {s.reaction_iterations} after")


def _print_caps(r: CapScheduleRun, idle_w: float, window_s: float) -> None:
    t = table(f"Power-cap schedule: {r.iterations:,} iterations, {r.switches} change(s) of "
              f"plan (peaks over {window_s:g} s)", ("run", "plans", "time", "energy"),
              left=("run", "plans"))
    t.add_row("re-planned", " > ".join(p.id for p in r.plans),
              format_duration_s(r.time_replan_s), format_run_energy_j(r.energy_replan_j))
    t.add_row(f"restarting ({r.restart_s:g} s each)", " > ".join(p.id for p in r.plans),
              format_duration_s(r.time_restart_s), format_run_energy_j(r.energy_restart_j))
    t.add_row("one plan under every cap", r.static_plan.id,
              format_duration_s(r.time_static_s), format_run_energy_j(r.energy_static_j))
    console.print(t)
    console.print(f"re-planning saves {format_duration_s(r.time_restart_s - r.time_replan_s)}"
                  f" and {format_energy_j(r.energy_restart_j - r.energy_replan_j)} against "
                  f"restarting (GPUs idle at {idle_w:g} W while restarting); "
                  f"{r.over_cap_iterations} iteration(s) run the old plan over a new cap")
