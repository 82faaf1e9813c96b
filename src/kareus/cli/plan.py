"""Choosing, listing, showing and exporting the plans of a result directory: plan, plan
list, plan show, plan export."""

import contextlib
import shlex
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kareus.cli.app import JsonFlag, app, console, print_json, table
from kareus.errors import KareusError
from kareus.plans.export import export_plan
from kareus.plans.methods import get_method
from kareus.plans.outfile import check_out_file, write_file_atomic
from kareus.plans.plan import (
    DEADLINE_TOLERANCE_S,
    ENERGY_TOLERANCE_J,
    Plan,
    objective_of,
    over_limit,
    rounding_slack,
    select,
)
from kareus.plans.units import parse_energy_j, parse_time_s
from kareus.results.report import timeline_figure
from kareus.results.resultdir import ResultDir

plan_app = typer.Typer(help="Choose, list, show or export the plans of a result.")
app.add_typer(plan_app, name="plan")

ResultOpt = Annotated[str, typer.Option("--result", help="Directory of `kareus optimize`.")]
PlanOpt = Annotated[str, typer.Option("--plan", help="Plan id, e.g. kareus-012 (`kareus plan "
                                                     "list` lists them).")]

_DEADLINE_SLACK = f"{DEADLINE_TOLERANCE_S * 1e3:g} ms"
_ENERGY_SLACK = f"{ENERGY_TOLERANCE_J:g} J"
DEADLINE_HELP = (f"Iteration time limit: seconds, or with a unit (2.5s, 2500ms). Rounding "
                 f"slack: a plan up to {_DEADLINE_SLACK} slower still meets it (tables print "
                 f"times with 3 decimals); the output says when the plan uses it.")
ENERGY_HELP = (f"Iteration energy limit: joules, or with a unit (15.12kJ, 15120J, 15120; also "
               f"MJ, Wh, kWh). Rounding slack: a plan using up to {_ENERGY_SLACK} more still "
               f"meets it (tables print kJ with 2 decimals); the output says when the plan "
               f"uses it.")


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
    method: Annotated[str, typer.Option("--method", help="Whose frontier.")] = "kareus",
    json_out: JsonFlag = False,
) -> None:
    """Pick the plan that meets a deadline or an energy budget with the least energy (or
    time), or the fastest / least-energy plan. `kareus plan list` lists every plan,
    `kareus plan export` writes one out."""
    if ctx.invoked_subcommand is not None:
        return
    if result is None:
        raise KareusError("--result DIR is required")
    deadline_s = None if deadline is None else parse_time_s(deadline)
    budget_j = None if energy_budget is None else parse_energy_j(energy_budget)
    try:
        objective, value = objective_of(max_throughput, min_energy, deadline_s, budget_j)
    except KareusError as exc:
        raise KareusError(f"{exc}; {_list_command(result)} lists every plan") from None
    method = _method_name(method)
    rd = ResultDir(result)
    point = select(rd.frontier(method), objective, value)
    p, _job = rd.read_plan(point["plan"])
    path = rd.plan_file(p.id)
    over = over_limit(point, objective, value)
    if json_out:
        print_json({**p.to_dict(), "path": str(path), "objective": objective,
                    "limit": value, "rounding_slack": rounding_slack(objective),
                    "over_limit": over, "within_rounding_slack": bool(over)})
        return
    freqs = sorted(set(p.execution.instruction_freqs.values())) or [
        p.execution.default_freq_mhz]
    console.print(f"[bold]{p.id}[/bold] ({method}, {objective}"
                  f"{'' if value is None else ' ' + _limit(objective, value)}): iteration "
                  f"{p.time_s:.4f} s, {p.energy_j / 1e3:.3f} kJ; clocks "
                  f"{freqs[0]}..{freqs[-1]} MHz; {path}")
    if over and value is not None:
        slack = _DEADLINE_SLACK if objective == "deadline" else _ENERGY_SLACK
        console.print(f"note: {_amount(objective, over)} over the exact limit "
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
    """Every plan of a result: id, method, iteration time (s) and energy (kJ); per method
    the fastest first."""
    rd = ResultDir(result)
    methods = [_method_name(method)] if method is not None else _methods(rd)
    rows = [{"id": pt["plan"], "method": m, "time_s": pt["time_s"], "energy_j": pt["energy_j"]}
            for m in methods
            for pt in sorted(rd.frontier(m), key=lambda q: (q["time_s"], q["energy_j"]))]
    if json_out:
        print_json({"result": result, "plans": rows})
        return
    t = table(f"Plans of {result}", ("id", "method", "time s", "energy kJ"),
              left=("id", "method"))
    for r in rows:
        t.add_row(r["id"], r["method"], f"{r['time_s']:.4f}", f"{r['energy_j'] / 1e3:.3f}")
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
        "--format", help="zeus (frequency schedule for Zeus's server) or json.")] = "json",
    force: Annotated[bool, typer.Option(
        "--force", help="Overwrite --out if it exists (never a result directory's own "
                        "files).", metavar="")] = False,
) -> None:
    """Write a plan as Kareus JSON or as a Zeus pipeline frequency schedule."""
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
        "--png", help="Also draw the plan's 1F1B timeline into this file; its name must end "
                      "in .png (any case; other names are refused).")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Overwrite the --png file if it exists (never a result directory's "
                        "own files).", metavar="")] = False,
    json_out: JsonFlag = False,
) -> None:
    """A plan's clocks per instruction and its partition settings per clock; --png draws
    its pipeline timeline (instructions coloured by clock, critical path outlined)."""
    rd = ResultDir(result)
    out = None if png is None else _out_file(rd, result, png, "--png", force, ".png")
    p, job = _read_plan(rd, result, plan_id)
    rows = settings_by_clock(p)
    if out is not None:
        title = str(job.get("model", {}).get("name", ""))
        pp = job.get("pp")  # rows are ranks: virtual stages (interleaved 1F1B) share one
        write_file_atomic(out, lambda tmp: timeline_figure(
            p, tmp, title, pp=pp if isinstance(pp, int) and pp > 0 else None))
    if json_out:
        print_json({**p.summary(), "settings": rows, "png": None if out is None else str(out)})
        return
    ex = p.execution
    freqs = sorted(set(ex.instruction_freqs.values())) or [ex.default_freq_mhz]
    console.print(f"[bold]{p.id}[/bold] ({p.method}): iteration {p.time_s:.4f} s, "
                  f"{p.energy_j / 1e3:.3f} kJ; clocks {freqs[0]}..{freqs[-1]} MHz; "
                  f"{len(ex.sequential)} instructions without overlap")
    t = table("Partition settings per clock", ("partition", "MHz", "SMs", "slot",
                                                "instructions"), left=("partition", "slot"))
    for r in rows:
        t.add_row(r["partition"], str(r["freq_mhz"]), str(r["sms"]), r["slot"] or "none",
                  str(r["instructions"]))
    console.print(t)
    if out is not None:
        console.print(f"timeline written to {out}")


def settings_by_clock(plan: Plan) -> list[dict[str, Any]]:
    """Per partition key and clock, each setting the plan uses and in how many
    instructions."""
    ex = plan.execution
    count: Counter[tuple[str, int, int, str | None]] = Counter()
    for iid, settings in ex.instruction_knobs.items():
        f = ex.freq(*iid)
        for key, s in settings.items():
            count[(key, f, s.sms, s.slot)] += 1
    return [{"partition": k, "freq_mhz": f, "sms": n, "slot": slot, "instructions": c}
            for (k, f, n, slot), c in sorted(count.items(),
                                             key=lambda x: (x[0][0], -x[0][1], x[0][2]))]
