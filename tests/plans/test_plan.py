import json

import pytest

from kareus.errors import KareusError
from kareus.plans.plan import select
from kareus.results.resultdir import ResultDir

FRONT = [{"time_s": 4.0, "energy_j": 200.0, "plan": "a"},
         {"time_s": 5.0, "energy_j": 150.0, "plan": "b"},
         {"time_s": 6.0, "energy_j": 120.0, "plan": "c"}]


def test_extremes():
    assert select(FRONT, "max-throughput")["plan"] == "a"
    assert select(FRONT, "min-energy")["plan"] == "c"


def test_deadline_picks_least_energy_that_meets_it():
    assert select(FRONT, "deadline", 5.5)["plan"] == "b"
    assert select(FRONT, "deadline", 5.0)["plan"] == "b"  # exactly on the deadline
    assert select(FRONT, "deadline", 100)["plan"] == "c"


def test_energy_budget_picks_fastest_within_it():
    assert select(FRONT, "energy-budget", 160)["plan"] == "b"
    assert select(FRONT, "energy-budget", 1e9)["plan"] == "a"


def test_infeasible_constraints_state_the_range():
    with pytest.raises(KareusError, match=r"from 4.0000 s to 6.0000 s"):
        select(FRONT, "deadline", 3.9)
    with pytest.raises(KareusError, match=r"from 120.0 J to 200.0 J"):
        select(FRONT, "energy-budget", 100)
    with pytest.raises(KareusError, match="positive"):
        select(FRONT, "deadline", -1)
    with pytest.raises(KareusError, match="empty"):
        select([], "min-energy")


def test_load_frontier_errors(tmp_path):
    with pytest.raises(KareusError, match="not found"):
        ResultDir(tmp_path).frontier("kareus")
    (tmp_path / "result.json").write_text("{broken")
    with pytest.raises(KareusError, match="cannot read"):
        ResultDir(tmp_path).frontier("kareus")
    (tmp_path / "result.json").write_text(json.dumps({"schema_version": 1, "methods": {}}))
    with pytest.raises(KareusError, match="no method 'kareus'"):
        ResultDir(tmp_path).frontier("kareus")


def test_a_deadline_or_budget_typed_from_a_table_still_matches():
    front = [{"time_s": 3.6901, "energy_j": 18_624.6, "plan": "x"},
             {"time_s": 4.2, "energy_j": 17_000.0, "plan": "y"}]
    assert select(front, "deadline", 3.690)["plan"] == "x"  # printed as 3.690
    assert select(front, "energy-budget", 18_620.0)["plan"] == "x"  # printed as 18.62 kJ
    with pytest.raises(KareusError, match="no plan meets"):
        select(front, "deadline", 3.689)


def test_methods_by_display_name_alias_or_any_case():
    from kareus.plans.methods import get_method

    assert get_method("Nanobatching+Perseus").name == "nanobatch_perseus"
    assert get_method("nanobatching + perseus").name == "nanobatch_perseus"
    assert get_method("KAREUS_NO_SCHED").name == "nanobatch_perseus"
    assert get_method("Megatron-LM").name == "megatron"
    assert get_method("Perseus").name == "perseus"
    with pytest.raises(KareusError, match="unknown method"):
        get_method("zeus")


def test_over_limit_says_how_much_of_the_rounding_slack_the_choice_uses():
    from kareus.plans.plan import (
        DEADLINE_TOLERANCE_S,
        ENERGY_TOLERANCE_J,
        over_limit,
        rounding_slack,
    )

    front = [{"time_s": 3.6901, "energy_j": 15_122.7, "plan": "x"},
             {"time_s": 4.2, "energy_j": 14_000.0, "plan": "y"}]
    chosen = select(front, "energy-budget", 15_120.0)
    assert chosen["plan"] == "x"  # 2.7 J over: within the slack
    assert over_limit(chosen, "energy-budget", 15_120.0) == pytest.approx(2.7)
    assert over_limit(chosen, "energy-budget", 15_200.0) == 0.0
    chosen = select(front, "deadline", 3.690)
    assert over_limit(chosen, "deadline", 3.690) == pytest.approx(0.0001)
    assert over_limit(chosen, "max-throughput", None) is None
    assert rounding_slack("deadline") == DEADLINE_TOLERANCE_S == 0.0005
    assert rounding_slack("energy-budget") == ENERGY_TOLERANCE_J == 5.0
    assert rounding_slack("min-energy") is None
    for objective, value in (("deadline", 3.690), ("energy-budget", 15_120.0)):
        point = select(front, objective, value)
        assert over_limit(point, objective, value) <= rounding_slack(objective)
