"""Instruction options of every method, on one backend, for one job.

Each method record (kareus.plans.methods) names the clocks its instructions may run at and the
sources of its options at each clock:

- ``sequential``: the Megatron-LM execution (microbatch not split, every collective
  blocking), measured as the whole microbatch's ops back to back;
- ``default_overlap``: Nanobatching (two nanobatches, each collective launched as soon as
  its input is ready, with the backend's default SMs);
- ``searched``: each partition key's searched frontier at that clock, composed per
  instruction; where a key was never measured at a clock, its default-overlap setting
  stands in.

Every number comes from the Backend (docs/architecture.md); nothing here knows which
backend it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kareus.backends.base import Backend
from kareus.compose.instruction import InstructionOption, KeyOption, combine, pareto_front
from kareus.compose.pipeline import PipelineCosts
from kareus.core import DIRECTIONS, ZERO, Knobs, Measurement, PartitionSetting
from kareus.errors import SpecError
from kareus.plans.methods import Method
from kareus.workload.partition import PartitionSet, Step

KeyFrontiers = dict[str, dict[int, list[KeyOption]]]
"""Per partition key, per clock: Pareto options from the search."""

InstructionOptions = dict[tuple[int, str], list[InstructionOption]]
"""Per (stage, direction): the Pareto-sorted options, fastest first."""


def key_frontiers(samples_by_key: Mapping[str, Iterable[tuple[Knobs, Measurement]]]
                  ) -> KeyFrontiers:
    """From each key's measured (knobs, measurement) pairs to per-clock fronts."""
    out: KeyFrontiers = {}
    for key, samples in samples_by_key.items():
        by_freq: dict[int, list[KeyOption]] = {}
        for knobs, m in samples:
            by_freq.setdefault(knobs.freq_mhz, []).append(
                KeyOption(m.time_s, m.dynamic_energy_j, knobs.setting))
        out[key] = {f: pareto_front(v) for f, v in by_freq.items()}
    return out


class Composer:
    def __init__(self, ps: PartitionSet, backend: Backend, freqs_mhz: tuple[int, ...]
                 ) -> None:
        self.ps = ps
        self.backend = backend
        self.freqs = tuple(sorted(freqs_mhz, reverse=True))
        self.f_max = self.freqs[0]
        """The highest clock of the search list: the max-clock methods run there, and so
        do the pipeline transfers (a GPU profiled without clock changes has one clock)."""

    def ask_all(self, methods: Sequence[Method], fronts: KeyFrontiers) -> None:
        """Ask the backend for every number composing ``methods`` takes: a dry run lists
        them, a journaled backend measures and records them."""
        for method in methods:
            self.options(method, fronts)
        self.pipeline_costs()

    # Options ---------------------------------------------------------------------------

    def options(self, method: Method, fronts: KeyFrontiers | None = None
                ) -> InstructionOptions:
        if method.needs_search and fronts is None:
            raise SpecError(f"{method.name} needs the partitions' search results")
        freqs = (self.f_max,) if method.clocks == "max" else self.freqs
        out: InstructionOptions = {}
        for stage in range(self.ps.job.pp):
            for d in DIRECTIONS:
                opts: list[InstructionOption] = []
                for f in freqs:
                    for source in method.options:
                        if source == "searched":
                            assert fronts is not None
                            opts += self._composed(stage, d, f, fronts)
                        elif source == "default_overlap":
                            opts.append(self._default_overlap(stage, d, f))
                        else:
                            opts.append(self._sequential(stage, d, f))
                out[(stage, d)] = pareto_front(opts)
        return out

    def _default_overlap(self, stage: int, d: str, f: int) -> InstructionOption:
        """Every partition at the backend's default SMs, launched at its first slot."""
        b = self.backend
        total = ZERO
        for step in self.ps.layouts[(stage, d)].steps:
            if step.kind == "partition":
                assert step.key is not None
                p = self.ps[step.key]
                m = b.measure(p, Knobs(f, b.default_sms, p.slots[0].name))
            else:
                m = self._fixed(step, f)
            total = total + m
        return InstructionOption(total.time_s, total.dynamic_energy_j, f)

    def _fixed(self, step: Step, f: int) -> Measurement:
        """A step no knob of Kareus's tunes: ops back to back, or a weight gradient GEMM
        beside its input-gradient collective (NCCL's default channels, launched with it)."""
        b = self.backend
        if step.kind == "overlap":
            assert step.unit is not None
            return b.measure(step.unit, Knobs(f, b.default_sms, step.unit.slots[0].name))
        return b.measure_ops(step.ops, f)

    def _steps(self, steps: Sequence[Step], f: int) -> Measurement:
        total = ZERO
        for step in steps:
            total = total + self._fixed(step, f)
        return total

    def _sequential(self, stage: int, d: str, f: int) -> InstructionOption:
        """Megatron-LM: the whole microbatch, collectives blocking (but for the
        input-gradient all-reduce beside the weight gradient GEMM), default SMs."""
        pre, layers, post = self.ps.sequential_steps(stage, d)
        layer = self._steps(self.ps.sequential_layer[d], f)
        m = self._steps(pre, f) + layer.scaled(layers) + self._steps(post, f)
        return InstructionOption(m.time_s, m.dynamic_energy_j, f, sequential=True)

    def _composed(self, stage: int, d: str, f: int, fronts: KeyFrontiers
                  ) -> list[InstructionOption]:
        b = self.backend
        layout = self.ps.layouts[(stage, d)]
        t0 = e0 = 0.0
        for step in layout.steps:
            if step.kind != "partition":
                m = self._fixed(step, f)
                t0 += m.time_s
                e0 += m.dynamic_energy_j
        per_key = {}
        for key, count in layout.partition_counts().items():
            opts = fronts.get(key, {}).get(f)
            if not opts:
                p = self.ps[key]
                default = PartitionSetting(b.default_sms, p.slots[0].name)
                m = b.measure(p, Knobs.at(f, default))
                opts = [KeyOption(m.time_s, m.dynamic_energy_j, default)]
            per_key[key] = (count, opts)
        return combine(t0, e0, f, per_key)

    # Pipeline costs ----------------------------------------------------------------------

    def pipeline_costs(self) -> PipelineCosts:
        job, b = self.ps.job, self.backend
        act, grad, end, fixed = [], [], [], []
        for g in self.ps.graph.stages:
            # each transfer once, on the sender (kareus.plans.schedule: both ends wait for it)
            sends = {t.name: b.measure_ops((t,), self.f_max) for t in g.transfers}
            act.append(sends["send_activation"].time_s if g.send_activation else 0.0)
            grad.append(sends["send_grad"].time_s if g.send_grad else 0.0)
            e = b.measure_ops(g.iteration_end, self.f_max) if g.iteration_end else None
            end.append(e.time_s if e else 0.0)
            fixed.append(job.num_microbatches * sum(m.dynamic_energy_j for m in sends.values())
                         + (e.dynamic_energy_j if e else 0.0))
        return PipelineCosts(job.pp, job.num_microbatches, job.num_gpus, b.static_power_w,
                             tuple(act), tuple(grad), tuple(end), tuple(fixed))
