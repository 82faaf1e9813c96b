"""Limits typed on the command line: an energy or a time, with an optional unit.

`--energy-budget` takes joules, or a number with one of ENERGY_UNITS (``15.12kJ``,
``15120J``, ``15120``); `--deadline` takes seconds, or one of TIME_UNITS (``2500ms``). Unit
symbols are case-sensitive (``mJ`` is not ``MJ``); a space between number and unit is
allowed.
"""

from __future__ import annotations

import math
import re

from kareus.errors import KareusError

ENERGY_UNITS: dict[str, float] = {"J": 1.0, "kJ": 1e3, "MJ": 1e6, "Wh": 3600.0,
                                  "kWh": 3.6e6}
"""Joules per unit."""
TIME_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3}
"""Seconds per unit."""

_QUANTITY = re.compile(r"\s*([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
                       r"\s*([A-Za-z]*)\s*")


def parse_quantity(text: str, units: dict[str, float], what: str, option: str) -> float:
    """``text`` in the base unit of ``units`` (the unit worth 1, also meant by a bare
    number): a positive finite value, or KareusError naming ``option`` and the units."""
    base = next(u for u, f in units.items() if f == 1.0)
    known = f"units: {', '.join(units)}; a bare number is {base}"
    m = _QUANTITY.fullmatch(text)
    if m is None:
        raise KareusError(f"{option} {text!r} is not {what}: give a number with an optional "
                          f"unit ({known})")
    number, unit = m.groups()
    if unit and unit not in units:
        raise KareusError(f"{option} {text!r}: unknown unit {unit!r} ({known})")
    value = float(number) * units[unit or base]
    if not math.isfinite(value) or not value > 0:
        raise KareusError(f"{option} {text!r}: needs a positive, finite number ({known})")
    return value


def parse_energy_j(text: str, option: str = "--energy-budget") -> float:
    """An energy in joules from ``15.12kJ``, ``15120J``, ``15120``, ``4.2Wh``, ..."""
    return parse_quantity(text, ENERGY_UNITS, "an energy", option)


def parse_time_s(text: str, option: str = "--deadline") -> float:
    """A time in seconds from ``2.5``, ``2.5s`` or ``2500ms``."""
    return parse_quantity(text, TIME_UNITS, "a time", option)
