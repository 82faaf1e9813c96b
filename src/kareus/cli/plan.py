"""Choosing and exporting plans from a result directory: plan, plan export."""

import contextlib
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kareus.cli.app import JsonFlag, app, console, print_json, table
from kareus.errors import KareusError
from kareus.plans.export import export_plan
from kareus.plans.methods import get_method
from kareus.plans.plan import Plan, objective_of, select
from kareus.results.report import timeline_figure
from kareus.results.resultdir import ResultDir

plan_app = typer.Typer(help="Choose a plan from a result, or export one.")
app.add_typer(plan_app, name="plan")

ResultOpt = Annotated[str, typer.Option("--result", help="Directory of `kareus optimize`.")]


@plan_app.callback(invoke_without_command=True)
def plan(
    ctx: typer.Context,
    result: Annotated[Optional[str], typer.Option(
        "--result", help="Directory of `kareus optimize`.")] = None,
    max_throughput: Annotated[bool, typer.Option(
        "--max-throughput", help="The fastest plan.", metavar="")] = False,
    min_energy: Annotated[bool, typer.Option(
        "--min-energy", help="The plan with the least energy.", metavar="")] = False,
    deadline: Annotated[Optional[float], typer.Option(
        "--deadline", help="Iteration time limit in seconds.")] = None,
    energy_budget: Annotated[Optional[float], typer.Option(
        "--energy-budget", help="Iteration energy limit in joules.")] = None,
    method: Annotated[str, typer.Option("--method", help="Whose frontier.")] = "kareus",
    json_out: JsonFlag = False,
) -> None:
    """Pick the plan that meets a deadline or an energy budget with the least energy (or
    time), or the fastest / least-energy plan. `kareus plan export` writes one out."""
    if ctx.invoked_subcommand is not None:
        return
    if result is None:
        raise KareusError("--result DIR is required")
    objective, value = objective_of(max_throughput, min_energy, deadline, energy_budget)
    with contextlib.suppress(KareusError):  # unknown here: the result lists its methods
        method = get_method(method).name  # display names and aliases, any case
    rd = ResultDir(result)
    point = select(rd.frontier(method), objective, value)
    p, _job = rd.read_plan(point["plan"])
    path = rd.plan_file(p.id)
    if json_out:
        print_json({**p.to_dict(), "path": str(path), "objective": objective,
                    "limit": value})
        return
    freqs = sorted(set(p.execution.instruction_freqs.values())) or [
        p.execution.default_freq_mhz]
    console.print(f"[bold]{p.id}[/bold] ({method}, {objective}"
                  f"{'' if value is None else f' {value:g}'}): iteration {p.time_s:.4f} s, "
                  f"{p.energy_j / 1e3:.3f} kJ; clocks {freqs[0]}..{freqs[-1]} MHz; {path}")


@plan_app.command("export")
def plan_export(
    result: ResultOpt,
    plan_id: Annotated[str, typer.Option("--plan", help="Plan id, e.g. kareus-012.")],
    out: Annotated[str, typer.Option("--out", help="File to write.")],
    fmt: Annotated[str, typer.Option(
        "--format", help="zeus (frequency schedule for Zeus's server) or json.")] = "json",
    force: Annotated[bool, typer.Option(
        "--force", help="Overwrite --out if it exists (never a result directory's own "
                        "files).", metavar="")] = False,
) -> None:
    """Write a plan as Kareus JSON or as a Zeus pipeline frequency schedule."""
    rd = ResultDir(result)
    if rd.owns(out):
        raise KareusError(f"{out} is a file of the result directory {result}; write the "
                          f"plan elsewhere")
    if Path(out).exists() and not force:
        raise KareusError(f"{out} exists; choose another --out, or --force to overwrite it")
    p, job = rd.read_plan(plan_id)
    export_plan(p, job, fmt, out)
    console.print(f"{p.id} written to {out} ({fmt})")


@plan_app.command("show")
def plan_show(
    result: ResultOpt,
    plan_id: Annotated[str, typer.Option("--plan", help="Plan id, e.g. kareus-012.")],
    png: Annotated[Optional[str], typer.Option(
        "--png", help="Also draw the plan's 1F1B timeline into this PNG file.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """A plan's clocks per instruction and its partition settings per clock; --png draws
    its pipeline timeline (instructions coloured by clock, critical path outlined)."""
    rd = ResultDir(result)
    p, job = rd.read_plan(plan_id)
    rows = settings_by_clock(p)
    if png is not None:
        if rd.owns(png):
            raise KareusError(f"{png} is a file of the result directory {result}")
        timeline_figure(p, Path(png), str(job.get("model", {}).get("name", "")))
    if json_out:
        print_json({**p.summary(), "settings": rows, "png": png})
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
    if png is not None:
        console.print(f"timeline written to {png}")


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
