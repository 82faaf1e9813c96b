"""The 1F1B schedule: each stage-to-stage transfer counted once, and latest finishes."""

import pytest

from kareus.compose.instruction import InstructionOption
from kareus.compose.pipeline import PipelineCosts, evaluate, solve_frontier
from kareus.plans.schedule import latest_finish, one_f_one_b, schedule

F, B, X = 1.0, 2.0, 0.5  # forward, backward, one transfer


def _duration(iid):
    return F if iid[2] == "forward" else B


def test_two_stage_toy_pipeline_by_hand():
    # stage 0: F0 F1 B0 B1; stage 1: F0 B0 F1 B1 (1F1B, 2 microbatches)
    # s0.F0 0-1, sends until 1.5 | s1.F0 1.5-2.5 | s1.B0 2.5-4.5, sends until 5.0
    # s0.F1 1.5-2.5, sends until 3.0 | s1.F1 5.0-6.0 | s1.B1 6.0-8.0, sends until 8.5
    # s0.B0 5.0-7.0 | s0.B1 8.5-10.5: each transfer once on every path
    t = schedule(2, 2, _duration, [X, 0.0], [0.0, X], [0.0, 0.0])
    assert t.iteration_s == pytest.approx(10.5)
    assert t.start[(1, 0, "forward")] == pytest.approx(1.5)
    assert t.start[(0, 1, "forward")] == pytest.approx(1.5)  # the sender waited for its send
    assert t.start[(0, 1, "backward")] == pytest.approx(8.5)
    # the same through the composition's evaluation
    opts = {(s, d): [InstructionOption(_duration((s, 0, d)), 1.0, 1410)]
            for s in range(2) for d in ("forward", "backward")}
    costs = PipelineCosts(2, 2, gpus=2, static_power_w=0.0, send_activation_s=(X, 0.0),
                          send_grad_s=(0.0, X), end_s=(0.0, 0.0), fixed_dynamic_j=(0.0, 0.0))
    choice = {(s, m, d): 0 for s in range(2) for m, d in one_f_one_b(2, 2, s)}
    assert evaluate(opts, costs, choice).time_s == pytest.approx(10.5)


def test_lowtime_dag_counts_each_transfer_once():
    # two options per instruction: the solver's plans are evaluated by the schedule, and its
    # fastest end is the hand-computed 10.5 s
    opts = {(s, d): [InstructionOption(_duration((s, 0, d)), 2.0, 1410),
                     InstructionOption(1.5 * _duration((s, 0, d)), 1.0, 1200)]
            for s in range(2) for d in ("forward", "backward")}
    costs = PipelineCosts(2, 2, gpus=2, static_power_w=0.0, send_activation_s=(X, 0.0),
                          send_grad_s=(0.0, X), end_s=(0.0, 0.0), fixed_dynamic_j=(0.0, 0.0))
    front = solve_frontier(opts, costs)
    assert front[0].time_s == pytest.approx(10.5)
    assert len(front) > 2


def test_latest_finish_gives_every_instructions_float():
    t = schedule(2, 2, _duration, [X, 0.0], [0.0, X], [0.0, 0.0])
    late = latest_finish(2, 2, t, _duration, [X, 0.0], [0.0, X], [0.0, 0.0])
    # on the critical path: no float
    for iid in ((0, 0, "forward"), (1, 0, "forward"), (1, 0, "backward"), (1, 1, "backward"),
                (0, 1, "backward")):
        assert late[iid] == pytest.approx(t.finish[iid])
    # s0.F1 finishes at 2.5 and may finish as late as 4.5 (s1.F1 waits for s1.B0 + send)
    assert late[(0, 1, "forward")] == pytest.approx(4.5)
    # growing an instruction by its float never lengthens the iteration
    for iid, lf in late.items():
        grown = t.finish[iid]

        def d(j, iid=iid, extra=lf - grown):
            return _duration(j) + (extra if j == iid else 0.0)

        assert schedule(2, 2, d, [X, 0.0], [0.0, X], [0.0, 0.0]).iteration_s == (
            pytest.approx(t.iteration_s))
