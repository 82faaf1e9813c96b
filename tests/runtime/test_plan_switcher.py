import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus.core import PartitionSetting
from kareus.errors import KareusError
from kareus.plans.execution import ExecutionPlan
from kareus.plans.plan import DEADLINE_TOLERANCE_S, Plan, PlanPower
from kareus.plans.replan import PACE_ROUNDING, FrontierPlan, pace_plan
from kareus.runtime.plan_switcher import SWITCH_LOG_SCHEMA_VERSION, Pace, PlanSwitcher

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _plan(pid, time_s, energy_j, peak_w=None, **execution):
    ex = ExecutionPlan(pid, overlap=True, default_freq_mhz=1410, **execution)
    power = None if peak_w is None else PlanPower(peak_w * 0.8, peak_w, 1.0, 2, 8, 60.0)
    return Plan(pid, "kareus", time_s, energy_j, ex, power=power)


# a frontier: slower is cheaper; "p0" is the operator's plan, "fast" is faster than it
FRONTIER = [_plan("fast", 0.9, 120.0, 9000.0), _plan("p0", 1.0, 100.0, 8000.0),
            _plan("p1", 1.2, 90.0, 7000.0), _plan("p2", 1.4, 82.0, 6500.0),
            _plan("p3", 1.5, 78.0, 6000.0), _plan("p4", 1.8, 70.0, 5000.0)]


def _switcher(patience=2, hysteresis=0.05, plans=FRONTIER, **kw):
    return PlanSwitcher(plans, "p0", hysteresis=hysteresis, patience=patience, **kw)


def _run(sw, paces, start=1):
    """Feed ``paces`` to successive boundaries; the ids switched to (None: no switch)."""
    out = []
    for i, p in enumerate(paces, start):
        new = sw.boundary(i, pace=Pace(*p))
        out.append(None if new is None else new.id)
    return out


# Selection, against a brute force ----------------------------------------------------

points = st.lists(st.tuples(st.floats(0.1, 10.0), st.floats(1.0, 1e4), st.floats(100.0, 1e4)),
                  min_size=1, max_size=12)


def _plans_of(pts):
    return [_plan(f"k{i}", t, e, w) for i, (t, e, w) in enumerate(pts)]


@FAST
@given(points, st.floats(0.05, 12.0))
def test_for_deadline_matches_brute_force(pts, deadline):
    plans = _plans_of(pts)
    chosen = PlanSwitcher(plans, "k0").for_deadline(deadline)
    by_energy = sorted(plans, key=lambda p: (p.energy_j, p.time_s))
    meeting = [p for p in by_energy if p.time_s - DEADLINE_TOLERANCE_S <= deadline]
    want = meeting[0] if meeting else sorted(plans, key=lambda p: (p.time_s, p.energy_j))[0]
    assert (chosen.time_s, chosen.energy_j) == (want.time_s, want.energy_j)


@FAST
@given(points, st.floats(50.0, 1.2e4))
def test_for_power_cap_matches_brute_force(pts, cap_w):
    plans = _plans_of(pts)
    chosen = PlanSwitcher(plans, "k0").for_power_cap(cap_w)
    fitting = [p for p in sorted(plans, key=lambda p: (p.time_s, p.energy_j))
               if not p.power.peak_w > cap_w]
    if fitting:
        assert (chosen.time_s, chosen.energy_j) == (fitting[0].time_s, fitting[0].energy_j)
        assert chosen.power.peak_w <= cap_w
    else:
        low = sorted(plans, key=lambda p: (p.power.peak_w, p.time_s))[0]
        assert (chosen.power.peak_w, chosen.time_s) == (low.power.peak_w, low.time_s)


@FAST
@given(points, st.floats(0.05, 12.0), st.integers(0, 11))
def test_for_pace_matches_brute_force(pts, target, base_index):
    plans = _plans_of(pts)
    base = plans[base_index % len(plans)]
    chosen = PlanSwitcher(plans, base.id).for_pace(target)
    limit = target + target * PACE_ROUNDING
    if base.time_s > limit:
        assert chosen is base
        return
    want = sorted((p for p in plans if not p.time_s > limit),
                  key=lambda p: (p.energy_j, p.time_s))[0]
    assert (chosen.time_s, chosen.energy_j) == (want.time_s, want.energy_j)
    assert chosen.time_s <= limit  # never slower than asked


@FAST
@given(points, st.floats(0.05, 12.0), st.integers(0, 11))
def test_for_pace_is_the_straggler_scenarios_rule(pts, target, base_index):
    """The runtime's pace trigger and `kareus replan`'s straggler scenario pick the same
    plan (one rule, kareus.plans.replan.pace_plan): ties in energy, a pace faster than
    the base, a plan an ulp over the pace."""
    plans = _plans_of(pts)
    base = plans[base_index % len(plans)]
    frontier = [FrontierPlan(p.id, p.time_s, p.energy_j) for p in plans]
    got = PlanSwitcher(plans, base.id).for_pace(target)
    want = pace_plan(frontier, frontier[base_index % len(plans)], target)
    assert (got.time_s, got.energy_j) == (want.time_s, want.energy_j)


def test_a_power_cap_needs_every_plans_power():
    plans = [*FRONTIER, _plan("old", 2.0, 60.0)]
    sw = PlanSwitcher(plans, "p0")
    with pytest.raises(KareusError, match="old has no power"):
        sw.for_power_cap(1e4)
    with pytest.raises(KareusError, match="old has no power"):
        sw.request(power_cap_kw=10.0)
    assert sw.for_deadline(1.3).id == "p1"


def test_sms_used_covers_every_setting_of_every_plan():
    a = _plan("a", 1.0, 10.0, knobs={"fwd_ar": PartitionSetting(16, "first")},
              knobs_by_freq={("fwd_ar", 1200): PartitionSetting(8, None)})
    b = _plan("b", 2.0, 5.0, default_sms=20,
              instruction_knobs={(0, 0, "forward"): {"bwd_ar": PartitionSetting(24, "x")}})
    sw = PlanSwitcher([a, b], "a")
    assert sw.sms_used() == {8, 16, 20, 24}
    assert sw.sms_used(default_sms=32) == {8, 16, 20, 24, 32}


@pytest.mark.parametrize(("plans", "start", "kw", "match"), [
    ([], "p0", {}, "at least one plan"),
    (FRONTIER, "nope", {}, "no plan 'nope'"),
    ([*FRONTIER, _plan("p0", 3.0, 1.0)], "p0", {}, "given twice"),
    ([_plan("z", 0.0, 1.0)], "z", {}, "positive"),
    (FRONTIER, "p0", {"hysteresis": -0.1}, "hysteresis"),
    (FRONTIER, "p0", {"patience": 0}, "patience"),
])
def test_a_bad_switcher_is_refused_in_one_line(plans, start, kw, match):
    with pytest.raises(KareusError, match=match) as exc:
        PlanSwitcher(plans, start, **kw)
    assert "\n" not in str(exc.value)


def test_a_control_document_switches_at_its_boundary_and_is_logged(tmp_path):
    log = tmp_path / "switches.jsonl"
    sw = _switcher(log_path=log)
    assert sw.boundary(0) is None
    assert sw.boundary(1, control={"plan": "p2"}).id == "p2"
    assert sw.base.id == sw.current.id == "p2"
    assert sw.boundary(2, control={"deadline_s": 1.25}).id == "p1"
    assert sw.boundary(3, control={"power_cap_kw": 6.6}).id == "p2"
    assert sw.boundary(4, control={"power_cap_kw": 1.0}).id == "p4"  # none fits: lowest
    assert sw.boundary(5, control={"deadline_s": 0.5}).id == "fast"  # none meets it
    assert sw.boundary(6, control={"deadline_s": 0.5}) is None  # already there
    lines = log.read_text().splitlines()
    assert len(lines) == 5 == len(sw.switches)
    docs = [json.loads(line) for line in lines]
    assert docs == sw.switches
    assert [(d["iteration"], d["old"], d["new"]) for d in docs] == [
        (1, "p0", "p2"), (2, "p2", "p1"), (3, "p1", "p2"), (4, "p2", "p4"), (5, "p4", "fast")]
    for d in docs:
        assert d["schema_version"] == SWITCH_LOG_SCHEMA_VERSION
        assert d["reason"] == "control file" and d["why"]
        assert {"old_time_s", "new_time_s", "old_energy_j", "new_energy_j"} <= set(d)
    assert docs[1]["deadline_s"] == 1.25 and docs[2]["power_cap_kw"] == 6.6
    assert docs[2]["new_peak_w"] == 6500.0 and docs[0]["plan"] == "p2"
    assert "cannot" not in docs[1]["why"]
    assert "no plan's peak power fits" in docs[3]["why"]
    assert "no plan meets the 0.5 s deadline" in docs[4]["why"]


def test_the_log_is_appended_to(tmp_path):
    log = tmp_path / "deep" / "switches.jsonl"
    _switcher(log_path=log).boundary(1, control={"plan": "p1"})
    _switcher(log_path=log).boundary(7, control={"plan": "p3"})
    assert [json.loads(x)["new"] for x in log.read_text().splitlines()] == ["p1", "p3"]


def test_a_control_these_plans_cannot_answer_is_refused_and_pace_goes_on(tmp_path):
    sw = _switcher(patience=1)
    new = sw.boundary(3, control={"plan": "kareus-999"}, pace=Pace(1.5, 1.0))
    assert new.id == "p3" and sw.base.id == "p0"  # refused; pace still applied
    assert len(sw.refused) == 1 and "kareus-999" in sw.refused[0]
    sw.boundary(4, control={"deadline_s": -2.0})
    assert len(sw.refused) == 2 and sw.current.id == "p3"


# Programmatic requests ---------------------------------------------------------------

@pytest.mark.parametrize(("kw", "match"), [
    ({}, "exactly one"), ({"plan": "p1", "deadline_s": 2.0}, "exactly one"),
    ({"plan": "nope"}, "no plan 'nope'"), ({"deadline_s": 0.0}, "positive"),
    ({"deadline_s": -1.0}, "positive"), ({"power_cap_kw": float("nan")}, "positive"),
    ({"power_cap_kw": float("inf")}, "positive"), ({"plan": "p1", "reason": ""}, "reason"),
])
def test_a_bad_request_is_refused_now_and_changes_nothing(kw, match):
    sw = _switcher()
    sw.request(plan="p2")
    with pytest.raises(KareusError, match=match) as exc:
        sw.request(**kw)
    assert "\n" not in str(exc.value)
    assert sw.current.id == "p0"
    assert sw.boundary(1).id == "p2"  # the earlier request stands


def test_a_request_applies_at_the_next_boundary_and_the_control_file_wins():
    sw = _switcher()
    sw.request(deadline_s=1.45, reason="my scheduler")
    assert sw.current.id == "p0"
    assert sw.boundary(1).id == "p2"
    assert sw.switches[-1]["reason"] == "my scheduler"
    assert sw.boundary(2) is None  # applied once
    sw.request(plan="p1")
    assert sw.boundary(3, control={"plan": "p4"}).id == "p4"
    assert sw.boundary(4) is None  # the request the control file superseded is gone
    sw.request(power_cap_kw=8.5)
    assert sw.boundary(5).id == "p0" and sw.switches[-1]["reason"] == "programmatic"


# Pace --------------------------------------------------------------------------------

def test_a_straggler_slows_the_others_and_stays_on_its_plan():
    other, straggler = _switcher(), _switcher()
    paces = [(1.5, 1.0)] * 4
    assert _run(other, paces) == [None, "p3", None, None]  # patience 2
    assert other.switches[0]["reason"] == "pace"
    assert other.switches[0]["target_time_s"] == pytest.approx(1.5)
    assert other.base.id == "p0"
    assert _run(straggler, [(1.5, 1.5)] * 4) == [None] * 4
    # once moved, its own pace is measured against its new plan: it stays
    assert _run(other, [(1.5, 1.0)] * 3, start=5) == [None] * 3


def test_recovery_returns_to_base_at_once():
    sw = _switcher()
    _run(sw, [(1.5, 1.0)] * 2)
    assert sw.current.id == "p3"
    assert _run(sw, [(1.0, 1.0)], start=3) == ["p0"]  # faster: no patience
    assert "nearer" in sw.switches[-1]["why"] or sw.switches[-1]["straggler"]


def test_patience_counts_consecutive_boundaries():
    sw = _switcher(patience=3)
    calm, slow = (1.0, 1.0), (1.5, 1.0)
    assert _run(sw, [slow, slow, calm, slow, slow, slow]) == [None] * 5 + ["p3"]
    assert sw.switches[-1]["boundaries_held"] == 3


def test_a_faster_move_is_immediate_and_never_slower_than_the_pace():
    sw = _switcher(patience=5)
    _run(sw, [(1.8, 1.0)] * 5)
    assert sw.current.id == "p4"
    assert _run(sw, [(1.25, 1.0)], start=6) == ["p1"]
    assert sw.current.time_s <= 1.25


def test_an_operator_request_wins_over_pace():
    sw = _switcher(patience=1)
    new = sw.boundary(1, control={"plan": "p1"}, pace=Pace(1.5, 1.0))
    assert new.id == "p1" and sw.base.id == "p1"
    assert [s["reason"] for s in sw.switches] == ["control file"]
    # then pace moves from the new base: 1.2 s x 1.5 = 1.8 s (1.7999999999999998 in floats)
    assert sw.boundary(2, pace=Pace(1.5, 1.0)).id == "p4"


@FAST
@given(st.lists(st.tuples(st.floats(0.8, 1.2), st.floats(0.0, 0.999)), min_size=1,
                max_size=30),
       st.sampled_from([0.02, 0.05, 0.1]), st.integers(1, 3))
def test_noise_within_hysteresis_never_switches(noise, h, patience):
    near = [*FRONTIER, _plan("n-", 0.99, 101.0), _plan("n+", 1.01, 99.0),
            _plan("p3-", 1.47, 79.0), _plan("p3+", 1.53, 77.0)]
    calm = _switcher(patience=patience, hysteresis=h, plans=near)
    moved = _switcher(patience=patience, hysteresis=h, plans=near)
    while moved.current.id != "p3":
        moved.boundary(0, pace=Pace(1.5, 1.0))
    n = len(moved.switches)
    for i, (own, u) in enumerate(noise, 1):
        calm.boundary(i, pace=Pace(own * (1 + u * h), own))
        # around a 1.5x straggler, within hysteresis of the running plan either way
        r = 1 / (1 + u * h) if i % 2 else 1 + u * h
        moved.boundary(i, pace=Pace(own * 1.5 * r, own))
    assert calm.switches == []
    assert len(moved.switches) == n


def test_a_pace_that_is_not_two_positive_numbers_is_refused():
    sw = _switcher()
    for bad in (Pace(0.0, 1.0), Pace(1.0, float("nan")), Pace(-1.0, -1.0)):
        with pytest.raises(KareusError, match="pace"):
            sw.boundary(1, pace=bad)
    assert sw.current.id == "p0"


events = st.lists(st.tuples(
    st.one_of(st.none(), st.fixed_dictionaries({"plan": st.sampled_from(
        ["p0", "p1", "p4", "nope"])}), st.fixed_dictionaries(
        {"deadline_s": st.floats(0.5, 2.0)}), st.fixed_dictionaries(
        {"power_cap_kw": st.floats(4.0, 10.0)})),
    st.one_of(st.none(), st.tuples(st.floats(0.9, 2.5), st.floats(0.9, 1.2)))),
    max_size=25)


@FAST
@given(events)
def test_every_rank_fed_the_same_inputs_decides_the_same(tmp_path, evs):
    logs = [tmp_path / f"rank{r}-{os.urandom(4).hex()}.jsonl" for r in range(2)]
    ranks = [_switcher(log_path=log) for log in logs]
    decided = [[], []]
    for i, (control, pace) in enumerate(evs):
        for r, sw in enumerate(ranks):
            p = None if pace is None else Pace(max(pace), pace[1])
            new = sw.boundary(i, control=control, pace=p)
            decided[r].append(None if new is None else new.id)
            # never slower than the pace asks of a non-straggler
            if p is not None and control is None and p.own < p.slowest and new is not None:
                assert new.time_s <= sw.base.time_s * p.slowest / p.own * (1 + 1e-9)
    assert decided[0] == decided[1]
    assert ranks[0].switches == ranks[1].switches
    texts = [log.read_text() if log.exists() else "" for log in logs]
    assert texts[0] == texts[1]
    assert len(texts[0].splitlines()) == len(ranks[0].switches)


def test_the_straggler_keeps_the_operators_plan_even_where_a_faster_one_is_cheaper():
    # "p0" is dominated (a faster plan uses less energy): the operator chose it anyway
    plans = [_plan("p0", 1.0, 100.0), _plan("cheap", 0.95, 95.0), _plan("slow", 1.5, 60.0)]
    straggler = PlanSwitcher(plans, "p0", patience=1)
    assert _run(straggler, [(1.5, 1.5), (1.0, 1.0), (1.2, 1.25)]) == [None] * 3
    other = PlanSwitcher(plans, "p0", patience=1)
    assert _run(other, [(1.5, 1.0)]) == ["slow"]
    assert _run(other, [(1.2, 1.2)], start=2) == ["p0"]  # now the slowest: back to base


def test_pace_keeps_to_the_operators_power_cap():
    """Under a power cap, the others slow down only to plans under it: here the cheapest
    plan within the pace ("hot") peaks over the cap, so they take the cheapest that fits."""
    plans = [_plan("fast", 0.9, 120.0, 9000.0), _plan("p0", 1.0, 100.0, 7000.0),
             _plan("ok", 1.3, 95.0, 6500.0), _plan("hot", 1.4, 80.0, 9500.0)]
    sw = PlanSwitcher(plans, "fast", patience=1)
    sw.request(power_cap_kw=7.0)
    assert sw.boundary(1).id == "p0"  # the fastest under 7 kW
    assert sw.boundary(2, pace=Pace(1.5, 1.0)).id == "ok"  # not "hot" (9.5 kW)
    sw.request(plan="p0")  # a plan, no cap: the cap is lifted
    assert sw.boundary(3).id == "p0"
    assert sw.boundary(4, pace=Pace(1.5, 1.0)).id == "hot"
