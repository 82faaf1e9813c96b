"""The emulator's figure like the Perseus/Kareus reference (docs/anchors.md §5): the critical
path of the pipeline's instruction windows, with edges that cost nothing.

The reference (github.com/ml-energy/kareus) measures every forward and backward instruction
inside real training, each window bracketed by Megatron timers that synchronise the GPU, and
every P2P call outside the windows; its iteration time is the critical path of those windows
in the 1F1B graph with free edges (no transfer, no optimizer step, no data-parallel sync), its
energy the windows' energy summed over one GPU per stage. lowtime rounds each window down to
1 ms first.

Here the windows are the instructions of an iteration simulated with the same timers
(`IterationSimulator.run(..., timed_windows=True)`): Megatron's ``Timer.start`` synchronises
the device and then reads the clock (megatron/core/timers.py), so a window starts at an empty
queue and includes the host's issue time before the first kernel, then every kernel to the
sync after the last, from the power limiter state it started in. The path is a longest path
over a graph built here: each rank's own instruction order (`rank_order`), a forward after
the previous stage's forward of its microbatch, a backward after the next stage's backward
of its microbatch. It does not reuse the schedule's list scheduling (`kareus.plans.schedule`), so
the tests can check one against the other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kareus.backends.emulator.iteration_result import IterationResult
from kareus.core import InstructionId
from kareus.plans.schedule import rank_order

LOWTIME_UNIT_S = 1e-3
"""lowtime's time unit in the reference: each window is rounded down to it."""


def window_graph(pp: int, microbatches: int, vp: int = 1
                 ) -> dict[InstructionId, list[InstructionId]]:
    """Per instruction, the instructions it waits for, every edge free: the one before it on
    its rank, and the neighbouring (virtual) stage's instruction of its microbatch whose
    output it needs."""
    stages = pp * vp
    preds: dict[InstructionId, list[InstructionId]] = {}
    for r in range(pp):
        order = rank_order(pp, microbatches, r, vp)
        for i, iid in enumerate(order):
            preds[iid] = [order[i - 1]] if i else []
    for (s, m, d), ps in preds.items():
        if d == "forward" and s > 0:
            ps.append((s - 1, m, d))
        elif d == "backward":
            ps.append((s + 1, m, d) if s < stages - 1 else (s, m, "forward"))
    return preds


def critical_path(preds: Mapping[InstructionId, list[InstructionId]],
                  duration_s: Mapping[InstructionId, float]
                  ) -> tuple[float, list[InstructionId]]:
    """The longest path through the DAG ``preds`` (node -> predecessors) with node weights
    ``duration_s``: its length and its nodes, first to last (Kahn's topological order)."""
    succs: dict[InstructionId, list[InstructionId]] = {n: [] for n in preds}
    missing = [n for n in preds if n not in duration_s]
    if missing:
        raise ValueError(f"no window for {missing[0]}")
    indegree = {n: len(ps) for n, ps in preds.items()}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    ready = [n for n, k in indegree.items() if k == 0]
    finish: dict[InstructionId, float] = {}
    via: dict[InstructionId, InstructionId | None] = {}
    while ready:
        n = ready.pop()
        best = max(preds[n], key=lambda p: finish[p], default=None)
        via[n] = best
        finish[n] = (finish[best] if best is not None else 0.0) + duration_s[n]
        for q in succs[n]:
            indegree[q] -= 1
            if indegree[q] == 0:
                ready.append(q)
    if len(finish) != len(preds):
        raise ValueError("the instruction graph has a cycle")
    if not finish:
        return 0.0, []
    end = max(finish, key=lambda n: finish[n])
    path: list[InstructionId] = []
    node: InstructionId | None = end
    while node is not None:
        path.append(node)
        node = via[node]
    return finish[end], path[::-1]


@dataclass(frozen=True)
class WindowPath:
    """The like-for-like figures of one simulated iteration."""

    time_s: float
    """The critical path of the windows, each rounded down to lowtime's 1 ms, as the
    reference's."""
    exact_time_s: float
    """The same without the rounding."""
    energy_j: float
    """Every window's energy (static included), summed over one GPU per stage."""
    stages: int
    path: tuple[InstructionId, ...]
    """The instructions on the (rounded) critical path, first to last."""

    @property
    def mean_power_per_gpu_w(self) -> float:
        """As the reference states it: energy / (time x stages)."""
        return self.energy_j / (self.time_s * self.stages)


def window_path(result: IterationResult, pp: int, microbatches: int, vp: int = 1
                ) -> WindowPath:
    """The like-for-like figures of ``result``, which must carry its instructions and have
    been simulated with the reference's timers
    (``IterationSimulator.run(plan, with_instructions=True, timed_windows=True)``)."""
    if not result.timed_windows:
        # without the timers' syncs a window can start with the host ahead (host_syncs):
        # shorter than any window the reference measured
        raise ValueError("the iteration was simulated without the timers' windows "
                         "(timed_windows=True)")
    static_w = result.static_energy_j / (result.num_gpus * result.time_s)
    windows: dict[InstructionId, tuple[float, float]] = {}
    for rep in result.stages:
        for i in rep.instructions:
            t = float(i["time_s"])
            windows[(i["stage"], i["microbatch"], i["direction"])] = (
                t, float(i["dynamic_energy_j"]) + static_w * t)
    if not windows:
        raise ValueError("the iteration was simulated without its instructions")
    graph = window_graph(pp, microbatches, vp)
    exact, _ = critical_path(graph, {k: t for k, (t, _e) in windows.items()})
    # floor to the unit; the epsilon keeps a window of exactly k ms at k ms
    rounded = {k: math.floor(t / LOWTIME_UNIT_S + 1e-9) * LOWTIME_UNIT_S
               for k, (t, _e) in windows.items()}
    time_s, path = critical_path(graph, rounded)
    energy = sum(e for _t, e in windows.values())
    # a rank holds vp virtual stages on one GPU: "one GPU per stage" is one per rank
    return WindowPath(time_s, exact, energy, pp, tuple(path))

