"""Phillips-Dessouky through the `lowtime` package: the pipeline solver Perseus uses.

It starts from every instruction at its slowest option and shortens the critical path one
time unit at a time at the least increase in dynamic energy (one min-cut per step). Its
cost grows with the DAG and with the number of steps, so kareus.compose.lp_frontier is the
default; this one is kept for parity (`kareus optimize --pipeline-solver
phillips-dessouky`) and for the test that the two give the same frontier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kareus.compose.instruction import InstructionOption
from kareus.compose.pipeline_costs import PipelineCosts
from kareus.core import InstructionId
from kareus.errors import KareusError


def pd_choices(options: dict[tuple[int, str], list[InstructionOption]],
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
    """The pipeline DAG (operation on node) and each instruction's lowtime Operation: one
    node per instruction, one per transfer (the sender's next instruction and the receiver
    both wait for it, batched isend/irecv, so every path counts it once), one per rank's
    end-of-iteration work."""
    import networkx as nx
    from lowtime.operation import DummyOperation, Operation

    specs = {k: spec([(o.time_s, o.dynamic_energy_j) for o in v]) for k, v in options.items()}
    c = costs.shape
    out_delay = c.out_delays(costs.send_activation_s, costs.send_grad_s)
    dag = nx.DiGraph()

    def add(op: Any) -> int:
        node = dag.number_of_nodes() + 1
        dag.add_node(node, op=op)
        return node

    source, sink = add(DummyOperation()), add(DummyOperation())
    ops: dict[InstructionId, Any] = {}
    node: list[int] = []
    after: list[int] = []  # the node an instruction's successors follow
    for i, (s, m, d) in enumerate(c.ids):
        ops[(s, m, d)] = op = Operation(spec=specs[(s, d)])
        node.append(add(op))
        after.append(node[i])
        if out_delay[i] > 0:
            after[i] = add(Operation(spec=spec([(out_delay[i], 0.0)])))
            dag.add_edge(node[i], after[i])
        if not c.preds[i]:
            dag.add_edge(source, node[i])
        for p in c.preds[i]:
            dag.add_edge(after[p], node[i])
    rank_end = c.rank_end_s(costs.end_s)
    for i in range(len(c.ids)):
        if c.last_on_rank[i]:
            last = after[i]
            if rank_end[c.rank[i]] > 0:
                last = add(Operation(spec=spec([(rank_end[c.rank[i]], 0.0)])))
                dag.add_edge(after[i], last)
            dag.add_edge(last, sink)
    dag.graph["source_node"], dag.graph["sink_node"] = source, sink
    return dag, ops


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])
