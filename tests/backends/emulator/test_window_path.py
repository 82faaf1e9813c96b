"""The like-for-like figure of kareus-1's reference: the critical path of instruction windows
with free edges (kareus.backends.emulator.window_path)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.backends.emulator.iteration import IterationResult, IterationSimulator, StageReport
from kareus.backends.emulator.window_path import critical_path, window_graph, window_path
from kareus.plans.methods import baseline_plan
from kareus.plans.schedule import compiled, run_times, schedule

# 2 stages, 3 microbatches; every forward of stage 0 takes 1, of stage 1 2; every backward
# of stage 1 takes 4, of stage 0 3. By hand (1F1B: stage 0 runs F0 F1 B0 F2 B1 B2, stage 1
# F0 B0 F1 B1 F2 B2): stage 1 runs back to back from t=1 (its F0 waits for stage 0's), each
# of its forwards ready before it needs them (stage 0's F1 ends at 2, F2 at 11, stage 1
# takes them at 7 and 13), so it ends at 1 + 3 x (2 + 4) = 19, and stage 0's last backward
# follows: 22.
HAND = {(0, m, "forward"): 1.0 for m in range(3)} | {
    (1, m, "forward"): 2.0 for m in range(3)} | {
    (1, m, "backward"): 4.0 for m in range(3)} | {
    (0, m, "backward"): 3.0 for m in range(3)}
HAND_PATH = [(0, 0, "forward"), (1, 0, "forward"), (1, 0, "backward"), (1, 1, "forward"),
             (1, 1, "backward"), (1, 2, "forward"), (1, 2, "backward"), (0, 2, "backward")]


def test_hand_built_two_stage_three_microbatch_path():
    length, path = critical_path(window_graph(2, 3), HAND)
    assert length == 22.0
    assert path == HAND_PATH


def test_graph_edges_are_the_rank_order_and_the_neighbour_stage():
    g = window_graph(2, 3)
    assert g[(0, 0, "forward")] == []
    assert set(g[(1, 1, "forward")]) == {(1, 0, "backward"), (0, 1, "forward")}
    assert set(g[(0, 0, "backward")]) == {(0, 1, "forward"), (1, 0, "backward")}
    assert set(g[(1, 0, "backward")]) == {(1, 0, "forward")}


def test_a_missing_window_is_refused():
    with pytest.raises(ValueError, match="no window"):
        critical_path(window_graph(2, 3), {k: v for k, v in HAND.items()
                                           if k != (1, 2, "backward")})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.sampled_from([1, 2]), st.data())
def test_longest_path_equals_the_schedule_with_free_edges(pp, groups, vp, data):
    """The independent longest path and the shared list schedule (kareus.plans.schedule)
    agree once its transfers and end-of-iteration work cost nothing."""
    mbs = pp * groups
    c = compiled(pp, mbs, vp)
    durations = data.draw(st.lists(st.floats(0.001, 1.0), min_size=len(c.ids),
                                   max_size=len(c.ids)))
    _start, finish, _ends = run_times(c, durations, [0.0] * len(c.ids), [0.0] * pp)
    length, path = critical_path(window_graph(pp, mbs, vp), dict(zip(c.ids, durations)))
    assert length == pytest.approx(max(finish), rel=1e-12)
    # the path is a chain of the graph whose windows add up to its length
    g = window_graph(pp, mbs, vp)
    assert all(a in g[b] for a, b in itertools.pairwise(path))
    assert sum(durations[c.index[i]] for i in path) == pytest.approx(length, rel=1e-12)


def _fake_result(windows: dict, static_w: float = 85.0, timed: bool = True
                 ) -> IterationResult:
    """An iteration whose instructions are ``windows`` ({iid: (time_s, dynamic_j)}), two
    GPUs per stage, simulated with the timers' windows unless not ``timed``."""
    stages = [StageReport(s) for s in range(2)]
    for (s, m, d), (t, e) in windows.items():
        stages[s].instructions.append({"stage": s, "microbatch": m, "direction": d,
                                       "time_s": t, "dynamic_energy_j": e})
    time_s = 30.0  # the wall clock: only the static power is read from it
    return IterationResult("fake", time_s, 0.0, 4 * time_s * static_w, 0.0, 4, stages,
                           timed_windows=timed)


def test_window_path_energy_is_every_window_on_one_gpu_per_stage():
    r = _fake_result({k: (t, 10.0 * t) for k, t in HAND.items()})
    w = window_path(r, 2, 3)
    busy = sum(HAND.values())  # 30 s of windows over the two stages
    assert w.energy_j == pytest.approx(busy * (10.0 + 85.0))
    assert w.time_s == w.exact_time_s == 22.0
    assert w.stages == 2
    assert w.mean_power_per_gpu_w == pytest.approx(busy * 95.0 / (22.0 * 2))
    assert list(w.path) == HAND_PATH


def test_windows_are_rounded_down_to_lowtimes_millisecond():
    r = _fake_result({k: (t * 1e-3 + 0.0009, 0.0) for k, t in HAND.items()})
    w = window_path(r, 2, 3)
    assert w.time_s == pytest.approx(22e-3)  # every window floored to whole ms
    assert w.exact_time_s == pytest.approx(22e-3 + 8 * 0.0009)  # 8 windows on the path
    exact_ms = window_path(_fake_result({k: (t * 1e-3, 0.0) for k, t in HAND.items()}), 2, 3)
    assert exact_ms.time_s == pytest.approx(22e-3)  # a whole ms stays whole


def test_a_result_without_its_instructions_is_refused():
    with pytest.raises(ValueError, match="without its instructions"):
        window_path(_fake_result({}), 2, 3)


def test_a_result_without_the_timers_windows_is_refused():
    """Plain training lets the host run ahead into some instructions (host_syncs): those
    are not the reference's windows, which all start at a timer's sync."""
    with pytest.raises(ValueError, match="timed_windows"):
        window_path(_fake_result({k: (t, 0.0) for k, t in HAND.items()}, timed=False), 2, 3)


def test_free_edges_against_the_simulators_transfers(k1):
    """kareus-1 as simulated: its instruction windows with the simulator's own transfers and
    end-of-iteration work put back rebuild its wall clock exactly; with free edges they give
    the like-for-like path, shorter by what the edges and the end cost."""
    job, ps, b = k1
    r = IterationSimulator(ps, b).run(baseline_plan("megatron", job), with_instructions=True,
                                      timed_windows=True)
    w = window_path(r, job.pp, job.num_microbatches)
    windows = {(i["stage"], i["microbatch"], i["direction"]): i["time_s"]
               for s in r.stages for i in s.instructions}
    assert job.pp == 2  # stage 0 sends only activations, stage 1 only gradients
    mbs = job.num_microbatches
    act = [r.stages[0].transfers_s / mbs, 0.0]
    grad = [0.0, r.stages[1].transfers_s / mbs]
    ends = [s.iteration_end_s for s in r.stages]
    assert min(act[0], grad[1], *ends) > 0
    wall = schedule(job.pp, mbs, windows.__getitem__, act, grad, ends)
    assert wall.iteration_s == pytest.approx(r.time_s, rel=1e-9)
    free = schedule(job.pp, mbs, windows.__getitem__, [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])
    assert free.iteration_s == pytest.approx(w.exact_time_s, rel=1e-12)
    # every microbatch crosses the stage boundary twice on the path (forward and backward)
    # at least once: the wall clock is longer by at least two transfers and the end work
    assert r.time_s - w.exact_time_s >= act[0] + grad[1] + max(ends) - 1e-12
    # rounding each window down to 1 ms moves the path by at most 1 ms per window on it
    exact_len, exact_path = critical_path(window_graph(job.pp, mbs), windows)
    assert 0.0 <= exact_len - w.time_s <= 1e-3 * len(exact_path)
    # energy over one GPU per stage: all windows, not the GPUs' idle time between them
    static_w = b.static_power_w
    assert w.energy_j == pytest.approx(sum(
        i["dynamic_energy_j"] + static_w * i["time_s"] for s in r.stages
        for i in s.instructions))
    assert w.energy_j < r.energy_j / (job.num_gpus // job.pp)
