"""The command-line options of a backend kind, declared on the spec fields they fill.

A spec field that the user sets from the command line is declared with `option` (its flag,
its help, the range a number must lie in); the CLI builds its backend options from the
registered kinds' fields (kareus.cli.options.with_backend), so a new kind brings its own
options without any CLI edit. A field whose value is a small dataclass filled by several
flags (the measurement protocol: --window, --cooldown, --settle) declares its parts with
`parts`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

OPTION = "kareus.option"
"""The key of a field's metadata that holds its `Flag` (or its parts)."""

MAX_SEED = 2**32 - 1
"""Seeds are 0..2^32-1, the range every seeded generator takes (numpy's legacy one too)."""


@dataclass(frozen=True)
class Flag:
    """How one option reads on the command line."""

    flag: str
    """The option's name, e.g. ``--noise``."""
    help: str
    positive: bool = False
    """Numbers: > 0 (a size, a duration that must pass); otherwise >= 0."""
    at_most: float | None = None
    """Numbers: the largest value taken (ints: 0..at_most)."""

    @property
    def param(self) -> str:
        """The option's parameter name: the flag in snake case."""
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Parts:
    """A field filled by several options, one per field of its dataclass value; what no
    option gives keeps that dataclass's default."""

    parts: dict[str, Flag]
    """By the dataclass's field name."""


def option(default: Any, *, flag: str, help: str, positive: bool = False,
           at_most: float | None = None) -> Any:
    """A spec field the command line sets with ``flag`` (``default``: when not given)."""
    return dataclasses.field(default=default, metadata={
        OPTION: Flag(flag, help, positive, at_most)})


def parts(**by_field: Flag) -> dict[str, Parts]:
    """The metadata of a spec field filled by an option per field of its (dataclass)
    value: ``dataclasses.field(default=..., metadata=parts(x=Flag(...), ...))``."""
    return {OPTION: Parts(by_field)}


@dataclass(frozen=True)
class SpecOption:
    """One option of a spec: the field it fills, its type and default, its flag; for a
    part, the part's field name and its dataclass's type."""

    field: str
    annotation: Any
    default: Any
    flag: Flag
    part: str | None = None
    of: Any = None
    """The dataclass a part fills (None for a plain option)."""


def spec_options(spec: type) -> Iterator[SpecOption]:
    """The options of a spec class, in field order (its base's fields first)."""
    hints = typing.get_type_hints(spec)
    for f in dataclasses.fields(spec):
        info = f.metadata.get(OPTION)
        if isinstance(info, Flag):
            yield SpecOption(f.name, hints[f.name], f.default, info)
        elif isinstance(info, Parts):
            of = _dataclass_in(hints[f.name])
            part_hints = typing.get_type_hints(of)
            for name, flag in info.parts.items():
                # a part not given is None: the dataclass's own default fills it
                yield SpecOption(f.name, typing.Optional[part_hints[name]], None, flag,
                                 name, of)


def _dataclass_in(annotation: Any) -> Any:
    """``X`` of ``X | None``."""
    for arg in (annotation, *typing.get_args(annotation)):
        if dataclasses.is_dataclass(arg):
            return arg
    raise TypeError(f"{annotation!r}: a field of parts holds a dataclass")


def flag_of(spec: type, field: str) -> str:
    """The flag(s) that set ``field`` of ``spec`` (``--x-y`` for a field ``x_y`` without
    one)."""
    flags = [o.flag.flag for o in spec_options(spec) if o.field == field]
    return "/".join(flags) or "--" + field.replace("_", "-")
