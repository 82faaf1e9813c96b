"""Instruction options of every method, on one backend, for one job.

- ``megatron``: max clock, microbatches not split, every collective blocking.
- ``nanobatch``: max clock, overlap with NCCL-like defaults (32 CTAs, collective launched
  as soon as its input is ready).
- ``perseus``: the Megatron execution at every search clock; clocks planned per
  instruction on the pipeline.
- ``nanobatch_perseus`` (= ``kareus_no_sched``): default overlap at every search clock.
- ``kareus``: at every search clock, each partition key's searched frontier at that clock,
  composed per instruction; where a key was never measured at a clock, its default-overlap
  setting stands in. Where overlap does not pay for an instruction, its sequential
  (Megatron-style) options stay available, and the plan says so.
- ``kareus_no_freq``: Kareus's settings at max clock only.
"""

from __future__ import annotations

from kareus.backends.base import Knobs
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.compose.instruction import InstructionOption, KeyOption, combine, pareto_front
from kareus.compose.pipeline import PipelineCosts
from kareus.errors import SpecError
from kareus.execution import ExecutionPlan, PartitionChoice
from kareus.partition import PartitionSet

METHODS = ("megatron", "nanobatch", "perseus", "nanobatch_perseus", "kareus",
           "kareus_no_freq")
ALIASES = {"kareus_no_sched": "nanobatch_perseus"}
DIRECTIONS = ("forward", "backward")

KeyFrontiers = dict[str, dict[int, list[KeyOption]]]
"""Per partition key, per clock: Pareto options from the search."""


def key_frontiers(samples_by_key: dict[str, list[dict]]) -> KeyFrontiers:
    """From search samples (SearchResult.to_dict()["samples"]) to per-clock fronts."""
    out: KeyFrontiers = {}
    for key, samples in samples_by_key.items():
        by_freq: dict[int, list[KeyOption]] = {}
        for s in samples:
            by_freq.setdefault(int(s["freq_mhz"]), []).append(
                KeyOption(float(s["time_s"]), float(s["dynamic_energy_j"]),
                          PartitionChoice(int(s["sms"]), s["slot"])))
        out[key] = {f: pareto_front(v) for f, v in by_freq.items()}
    return out


class Composer:
    def __init__(self, ps: PartitionSet, simulator: IterationSimulator,
                 freqs_mhz: tuple[int, ...]) -> None:
        self.ps = ps
        self.sim = simulator
        self.backend = simulator.backend
        self.freqs = tuple(sorted(freqs_mhz, reverse=True))
        self.f_max = self.backend.gpu.max_freq_mhz
        self._default = ExecutionPlan("default", overlap=True, default_freq_mhz=self.f_max,
                                      default_slot="first")
        self._sequential = ExecutionPlan("sequential", overlap=False,
                                         default_freq_mhz=self.f_max)

    # Options ---------------------------------------------------------------------------

    def options(self, method: str, fronts: KeyFrontiers | None = None
                ) -> dict[tuple[int, str], list[InstructionOption]]:
        method = ALIASES.get(method, method)
        if method not in METHODS:
            raise SpecError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
        freqs = (self.f_max,) if method in ("megatron", "nanobatch", "kareus_no_freq") else (
            self.freqs)
        out = {}
        for stage in range(self.ps.job.pp):
            for d in DIRECTIONS:
                opts: list[InstructionOption] = []
                for f in freqs:
                    if method in ("megatron", "perseus"):
                        opts.append(self._measured(self._sequential, stage, d, f, seq=True))
                    elif method in ("nanobatch", "nanobatch_perseus"):
                        opts.append(self._measured(self._default, stage, d, f))
                    else:
                        if fronts is None:
                            raise SpecError(f"{method} needs the partitions' search results")
                        opts += self._composed(stage, d, f, fronts)
                        # the defaults and the sequential schedule are in Kareus's space too
                        opts.append(self._measured(self._default, stage, d, f))
                        opts.append(self._measured(self._sequential, stage, d, f, seq=True))
                out[(stage, d)] = pareto_front(opts)
        return out

    def _measured(self, plan: ExecutionPlan, stage: int, d: str, f: int, seq: bool = False
                  ) -> InstructionOption:
        m = self.sim.instruction(plan, stage, d, f)
        knobs = (("__sequential__", PartitionChoice(0, None)),) if seq else ()
        return InstructionOption(m.time_s, m.dynamic_energy_j, f, knobs)

    def _composed(self, stage: int, d: str, f: int, fronts: KeyFrontiers
                  ) -> list[InstructionOption]:
        layout = self.ps.layouts[(stage, d)]
        fixed = [s for s in layout.steps if s.kind != "partition"]
        t0 = e0 = 0.0
        for step in fixed:
            m = self.backend.run_ops(step.ops, f)
            t0 += m.time_s
            e0 += m.dynamic_energy_j
        per_key = {}
        for key, count in layout.partition_counts().items():
            opts = fronts.get(key, {}).get(f)
            if not opts:
                p = self.ps[key]
                default = Knobs(f, self.backend.default_sms, p.slots[0].name)
                m = self.backend.measure_exact(p, default)
                opts = [KeyOption(m.time_s, m.dynamic_energy_j,
                                  PartitionChoice(default.sms, default.slot))]
            per_key[key] = (count, opts)
        return combine(t0, e0, f, per_key)

    # Pipeline costs ----------------------------------------------------------------------

    def pipeline_costs(self) -> PipelineCosts:
        job, b = self.ps.job, self.backend
        stages = self.ps.graph.stages
        act, grad, end, fixed = [], [], [], []
        for g in stages:
            sends = {op.name: b.run_ops((op,), self.f_max)
                     for op in (*g.forward_post, *g.backward_post)
                     if op.is_collective and op.group == "pp"}
            act.append(sends["send_activation"].time_s if "send_activation" in sends else 0.0)
            grad.append(sends["send_grad"].time_s if "send_grad" in sends else 0.0)
            e = b.run_ops(g.iteration_end, self.f_max) if g.iteration_end else None
            end.append(e.time_s if e else 0.0)
            fixed.append(job.num_microbatches * sum(m.dynamic_energy_j for m in sends.values())
                         + (e.dynamic_energy_j if e else 0.0))
        return PipelineCosts(job.pp, job.num_microbatches, job.num_gpus, b.static_power_w,
                             tuple(act), tuple(grad), tuple(end), tuple(fixed))


def to_execution_plan(name: str, picks: dict[tuple[int, int, str], InstructionOption],
                      f_max: int, overlap: bool) -> ExecutionPlan:
    """An ExecutionPlan that runs each instruction with its chosen option."""
    freqs, knobs, sequential = {}, {}, set()
    for (s, m, d), opt in picks.items():
        freqs[(s, m, d)] = opt.freq_mhz
        kn = opt.knob_dict()
        if "__sequential__" in kn:
            sequential.add((s, m, d))
        elif kn:
            knobs[(s, m, d)] = kn
    return ExecutionPlan(name, overlap=overlap, default_freq_mhz=f_max,
                         instruction_freqs=freqs, instruction_knobs=knobs,
                         default_slot="first" if overlap else None,
                         sequential=frozenset(sequential) if overlap else frozenset())
