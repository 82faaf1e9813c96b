"""Every flag of every command explains itself, and no flag shows a <bool> metavar."""

import click
import typer

from kareus.cli import app


def _commands(cmd: click.Command, path: str = "kareus"):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, f"{path} {name}")


def test_every_option_has_help_and_no_bool_metavar():
    missing, metavars = [], []
    for path, cmd in _commands(typer.main.get_command(app)):
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.name == "help":
                continue
            if not (p.help or "").strip():
                missing.append(f"{path} {p.opts[0]}")
            if p.is_flag and p.metavar != "":
                metavars.append(f"{path} {p.opts[0]}")
    assert not missing, missing
    assert not metavars, metavars
