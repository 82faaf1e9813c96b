import pytest

from kareus.plans.metrics import (
    iso_energy_time_reduction,
    iso_time_energy_reduction,
    max_throughput_vs,
    method_metrics,
)

PERSEUS = [(10.0, 100.0), (12.0, 80.0), (15.0, 70.0)]
METHOD = [(8.0, 95.0), (10.0, 75.0), (11.0, 68.0), (13.0, 60.0)]


def test_iso_time():
    # plans no slower than 10 s: (8, 95), (10, 75) -> 75 against 100
    assert iso_time_energy_reduction(METHOD, PERSEUS) == pytest.approx(0.25)


def test_iso_energy():
    # plans using <= 70 J: (11, 68), (13, 60) -> 11 s against 15 s
    assert iso_energy_time_reduction(METHOD, PERSEUS) == pytest.approx(1 - 11 / 15)


def test_no_qualifying_plan_gives_none():
    slow = [(20.0, 50.0)]
    assert iso_time_energy_reduction(slow, PERSEUS) is None
    hungry = [(5.0, 500.0)]
    assert iso_energy_time_reduction(hungry, PERSEUS) is None


def test_max_throughput_against_megatron():
    t, e = max_throughput_vs(METHOD, [(10.0, 120.0)])
    assert t == pytest.approx(0.2) and e == pytest.approx(1 - 95 / 120)


def test_reference_against_itself_is_zero():
    assert iso_time_energy_reduction(PERSEUS, PERSEUS) == pytest.approx(0.0)
    assert iso_energy_time_reduction(PERSEUS, PERSEUS) == pytest.approx(0.0)


def test_method_metrics_table():
    m = method_metrics({"perseus": PERSEUS, "kareus": METHOD, "megatron": [(10.0, 120.0)]})
    assert m["kareus"]["iso_time_energy_reduction"] == pytest.approx(0.25)
    assert "iso_time_energy_reduction" not in m["perseus"]
    assert m["megatron"]["max_throughput_time_reduction_vs_megatron"] == pytest.approx(0.0)
