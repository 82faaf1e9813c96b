"""Perseus interop: import-perseus."""

from typing import Annotated, Any, Optional

import typer

from kareus.cli.app import JsonFlag, app, console, print_json, stderr_console, table
from kareus.cli.options import float_option
from kareus.workflows.perseus import import_perseus as run_import

MAX_ROWS = 15


@app.command("import-perseus")
def import_perseus(
    profile: Annotated[str, typer.Argument(
        help="Per-instruction profile in Zeus's format (InstructionProfilingResult: CSV, "
             "or its JSON list).", metavar="FILE")],
    out: Annotated[str, typer.Option("--out", help="Directory for the plans.")],
    microbatches: Annotated[int, typer.Option(
        "--microbatches", help="Microbatches per iteration (1F1B); at most 1024 pipeline "
                               "instructions (stages x microbatches x 2).")],
    static_power_w: Annotated[Optional[float], float_option(
        "--static-power-w", help="Static power per GPU in W, subtracted from each "
                                 "instruction's energy (wins over --gpu).")] = None,
    gpu: Annotated[Optional[str], typer.Option(
        "--gpu", help="GPU model: its catalog static power (unless --static-power-w) and "
                      "clock table (the profile's clocks are checked).")] = None,
    p2p_time_s: Annotated[float, float_option(
        "--p2p-time-s", help="Time of each P2P activation/gradient transfer in seconds "
                             "(the profile has none).")] = 0.0,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace --out if it exists and is not empty.", metavar="")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Solve the 1F1B time-energy frontier of a Perseus (Zeus pipeline frequency
    optimizer) profile; write DIR/summary.json, DIR/plans/*.json and DIR/zeus/*.py (Zeus
    PointSolution schedules)."""
    say = None if json_out else (lambda msg: stderr_console().log(msg))
    summary = run_import(profile, out, microbatches, static_power_w, gpu, p2p_time_s, force,
                         say)
    if json_out:
        print_json({**summary, "out": out})
        return
    _print_frontier(summary, out)


def _print_frontier(summary: dict[str, Any], out: str) -> None:
    t = table(f"Perseus frontier of {summary['source']} ({summary['pp']} stages, "
              f"{summary['microbatches']} microbatches, {summary['num_gpus']} GPUs)",
              ("plan", "iteration s", "energy kJ", "clocks MHz", "zeus schedule", ""),
              left=("plan", "zeus schedule", ""))
    frontier = summary["frontier"]
    n = len(frontier)
    shown = sorted({round(i * (n - 1) / (MAX_ROWS - 1)) for i in range(MAX_ROWS)}
                   if n > MAX_ROWS else range(n))
    for point in (frontier[i] for i in shown):
        mark = [name for name, key in (("fastest", "fastest"), ("least energy",
                                                                "least_energy"))
                if summary[key] == point["plan"]]
        freqs = point["freqs_mhz"]
        t.add_row(point["plan"], f"{point['time_s']:.4f}", f"{point['energy_j'] / 1e3:.3f}",
                  f"{freqs[0]}..{freqs[-1]}" if freqs else "", point["zeus_file"],
                  ", ".join(mark))
    console.print(t)
    if n > len(shown):
        console.print(f"{len(shown)} of {n} plans shown, evenly spaced; all in summary.json")
    console.print(f"static power {summary['static_power_w']:g} W per GPU "
                  f"({summary['static_power_source']}); P2P transfers "
                  f"{summary['p2p_time_s']:g} s ({summary['p2p_source']}); wrote "
                  f"{out}/summary.json, plans/, zeus/")
