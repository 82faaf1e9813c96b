"""The 1F1B schedule: each stage-to-stage transfer counted once, and latest finishes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.compose.instruction import InstructionOption
from kareus.compose.pipeline import PipelineCosts, evaluate, solve_frontier
from kareus.plans.schedule import (
    host_syncs,
    latest_finish,
    one_f_one_b,
    rank_order,
    schedule,
)

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


def _silent(pp: int, mbs: int, rank: int, vp: int = 1) -> list[str]:
    """The instructions Megatron-Core starts without a sync before them, as text."""
    return [f"{d[0]}{s}.{m}" for (s, m, d), synced in zip(
        rank_order(pp, mbs, rank, vp), host_syncs(pp, mbs, rank, vp), strict=True)
        if not synced]


def test_host_syncs_plain_1f1b_by_hand():
    """Megatron-Core's plain 1F1B (schedules.py): send_forward_recv_backward moves nothing on
    the last stage, send_backward_recv_forward nothing on the first; warm-up and cool-down
    always exchange. PP2, 4 microbatches: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3, its steady
    backwards then forwards silent; stage 1 runs F0 B0 F1 B1 ..., its backwards silent."""
    assert _silent(2, 4, 0) == ["f0.2", "f0.3"]
    assert _silent(2, 4, 1) == ["b1.0", "b1.1", "b1.2", "b1.3"]
    # a middle stage exchanges both ways around every instruction
    assert _silent(4, 8, 1) == [] and _silent(4, 8, 2) == []
    # all microbatches in warm-up: stage 0 never reaches a steady backward
    assert _silent(4, 3, 0) == []
    # the first instruction always starts from a sync (the optimizer step before it)
    assert all(host_syncs(pp, 4, r)[0] for pp in (1, 2, 4) for r in range(pp))


def test_host_syncs_without_a_pipeline():
    """forward_backward_no_pipelining: no exchange at all after the first instruction."""
    assert host_syncs(1, 3, 0) == [True] + [False] * 5


def test_host_syncs_interleaved_by_hand():
    """Interleaved 1F1B: a steady step runs its forward and backward with no call between
    them; every other pair of instructions is separated by a _communicate (which
    synchronises even with nothing to move). PP2, VP2, 4 microbatches: rank 0 has 4
    warm-up forwards (2 (pp - r - 1) + (V - 1) pp), then 4 steady pairs."""
    assert _silent(2, 4, 0, 2) == ["b2.0", "b2.1", "b0.0", "b0.1"]
    assert _silent(2, 4, 1, 2) == ["b3.0", "b3.1", "b1.0", "b1.1", "b3.2", "b3.3"]
    # all in warm-up (pp 4, vp 2, 4 microbatches: rank 0 warms up with all 8 forwards)
    assert _silent(4, 4, 0, 2) == []


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.sampled_from([1, 2, 3]), st.data())
def test_host_syncs_silent_transitions(pp, groups, vp, data):
    """A silent transition is always a forward followed by a backward or the reverse (an
    exchange sits between two forwards or two backwards), and there are as many as the
    schedule's steady phase has: plain, the last stage's every backward and the first
    stage's every steady forward; interleaved, one per steady step."""
    vp = 1 if pp == 1 else vp
    mbs = pp * groups
    rank = data.draw(st.integers(0, pp - 1))
    order = rank_order(pp, mbs, rank, vp)
    syncs = host_syncs(pp, mbs, rank, vp)
    assert len(syncs) == len(order) and syncs[0]
    for i in range(1, len(order)):
        if not syncs[i] and pp > 1:
            assert order[i - 1][2] != order[i][2]
    silent = syncs.count(False)
    if pp == 1:
        assert silent == len(order) - 1
    elif vp == 1:
        warmup = min(pp - rank - 1, mbs)
        expected = (mbs if rank == pp - 1 else 0) + (
            max(0, mbs - warmup - 1) if rank == 0 else 0)
        assert silent == expected
    else:
        total = mbs * vp
        assert silent == total - min(total, 2 * (pp - rank - 1) + (vp - 1) * pp)
