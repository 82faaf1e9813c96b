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
