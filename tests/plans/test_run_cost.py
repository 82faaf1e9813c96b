"""A training run's line (kareus.plans.run_cost): every number by its magnitude, the cost
in a named currency (issue 34, item 13)."""

import pytest

from kareus.errors import KareusError
from kareus.plans.run_cost import RunCost


def test_a_small_run_prints_no_zeros_and_names_the_currency():
    run = RunCost.of(10, 0.0102, 10.47, 0.0104, 10.9, price_per_kwh=0.12,
                     g_co2_per_kwh=400.0)
    line = run.line()
    assert "0.00" not in line and "0.0 " not in line
    assert "0.02908 Wh" in line  # 10 x 10.47 J
    assert "USD" in line and run.to_dict()["currency"] == "USD"


def test_currency_is_the_users():
    run = RunCost.of(1000, 4.0, 2e4, 4.2, 2.1e4, price_per_kwh=0.3, currency="EUR")
    assert "EUR" in run.line() and "USD" not in run.line()
    assert run.to_dict()["currency"] == "EUR"


@pytest.mark.parametrize("bad", ["", "US D", "x" * 9, "\n"])
def test_a_currency_that_is_no_name_is_refused(bad):
    with pytest.raises(KareusError, match="--currency"):
        RunCost.of(1, 1.0, 1.0, 1.0, 1.0, price_per_kwh=1.0, currency=bad)
