"""The host that issues the compute stream's kernels (docs/emulator.md, "The host").

Training's Python issues every kernel: a module call (a linear, an attention) costs the
host tens of microseconds, a basic PyTorch op about one (docs/anchors.md §10). A kernel
cannot start before the host issued it. The host never waits for the GPU between two
syncs, so where the GPU's kernels take longer than the host needs per kernel the queue
fills and the host is hidden; after a sync (an empty queue) the GPU waits for the host
until it is ahead again, and where kernels are shorter than their issue time the GPU
waits throughout (host-bound).

The host's lag ``lag_s`` is the host's time minus the GPU's at a point of the compute
stream: 0 right after a sync (the host starts issuing as the GPU becomes free), negative
when the host is ahead. Before each op the host spends the op's issue time (`HostCosts`);
the GPU waits ``max(0, lag)`` (a ``("host", seconds)`` item, static power as any wait),
then runs the op's items, which move the lag down by their time. The GPU's time per item is
taken at the run's set clock without the side collective (`StreamRunner.host_plan`): the
waits are fixed before the run, so a run with them is still a list of items at each clock,
profiled and cached as any other (streams.py). A side collective slowing the kernels, or
the power limiter lowering the clock, would hide the host a little more than that.
"""

from __future__ import annotations

from dataclasses import dataclass

from kareus.backends.emulator.params import EmulatorParams
from kareus.workload.ops import ComputeOp, Op

BACKWARD_SUFFIXES = ("_bwd", "_dgrad", "_wgrad", "_grad_acc")
"""Names of the graph's backward kernels (kareus.workload.layer, graph, training_ops):
issued by autograd's backward of the module whose forward is the name's stem, or, for the
unfused gradient accumulation's add, by the DDP hook that runs in that backward."""


MODULE_OPS = frozenset({"embedding"})
"""Memory-bound kernels issued by a module call of their own: Megatron-Core's
VocabParallelEmbedding (a lookup, a mask, its all-reduce). No public figure for it: the
linear's (an assumption, docs/anchors.md §10)."""


def is_backward(op: Op) -> bool:
    return op.name.endswith(BACKWARD_SUFFIXES)


HOST_PARAMS = ("host_module_s", "host_basic_op_s", "host_backward_scale")
"""The `EmulatorParams` fields of the host (`HostCosts.of`), in its fields' order: only
simulated iterations read them, never a measurement (its loop keeps its host ahead), so
never composition."""


@dataclass(frozen=True)
class HostCosts:
    """Host time to issue each op, from the emulator's constants (docs/anchors.md §10)."""

    module_s: float
    basic_op_s: float
    backward_scale: float

    @classmethod
    def of(cls, p: EmulatorParams) -> HostCosts:
        return cls(*(float(getattr(p, name)) for name in HOST_PARAMS))

    def issue_s(self, op: Op) -> float:
        """A linear's or an attention's first kernel, or an embedding: one module call
        (the module's other kernels, a backward's weight gradient GEMM or CP's second
        attention chunk: one basic op each); a memory-bound kernel (norm, RoPE,
        activation, residual, loss): one basic op; a collective: nothing of its own
        (called inside its module, whose time counts it). A backward kernel: times
        ``backward_scale``. A recomputed forward is forward ops again, issued again. An op
        fused into the previous kernel (`ComputeOp.fused`: the fused dropout mask) issues
        nothing of its own."""
        if not isinstance(op, ComputeOp) or op.fused:
            return 0.0
        module = (op.kind in ("gemm", "attention") and op.opens_slot) or op.name in MODULE_OPS
        t = self.module_s if module else self.basic_op_s
        return t * self.backward_scale if is_backward(op) else t


@dataclass(frozen=True)
class HostPlan:
    """One run of ops as the host sees it: per op its issue time and the GPU's time for
    its items at the set clock, and what follows from them."""

    issue_s: tuple[float, ...]
    gpu_s: tuple[float, ...]
    hidden_below_s: float
    """A run started with the host's lag at or below minus this never waits for it."""

    @classmethod
    def of(cls, issue_s: tuple[float, ...], gpu_s: tuple[float, ...]) -> HostPlan:
        worst, issued, ran = 0.0, 0.0, 0.0
        for c, d in zip(issue_s, gpu_s, strict=True):
            issued += c
            worst = max(worst, issued - ran)
            ran += d
        return cls(issue_s, gpu_s, worst)

    @property
    def drift_s(self) -> float:
        """The lag's change over the run where the GPU never waits."""
        return sum(self.issue_s) - sum(self.gpu_s)

    def hidden(self, lag_s: float) -> bool:
        return lag_s <= -self.hidden_below_s

    def waits(self, lag_s: float) -> tuple[tuple[float, ...] | None, float]:
        """The GPU's wait before each op (None: none anywhere) and the lag at the end,
        from lag ``lag_s`` at the start."""
        if self.hidden(lag_s):
            return None, lag_s + self.drift_s
        out = []
        lag = lag_s
        for c, d in zip(self.issue_s, self.gpu_s, strict=True):
            lag += c
            w = max(0.0, lag)
            out.append(w)
            lag -= w + d
        return tuple(out), lag
