"""The pipeline schedule: instruction order per pipeline rank, and start/finish times.

Shared by the emulator's whole-iteration simulation and by the composition, so that a
plan's predicted iteration time and the simulated one come from the same schedule.

Two schedules, both Megatron-Core's (megatron/core/pipeline_parallel/schedules.py):

- plain 1F1B (``vp == 1``): rank ``s`` holds stage ``s``;
- interleaved 1F1B (``vp = V > 1``, Megatron's virtual pipeline): rank ``r`` holds ``V``
  model chunks, the virtual stages ``r, r + pp, ..., r + (V - 1) pp``; a microbatch passes
  through all ``pp x V`` virtual stages in order. Each rank runs ``V x M`` forwards and as
  many backwards: ``2 (pp - r - 1) + (V - 1) pp`` forwards of warm-up, then one forward and
  one backward in turn, then the remaining backwards. The k-th forward (backward) of a rank
  is microbatch/chunk entry k of Megatron's schedule table (``get_schedule_table``: groups
  of ``pp`` microbatches, every chunk in turn per group), backwards with the chunk order
  reversed.

An instruction is ``(stage, microbatch, direction)`` where ``stage`` is the virtual stage
(the plain stage when ``vp == 1``). Every dependency is "start after a predecessor's
finish plus the predecessor's send": the previous instruction on the same rank (a
transfer is one batched isend/irecv, so the sender waits for it too), and the
instruction on the neighbouring virtual stage whose output it needs. Each transfer is
therefore counted once on every path.

The dependency structure depends only on ``(pp, microbatches, vp)``: it is compiled once
into index arrays in a topological order (`compiled`), and every schedule is one pass over
them, with no search.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kareus.core import InstructionId


def one_f_one_b(pp: int, microbatches: int, stage: int) -> list[tuple[int, str]]:
    """The plain 1F1B instruction order of one stage: (microbatch, direction)."""
    warmup = min(pp - stage - 1, microbatches)
    order = [(m, "forward") for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(warmup + i, "forward"), (i, "backward")]
    order += [(m, "backward") for m in range(microbatches - warmup, microbatches)]
    return order


def rank_order(pp: int, microbatches: int, rank: int, vp: int = 1) -> list[InstructionId]:
    """The instructions pipeline rank ``rank`` runs, in order (virtual stage ids)."""
    if vp == 1:
        return [(rank, m, d) for m, d in one_f_one_b(pp, microbatches, rank)]
    table = [(m, c) for g in range(0, microbatches, pp) for c in range(vp)
             for m in range(g, min(g + pp, microbatches))]
    total = len(table)
    warmup = min(total, 2 * (pp - rank - 1) + (vp - 1) * pp)
    fwd = [(c * pp + rank, m, "forward") for m, c in table]
    bwd = [((vp - 1 - c) * pp + rank, m, "backward") for m, c in table]
    order = fwd[:warmup]
    for i in range(total - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[total - warmup:]


def host_syncs(pp: int, microbatches: int, rank: int, vp: int = 1) -> list[bool]:
    """Per instruction of `rank_order`, whether the device is synchronised right before it
    (the host then starts issuing it to an empty queue: kareus.backends.emulator.host).

    Megatron-Core (0.16, pipeline_parallel/schedules.py and p2p_communication.py) puts a
    P2P call between consecutive instructions of a rank, and ``_communicate`` ends with
    ``torch.cuda.synchronize()`` (``batch_p2p_sync``), but not everywhere:

    - plain 1F1B: a steady forward is followed by ``send_forward_recv_backward``, which
      communicates nothing on the last stage, and a steady backward by
      ``send_backward_recv_forward``, nothing on the first; warm-up and cool-down always
      exchange (``send_forward`` + ``recv_forward``, ``send_backward`` +
      ``recv_backward``: a rank with warm-up or cool-down is not the last);
    - interleaved 1F1B: a steady step runs its forward and its backward with no call
      between them (``forward_backward_helper_wrapper``); every other pair is separated
      by a ``send_*_recv_*`` that calls ``_communicate`` even when it has nothing to move.

    The first instruction counts as synchronised: the previous iteration's optimizer step
    read the gradient norm on the host (docs/anchors.md §10). Without a pipeline
    (``pp == 1``) nothing synchronises between instructions."""
    order = rank_order(pp, microbatches, rank, vp)
    if pp == 1:  # forward_backward_no_pipelining
        return [i == 0 for i in range(len(order))]
    total = len(order) // 2
    warmup = min(total, 2 * (pp - rank - 1) + (vp - 1) * pp)
    out = [True]
    for i in range(1, len(order)):
        before, now = order[i - 1][2], order[i][2]
        if vp == 1:
            # an exchange with the next stage after a forward, the previous after a backward
            silent = (((before, now) == ("forward", "backward") and rank == pp - 1)
                      or ((before, now) == ("backward", "forward") and rank == 0))
        else:
            # a steady step's backward, after its forward (rank_order: warm-up forwards,
            # then forward/backward pairs, then cool-down backwards)
            silent = (i - warmup) % 2 == 1 and warmup < i < warmup + 2 * (total - warmup)
        out.append(not silent)
    return out


def sends_after(stage: int, direction: str, stages: int, send_activation_s: Sequence[float],
                send_grad_s: Sequence[float]) -> float:
    """How long the rank of ``stage`` waits for the transfer that follows its instruction
    (``stages``: the number of (virtual) stages)."""
    if direction == "forward":
        return send_activation_s[stage] if stage < stages - 1 else 0.0
    return send_grad_s[stage] if stage > 0 else 0.0


@dataclass(frozen=True)
class Compiled:
    """The dependency structure of one pipeline shape, in a topological order."""

    pp: int
    vp: int
    ids: tuple[InstructionId, ...]
    index: dict[InstructionId, int]
    rank: tuple[int, ...]
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    last_on_rank: tuple[bool, ...]
    """Whether the instruction is its rank's last (its successors are then all elsewhere,
    and the rank's end-of-iteration work follows it)."""

    @property
    def stages(self) -> int:
        return self.pp * self.vp

    def out_delays(self, send_activation_s: Sequence[float], send_grad_s: Sequence[float]
                   ) -> list[float]:
        n = self.stages
        return [sends_after(s, d, n, send_activation_s, send_grad_s) for s, _m, d in self.ids]

    def rank_end_s(self, end_s: Sequence[float]) -> list[float]:
        """Per rank, the end-of-iteration work of all its chunks."""
        out = [0.0] * self.pp
        for s, e in enumerate(end_s):
            out[s % self.pp] += e
        return out


@functools.lru_cache(maxsize=16)
def compiled(pp: int, microbatches: int, vp: int = 1) -> Compiled:
    """The compiled structure of a pipeline (cached: do not modify)."""
    stages = pp * vp
    orders = [rank_order(pp, microbatches, r, vp) for r in range(pp)]
    # cross-rank predecessor: forward after the previous virtual stage's forward, backward
    # after the next one's backward, the last stage's backward after its own forward
    def cross(iid: InstructionId) -> InstructionId | None:
        s, m, d = iid
        if d == "forward":
            return (s - 1, m, d) if s > 0 else None
        return (s + 1, m, d) if s < stages - 1 else (s, m, "forward")

    ids: list[InstructionId] = []
    done: set[InstructionId] = set()
    pos = [0] * pp
    while len(ids) < sum(len(o) for o in orders):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                iid = orders[r][pos[r]]
                dep = cross(iid)
                if dep is not None and dep not in done:
                    break
                ids.append(iid)
                done.add(iid)
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule deadlocks: pp {pp}, vp {vp}, "
                               f"{microbatches} microbatches")
    index = {iid: i for i, iid in enumerate(ids)}
    preds: list[list[int]] = [[] for _ in ids]
    for order in orders:
        for a, b in itertools.pairwise(order):
            preds[index[b]].append(index[a])
    for i, iid in enumerate(ids):
        dep = cross(iid)
        if dep is not None:
            preds[i].append(index[dep])
    succs: list[list[int]] = [[] for _ in ids]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    last = {index[o[-1]] for o in orders if o}
    return Compiled(pp, vp, tuple(ids), index, tuple(s % pp for s, _m, _d in ids),
                    tuple(tuple(p) for p in preds), tuple(tuple(s) for s in succs),
                    tuple(i in last for i in range(len(ids))))


@dataclass
class Timing:
    start: dict[InstructionId, float]
    finish: dict[InstructionId, float]
    stage_end: list[float]
    """Per pipeline rank: its last instruction's finish (and send) plus the end-of-iteration
    work (with ``vp == 1`` a rank is a stage)."""

    @property
    def iteration_s(self) -> float:
        return max(self.stage_end)


def run_times(c: Compiled, durations: Sequence[float], out_delay: Sequence[float],
              rank_end_s: Sequence[float]) -> tuple[list[float], list[float], list[float]]:
    """Start and finish of every instruction (in ``c.ids`` order), and each rank's end,
    for ``durations`` given in that order."""
    n = len(c.ids)
    start = [0.0] * n
    finish = [0.0] * n
    ready = [0.0] * n  # finish plus the instruction's send
    preds = c.preds
    for i in range(n):
        t = 0.0
        for p in preds[i]:
            if ready[p] > t:
                t = ready[p]
        start[i] = t
        finish[i] = f = t + durations[i]
        ready[i] = f + out_delay[i]
    ends = list(rank_end_s)
    for i in range(n):
        if c.last_on_rank[i]:
            ends[c.rank[i]] += ready[i]
    return start, finish, ends


def schedule(pp: int, microbatches: int, duration: Callable[[InstructionId], float],
             send_activation_s: Sequence[float], send_grad_s: Sequence[float],
             end_s: Sequence[float],
             duration_at: Callable[[InstructionId, float], float] | None = None,
             vp: int = 1) -> Timing:
    """List-schedule every rank's order (`rank_order`). Forwards wait for the previous
    virtual stage's forward of their microbatch plus its ``send_activation_s``, backwards
    for the next one's backward plus its ``send_grad_s``; a rank ends ``end_s`` (summed
    over its chunks) after its last instruction and send. The per-stage lists are indexed
    by virtual stage.

    ``duration_at(iid, start)``, if given, replaces ``duration``: a simulation whose
    instructions depend on what their rank did before (the power limiter's state) learns
    when each starts; instructions of one rank are asked in their order.
    """
    c = compiled(pp, microbatches, vp)
    out_delay = c.out_delays(send_activation_s, send_grad_s)
    if duration_at is None:
        durations = [duration(iid) for iid in c.ids]
        start, finish, ends = run_times(c, durations, out_delay, c.rank_end_s(end_s))
        return Timing(dict(zip(c.ids, start, strict=True)),
                      dict(zip(c.ids, finish, strict=True)), ends)
    start_l, finish_l, ends = run_times_at(
        c, lambda i, t: duration_at(c.ids[i], t), out_delay, c.rank_end_s(end_s))
    return Timing(dict(zip(c.ids, start_l, strict=True)),
                  dict(zip(c.ids, finish_l, strict=True)), ends)


def run_times_at(c: Compiled, duration_at: Callable[[int, float], float],
                 out_delay: Sequence[float], rank_end_s: Sequence[float]
                 ) -> tuple[list[float], list[float], list[float]]:
    """`run_times` where each instruction's duration depends on when it starts:
    ``duration_at(index, start)`` is asked in ``c.ids`` order (topological, each rank's
    instructions in their order)."""
    n = len(c.ids)
    start, finish, ready = [0.0] * n, [0.0] * n, [0.0] * n
    for i in range(n):
        t = max((ready[p] for p in c.preds[i]), default=0.0)
        start[i] = t
        finish[i] = t + duration_at(i, t)
        ready[i] = finish[i] + out_delay[i]
    ends = list(rank_end_s)
    for i in range(n):
        if c.last_on_rank[i]:
            ends[c.rank[i]] += ready[i]
    return start, finish, ends


def successors(pp: int, microbatches: int, vp: int = 1
               ) -> dict[InstructionId, list[InstructionId]]:
    """Per instruction, the instructions that wait for it: the next one on its rank and
    the one on the adjacent virtual stage that needs its output."""
    c = compiled(pp, microbatches, vp)
    return {iid: [c.ids[j] for j in c.succs[i]] for i, iid in enumerate(c.ids) if c.succs[i]}


def latest_finish(pp: int, microbatches: int, timing: Timing,
                  duration: Callable[[InstructionId], float],
                  send_activation_s: Sequence[float], send_grad_s: Sequence[float],
                  end_s: Sequence[float], vp: int = 1) -> dict[InstructionId, float]:
    """The latest each instruction may finish without lengthening the iteration
    (``timing.iteration_s``), given every other duration: its float is this minus its
    finish in ``timing``."""
    c = compiled(pp, microbatches, vp)
    durations = [duration(iid) for iid in c.ids]
    late = latest_times(c, durations, c.out_delays(send_activation_s, send_grad_s),
                        c.rank_end_s(end_s), timing.iteration_s)
    return dict(zip(c.ids, late, strict=True))


def latest_times(c: Compiled, durations: Sequence[float], out_delay: Sequence[float],
                 rank_end_s: Sequence[float], iteration_s: float) -> list[float]:
    """`latest_finish` on index arrays (``c.ids`` order)."""
    n = len(c.ids)
    late = [0.0] * n
    succs, last, rank = c.succs, c.last_on_rank, c.rank
    for i in range(n - 1, -1, -1):  # reverse topological order
        bound = iteration_s - rank_end_s[rank[i]] if last[i] else float("inf")
        for j in succs[i]:
            b = late[j] - durations[j]
            if b < bound:
                bound = b
        late[i] = bound - out_delay[i]
    return late


def free_float(pp: int, microbatches: int, timing: Timing,
               send_activation_s: Sequence[float], send_grad_s: Sequence[float],
               end_s: Sequence[float], vp: int = 1) -> dict[InstructionId, float]:
    """How much each instruction may grow without moving anything else's start: growing
    every instruction within its free float at once leaves the schedule's starts, and the
    iteration time, unchanged."""
    c = compiled(pp, microbatches, vp)
    out_delay = c.out_delays(send_activation_s, send_grad_s)
    rank_end = c.rank_end_s(end_s)
    start = [timing.start[iid] for iid in c.ids]
    finish = [timing.finish[iid] for iid in c.ids]
    free = free_times(c, start, finish, out_delay, rank_end, timing.iteration_s)
    return dict(zip(c.ids, free, strict=True))


def free_times(c: Compiled, start: Sequence[float], finish: Sequence[float],
               out_delay: Sequence[float], rank_end_s: Sequence[float],
               iteration_s: float) -> list[float]:
    """`free_float` on index arrays (``c.ids`` order)."""
    out = [0.0] * len(c.ids)
    for i in range(len(c.ids)):
        bound = iteration_s - rank_end_s[c.rank[i]] if c.last_on_rank[i] else float("inf")
        for j in c.succs[i]:
            if start[j] < bound:
                bound = start[j]
        out[i] = bound - out_delay[i] - finish[i]
    return out
