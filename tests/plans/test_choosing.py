"""Choosing a plan lives in the library, not the CLI (issue 40): the objective a power
cap implies, a plan's settings per clock, the point chosen under a cap."""

import pytest

from kareus.errors import KareusError
from kareus.plans.plan import objective_of, settings_by_clock
from kareus.results.choice import cap_given, chosen_point
from kareus.results.resultdir import ResultDir


def test_a_power_cap_alone_asks_for_the_fastest_plan_under_it():
    assert objective_of(capped=True) == ("max-throughput", None)
    assert objective_of(min_energy=True, capped=True) == ("min-energy", None)
    assert objective_of(deadline_s=3.0, capped=True) == ("deadline", 3.0)
    with pytest.raises(KareusError, match="give exactly one"):
        objective_of()


def test_one_form_of_the_cap_at_a_time():
    assert not cap_given(None, None)
    assert cap_given(3.0, None) and cap_given(None, 300.0)
    with pytest.raises(KareusError, match="give one of --power-cap-kw and"):
        cap_given(3.0, 300.0)


def test_the_point_chosen_under_a_cap_is_the_fastest_under_it(small_result):
    rd = ResultDir(str(small_result))
    frontier = rd.frontier("kareus")
    fastest = min(frontier, key=lambda p: p["time_s"])
    assert chosen_point(rd, "kareus", "max-throughput", None, None, None, 1.0) == fastest
    # a cap of 1 W per GPU: no plan stays under it, and the error says why
    with pytest.raises(KareusError, match="no plan stays under"):
        chosen_point(rd, "kareus", "max-throughput", None, None, 1.0, 1.0)
    # a generous cap keeps every plan: the same choice
    assert chosen_point(rd, "kareus", "min-energy", None, 1e6, None, 1.0) == min(
        frontier, key=lambda p: p["energy_j"])


def test_settings_by_clock_count_each_setting_once_per_instruction(small_result):
    rd = ResultDir(str(small_result))
    plan, _job = rd.read_plan(rd.frontier("kareus")[0]["plan"])
    rows = settings_by_clock(plan)
    ex = plan.execution
    assert sum(r["instructions"] for r in rows) == sum(
        len(s) for s in ex.instruction_knobs.values())
    assert rows == sorted(rows, key=lambda r: (r["partition"], -r["freq_mhz"], r["sms"]))
