"""Every flag of every command explains itself, no flag shows a <bool> metavar, help
paragraphs flow instead of keeping the docstrings' line breaks, and the tables print whole
words."""

import typer

from kareus.cli import app
from kareus.cli.app import flowed
from tests.conftest import run_cli


def _commands(cmd, path: str = "kareus"):
    # Typer bundles its own click: not click.Group / click.Option instances
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, f"{path} {name}")


def test_every_command_is_walked():
    paths = [path for path, _ in _commands(typer.main.get_command(app))]
    assert {"kareus optimize", "kareus compare", "kareus plan show", "kareus gpu reset-clocks"
            } <= set(paths)


def test_every_option_has_help_and_no_bool_metavar():
    missing, metavars = [], []
    for path, cmd in _commands(typer.main.get_command(app)):
        for p in cmd.params:
            if getattr(p, "param_type_name", "") != "option" or p.name == "help":
                continue
            if not (p.help or "").strip():
                missing.append(f"{path} {p.opts[0]}")
            if p.is_flag and p.metavar != "":
                metavars.append(f"{path} {p.opts[0]}")
    assert not missing, missing
    assert not metavars, metavars


def test_help_paragraphs_flow(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    out = run_cli("optimize", "--help").out
    # in the docstring "... on the local GPU" ends a source line and "first (as" starts one
    assert ("With --backend nvml: profile every partition and composition step on the local "
            "GPU first (as `kareus profile`), then compose from those measurements.") in out
    root = run_cli("--help").out
    assert "write DIR/result.json, DIR/plans/, DIR/frontier.png and DIR/report.md." in root
    assert ("With --executor ray, each partition's group runs as Ray actors on one node of "
            "the cluster (partitions in parallel), and this process writes the journal."
            in run_cli("profile", "--help").out)


def test_every_help_paragraph_is_one_line():
    for path, cmd in _commands(typer.main.get_command(app)):
        for para in (cmd.help or "").split("\n\n"):
            lines = para.splitlines()
            assert all(line.startswith("- ") for line in lines[1:]), (path, para)


def test_flowed_keeps_paragraphs_and_list_items():
    doc = """First line
    goes on.

    Second paragraph
    goes on:
    - one item
      continued
    - another

    \bkept
    as is"""
    assert flowed(doc) == ("First line goes on.\n\nSecond paragraph goes on:\n"
                           "- one item continued\n- another\n\n\bkept\nas is")


def test_partitions_table_prints_whole_directions():
    out = run_cli("partitions", "-p", "kareus-1").out
    rows = [line.split("│") for line in out.splitlines() if line.startswith("│")]
    assert {r[2].strip() for r in rows} == {"forward", "backward"}
