"""Filling a plan's slack: every instruction that can run slower (at a lower clock, or
with a cheaper partition setting) without lengthening the iteration does so.

Phillips-Dessouky shortens the critical path step by step; instructions off that path are
left wherever the solve put them, and its two ends are uniform plans (every instruction at
its fastest or its slowest option). So a frontier point can spend energy that buys no time:
on kareus-1 Perseus's fastest point ran every instruction at max clock. This pass takes a
plan and, while some instruction's float (how much later it may finish without delaying the
iteration, kareus.plans.schedule.latest_finish) covers a slower option of that instruction, moves
it to the slowest such option. Options are Pareto-sorted, so each move lowers the energy and
none lengthens the iteration; the pass ends when no instruction can move.

Total floats are shared along paths: two moves that each fit may not fit together. Each
round of the exact pass therefore applies the longest prefix of its moves (largest float
first) that keeps the iteration time, found by bisection (more moves can only lengthen the
iteration), then recomputes the floats. It is preceded by a fast pass that moves every
instruction at once within its free float (growth that moves no other start,
kareus.plans.schedule.free_float), which is safe in bulk.
"""

from __future__ import annotations

from kareus.compose.instruction import InstructionOption
from kareus.core import InstructionId
from kareus.plans.schedule import free_float, latest_finish, schedule

_TOLERANCE = 1e-12


def fill_slack(options: dict[tuple[int, str], list[InstructionOption]], pp: int,
               microbatches: int, send_activation_s: tuple[float, ...],
               send_grad_s: tuple[float, ...], end_s: tuple[float, ...],
               choice: dict[InstructionId, int]) -> dict[InstructionId, int]:
    """``choice`` (per instruction, an index into its Pareto-sorted options, fastest first)
    with every instruction moved as slow as the iteration time allows."""
    choice = dict(choice)

    def duration(iid: InstructionId) -> float:
        return options[(iid[0], iid[2])][choice[iid]].time_s

    def iteration_with(moves: list[tuple[InstructionId, int]]) -> float:
        trial = {**choice, **dict(moves)}
        return schedule(pp, microbatches,
                        lambda iid: options[(iid[0], iid[2])][trial[iid]].time_s,
                        list(send_activation_s), list(send_grad_s), list(end_s)).iteration_s

    def slowest_within(iid: InstructionId, spare: float, tol: float) -> int:
        opts = options[(iid[0], iid[2])]
        now = best = choice[iid]
        while best + 1 < len(opts) and opts[best + 1].time_s - opts[now].time_s <= spare - tol:
            best += 1
        return best

    while True:  # bulk: every instruction within its free float
        timing = schedule(pp, microbatches, duration, list(send_activation_s),
                          list(send_grad_s), list(end_s))
        tol = _TOLERANCE * timing.iteration_s
        free = free_float(pp, microbatches, timing, send_activation_s, send_grad_s, end_s)
        moves = {iid: slowest_within(iid, f, tol) for iid, f in free.items() if f > tol}
        moves = {iid: i for iid, i in moves.items() if i != choice[iid]}
        if not moves:
            break
        choice.update(moves)

    while True:  # exact: within the total floats, the longest prefix of moves that fits
        timing = schedule(pp, microbatches, duration, list(send_activation_s),
                          list(send_grad_s), list(end_s))
        latest = latest_finish(pp, microbatches, timing, duration, send_activation_s,
                               send_grad_s, end_s)
        tol = _TOLERANCE * timing.iteration_s
        queue: list[tuple[InstructionId, int]] = []
        for iid in sorted(choice, key=lambda i: timing.finish[i] - latest[i]):
            spare = latest[iid] - timing.finish[iid]
            if spare <= tol:
                break  # sorted by float, largest first: nothing after this can move
            best = slowest_within(iid, spare, tol)
            if best != choice[iid]:
                queue.append((iid, best))
        if not queue:
            return choice
        # each move alone keeps the iteration time; moves sharing a path may not together.
        # More moves can only lengthen the iteration: bisect for the longest prefix that
        # does not (the first move always fits).
        limit = timing.iteration_s + tol
        ok, bad = 1, len(queue) + 1
        if iteration_with(queue) <= limit:
            ok = len(queue)
        else:
            bad = len(queue)
            while bad - ok > 1:
                mid = (ok + bad) // 2
                if iteration_with(queue[:mid]) <= limit:
                    ok = mid
                else:
                    bad = mid
        choice.update(queue[:ok])
