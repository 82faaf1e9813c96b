"""Filling a plan's slack: every instruction that can run slower (at a lower clock, or
with a cheaper partition setting) without lengthening the iteration does so.

Phillips-Dessouky shortens the critical path step by step; instructions off that path are
left wherever the solve put them, and its two ends are uniform plans (every instruction at
its fastest or its slowest option). So a frontier point can spend energy that buys no time:
on kareus-1 Perseus's fastest point ran every instruction at max clock. This pass takes a
plan and, while some instruction's float (how much later it may finish without delaying the
iteration, kareus.plans.schedule.latest_times) covers a slower option of that instruction, moves
it to the slowest such option. Options are Pareto-sorted, so each move lowers the energy and
none lengthens the iteration; the pass ends when no instruction can move.

Total floats are shared along paths: two moves that each fit may not fit together. Each
round of the exact pass therefore applies the longest prefix of its moves (largest float
first) that keeps the iteration time, found by bisection (more moves can only lengthen the
iteration), then recomputes the floats. It is preceded by a fast pass that moves every
instruction at once within its free float (growth that moves no other start,
kareus.plans.schedule.free_times), which is safe in bulk.
"""

from __future__ import annotations

from kareus.compose.instruction import InstructionOption
from kareus.core import InstructionId
from kareus.plans.schedule import Compiled, compiled, free_times, latest_times, run_times

_TOLERANCE = 1e-12


def fill_slack(options: dict[tuple[int, str], list[InstructionOption]], pp: int,
               microbatches: int, send_activation_s: tuple[float, ...],
               send_grad_s: tuple[float, ...], end_s: tuple[float, ...],
               choice: dict[InstructionId, int], vp: int = 1,
               exact_rounds: int | None = None) -> dict[InstructionId, int]:
    """``choice`` (per instruction, an index into its Pareto-sorted options, fastest first)
    with every instruction moved as slow as the iteration time allows (``exact_rounds``:
    at most that many rounds of the exact pass; a plan that is already close to slack-free,
    such as an LP solution, gains under 0.05% of energy from a second round)."""
    c = compiled(pp, microbatches, vp)
    times = [[o.time_s for o in options[(s, d)]] for s, _m, d in c.ids]
    pick = [choice[iid] for iid in c.ids]
    out_delay = c.out_delays(send_activation_s, send_grad_s)
    rank_end = c.rank_end_s(end_s)

    def durations_of(p: list[int]) -> list[float]:
        return [t[i] for t, i in zip(times, p, strict=True)]

    def slowest_within(i: int, spare: float, tol: float) -> int:
        t = times[i]
        now = best = pick[i]
        while best + 1 < len(t) and t[best + 1] - t[now] <= spare - tol:
            best += 1
        return best

    while True:  # bulk: every instruction within its free float
        dur = durations_of(pick)
        start, finish, ends = run_times(c, dur, out_delay, rank_end)
        iteration = max(ends)
        tol = _TOLERANCE * iteration
        free = free_times(c, start, finish, out_delay, rank_end, iteration)
        moves = [(i, slowest_within(i, f, tol)) for i, f in enumerate(free) if f > tol]
        moves = [(i, b) for i, b in moves if b != pick[i]]
        if not moves:
            break
        for i, b in moves:
            pick[i] = b

    rounds = 0
    while exact_rounds is None or rounds < exact_rounds:
        # exact: within the total floats, the longest prefix of moves that fits
        rounds += 1
        dur = durations_of(pick)
        _start, finish, ends = run_times(c, dur, out_delay, rank_end)
        iteration = max(ends)
        latest = latest_times(c, dur, out_delay, rank_end, iteration)
        tol = _TOLERANCE * iteration
        queue: list[tuple[int, int]] = []
        for i in sorted(range(len(pick)), key=lambda i: finish[i] - latest[i]):
            spare = latest[i] - finish[i]
            if spare <= tol:
                break  # sorted by float, largest first: nothing after this can move
            best = slowest_within(i, spare, tol)
            if best != pick[i]:
                queue.append((i, best))
        if not queue:
            break
        ok = _longest_prefix(c, dur, [(i, times[i][b]) for i, b in queue], out_delay,
                             rank_end, iteration + tol)
        for i, b in queue[:ok]:
            pick[i] = b
    return dict(zip(c.ids, pick, strict=True))


def _longest_prefix(c: Compiled, durations: list[float], moves: list[tuple[int, float]],
                    out_delay: list[float], rank_end: list[float], limit_s: float) -> int:
    """How many of ``moves`` (instruction, new duration), in order, fit together within
    ``limit_s``. Each move alone fits; moves sharing a path may not together. More moves
    can only lengthen the iteration: bisect (the first move always fits)."""

    def fits(k: int) -> bool:
        trial = list(durations)
        for i, t in moves[:k]:
            trial[i] = t
        return max(run_times(c, trial, out_delay, rank_end)[2]) <= limit_s

    if fits(len(moves)):
        return len(moves)
    ok, bad = 1, len(moves)
    while bad - ok > 1:
        mid = (ok + bad) // 2
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return ok
