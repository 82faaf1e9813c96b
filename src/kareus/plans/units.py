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


# Printing ---------------------------------------------------------------------------------
# One formatter for every table and report: a quantity in the unit its magnitude calls for,
# to a number of significant digits, so that no positive number prints as "0.00" and a tiny
# job's methods do not all print alike.

TIME_DISPLAY: dict[str, float] = {"µs": 1e-6, "ms": 1e-3, "s": 1.0}
"""Seconds per unit, for an iteration's time (ascending)."""
DURATION_DISPLAY: dict[str, float] = {"s": 1.0, "min": 60.0, "h": 3600.0}
"""Seconds per unit, for a training run's time (ascending)."""
ENERGY_DISPLAY: dict[str, float] = {"mJ": 1e-3, "J": 1.0, "kJ": 1e3, "MJ": 1e6, "GJ": 1e9}
"""Joules per unit, for an iteration's energy (ascending)."""
RUN_ENERGY_DISPLAY: dict[str, float] = {"Wh": 3600.0, "kWh": 3.6e6, "MWh": 3.6e9,
                                        "GWh": 3.6e12}
"""Joules per unit, for a training run's energy (ascending)."""
POWER_DISPLAY: dict[str, float] = {"mW": 1e-3, "W": 1.0, "kW": 1e3, "MW": 1e6}
"""Watts per unit (ascending)."""
MASS_DISPLAY: dict[str, float] = {"g": 1e-6, "kg": 1e-3, "t": 1.0}
"""Tonnes per unit, for emissions (ascending)."""

DIGITS = 4
"""Significant digits printed by default."""
_PLAIN = (1e-4, 1e7)
"""Numbers (in their unit) outside this range print in scientific notation."""


def format_number(x: float, digits: int = DIGITS, decimals: int = 0) -> str:
    """``x`` to ``digits`` significant digits (at least ``decimals`` decimals), thousands
    separated; scientific notation far from 1; "0" for zero."""
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if not _PLAIN[0] <= abs(x) < _PLAIN[1]:
        return f"{x:.{digits - 1}e}"
    magnitude = math.floor(math.log10(abs(x)))
    return f"{x:,.{max(digits - 1 - magnitude, decimals, 0)}f}"


def display_unit(value: float, units: dict[str, float]) -> tuple[str, float]:
    """The largest of ``units`` that ``value`` (in their base unit) is at least one of,
    the smallest where it is less: (its name, its size in the base unit)."""
    ordered = sorted(units.items(), key=lambda u: u[1])
    unit, scale = ordered[0]
    for name, s in ordered:
        if abs(value) >= s:
            unit, scale = name, s
    return unit, scale


def format_quantity(value: float, units: dict[str, float], digits: int = DIGITS,
                    resolution: float | None = None) -> str:
    """``value`` (in the base unit of ``units``) in the largest of ``units`` it is at
    least one of (the smallest where it is less), to ``digits`` significant digits;
    ``resolution`` (base unit): print at least this finely (a limit typed back from a
    table then meets its rounding slack)."""
    unit, scale = display_unit(value, units)
    decimals = 0
    if resolution is not None and resolution > 0:
        decimals = max(math.ceil(-math.log10(resolution / scale) - 1e-9), 0)
    return f"{format_number(value / scale, digits, decimals)} {unit}"


def format_time_s(s: float, resolution: float | None = None) -> str:
    """An iteration's time: ``4.178 s``, ``10.23 ms``."""
    return format_quantity(s, TIME_DISPLAY, resolution=resolution)


def format_duration_s(s: float) -> str:
    """A training run's time: ``12.34 h``, ``3.5 min``."""
    return format_quantity(s, DURATION_DISPLAY)


def format_energy_j(j: float, resolution: float | None = None) -> str:
    """An iteration's energy: ``20.91 kJ``, ``10.47 J``."""
    return format_quantity(j, ENERGY_DISPLAY, resolution=resolution)


def format_run_energy_j(j: float) -> str:
    """A training run's energy: ``1.234 MWh``, ``56.78 kWh``."""
    return format_quantity(j, RUN_ENERGY_DISPLAY)


def format_power_w(w: float) -> str:
    """A power: ``5.048 kW``, ``400.0 W``."""
    return format_quantity(w, POWER_DISPLAY)


def format_mass_t(t: float) -> str:
    """Emissions: ``12.34 t``, ``5.678 kg``."""
    return format_quantity(t, MASS_DISPLAY)


def format_money(amount: float, currency: str) -> str:
    """An amount of ``currency``: ``1,234,567 USD``, ``12.35 EUR``, ``0.01234 USD``."""
    plain = f"{amount:,.0f}" if 1e3 <= abs(amount) < 1e15 else format_number(amount)
    return f"{plain} {currency}"
