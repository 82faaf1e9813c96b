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
from kareus.backends.emulator.backend import EmulatorBackend
from kareus.core import ZERO, Knobs, Measurement
from kareus.execution import ExecutionPlan
from kareus.partition import PartitionSet, Step
from kareus.schedule import one_f_one_b, schedule


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
            d: dict[str, object] = {
                "stage": s.index, "busy_s": s.busy_s, "idle_s": self.time_s - s.busy_s,
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

    # One instruction ----------------------------------------------------------------------

    def instruction(self, plan: ExecutionPlan, stage: int, direction: str, freq_mhz: int,
                    microbatch: int | None = None) -> Measurement:
        """One instruction's cost; ``microbatch`` selects per-instruction knobs, if any."""
        if plan.runs_sequential(stage, direction, microbatch):
            key: tuple = ("seq", stage, direction, freq_mhz)
            compute = lambda: self._sequential(stage, direction, freq_mhz)  # noqa: E731
        else:
            iid = None if microbatch is None else (stage, microbatch, direction)
            knobs = self._knobs(plan, stage, direction, freq_mhz, iid)
            key = ("ovl", stage, direction, freq_mhz, knobs, plan.default_sms)
            compute = lambda: self._overlapped(stage, direction, freq_mhz, knobs,  # noqa: E731
                                               plan.default_sms)
        hit = self._instr.get(key)
        if hit is None:
            hit = self._instr[key] = compute()
        return hit

    def _knobs(self, plan, stage, direction, freq_mhz, iid) -> tuple:
        keys = self.ps.layouts[(stage, direction)].partition_counts()
        out = []
        for k in sorted(keys):
            c = plan.choice(k, freq_mhz, self.backend.default_sms, iid)
            out.append((k, c.sms, self.ps[k].resolve_slot(c.slot)))
        return tuple(out)

    def _overlapped(self, stage: int, direction: str, freq_mhz: int, knobs: tuple,
                    default_sms: int | None) -> Measurement:
        b = self.backend
        chosen = {k: (sms, slot) for k, sms, slot in knobs}
        total = ZERO
        for step in self.ps.layouts[(stage, direction)].steps:
            if step.kind == "partition":
                assert step.key is not None
                sms, slot = chosen[step.key]
                total = total + b.predict(self.ps[step.key], Knobs(freq_mhz, sms, slot))
            else:
                total = total + self._fixed(step, freq_mhz, default_sms)
        return total

    def _fixed(self, step: Step, freq_mhz: int, sms: int | None = None) -> Measurement:
        """Ops back to back; or a weight gradient GEMM beside its input-gradient collective,
        which is launched with the GEMM (Megatron-Core's allreduce_dgrad)."""
        b = self.backend
        if step.kind == "overlap":
            assert step.unit is not None
            unit = step.unit
            return b.predict(unit, Knobs(freq_mhz, sms or b.default_sms, unit.slots[0].name))
        return b.predict_ops(step.ops, freq_mhz, sms)

    def _sequential(self, stage: int, direction: str, freq_mhz: int) -> Measurement:
        """Megatron-LM: the whole microbatch, collectives blocking but for the input-gradient
        all-reduce beside the weight gradient GEMM, NCCL's default channels."""
        pre, layers, post = self.ps.sequential_steps(stage, direction)
        total = [ZERO, ZERO, ZERO]
        for i, steps in enumerate((pre, self.ps.sequential_layer[direction], post)):
            for step in steps:
                total[i] = total[i] + self._fixed(step, freq_mhz)
        return total[0] + total[1].scaled(layers) + total[2]

    # The pipeline ---------------------------------------------------------------------------

    def run(self, plan: ExecutionPlan, with_instructions: bool = False) -> IterationResult:
        job, b = self.job, self.backend
        pp, mbs = job.pp, job.num_microbatches
        stages = self.ps.graph.stages
        # Transfers between stages: both ends wait for each (kareus.schedule); their (small)
        # dynamic energy is counted once, on the sender.
        sends = {s.index: {t.name: b.predict_ops((t,), plan.default_freq_mhz)
                           for t in s.transfers} for s in stages}
        ends = [b.predict_ops(g.iteration_end, plan.default_freq_mhz) if g.iteration_end else ZERO
                for g in stages]
        costs: dict = {}

        def duration(iid) -> float:
            s, m, d = iid
            costs[iid] = self.instruction(plan, s, d, plan.freq(s, m, d), m)
            return costs[iid].time_s

        def send(s: int, name: str) -> float:
            m = sends[s].get(name)
            return m.time_s if m is not None else 0.0

        timing = schedule(pp, mbs, duration,
                          [send(s, "send_activation") for s in range(pp)],
                          [send(s, "send_grad") for s in range(pp)],
                          [e.time_s for e in ends])
        reports = [StageReport(s) for s in range(pp)]
        for s in range(pp):
            rep = reports[s]
            for m, d in one_f_one_b(pp, mbs, s):
                cost = costs[(s, m, d)]
                rep.busy_s += cost.time_s
                rep.dynamic_energy_j += cost.dynamic_energy_j
                if with_instructions:
                    rep.instructions.append({
                        "microbatch": m, "direction": d, "freq_mhz": plan.freq(s, m, d),
                        "start_s": timing.start[(s, m, d)], "time_s": cost.time_s,
                        "dynamic_energy_j": cost.dynamic_energy_j})
            for sent in sends[s].values():
                rep.dynamic_energy_j += sent.dynamic_energy_j * mbs
            rep.busy_s += ends[s].time_s
            rep.dynamic_energy_j += ends[s].dynamic_energy_j
            rep.end_s = timing.stage_end[s]
        time_s = timing.iteration_s
        gpus_per_stage = job.num_gpus // pp
        dynamic = gpus_per_stage * sum(r.dynamic_energy_j for r in reports)
        static = job.num_gpus * time_s * b.static_power_w
        return IterationResult(plan.name, time_s, dynamic + static, static, dynamic,
                               job.num_gpus, reports)
