"""The `kareus` Typer application and what every command module shares."""

import inspect
import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from kareus.core import Measurement


def flowed(doc: str) -> str:
    """A docstring as help text: the line breaks of the source inside a paragraph become
    spaces, so that the terminal wraps each paragraph (Typer's rich help prints every
    paragraph but the first with its source line breaks, and command lists the first with
    them). Lines starting with "- " stay list items; a paragraph starting with "\\b" is
    kept as written (click's no-rewrap marker)."""
    paras = []
    for para in inspect.cleandoc(doc).split("\n\n"):
        if para.startswith("\b"):
            paras.append(para)
            continue
        lines: list[str] = []
        for line in para.splitlines():
            if lines and not line.startswith("- "):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.strip())
        paras.append("\n".join(lines))
    return "\n\n".join(paras)


class FlowedHelpGroup(TyperGroup):
    """The root group: its help and every command's and group's below it flowed
    (`flowed`), so that paragraphs wrap at the terminal's width, not at the source's."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        stack: list[Any] = [self]
        while stack:
            cmd = stack.pop()
            if cmd.help:
                cmd.help = flowed(cmd.help)
            stack += getattr(cmd, "commands", {}).values()


app = typer.Typer(
    cls=FlowedHelpGroup,
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
    """A fraction as a percentage; "n/a" where there is none (as report.md)."""
    return "n/a" if x is None else f"{x * 100:.1f}%"
