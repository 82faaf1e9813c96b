"""The `kareus` Typer application and what every command module shares."""

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kareus.core import Measurement

app = typer.Typer(
    name="kareus",
    help="Plan SM clocks, communication SMs and launch slots for energy-efficient training.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Piped or redirected output is not cut at 80 columns; in a narrow terminal table cells fold
# onto more lines instead of being cut (keys, method and GPU names stay whole).
console = Console() if sys.stdout.isatty() else Console(width=200)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead.",
                                        metavar="")]


def print_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def stderr_console() -> Console:
    """Progress and log lines: no source-file locations on log lines."""
    return Console(stderr=True, log_path=False)


def table(title: str, columns: tuple[str, ...], left: tuple[str, ...] = ()) -> Table:
    """A table whose columns are right-aligned numbers except those named in ``left``."""
    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", overflow="fold")
    return t


MEASUREMENT_COLUMNS = ("time ms", "energy J", "dynamic J", "static J", "power W",
                       "clock MHz")


def measurement_row(m: Measurement) -> list[str]:
    return [f"{m.time_s * 1e3:,.3f}", f"{m.energy_j:,.4f}", f"{m.dynamic_energy_j:,.4f}",
            f"{m.static_energy_j:,.4f}", f"{m.avg_power_w:,.1f}", f"{m.effective_freq_mhz:,.0f}"]


def pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:.1f}%"
