"""The 1F1B pipeline schedule: instruction order per stage, and start/finish times.

Shared by the emulator's whole-iteration simulation and by the composition, so that a
plan's predicted iteration time and the simulated one come from the same schedule.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kareus.core import InstructionId


def one_f_one_b(pp: int, microbatches: int, stage: int) -> list[tuple[int, str]]:
    """The 1F1B instruction order of one stage: (microbatch, direction)."""
    warmup = min(pp - stage - 1, microbatches)
    order = [(m, "forward") for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(warmup + i, "forward"), (i, "backward")]
    order += [(m, "backward") for m in range(microbatches - warmup, microbatches)]
    return order


def sends_after(stage: int, direction: str, pp: int, send_activation_s: Sequence[float],
                send_grad_s: Sequence[float]) -> float:
    """How long ``stage`` waits for the transfer that follows its instruction."""
    if direction == "forward":
        return send_activation_s[stage] if stage < pp - 1 else 0.0
    return send_grad_s[stage] if stage > 0 else 0.0


@dataclass
class Timing:
    start: dict[InstructionId, float]
    finish: dict[InstructionId, float]
    stage_end: list[float]
    """Per stage: its last instruction's finish plus the end-of-iteration work."""

    @property
    def iteration_s(self) -> float:
        return max(self.stage_end)


def schedule(pp: int, microbatches: int, duration: Callable[[InstructionId], float],
             send_activation_s: list[float], send_grad_s: list[float],
             end_s: list[float],
             duration_at: Callable[[InstructionId, float], float] | None = None) -> Timing:
    """List-schedule every stage's 1F1B order. A forward waits for the previous stage's
    forward of its microbatch plus ``send_activation_s[s - 1]``; a backward for the next
    stage's backward plus ``send_grad_s[s + 1]``; a stage ends ``end_s[s]`` after its last
    instruction (the data-parallel gradient sync).

    A transfer is one batched isend/irecv (Megatron's 1F1B): the receiver waits for it and
    so does the sender, whose next instruction starts when its send is done. Each transfer
    is counted once on every path: as the delay to the receiver, or as the sender's wait.

    ``duration_at(iid, start)``, if given, replaces ``duration``: a simulation whose
    instructions depend on what their stage did before (the power limiter's state) learns
    when each starts; instructions of one stage are asked in their order.
    """
    orders = [one_f_one_b(pp, microbatches, s) for s in range(pp)]
    start: dict[InstructionId, float] = {}
    finish: dict[InstructionId, float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                m, d = orders[s][pos[s]]
                if d == "forward":
                    prev = 0.0 if s == 0 else finish.get((s - 1, m, "forward"))
                    ready = None if prev is None else prev + (
                        send_activation_s[s - 1] if s > 0 else 0.0)
                elif s == pp - 1:
                    ready = finish.get((s, m, "forward"))
                else:
                    nxt = finish.get((s + 1, m, "backward"))
                    ready = None if nxt is None else nxt + send_grad_s[s + 1]
                if ready is None:
                    break
                iid = (s, m, d)
                start[iid] = max(free[s], ready)
                finish[iid] = start[iid] + (duration(iid) if duration_at is None
                                            else duration_at(iid, start[iid]))
                free[s] = finish[iid] + sends_after(s, d, pp, send_activation_s, send_grad_s)
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B orders never deadlock
            raise RuntimeError("pipeline schedule deadlocked")
    return Timing(start, finish, [free[s] + end_s[s] for s in range(pp)])


@functools.lru_cache(maxsize=32)
def successors(pp: int, microbatches: int) -> dict[InstructionId, list[InstructionId]]:
    """Per instruction, the instructions that wait for it: the next one on its stage and
    the one on the adjacent stage that needs its output (cached: do not modify)."""
    succ: dict[InstructionId, list[InstructionId]] = {}
    for s in range(pp):
        for a, b in itertools.pairwise(one_f_one_b(pp, microbatches, s)):
            succ.setdefault((s, *a), []).append((s, *b))
    for s in range(pp - 1):
        for m in range(microbatches):
            succ.setdefault((s, m, "forward"), []).append((s + 1, m, "forward"))
            succ.setdefault((s + 1, m, "backward"), []).append((s, m, "backward"))
    return succ


def latest_finish(pp: int, microbatches: int, timing: Timing,
                  duration: Callable[[InstructionId], float],
                  send_activation_s: Sequence[float], send_grad_s: Sequence[float],
                  end_s: Sequence[float]) -> dict[InstructionId, float]:
    """The latest each instruction may finish without lengthening the iteration
    (``timing.iteration_s``), given every other duration: its float is this minus its
    finish in ``timing``."""
    succ = successors(pp, microbatches)
    end = timing.iteration_s
    latest: dict[InstructionId, float] = {}
    for iid in sorted(timing.finish, key=lambda i: timing.finish[i], reverse=True):
        s, _m, d = iid
        wait = sends_after(s, d, pp, send_activation_s, send_grad_s)
        nxt = succ.get(iid, [])
        bound = end - end_s[s] if not any(j[0] == s for j in nxt) else float("inf")
        for j in nxt:
            bound = min(bound, latest[j] - duration(j))
        latest[iid] = bound - wait
    return latest


def free_float(pp: int, microbatches: int, timing: Timing,
               send_activation_s: Sequence[float], send_grad_s: Sequence[float],
               end_s: Sequence[float]) -> dict[InstructionId, float]:
    """How much each instruction may grow without moving anything else's start: growing
    every instruction within its free float at once leaves the schedule's starts, and the
    iteration time, unchanged."""
    succ = successors(pp, microbatches)
    out: dict[InstructionId, float] = {}
    for iid, fin in timing.finish.items():
        s, _m, d = iid
        wait = sends_after(s, d, pp, send_activation_s, send_grad_s)
        nxt = succ.get(iid, [])
        bound = timing.iteration_s - end_s[s] if not any(j[0] == s for j in nxt) else (
            float("inf"))
        for j in nxt:
            bound = min(bound, timing.start[j])
        out[iid] = bound - wait - fin
    return out
