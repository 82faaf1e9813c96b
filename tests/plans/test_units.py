"""The parser of `--energy-budget` and `--deadline` values (kareus.plans.units)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kareus.errors import KareusError
from kareus.plans.units import ENERGY_UNITS, TIME_UNITS, parse_energy_j, parse_time_s

POSITIVE = st.floats(min_value=1e-6, max_value=1e9, allow_nan=False, allow_infinity=False)
SPACE = st.sampled_from(["", " ", "  ", "\t"])


@given(POSITIVE, st.sampled_from(sorted(ENERGY_UNITS)), SPACE, SPACE)
def test_an_energy_in_any_unit_is_its_joules(x, unit, pad, gap):
    assert parse_energy_j(f"{pad}{x!r}{gap}{unit}{pad}") == pytest.approx(
        x * ENERGY_UNITS[unit], rel=1e-12)


@given(POSITIVE, st.sampled_from(sorted(TIME_UNITS)), SPACE)
def test_a_time_in_any_unit_is_its_seconds(x, unit, gap):
    assert parse_time_s(f"{x!r}{gap}{unit}") == pytest.approx(x * TIME_UNITS[unit], rel=1e-12)


@given(POSITIVE)
def test_a_bare_number_is_joules_or_seconds(x):
    assert parse_energy_j(repr(x)) == x and parse_time_s(repr(x)) == x
    assert parse_energy_j(f"{x:.3e}") == float(f"{x:.3e}")


@given(st.text(max_size=12))
def test_any_text_is_a_positive_finite_value_or_one_kareus_error(text):
    for parse, units in ((parse_energy_j, ENERGY_UNITS), (parse_time_s, TIME_UNITS)):
        try:
            v = parse(text)
        except KareusError as exc:
            msg = str(exc)
            assert "\n" not in msg and all(u in msg for u in units)
        else:
            assert math.isfinite(v) and v > 0


@given(POSITIVE, st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                         min_size=1, max_size=4))
def test_an_unknown_unit_is_refused(x, unit):
    for parse, units in ((parse_energy_j, ENERGY_UNITS), (parse_time_s, TIME_UNITS)):
        if unit in units:
            continue
        with pytest.raises(KareusError, match="unit"):
            parse(f"{x!r}{unit}")


@pytest.mark.parametrize("text", ["0", "0kJ", "-5", "-1ms", "1e999", "inf", "nan", "", "kJ",
                                  "1.2.3", "1,5kJ", "15 k J"])
def test_not_a_positive_finite_quantity(text):
    with pytest.raises(KareusError):
        parse_energy_j(text)


def test_the_energy_and_time_units():
    assert parse_energy_j("15.12kJ") == pytest.approx(15120)
    assert parse_energy_j("15120J") == parse_energy_j("15120") == 15120
    assert parse_energy_j("0.0042MJ") == pytest.approx(4200)
    assert parse_energy_j("1Wh") == 3600 and parse_energy_j("1kWh") == 3.6e6
    assert parse_time_s("2500ms") == pytest.approx(2.5) == parse_time_s("2.5s")
    with pytest.raises(KareusError, match="unknown unit 'mJ'"):
        parse_energy_j("5mJ")  # case matters: mJ is not MJ


# Printing: one formatter by magnitude (issue 34, item 13) --------------------------------

from kareus.plans.units import (  # noqa: E402
    DURATION_DISPLAY,
    ENERGY_DISPLAY,
    RUN_ENERGY_DISPLAY,
    TIME_DISPLAY,
    format_energy_j,
    format_money,
    format_number,
    format_quantity,
    format_run_energy_j,
    format_time_s,
)

MAGNITUDE = st.floats(min_value=1e-12, max_value=1e15, allow_nan=False, allow_infinity=False)
FAMILIES = st.sampled_from([TIME_DISPLAY, DURATION_DISPLAY, ENERGY_DISPLAY, RUN_ENERGY_DISPLAY])


def _read_back(text, units):
    number, unit = text.rsplit(" ", 1)
    return float(number.replace(",", "")) * units[unit]


@given(MAGNITUDE, FAMILIES)
def test_any_positive_magnitude_prints_short_with_its_digits(x, units):
    text = format_quantity(x, units)
    number = text.rsplit(" ", 1)[0]
    assert len(number) <= 12, text
    assert any(c in "123456789" for c in number.split("e")[0]), text  # never "0.00"
    # four significant digits: read back within half a unit of the fourth
    assert _read_back(text, units) == pytest.approx(x, rel=5e-4)


@given(MAGNITUDE, FAMILIES)
def test_the_unit_is_the_largest_the_magnitude_reaches(x, units):
    unit = format_quantity(x, units).rsplit(" ", 1)[1]
    smallest = min(units.values())
    assert units[unit] <= max(x, smallest)
    assert not any(units[unit] < s <= x for s in units.values())


def test_the_issues_numbers():
    # a tiny job's methods no longer all print "0.010 s, 0.01 kJ"; no "0.00 MWh"
    assert format_time_s(0.0102) == "10.20 ms" and format_time_s(0.0104) == "10.40 ms"
    assert format_energy_j(10.47) == "10.47 J" and format_energy_j(20910.0) == "20.91 kJ"
    assert format_run_energy_j(20910.0 * 10) == "58.08 Wh"
    assert format_money(0.0123, "USD") == "0.01230 USD"
    assert format_money(1234567.8, "EUR") == "1,234,568 EUR"
    assert format_number(0.0) == "0"


@given(st.floats(min_value=1e-3, max_value=1e4, allow_nan=False))
def test_a_resolution_prints_at_least_that_finely(s):
    # a time typed back from a table meets its deadline within the 0.5 ms rounding slack
    text = format_time_s(s, resolution=1e-3)
    assert abs(_read_back(text, TIME_DISPLAY) - s) <= 0.5e-3 + 1e-12
