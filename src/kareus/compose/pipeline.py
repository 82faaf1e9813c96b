"""The iteration frontier: the 1F1B pipeline DAG solved for its time-energy tradeoff.

Every instruction (stage, microbatch, direction) is an operation whose execution options
are its stage's instruction options for that direction. The `lowtime` package's
Phillips-Dessouky solver starts from every instruction at its slowest option and shortens
the critical path one time unit at a time at the least increase in dynamic energy. After
each step the chosen options are read back and the plan is evaluated exactly (the same
1F1B list schedule the emulator uses, with the options' real times): iteration time, and
energy = GPUs per stage x sum of dynamic energies + GPUs x time x static power. The
frontier is the Pareto set of the plans met on the way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kareus.compose.instruction import InstructionOption, pareto_front
from kareus.compose.slack import fill_slack
from kareus.core import InstructionId
from kareus.errors import KareusError
from kareus.plans.schedule import one_f_one_b, schedule, sends_after


@dataclass(frozen=True)
class PipelineCosts:
    """Everything the pipeline needs besides the instruction options."""

    pp: int
    microbatches: int
    gpus: int
    static_power_w: float
    send_activation_s: tuple[float, ...]
    send_grad_s: tuple[float, ...]
    end_s: tuple[float, ...]
    fixed_dynamic_j: tuple[float, ...]
    """Per stage, per GPU: transfers' and end-of-iteration dynamic energy."""


@dataclass(frozen=True)
class PipelinePoint:
    time_s: float
    energy_j: float
    dynamic_energy_j: float
    choice: dict[InstructionId, int]
    """Per instruction, the index of its option in the (pruned) option list it was solved
    with; `picks` holds the options themselves."""
    picks: dict[InstructionId, InstructionOption]
    options: dict[tuple[int, str], list[InstructionOption]] = field(
        default_factory=dict, compare=False, repr=False)
    """The option lists ``choice`` indexes (shared, not copied)."""


def evaluate(options: dict[tuple[int, str], list[InstructionOption]], costs: PipelineCosts,
             choice: dict[InstructionId, int]) -> PipelinePoint:
    def duration(iid: InstructionId) -> float:
        s, _m, d = iid
        return options[(s, d)][choice[iid]].time_s

    timing = schedule(costs.pp, costs.microbatches, duration, list(costs.send_activation_s),
                      list(costs.send_grad_s), list(costs.end_s))
    per_gpu = sum(options[(s, d)][i].dynamic_energy_j for (s, _m, d), i in choice.items())
    per_gpu += sum(costs.fixed_dynamic_j)
    dynamic = costs.gpus // costs.pp * per_gpu
    t = timing.iteration_s
    picks = {iid: options[(iid[0], iid[2])][i] for iid, i in choice.items()}
    return PipelinePoint(t, dynamic + costs.gpus * t * costs.static_power_w, dynamic,
                         dict(choice), picks, options)


def evaluate_filled(options: dict[tuple[int, str], list[InstructionOption]],
                    costs: PipelineCosts, choice: dict[InstructionId, int]) -> PipelinePoint:
    """``choice`` with its slack filled (kareus.compose.slack), evaluated."""
    return evaluate(options, costs, fill_slack(
        options, costs.pp, costs.microbatches, costs.send_activation_s, costs.send_grad_s,
        costs.end_s, choice))


def _uniform(options, costs, pick) -> dict[InstructionId, int]:
    return {(s, m, d): pick(options[(s, d)]) for s in range(costs.pp)
            for m, d in one_f_one_b(costs.pp, costs.microbatches, s)}


def default_steps(costs: PipelineCosts) -> int:
    """Solver steps between the slowest and the fastest plan: 400 for small pipelines,
    fewer for large ones (each step costs time proportional to the DAG's size; lowtime
    spends ~0.13 s per step on a 512-instruction pipeline here), never under 120."""
    instructions = 2 * costs.pp * costs.microbatches
    return max(120, min(400, 60_000 // instructions))


def solve_frontier(options: dict[tuple[int, str], list[InstructionOption]],
                   costs: PipelineCosts, max_steps: int | None = None) -> list[PipelinePoint]:
    """Pareto frontier of (iteration time, energy) plans.

    ``options[(stage, direction)]`` must be Pareto-sorted, fastest first. The time unit is
    1 ms or coarser, so that the solver takes at most about ``max_steps`` steps between the
    slowest and the fastest plan (default: `default_steps`; large pipelines stay fast).
    """
    max_steps = max_steps or default_steps(costs)
    options = {k: drop_wasteful(pareto_front(v), costs.static_power_w)
               for k, v in options.items()}
    # every point is the least-energy plan found for its iteration time: slack filled
    fastest = evaluate_filled(options, costs, _uniform(options, costs, lambda o: 0))
    slowest = evaluate(options, costs, _uniform(options, costs, lambda o: len(o) - 1))
    points = [fastest, slowest]
    if all(len(v) == 1 for v in options.values()):
        return _frontier(points)
    unit = max(1e-3, (slowest.time_s - fastest.time_s) / max_steps)
    for choice in _phillips_dessouky(options, costs, unit):
        points.append(evaluate_filled(options, costs, choice))
    return _frontier(points)


def drop_wasteful(options: list[InstructionOption], static_power_w: float
                  ) -> list[InstructionOption]:
    """Drop options slower than the one with the least energy on its own GPU (dynamic +
    static power x time): running slower than that costs that GPU more energy than it
    saves whether or not the instruction is on the critical path. Without them the
    solver's time unit covers only the useful range, so the frontier is finer where it
    matters."""
    if not options:
        return options
    best = min(options, key=lambda o: o.dynamic_energy_j + static_power_w * o.time_s)
    return [o for o in options if o.time_s <= best.time_s]


def merge_frontiers(*fronts: list[PipelinePoint]) -> list[PipelinePoint]:
    """The Pareto set of several solves' plans."""
    return _frontier([p for f in fronts for p in f])


def _frontier(points: list[PipelinePoint]) -> list[PipelinePoint]:
    return pareto_front(points, key=lambda p: (p.time_s, p.energy_j))


def _phillips_dessouky(options: dict[tuple[int, str], list[InstructionOption]],
                       costs: PipelineCosts, unit: float) -> Iterator[dict[InstructionId, int]]:
    """Yield the per-instruction option choice after every solver step."""
    from lowtime.solver import PhillipsDessouky

    dag, ops = _pipeline_dag(options, costs, _spec_builder(unit))
    logging.getLogger("lowtime").setLevel(logging.WARNING)
    try:
        for _ in PhillipsDessouky(dag, attr_name="op").run():
            yield {iid: int(op.assigned_knob) for iid, op in ops.items()}
    except Exception as exc:
        raise _solver_failed(exc) from None
    except BaseException as exc:
        # lowtime's Rust core panics as pyo3_runtime.PanicException, a BaseException; any
        # other (Ctrl-C, SIGTERM's kareus.cli.Terminated, SystemExit, GeneratorExit) goes on
        if not is_rust_panic(exc):
            raise
        raise _solver_failed(exc) from None


def is_rust_panic(exc: BaseException) -> bool:
    """A Rust panic surfaced by PyO3 (``pyo3_runtime.PanicException``, which is not an
    `Exception` and cannot be imported: it is recognised by its module and name)."""
    return any(c.__module__ == "pyo3_runtime" and c.__name__ == "PanicException"
               for c in type(exc).__mro__)


def _solver_failed(exc: BaseException) -> KareusError:
    return KareusError(f"the pipeline solver (lowtime) failed: {type(exc).__name__}: {exc}")


def _spec_builder(unit: float) -> Callable[[list[tuple[float, float]]], Any]:
    """(time, dynamic energy) options -> a lowtime OperationSpec in ``unit`` steps."""
    from lowtime.cost_model import CostModel
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec

    class HullCost(CostModel):
        """Piecewise-linear through the lower convex hull of the options: exact at the
        hull's vertices, convex as Phillips-Dessouky needs."""

        def __init__(self, cands: CandidateExecutionOptions) -> None:
            pts = sorted({(o.quant_time, o.cost) for o in cands.options})
            hull: list[tuple[int, float]] = []
            for p in pts:
                while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
                    hull.pop()
                hull.append(p)
            self.xs = np.array([h[0] for h in hull], dtype=float)
            self.ys = np.array([h[1] for h in hull], dtype=float)

        def __call__(self, quant_time: int) -> float:
            return float(np.interp(quant_time, self.xs, self.ys))

    def spec(opts: list[tuple[float, float]]) -> Any:
        cands = CandidateExecutionOptions(options=[
            ExecutionOption(real_time=t, unit_time=unit, cost=e, knob=i)
            for i, (t, e) in enumerate(opts)])
        return OperationSpec(options=cands, cost_model=HullCost(cands))

    return spec


def _pipeline_dag(options: dict[tuple[int, str], list[InstructionOption]],
                  costs: PipelineCosts, spec: Callable[[list[tuple[float, float]]], Any]
                  ) -> tuple[Any, dict[InstructionId, Any]]:
    """The 1F1B DAG (operation on node) and each instruction's lowtime Operation."""
    import networkx as nx
    from lowtime.operation import DummyOperation, Operation

    specs = {k: spec([(o.time_s, o.dynamic_energy_j) for o in v]) for k, v in options.items()}
    dag = nx.DiGraph()

    def add(op: Any) -> int:
        node = dag.number_of_nodes() + 1
        dag.add_node(node, op=op)
        return node

    source, sink = add(DummyOperation()), add(DummyOperation())
    ids: dict[InstructionId, int] = {}
    ops: dict[InstructionId, Any] = {}
    after: dict[InstructionId, int] = {}  # the node a stage's next instruction follows
    for s in range(costs.pp):
        prev = source
        for m, d in one_f_one_b(costs.pp, costs.microbatches, s):
            ops[(s, m, d)] = op = Operation(spec=specs[(s, d)])
            ids[(s, m, d)] = n = add(op)
            dag.add_edge(prev, n)
            prev = after[(s, m, d)] = n
            delay = sends_after(s, d, costs.pp, costs.send_activation_s, costs.send_grad_s)
            if delay > 0:
                # one node per transfer: the sender's next instruction and the receiver
                # both wait for it (batched isend/irecv), so every path counts it once
                prev = after[(s, m, d)] = add(Operation(spec=spec([(delay, 0.0)])))
                dag.add_edge(n, prev)
        if costs.end_s[s] > 0:
            end = add(Operation(spec=spec([(costs.end_s[s], 0.0)])))
            dag.add_edge(prev, end)
            prev = end
        dag.add_edge(prev, sink)
    for s in range(costs.pp - 1):
        for m in range(costs.microbatches):
            dag.add_edge(after[(s, m, "forward")], ids[(s + 1, m, "forward")])
            dag.add_edge(after[(s + 1, m, "backward")], ids[(s, m, "backward")])
    dag.graph["source_node"], dag.graph["sink_node"] = source, sink
    return dag, ops


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])
