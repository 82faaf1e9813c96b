"""Instruction options of every method, on one backend, for one job.

Each method record (kareus.methods) names the clocks its instructions may run at and the
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

from collections.abc import Iterable, Mapping

from kareus.backends.base import Backend
from kareus.compose.instruction import InstructionOption, KeyOption, combine, pareto_front
from kareus.compose.pipeline import PipelineCosts
from kareus.core import DIRECTIONS, ZERO, Knobs, Measurement, PartitionSetting
from kareus.errors import SpecError
from kareus.methods import Method
from kareus.partition import PartitionSet
from kareus.workload.layer import backward_ops, forward_ops
from kareus.workload.ops import Collective, Op

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
        self.f_max = backend.gpu.max_freq_mhz
        self._megatron_layer: tuple[tuple[Op, ...], tuple[Op, ...]] | None = None

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
        total = ZERO  # summed from ZERO in step order: the same numbers as a simulation
        for step in self.ps.layouts[(stage, d)].steps:
            if step.kind == "partition":
                assert step.key is not None
                p = self.ps[step.key]
                m = b.measure(p, Knobs(f, b.default_sms, p.slots[0].name))
            else:
                m = b.measure_ops(step.ops, f)
            total = total + m
        return InstructionOption(total.time_s, total.dynamic_energy_j, f)

    def _sequential(self, stage: int, d: str, f: int) -> InstructionOption:
        """Megatron-LM: the whole microbatch, collectives blocking, default SMs."""
        job, b = self.ps.job, self.backend
        if self._megatron_layer is None:
            fwd_ops = forward_ops(job, sequences=job.micro_batch_size)
            bwd_ops = backward_ops(job, fwd_ops, sequences=job.micro_batch_size)
            self._megatron_layer = (tuple(fwd_ops), tuple(bwd_ops))
        fwd, bwd = self._megatron_layer
        g = self.ps.graph.stages[stage]
        if d == "forward":
            layer = b.measure_ops(fwd, f)
            pre, post = b.measure_ops(g.forward_pre, f), b.measure_ops(g.forward_post, f)
        else:
            layer = b.measure_ops((*fwd, *bwd) if job.recompute else bwd, f)
            pre, post = b.measure_ops(g.backward_pre, f), b.measure_ops(g.backward_post, f)
        m = pre + layer.scaled(g.num_layers) + post
        return InstructionOption(m.time_s, m.dynamic_energy_j, f, sequential=True)

    def _composed(self, stage: int, d: str, f: int, fronts: KeyFrontiers
                  ) -> list[InstructionOption]:
        b = self.backend
        layout = self.ps.layouts[(stage, d)]
        t0 = e0 = 0.0
        for step in layout.steps:
            if step.kind != "partition":
                m = b.measure_ops(step.ops, f)
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
            sends = {op.name: b.measure_ops((op,), self.f_max)
                     for op in (*g.forward_post, *g.backward_post)
                     if isinstance(op, Collective) and op.group == "pp"}
            act.append(sends["send_activation"].time_s if "send_activation" in sends else 0.0)
            grad.append(sends["send_grad"].time_s if "send_grad" in sends else 0.0)
            e = b.measure_ops(g.iteration_end, self.f_max) if g.iteration_end else None
            end.append(e.time_s if e else 0.0)
            fixed.append(job.num_microbatches * sum(m.dynamic_energy_j for m in sends.values())
                         + (e.dynamic_energy_j if e else 0.0))
        return PipelineCosts(job.pp, job.num_microbatches, job.num_gpus, b.static_power_w,
                             tuple(act), tuple(grad), tuple(end), tuple(fixed))
