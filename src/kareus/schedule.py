"""The 1F1B pipeline schedule: instruction order per stage, and start/finish times.

Shared by the emulator's whole-iteration simulation and by the composition, so that a
plan's predicted iteration time and the simulated one come from the same schedule.
"""

from __future__ import annotations

from collections.abc import Callable
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
             end_s: list[float]) -> Timing:
    """List-schedule every stage's 1F1B order. A forward waits for the previous stage's
    forward of its microbatch plus ``send_activation_s[s - 1]``; a backward for the next
    stage's backward plus ``send_grad_s[s + 1]``; a stage ends ``end_s[s]`` after its last
    instruction (the data-parallel gradient sync)."""
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
                free[s] = finish[iid] = start[iid] + duration(iid)
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B orders never deadlock
            raise RuntimeError("pipeline schedule deadlocked")
    return Timing(start, finish, [free[s] + end_s[s] for s in range(pp)])
