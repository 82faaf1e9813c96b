"""Whole-iteration simulation: a 1F1B pipeline of instructions, each built from its steps.

An instruction's cost is that of its steps back to back (outside ops, the solo first
segment, the partitions with the plan's knobs at the instruction's clock, the exposed last
collective); with ``overlap=False`` (Megatron-LM) the microbatch is not split and every
collective blocks the compute stream. Stages follow the 1F1B order (warm-up forwards,
steady one-forward-one-backward, cool-down backwards); a forward waits for the previous
stage's forward of the same microbatch plus the activation transfer, a backward for the
next stage's backward plus the gradient transfer. After its last backward a stage runs
the data-parallel gradient sync. A GPU that waits draws static power.

Iteration time is the slowest rank's; energy is summed over all GPUs of the job:
sum of dynamic energies (every GPU of a stage does the same work) + GPUs x time x static.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kareus import SCHEMA_VERSION
from kareus.backends.base import ZERO, Knobs, Measurement
from kareus.backends.emulator.backend import EmulatorBackend
from kareus.execution import ExecutionPlan
from kareus.partition import PartitionSet
from kareus.workload.graph import StageGraph
from kareus.workload.layer import backward_ops, forward_ops
from kareus.workload.ops import Op


def one_f_one_b(pp: int, microbatches: int, stage: int) -> list[tuple[int, str]]:
    """The 1F1B instruction order of one stage: (microbatch, direction)."""
    warmup = min(pp - stage - 1, microbatches)
    order = [(m, "forward") for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(warmup + i, "forward"), (i, "backward")]
    order += [(m, "backward") for m in range(microbatches - warmup, microbatches)]
    return order


@dataclass
class StageReport:
    index: int
    busy_s: float = 0.0
    end_s: float = 0.0
    dynamic_energy_j: float = 0.0
    instructions: list[dict] = field(default_factory=list)


@dataclass
class IterationResult:
    plan: str
    time_s: float
    energy_j: float
    static_energy_j: float
    dynamic_energy_j: float
    num_gpus: int
    stages: list[StageReport]

    @property
    def mean_power_per_gpu_w(self) -> float:
        return self.energy_j / (self.num_gpus * self.time_s)

    def to_dict(self, with_instructions: bool = False) -> dict:
        stages = []
        for s in self.stages:
            d = {"stage": s.index, "busy_s": s.busy_s, "idle_s": self.time_s - s.busy_s,
                 "end_s": s.end_s, "dynamic_energy_j_per_gpu": s.dynamic_energy_j}
            if with_instructions:
                d["instructions"] = s.instructions
            stages.append(d)
        return {
            "schema_version": SCHEMA_VERSION,
            "plan": self.plan,
            "time_s": self.time_s,
            "energy_j": self.energy_j,
            "static_energy_j": self.static_energy_j,
            "dynamic_energy_j": self.dynamic_energy_j,
            "num_gpus": self.num_gpus,
            "mean_power_per_gpu_w": self.mean_power_per_gpu_w,
            "stages": stages,
        }


class IterationSimulator:
    def __init__(self, partitions: PartitionSet, backend: EmulatorBackend) -> None:
        self.ps = partitions
        self.job = partitions.job
        self.backend = backend
        self._instr: dict = {}
        self._megatron_layer: tuple[tuple[Op, ...], tuple[Op, ...]] | None = None

    # One instruction ----------------------------------------------------------------------

    def instruction(self, plan: ExecutionPlan, stage: int, direction: str, freq_mhz: int
                    ) -> Measurement:
        key = (id(plan), plan.overlap, stage, direction, freq_mhz)
        hit = self._instr.get(key)
        if hit is None:
            if plan.overlap:
                hit = self._overlapped(plan, stage, direction, freq_mhz)
            else:
                hit = self._sequential(stage, direction, freq_mhz)
            self._instr[key] = hit
        return hit

    def _overlapped(self, plan: ExecutionPlan, stage: int, direction: str, freq_mhz: int
                    ) -> Measurement:
        b = self.backend
        total = ZERO
        for step in self.ps.layouts[(stage, direction)].steps:
            if step.kind == "partition":
                p = self.ps[step.key]
                c = plan.choice(step.key, freq_mhz, b.default_sms)
                slot = p.slots[0].name if c.slot == "first" else c.slot
                total = total + b.measure_exact(p, Knobs(freq_mhz, c.sms, slot))
            else:
                total = total + b.run_ops(step.ops, freq_mhz, plan.default_sms)
        return total

    def _sequential(self, stage: int, direction: str, freq_mhz: int) -> Measurement:
        """Megatron-LM: the whole microbatch, collectives blocking, default SMs."""
        if self._megatron_layer is None:
            fwd = forward_ops(self.job, sequences=self.job.micro_batch_size)
            bwd = backward_ops(self.job, fwd, sequences=self.job.micro_batch_size)
            self._megatron_layer = (tuple(fwd), tuple(bwd))
        fwd, bwd = self._megatron_layer
        g: StageGraph = self.ps.graph.stages[stage]
        b = self.backend
        if direction == "forward":
            layer = b.run_ops(fwd, freq_mhz)
            pre, post = b.run_ops(g.forward_pre, freq_mhz), b.run_ops(g.forward_post, freq_mhz)
        else:
            layer = b.run_ops((*fwd, *bwd) if self.job.recompute else bwd, freq_mhz)
            pre = b.run_ops(g.backward_pre, freq_mhz)
            post = b.run_ops(g.backward_post, freq_mhz)
        return pre + layer.scaled(g.num_layers) + post

    # The pipeline ---------------------------------------------------------------------------

    def run(self, plan: ExecutionPlan, with_instructions: bool = False) -> IterationResult:
        job, b = self.job, self.backend
        pp, mbs = job.pp, job.num_microbatches
        stages = self.ps.graph.stages
        # Transfers between stages: their time delays the receiver; their (small) dynamic
        # energy is the sender's.
        p2p = {}
        for s in stages:
            sends = [op for op in (*s.forward_post, *s.backward_post)
                     if op.is_collective and op.group == "pp"]
            p2p[s.index] = {op.name: b.run_ops((op,), plan.default_freq_mhz) for op in sends}
        orders = [one_f_one_b(pp, mbs, s) for s in range(pp)]
        finish: dict[tuple[int, int, str], float] = {}
        free = [0.0] * pp
        pos = [0] * pp
        reports = [StageReport(s) for s in range(pp)]
        remaining = sum(len(o) for o in orders)
        while remaining:
            progressed = False
            for s in range(pp):
                while pos[s] < len(orders[s]):
                    m, d = orders[s][pos[s]]
                    ready = self._ready_time(finish, p2p, s, m, d, pp)
                    if ready is None:
                        break
                    f = plan.freq(s, m, d)
                    cost = self.instruction(plan, s, d, f)
                    start = max(free[s], ready)
                    free[s] = finish[(s, m, d)] = start + cost.time_s
                    rep = reports[s]
                    rep.busy_s += cost.time_s
                    rep.dynamic_energy_j += cost.dynamic_energy_j
                    if with_instructions:
                        rep.instructions.append({
                            "microbatch": m, "direction": d, "freq_mhz": f, "start_s": start,
                            "time_s": cost.time_s, "dynamic_energy_j": cost.dynamic_energy_j})
                    pos[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:  # pragma: no cover - 1F1B orders never deadlock
                raise RuntimeError("pipeline schedule deadlocked")
        for s, g in enumerate(stages):
            for sent in p2p[s].values():
                reports[s].dynamic_energy_j += sent.dynamic_energy_j * mbs
            end = b.run_ops(g.iteration_end, plan.default_freq_mhz) if g.iteration_end else ZERO
            reports[s].busy_s += end.time_s
            reports[s].dynamic_energy_j += end.dynamic_energy_j
            reports[s].end_s = free[s] + end.time_s
        time_s = max(r.end_s for r in reports)
        gpus_per_stage = job.num_gpus // pp
        dynamic = gpus_per_stage * sum(r.dynamic_energy_j for r in reports)
        static = job.num_gpus * time_s * b.static_power_w
        return IterationResult(plan.name, time_s, dynamic + static, static, dynamic,
                               job.num_gpus, reports)

    @staticmethod
    def _ready_time(finish, p2p, s, m, d, pp) -> float | None:
        if d == "forward":
            if s == 0:
                return 0.0
            prev = finish.get((s - 1, m, "forward"))
            return None if prev is None else prev + p2p[s - 1]["send_activation"].time_s
        if s == pp - 1:
            return finish.get((s, m, "forward"))
        nxt = finish.get((s + 1, m, "backward"))
        return None if nxt is None else nxt + p2p[s + 1]["send_grad"].time_s
