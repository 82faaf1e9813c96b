"""What a whole-iteration simulation (kareus.backends.emulator.iteration) reports: the
iteration's time and energy, per pipeline rank its busy time, energy and instructions, and
where each rank's time and energy go (`IterationResult.breakdown`: `kareus simulate
--breakdown`, docs/emulator.md "Where an iteration's time goes").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kareus import SCHEMA_VERSION
from kareus.backends.emulator.timeline import KERNEL_CLASSES


@dataclass
class StageReport:
    index: int
    busy_s: float = 0.0
    end_s: float = 0.0
    dynamic_energy_j: float = 0.0
    instructions: list[dict] = field(default_factory=list)
    classes: list[float] = field(default_factory=lambda: [0.0] * 2 * len(KERNEL_CLASSES))
    """Its instructions' time, then energy (static included), per `KERNEL_CLASSES`."""
    transfers_s: float = 0.0
    transfers_j: float = 0.0
    """The sends it waits for (`kareus.plans.schedule`: the sender waits for its send)."""
    iteration_end_s: float = 0.0
    iteration_end_j: float = 0.0


@dataclass
class IterationResult:
    plan: str
    time_s: float
    energy_j: float
    static_energy_j: float
    dynamic_energy_j: float
    num_gpus: int
    stages: list[StageReport]
    """One per pipeline rank (a rank is a stage unless the pipeline is interleaved)."""
    timed_windows: bool = False
    """Simulated with Megatron's timers around every instruction (`IterationSimulator.run`):
    each instruction's time is then its timer's window."""

    @property
    def mean_power_per_gpu_w(self) -> float:
        return self.energy_j / (self.num_gpus * self.time_s)

    def breakdown(self) -> list[dict[str, dict[str, float]]]:
        """Per stage, one GPU's iteration split by where its time goes: ``{class: {"time_s",
        "energy_j"}}``. Classes: `KERNEL_CLASSES` (compute kernels by kind, launch gaps,
        exposed collectives; hidden collectives are inside their compute kernel's time;
        dropout and unfused gradient accumulation, the training settings' ops),
        then ``transfers`` (its sends), ``iteration_end`` (data-parallel sync, optimizer
        step) and ``pipeline_wait`` (bubbles and waits for the neighbours' transfers, at
        static power).
        Times add up to ``time_s``; energies times GPUs per stage, over stages, to
        ``energy_j``."""
        static_w = self.static_energy_j / (self.num_gpus * self.time_s)
        n = len(KERNEL_CLASSES)
        out = []
        for s in self.stages:
            row = {c: {"time_s": s.classes[i], "energy_j": s.classes[n + i]}
                   for i, c in enumerate(KERNEL_CLASSES)}
            row["transfers"] = {"time_s": s.transfers_s, "energy_j": s.transfers_j}
            row["iteration_end"] = {"time_s": s.iteration_end_s, "energy_j": s.iteration_end_j}
            # the remainder: exact but for rounding (a stage with no waits, PP1: ~1e-15)
            wait_s = max(0.0, self.time_s - sum(v["time_s"] for v in row.values()))
            row["pipeline_wait"] = {"time_s": wait_s, "energy_j": wait_s * static_w}
            out.append(row)
        return out

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
