"""Choosing, listing, showing and exporting the plans of a result directory: plan, plan
list, plan show, plan export."""

import contextlib
import shlex
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kareus.cli.app import JsonFlag, app, console, print_json, table
from kareus.cli.options import float_option
from kareus.errors import KareusError
from kareus.plans.export import export_plan
from kareus.plans.methods import PROPOSED, get_method
from kareus.plans.outfile import check_distinct, check_out_file, write_file_atomic
from kareus.plans.plan import (
    DEADLINE_TOLERANCE_S,
    ENERGY_TOLERANCE_J,
    Plan,
    objective_of,
    over_limit,
    rounding_slack,
    settings_by_clock,
)
from kareus.plans.power import trace_of
from kareus.plans.run_cost import (
    DEFAULT_CURRENCY,
    MAX_ITERATIONS,
    MAX_TRAIN_TOKENS,
)
from kareus.plans.units import (
    format_energy_j,
    format_power_w,
    format_time_s,
    parse_energy_j,
    parse_time_s,
)
from kareus.results.choice import cap_given, chosen_point, job_spec, run_cost
from kareus.results.power_figure import power_figure, power_panel
from kareus.results.resultdir import ResultDir
from kareus.results.timeline import clock_scale_mhz, timeline_figure

plan_app = typer.Typer(help="Choose, list, show or export the plans of a result.")
app.add_typer(plan_app, name="plan")

ResultOpt = Annotated[str, typer.Option("--result", help="Directory of `kareus optimize`.")]
PowerWindowOpt = Annotated[float, float_option(
    "--power-window-s", positive=True, help="Window of the moving average of the cluster "
    "power (its peak, under a cap), s.")]
CurrencyOpt = Annotated[str, typer.Option(
    "--currency", help="What --price-per-kwh is in, named on the cost (USD, EUR, ...; "
    "nothing is converted).")]
PlanOpt = Annotated[str, typer.Option("--plan", help="Plan id, e.g. kareus-012 (`kareus plan "
                                                     "list` lists them).")]

_DEADLINE_SLACK = f"{DEADLINE_TOLERANCE_S * 1e3:g} ms"
_ENERGY_SLACK = f"{ENERGY_TOLERANCE_J:g} J"
DEADLINE_HELP = (f"Iteration time limit: seconds, or with a unit (2.5s, 2500ms). Rounding "
                 f"slack: a plan up to {_DEADLINE_SLACK} slower still meets it (tables print "
                 f"times to 1 ms or finer); the output says when the plan uses it.")
ENERGY_HELP = (f"Iteration energy limit: joules, or with a unit (15.12kJ, 15120J, 15120; also "
               f"MJ, Wh, kWh). Rounding slack: a plan using up to {_ENERGY_SLACK} more still "
               f"meets it (tables print energies to 10 J or finer, e.g. kJ with 2 decimals); "
               f"the output says when the plan uses it.")
TIME_RESOLUTION_S = 2 * DEADLINE_TOLERANCE_S
"""Tables print times at least this finely: a time typed back from one, rounded by at
most half of it, meets its deadline within the rounding slack."""
ENERGY_RESOLUTION_J = 2 * ENERGY_TOLERANCE_J
"""The same for energies and the energy budget's slack."""


def _time(s: float) -> str:
    return format_time_s(s, resolution=TIME_RESOLUTION_S)


def _energy(j: float) -> str:
    return format_energy_j(j, resolution=ENERGY_RESOLUTION_J)


@plan_app.callback(invoke_without_command=True)
def plan(
    ctx: typer.Context,
    result: Annotated[Optional[str], typer.Option(
        "--result", help="Directory of `kareus optimize`.")] = None,
    max_throughput: Annotated[bool, typer.Option(
        "--max-throughput", help="The fastest plan.", metavar="")] = False,
    min_energy: Annotated[bool, typer.Option(
        "--min-energy", help="The plan with the least energy.", metavar="")] = False,
    deadline: Annotated[Optional[str], typer.Option(
        "--deadline", help=DEADLINE_HELP, metavar="TIME")] = None,
    energy_budget: Annotated[Optional[str], typer.Option(
        "--energy-budget", help=ENERGY_HELP, metavar="ENERGY")] = None,
    power_cap_kw: Annotated[Optional[float], float_option(
        "--power-cap-kw", positive=True, help="Cluster power cap, kW: only plans whose peak "
        "(the moving average over --power-window-s) stays under it; alone, the fastest of "
        "them.")] = None,
    power_cap_w_per_gpu: Annotated[Optional[float], float_option(
        "--power-cap-w-per-gpu", positive=True, help="The cap per GPU, W (times the job's "
        "GPUs).")] = None,
    power_window_s: PowerWindowOpt = 1.0,
    iterations: Annotated[Optional[int], typer.Option(
        "--iterations", help="A training run of this many iterations: its time, GPU "
        f"energy (and cost, emissions) against Megatron-LM at max clock (at most "
        f"{MAX_ITERATIONS:,}).")] = None,
    train_tokens: Annotated[Optional[float], float_option(
        "--train-tokens", positive=True, at_most=MAX_TRAIN_TOKENS, help="The same, for a "
        f"run over this many tokens (at most {MAX_TRAIN_TOKENS:g}).")] = None,
    price_per_kwh: Annotated[Optional[float], float_option(
        "--price-per-kwh", help="Electricity price per kWh in --currency, for the run's "
        "cost.")] = None,
    currency: CurrencyOpt = DEFAULT_CURRENCY,
    grid_g_co2_per_kwh: Annotated[Optional[float], float_option(
        "--grid-g-co2-per-kwh", help="Grid carbon intensity, for the run's emissions.")
    ] = None,
    method: Annotated[str, typer.Option("--method", help="Whose frontier.")] = PROPOSED,
    json_out: JsonFlag = False,
) -> None:
    """Pick the plan that meets a deadline or an energy budget with the least energy (or
    time), or the fastest / least-energy plan; with a power cap, among the plans that stay
    under it. `kareus plan list` lists every plan, `kareus plan export` writes one out."""
    if ctx.invoked_subcommand is not None:
        return
    if result is None:
        raise KareusError("--result DIR is required")
    capped = cap_given(power_cap_kw, power_cap_w_per_gpu)
    objective, value = _objective(result, max_throughput, min_energy, deadline,
                                  energy_budget, capped)
    method = _method_name(method)
    rd = ResultDir(result)
    point = chosen_point(rd, method, objective, value, power_cap_kw, power_cap_w_per_gpu,
                         power_window_s)
    p, job = rd.read_plan(point["plan"])
    path = rd.plan_file(p.id)
    over = over_limit(point, objective, value)
    asked = (iterations, train_tokens, price_per_kwh, grid_g_co2_per_kwh)
    run = (None if all(v is None for v in asked) else run_cost(
        rd, p, job, iterations, train_tokens, price_per_kwh, grid_g_co2_per_kwh, currency))
    if json_out:
        print_json({**p.to_dict(), "path": str(path), "objective": objective,
                    "limit": value, "rounding_slack": rounding_slack(objective),
                    "over_limit": over, "within_rounding_slack": bool(over),
                    "training_run": run.to_dict() if run is not None else None})
        return
    freqs = sorted(set(p.execution.instruction_freqs.values())) or [p.execution.default_freq_mhz]
    console.print(f"[bold]{p.id}[/bold] ({method}, {objective}"
                  f"{'' if value is None else ' ' + _limit(objective, value)}): iteration "
                  f"{_time(p.time_s)}, {_energy(p.energy_j)}; clocks "
                  f"{freqs[0]}..{freqs[-1]} MHz; {path}")
    if p.power is not None:
        peak = trace_of(p.timeline, p.time_s, p.power).peak_w(power_window_s)
        console.print(f"cluster power: mean {format_power_w(p.power.mean_w)}, peak "
                      f"{format_power_w(peak)} over {power_window_s:g} s"
                      + (" (under the cap)" if capped else ""))
    if run is not None:
        console.print(run.line())
    if over and value is not None:
        console.print(_over_note(objective, over, value))


def _objective(result: str, max_throughput: bool, min_energy: bool,
               deadline: Optional[str], energy_budget: Optional[str], capped: bool
               ) -> tuple[str, Optional[float]]:
    """The one objective asked for and its limit; with a power cap alone, the fastest."""
    deadline_s = None if deadline is None else parse_time_s(deadline)
    budget_j = None if energy_budget is None else parse_energy_j(energy_budget)
    try:
        return objective_of(max_throughput, min_energy, deadline_s, budget_j, capped)
    except KareusError as exc:
        raise KareusError(f"{exc}; {_list_command(result)} lists every plan") from None


def _over_note(objective: str, over: float, value: float) -> str:
    """What a plan over the exact limit but within its rounding slack is told."""
    slack = _DEADLINE_SLACK if objective == "deadline" else _ENERGY_SLACK
    return (f"note: {_amount(objective, over)} over the exact limit "
            f"{_limit(objective, value)}, within its {slack} rounding slack")


def _limit(objective: str, value: float) -> str:
    return f"{value:g} s" if objective == "deadline" else f"{value:g} J"


def _amount(objective: str, over: float) -> str:
    return f"{over * 1e3:.1f} ms" if objective == "deadline" else f"{over:.1f} J"


def _method_name(method: str) -> str:
    """The method's name in result.json: display names and aliases, any case, resolve;
    an unknown one stays as typed (the result lists its methods)."""
    with contextlib.suppress(KareusError):
        return get_method(method).name
    return method


def _list_command(result: str) -> str:
    return f"`kareus plan list --result {shlex.quote(result)}`"


def _read_plan(rd: ResultDir, result: str, plan_id: str) -> tuple[Plan, dict[str, Any]]:
    """A plan of the result; an id it does not list names the command that lists them."""
    if plan_id not in rd.plan_ids():
        raise KareusError(f"{rd.result_file} lists no plan {plan_id!r}; "
                          f"{_list_command(result)} lists its plans")
    return rd.read_plan(plan_id)


def _out_file(rd: ResultDir, result: str, path: str, option: str, force: bool,
              suffix: Optional[str] = None) -> Path:
    return check_out_file(path, option=option, force=force, suffix=suffix,
                          owner=result if rd.owns(path) else None)


@plan_app.command("list")
def plan_list(
    result: ResultOpt,
    method: Annotated[Optional[str], typer.Option(
        "--method", help="Only this method's plans (name, display name or alias).")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Every plan of a result: id, method, iteration time and energy (each in the unit its
    magnitude calls for); per method the fastest first."""
    rd = ResultDir(result)
    methods = [_method_name(method)] if method is not None else _methods(rd)
    rows = [{"id": pt["plan"], "method": m, "time_s": pt["time_s"], "energy_j": pt["energy_j"]}
            for m in methods
            for pt in sorted(rd.frontier(m), key=lambda q: (q["time_s"], q["energy_j"]))]
    if json_out:
        print_json({"result": result, "plans": rows})
        return
    t = table(f"Plans of {result}", ("id", "method", "time", "energy"),
              left=("id", "method"))
    for r in rows:
        t.add_row(r["id"], r["method"], _time(r["time_s"]), _energy(r["energy_j"]))
    console.print(t)
    console.print(f"`kareus plan show --result {shlex.quote(result)} --plan ID` shows one")


def _methods(rd: ResultDir) -> list[str]:
    methods = rd.read_result().get("methods")
    if not isinstance(methods, dict):
        raise KareusError(f"{rd.result_file} lists no methods")
    return list(methods)


@plan_app.command("export")
def plan_export(
    result: ResultOpt,
    plan_id: PlanOpt,
    out: Annotated[str, typer.Option("--out", help="File to write.")],
    fmt: Annotated[str, typer.Option(
        "--format", help="zeus (frequency schedule for Zeus's server: one schedule for the "
                         "whole run, no re-planning while training) or json.")] = "json",
    force: Annotated[bool, typer.Option(
        "--force", help="Overwrite --out if it exists (never a result directory's own "
                        "files).", metavar="")] = False,
) -> None:
    """Write a plan as Kareus JSON or as a Zeus pipeline frequency schedule (Zeus's server
    serves one schedule: re-planning while training needs the result directory and
    Kareus's runtime, docs/runtime.md)."""
    rd = ResultDir(result)
    path = _out_file(rd, result, out, "--out", force)
    p, job = _read_plan(rd, result, plan_id)
    export_plan(p, job, fmt, path)
    console.print(f"{p.id} written to {path} ({fmt})")


@plan_app.command("show")
def plan_show(
    result: ResultOpt,
    plan_id: PlanOpt,
    png: Annotated[Optional[str], typer.Option(
        "--png", help="Also draw the plan's 1F1B timeline, with its cluster power over "
                      "time below, into this file; its name must end in .png (any case; "
                      "other names are refused).")] = None,
    power_png: Annotated[Optional[str], typer.Option(
        "--power-png", help="Also draw the plan's cluster power over the iteration into "
                            "this .png file: the ranks stacked, the total, its moving "
                            "average over --power-window-s, the cap line with "
                            "--power-cap-kw.")] = None,
    power_cap_kw: Annotated[Optional[float], float_option(
        "--power-cap-kw", help="The power panels' cap line, kW.", positive=True)] = None,
    power_window_s: PowerWindowOpt = 1.0,
    force: Annotated[bool, typer.Option(
        "--force", help="Overwrite the --png / --power-png file if it exists (never a "
                        "result directory's own files).", metavar="")] = False,
    json_out: JsonFlag = False,
) -> None:
    """A plan's clocks per instruction and its partition settings per clock; --png draws
    its pipeline timeline (instructions coloured by clock, critical path outlined),
    --power-png its cluster power over time (docs/power.md)."""
    rd = ResultDir(result)
    out = None if png is None else _out_file(rd, result, png, "--png", force, ".png")
    power_out = (None if power_png is None
                 else _out_file(rd, result, power_png, "--power-png", force, ".png"))
    check_distinct({"--png": out, "--power-png": power_out})
    p, job = _read_plan(rd, result, plan_id)
    rows = settings_by_clock(p)
    spec = job_spec(rd, job)
    title = spec.describe()  # the whole job, as the result's own figures
    if power_out is not None:
        power_figure(p, power_out, title, power_window_s,
                     None if power_cap_kw is None else power_cap_kw * 1e3)
    if out is not None:
        # below the timeline, the plan's power over time (plans written before power was
        # recorded have the timeline alone); rows are ranks: virtual stages (interleaved
        # 1F1B) share one; one clock colour scale per GPU, as the result's timelines
        panel = (power_panel(p, title, power_window_s, None if power_cap_kw is None
                             else power_cap_kw * 1e3)[1] if p.power is not None else None)
        write_file_atomic(out, lambda tmp: timeline_figure(
            p, tmp, title, clocks_mhz=clock_scale_mhz(spec), pp=spec.pp, panel=panel))
    if json_out:
        print_json({**p.summary(), "settings": rows, "png": None if out is None else str(out),
                    "power_png": None if power_out is None else str(power_out)})
        return
    ex = p.execution
    freqs = sorted(set(ex.instruction_freqs.values())) or [ex.default_freq_mhz]
    console.print(f"[bold]{p.id}[/bold] ({p.method}): iteration {_time(p.time_s)}, "
                  f"{_energy(p.energy_j)}; clocks {freqs[0]}..{freqs[-1]} MHz; "
                  f"{len(ex.sequential)} instructions without overlap")
    t = table("Partition settings per clock", ("partition", "MHz", "SMs", "slot",
                                                "instructions"), left=("partition", "slot"))
    for r in rows:
        t.add_row(r["partition"], str(r["freq_mhz"]), str(r["sms"]), r["slot"] or "none",
                  str(r["instructions"]))
    console.print(t)
    if out is not None:
        console.print(f"timeline written to {out}")
    if power_out is not None:
        console.print(f"power over time written to {power_out}")

