"""What re-planning saves, planned: hand-worked straggler and cap-schedule runs on a
small frontier, the edges, and over any frontier and slowdown a per-iteration simulation
written here (not the module's closed form)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.errors import KareusError
from kareus.plans.replan import (
    PACE_ROUNDING,
    CapStep,
    FrontierPlan,
    JobShape,
    cap_schedule_run,
    parse_cap_schedule,
    straggler_savings,
)

# 2 replicas of 4 GPUs in the result; a waiting GPU draws 10 W, an idle one 7 W
SHAPE = JobShape(result_replicas=2, gpus_per_replica=4, wait_power_w=10.0, idle_power_w=7.0)
A = FrontierPlan("a", 10.0, 1000.0, 5000.0)
B = FrontierPlan("b", 12.0, 900.0, 4000.0)
C = FrontierPlan("c", 15.0, 850.0, 3500.0)
D = FrontierPlan("d", 20.0, 840.0, 3000.0)
PLANS = [A, B, C, D]


def test_hand_worked_straggler_ideal():
    # 4 replicas, one 1.3x slower for 10 iterations on a (10 s): the pace is 13 s, b
    # (12 s) is the least-energy plan that fits. A replica-iteration of a: 500 J, of b:
    # 450 J; a waiting replica draws 4 x 10 = 40 W.
    s = straggler_savings(PLANS, SHAPE, replicas=4, slowdown=1.3, duration_iterations=10,
                          reaction_iterations=0)
    assert (s.p0.id, s.p1.id) == ("a", "b")
    # without: every replica 500 + 40 x 3 = 620 J per iteration
    assert s.energy_without_j == pytest.approx(10 * 4 * 620)
    # with: the straggler 620 J, the others 450 + 40 x 1 = 490 J each
    assert s.energy_with_j == pytest.approx(10 * (620 + 3 * 490))
    assert s.saved_j == pytest.approx(3900)
    assert s.saved_fraction == pytest.approx(3900 / 24800)
    assert s.time_without_s == s.time_with_s == pytest.approx(130)
    # the others' waiting (the straggler is busy, slowed)
    assert s.wait_without_j == pytest.approx(10 * 3 * 40 * 3)
    assert s.wait_with_j == pytest.approx(10 * 3 * 40 * 1)


def test_hand_worked_straggler_reacting_one_iteration_late():
    s = straggler_savings(PLANS, SHAPE, replicas=4, slowdown=1.3, duration_iterations=10,
                          reaction_iterations=1)
    assert s.iterations == 11
    # 1 slow iteration on a (2480 J), 9 slow on b (2090 J), then one recovered iteration
    # with the others still on b: 12 s, the straggler 500 + 40 x 2, the others 450 each
    assert s.energy_with_j == pytest.approx(2480 + 9 * 2090 + (580 + 3 * 450))
    assert s.energy_without_j == pytest.approx(10 * 2480 + 4 * 500)
    assert s.time_with_s == pytest.approx(10 * 13 + 12)
    assert s.time_without_s == pytest.approx(10 * 13 + 10)


def test_hand_worked_straggler_shorter_than_the_switch_in():
    # slow for 1 iteration, the runtime's patience 2: the others never move (the pace
    # did not hold), so re-planning is the run without it
    s = straggler_savings(PLANS, SHAPE, replicas=4, slowdown=1.3, duration_iterations=1,
                          reaction_iterations=1, switch_in_iterations=2)
    assert s.energy_with_j == s.energy_without_j == pytest.approx(2480 + 2000)
    assert s.time_with_s == s.time_without_s == pytest.approx(13 + 10)


def test_hand_worked_straggler_switching_in_after_the_patience():
    # slow for 10 iterations on a; the others move to b after 2 slow iterations and back
    # 1 after the recovery
    s = straggler_savings(PLANS, SHAPE, replicas=4, slowdown=1.3, duration_iterations=10,
                          reaction_iterations=1, switch_in_iterations=2)
    assert s.iterations == 11
    assert s.energy_with_j == pytest.approx(2 * 2480 + 8 * 2090 + (580 + 3 * 450))
    assert s.time_with_s == pytest.approx(10 * 13 + 12)


@pytest.mark.parametrize("slowdown", [0.5, 1.0])
def test_no_slowdown_no_saving(slowdown):
    s = straggler_savings(PLANS, SHAPE, 4, slowdown, 10, reaction_iterations=1)
    assert s.p1 == s.p0 == A
    assert s.saved_j == pytest.approx(0)
    assert s.time_with_s == s.time_without_s


def test_no_slower_plan_fits_the_pace():
    s = straggler_savings(PLANS, SHAPE, 4, 1.1, 10)  # pace 11 s: only a
    assert s.p1 == A
    assert s.saved_j == pytest.approx(0)


def test_one_replica_has_nobody_waiting():
    s = straggler_savings(PLANS, SHAPE, 1, 2.0, 10)
    assert s.p1 == A and s.saved_j == pytest.approx(0)


def test_the_operators_plan():
    s = straggler_savings(PLANS, SHAPE, 4, 1.5, 10, p0_id="b")  # pace 18 s: c
    assert (s.p0.id, s.p1.id) == ("b", "c")
    with pytest.raises(KareusError, match="no plan 'zz'"):
        straggler_savings(PLANS, SHAPE, 4, 1.5, 10, p0_id="zz")


@pytest.mark.parametrize("kw", [dict(replicas=0), dict(slowdown=-1.0),
                                dict(slowdown=math.nan), dict(duration_iterations=0),
                                dict(reaction_iterations=-1)])
def test_bad_straggler_inputs(kw):
    args = dict(replicas=4, slowdown=1.5, duration_iterations=10, reaction_iterations=1)
    with pytest.raises(KareusError):
        straggler_savings(PLANS, SHAPE, **(args | kw))


def test_hand_worked_cap_schedule():
    steps = parse_cap_schedule("0:none,100:4.2,300:3.2,500:none")
    assert steps == [CapStep(0, None), CapStep(100, 4200.0), CapStep(300, 3200.0),
                     CapStep(500, None)]
    r = cap_schedule_run(PLANS, SHAPE, steps, iterations=600, restart_s=50.0)
    assert [p.id for p in r.plans] == ["a", "b", "d", "a"]
    # iterations 0..100 on a (the step's own iteration ends on the old plan), 101..300 on
    # b, 301..500 on d, 501..599 on a
    assert r.time_replan_s == pytest.approx(200 * 10 + 200 * 12 + 200 * 20)
    assert r.energy_replan_j == pytest.approx(200 * 1000 + 200 * 900 + 200 * 840)
    assert r.switches == 3
    assert r.time_restart_s == pytest.approx(8400 + 3 * 50)
    assert r.energy_restart_j == pytest.approx(548000 + 3 * 50 * 8 * 7)
    assert r.static_plan == D  # the only plan under 3.2 kW
    assert (r.time_static_s, r.energy_static_j) == (600 * 20, 600 * 840)
    assert r.over_cap_iterations == 2  # a under 4.2 kW, b under 3.2 kW


def test_a_step_that_keeps_the_plan_restarts_nothing():
    r = cap_schedule_run(PLANS, SHAPE, parse_cap_schedule("0:none,10:9"), 20, 100.0)
    assert r.switches == 0 and r.time_restart_s == r.time_replan_s == 200


def test_a_cap_no_plan_fits_is_one_line():
    with pytest.raises(KareusError, match=r"no plan stays under 2.00 kW"):
        cap_schedule_run(PLANS, SHAPE, parse_cap_schedule("0:none,5:2"), 20, 100.0)


@pytest.mark.parametrize("text", ["", "0", "0:x", "a:none", "0:none,0:4", "5:none",
                                  "0:none,10:-1", "0:none;10:4", "0:inf", "0:none,-3:4"])
def test_bad_cap_schedules(text):
    with pytest.raises(KareusError, match="cap-schedule"):
        parse_cap_schedule(text)


def test_a_step_after_the_run_is_refused():
    with pytest.raises(KareusError, match="after the run's last"):
        cap_schedule_run(PLANS, SHAPE, parse_cap_schedule("0:none,20:4"), 20, 1.0)


# Over any frontier: a per-iteration simulation ---------------------------------------


@st.composite
def frontiers(draw):
    """A Pareto frontier whose energies charge every GPU the wait power over the plan's
    time (as a result's do: static power), dynamic energy >= 0."""
    n = draw(st.integers(1, 8))
    times = sorted(draw(st.lists(st.floats(1.0, 50.0), min_size=n, max_size=n,
                                 unique=True)))
    dyn = sorted(draw(st.lists(st.floats(0.0, 5e4), min_size=n, max_size=n, unique=True)),
                 reverse=True)
    static = SHAPE.result_replicas * SHAPE.gpus_per_replica * SHAPE.wait_power_w
    pts = [(t, d + static * t) for t, d in zip(times, dyn, strict=True)]
    front, best = [], math.inf
    for t, e in pts:  # fastest first: keep those using less energy than every faster one
        if e < best:
            front.append((t, e))
            best = e
    return [FrontierPlan(f"p{i}", t, e) for i, (t, e) in enumerate(front)]


def simulate(plans, shape, replicas, f, n, lag, p0, lag_in):
    """Iteration by iteration, both runs: straggler slow for n, the others on the pace's
    plan from iteration lag_in to n + lag where the pace held for lag_in iterations."""
    pace = max(f, 1.0) * p0.time_s
    fits = [p for p in plans if p.time_s <= pace * (1 + PACE_ROUNDING)
            and p.energy_j < p0.energy_j]
    p1 = min(fits, key=lambda p: p.energy_j) if fits and replicas > 1 and f > 1 else p0
    per = {p.id: p.energy_j / shape.result_replicas for p in plans}
    w = shape.gpus_per_replica * shape.wait_power_w
    runs = {}
    for replan in (False, True):
        t_run = e_run = 0.0
        for i in range(n + lag):
            slow = i < n
            strag_t = pace if slow else p0.time_s
            others = p1 if replan and lag_in < n and lag_in <= i < n + lag else p0
            t = max(strag_t, others.time_s)
            e = per[p0.id] + w * (strag_t - p0.time_s) + w * (t - strag_t)
            e += (replicas - 1) * (per[others.id] + w * (t - others.time_s))
            t_run += t
            e_run += e
        runs[replan] = (t_run, e_run)
    return p1, runs


@settings(max_examples=150, deadline=None)
@given(plans=frontiers(), f=st.floats(0.5, 4.0), replicas=st.integers(1, 16),
       n=st.integers(1, 30), lag=st.integers(0, 3), lag_in=st.integers(0, 3),
       data=st.data())
def test_matches_a_per_iteration_simulation(plans, f, replicas, n, lag, lag_in, data):
    p0 = data.draw(st.sampled_from(plans))
    s = straggler_savings(plans, SHAPE, replicas, f, n, p0.id, lag, lag_in)
    p1, runs = simulate(plans, SHAPE, replicas, f, n, lag, p0, lag_in)
    assert s.p1.id == p1.id
    assert s.p1.time_s <= max(f, 1.0) * p0.time_s * (1 + PACE_ROUNDING)
    assert (s.time_without_s, s.energy_without_j) == pytest.approx(runs[False], rel=1e-9)
    assert (s.time_with_s, s.energy_with_j) == pytest.approx(runs[True], rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(plans=frontiers(), f=st.floats(0.5, 4.0), replicas=st.integers(1, 16),
       n=st.integers(1, 10**6), data=st.data())
def test_replanning_at_once_never_costs_energy_or_time(plans, f, replicas, n, data):
    p0 = data.draw(st.sampled_from(plans))
    s = straggler_savings(plans, SHAPE, replicas, f, n, p0.id, reaction_iterations=0)
    assert s.time_with_s == pytest.approx(s.time_without_s, rel=1e-12)
    assert s.energy_with_j <= s.energy_without_j * (1 + 1e-12)
    # late by L: the run is longer by the L recovered iterations on the slower plan,
    # where the others switched at all (after L_in = 1 slow iteration)
    late = straggler_savings(plans, SHAPE, replicas, f, n, p0.id, reaction_iterations=1)
    lost = max(0.0, late.p1.time_s - p0.time_s) if n > 1 else 0.0
    assert late.time_with_s - late.time_without_s == pytest.approx(
        lost, rel=1e-9, abs=1e-9 * late.time_without_s)
