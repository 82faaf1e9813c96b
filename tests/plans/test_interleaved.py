"""Interleaved 1F1B (Megatron's virtual pipeline) worked by hand: 2 ranks, V = 2 model
chunks each (virtual stages 0..3, rank = stage % 2), 4 microbatches; forward 1 s,
backward 2 s, every transfer 0.5 s, end-of-iteration work 0.25 s per virtual stage.
The same example is in docs/composition.md, "Interleaved 1F1B"."""

import pytest

from kareus.compose.instruction import InstructionOption
from kareus.compose.pipeline import PipelineCosts, evaluate
from kareus.plans.schedule import rank_order, schedule

F, B, X, END = 1.0, 2.0, 0.5, 0.25
PP, M, V = 2, 4, 2
ACT = [X, X, X, 0.0]   # every virtual stage but the last sends its activation
GRAD = [0.0, X, X, X]  # every virtual stage but the first sends its gradient


def _duration(iid):
    return F if iid[2] == "forward" else B


def _f(s, m):
    return (s, m, "forward")


def _b(s, m):
    return (s, m, "backward")


# Megatron's schedule table, groups of pp = 2 microbatches, every chunk in turn:
# (m0,c0) (m1,c0) (m0,c1) (m1,c1) (m2,c0) (m3,c0) (m2,c1) (m3,c1); forwards run it with
# virtual stage c * pp + rank, backwards with the chunks reversed. Warm-up: rank 0
# 2 (pp - 0 - 1) + (V - 1) pp = 4 forwards, rank 1 2. In (virtual stage, microbatch):
RANK0 = [_f(0, 0), _f(0, 1), _f(2, 0), _f(2, 1),
         _f(0, 2), _b(2, 0), _f(0, 3), _b(2, 1), _f(2, 2), _b(0, 0), _f(2, 3), _b(0, 1),
         _b(2, 2), _b(2, 3), _b(0, 2), _b(0, 3)]
RANK1 = [_f(1, 0), _f(1, 1),
         _f(3, 0), _b(3, 0), _f(3, 1), _b(3, 1), _f(1, 2), _b(1, 0), _f(1, 3), _b(1, 1),
         _f(3, 2), _b(3, 2), _f(3, 3), _b(3, 3),
         _b(1, 2), _b(1, 3)]

# Start and finish, by hand, in the order they are decided. An instruction starts when
# the previous one on its rank has finished and sent (the sender waits for its transfer)
# and when the one it needs has finished and sent: a forward the previous virtual
# stage's forward (+0.5), a backward the next one's backward (+0.5), the last virtual
# stage's backward its own forward (same rank, no transfer).
BY_HAND = {
    _f(0, 0): (0.0, 1.0),    # sends until 1.5
    _f(0, 1): (1.5, 2.5),    # after its own send; sends until 3.0
    _f(1, 0): (1.5, 2.5),    # F(0,0) + 0.5
    _f(1, 1): (3.0, 4.0),    # after F(1,0)'s send (3.0) and F(0,1)'s (3.0)
    _f(2, 0): (3.0, 4.0),    # F(1,0) + 0.5 = 3.0
    _f(2, 1): (4.5, 5.5),    # F(2,0)'s send and F(1,1) + 0.5, both 4.5
    _f(3, 0): (4.5, 5.5),    # F(2,0) + 0.5; the last stage sends no activation
    _b(3, 0): (5.5, 7.5),    # its own forward; sends until 8.0
    _f(0, 2): (6.0, 7.0),    # after F(2,1)'s send
    _f(3, 1): (8.0, 9.0),    # after B(3,0)'s send (F(2,1) was ready at 6.0)
    _b(2, 0): (8.0, 10.0),   # B(3,0) + 0.5 (F(0,2) was ready at 7.5)
    _b(3, 1): (9.0, 11.0),   # its own forward; sends until 11.5
    _f(1, 2): (11.5, 12.5),  # after B(3,1)'s send (F(0,2) was ready at 7.5)
    _f(0, 3): (10.5, 11.5),  # after B(2,0)'s send
    _b(2, 1): (12.0, 14.0),  # after F(0,3)'s send (B(3,1) was ready at 11.5)
    _b(1, 0): (13.0, 15.0),  # after F(1,2)'s send (B(2,0) was ready at 10.5)
    _f(1, 3): (15.5, 16.5),  # after B(1,0)'s send
    _f(2, 2): (14.5, 15.5),  # after B(2,1)'s send (F(1,2) was ready at 13.0)
    _b(0, 0): (16.0, 18.0),  # after F(2,2)'s send; stage 0 sends no gradient
    _b(1, 1): (17.0, 19.0),  # after F(1,3)'s send (B(2,1) was ready at 14.5)
    _f(2, 3): (18.0, 19.0),  # after B(0,0) (F(1,3) was ready at 17.0)
    _f(3, 2): (19.5, 20.5),  # after B(1,1)'s send
    _b(0, 1): (19.5, 21.5),  # F(2,3)'s send and B(1,1)'s, both 19.5
    _b(3, 2): (20.5, 22.5),  # its own forward; sends until 23.0
    _f(3, 3): (23.0, 24.0),  # after B(3,2)'s send
    _b(3, 3): (24.0, 26.0),  # sends until 26.5
    _b(2, 2): (23.0, 25.0),  # B(3,2) + 0.5 (B(0,1) was done at 21.5)
    _b(2, 3): (26.5, 28.5),  # B(3,3) + 0.5
    _b(1, 2): (26.5, 28.5),  # after B(3,3)'s send (B(2,2) was ready at 25.5)
    _b(1, 3): (29.0, 31.0),  # B(1,2)'s send and B(2,3)'s, both 29.0; sends until 31.5
    _b(0, 2): (29.0, 31.0),  # B(2,3)'s send and B(1,2)'s, both 29.0
    _b(0, 3): (31.5, 33.5),  # B(1,3) + 0.5
}
# Rank 0 ends at 33.5 + 2 x 0.25 (its chunks' end-of-iteration work) = 34.0; rank 1 at
# 31.5 (its last send) + 0.5 = 32.0. The iteration takes 34.0 s.
ITERATION_S = 34.0


def test_rank_orders_are_megatrons_interleaved_orders():
    assert rank_order(PP, M, 0, V) == RANK0
    assert rank_order(PP, M, 1, V) == RANK1


def test_interleaved_schedule_by_hand():
    t = schedule(PP, M, _duration, ACT, GRAD, [END] * 4, vp=V)
    assert set(t.start) == set(BY_HAND)
    for iid, (start, finish) in BY_HAND.items():
        assert (t.start[iid], t.finish[iid]) == pytest.approx((start, finish)), iid
    assert t.stage_end == pytest.approx([34.0, 32.0])
    assert t.iteration_s == pytest.approx(ITERATION_S)


def test_the_composition_evaluates_the_same_iteration():
    opts = {(s, d): [InstructionOption(_duration((s, 0, d)), 1.0, 1410)]
            for s in range(PP * V) for d in ("forward", "backward")}
    costs = PipelineCosts(PP, M, gpus=4, static_power_w=0.0, send_activation_s=tuple(ACT),
                          send_grad_s=tuple(GRAD), end_s=(END,) * 4,
                          fixed_dynamic_j=(0.0,) * 4, vp=V)
    point = evaluate(opts, costs, {iid: 0 for iid in BY_HAND})
    assert point.time_s == pytest.approx(ITERATION_S)
    # 32 instructions of 1 J per GPU, each on gpus / pp = 2 GPUs
    assert point.energy_j == pytest.approx(64.0)


def test_interleaving_halves_the_bubble_but_sends_twice_as_often():
    # plain 1F1B with each rank's two chunks as one stage (forward 2 s, backward 4 s): 24 s
    # of work per rank, a (pp - 1) x 6 s bubble and the 0.5 s end; interleaving halves
    # the bubble (3 s) ...
    def plain(x):
        return schedule(PP, M, lambda iid: 2 * _duration(iid), [x, 0.0], [0.0, x],
                        [2 * END, 2 * END]).iteration_s

    free = schedule(PP, M, _duration, [0.0] * 4, [0.0] * 4, [END] * 4, vp=V).iteration_s
    assert (free, plain(0.0)) == pytest.approx((24 + 3 + 0.5, 24 + 6 + 0.5))
    # ... but a microbatch crosses 3 links instead of 1: with 0.5 s transfers plain 1F1B
    # (33.0 s) beats the hand-worked 34.0 s
    assert plain(X) == pytest.approx(33.0) and plain(X) < ITERATION_S
