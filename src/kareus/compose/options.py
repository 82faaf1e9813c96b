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
backend it is. The composer first writes every option down as a recipe of needs
(kareus.compose.recipe), so what composing asks for is known before anything is measured
(`Composer.needs`); each need is then answered once, journal first where the backend is a
journal-first one, and every recipe is evaluated once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from kareus.backends.base import Backend, JournalFirst
from kareus.backends.needs import Need, TransientUnmeasurable, measure_need
from kareus.compose.instruction import InstructionOption, KeyOption, pareto_front
from kareus.compose.pipeline import PipelineCosts
from kareus.compose.recipe import Combined, KeyChoice, Recipe, Scaled, Total, Whole
from kareus.compose.transient import Transient
from kareus.core import DIRECTIONS, Knobs, Measurement, PartitionSetting
from kareus.core.registry import Registry
from kareus.errors import SpecError
from kareus.plans.methods import DEFAULT_OVERLAP, SEARCHED, SEQUENTIAL, Method
from kareus.workload.partition import PartitionSet, Step

KeyFrontiers = dict[str, dict[int, list[KeyOption]]]
"""Per partition key, per clock: Pareto options from the search."""

InstructionOptions = dict[tuple[int, str], list[InstructionOption]]
"""Per (stage, direction): the Pareto-sorted options, fastest first."""


SourceRecipe = Callable[["Composer", int, str, int, "KeyFrontiers | None"], Recipe]
"""An option source's recipe of one instruction (stage, direction) at one clock."""

SOURCE_RECIPES: Registry[SourceRecipe] = Registry("option source")
"""Per option source (kareus.plans.methods.OPTION_SOURCES, by its name): how composition
builds its options. A method names its sources; composing looks each one up here."""


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
    """The instruction options and pipeline costs of a job's methods on one backend."""

    def __init__(self, ps: PartitionSet, backend: Backend, freqs_mhz: tuple[int, ...]
                 ) -> None:
        self.ps = ps
        self.backend = backend
        self.freqs = tuple(sorted(freqs_mhz, reverse=True))
        self.f_max = self.freqs[0]
        """The highest clock of the search list: the max-clock methods run there, and so
        do the pipeline transfers (a GPU profiled without clock changes has one clock)."""
        self._recipes: dict[str, tuple[KeyFrontiers | None,
                                       dict[tuple[int, str], list[Recipe]]]] = {}
        self._answers: dict[Need, Measurement] = {}
        self.transient_note: str | None = None
        """Why no wait transient is charged (the backend cannot measure them), if so."""

    # What composing asks for -------------------------------------------------------------

    def needs(self, methods: Sequence[Method], fronts: KeyFrontiers | None) -> list[Need]:
        """Every number composing ``methods`` (and the pipeline) takes, in the order it is
        first used, once each. Nothing is measured."""
        out: dict[Need, None] = {}
        for method in methods:
            for recipes in self._method_recipes(method, fronts).values():
                for r in recipes:
                    out.update(dict.fromkeys(r.needs()))
        out.update(dict.fromkeys(self._pipeline_needs()))
        return list(out)

    def answer_all(self, needs: Sequence[Need]) -> None:
        """Fetch ``needs`` from the backend now, in this order (a profile measures them)."""
        for need in needs:
            self._answer(need)

    # Options ---------------------------------------------------------------------------

    def options(self, method: Method, fronts: KeyFrontiers | None = None
                ) -> InstructionOptions:
        recipes = self._method_recipes(method, fronts)
        self.answer_all([n for rs in recipes.values() for r in rs for n in r.needs()])
        return {sd: [self._with_transient(sd, o) for o in pareto_front(
            [o for r in rs for o in r.options(self._answers)])]
            for sd, rs in recipes.items()}

    def _with_transient(self, sd: tuple[int, str], o: InstructionOption
                        ) -> InstructionOption:
        """``o`` with its wait transient (kareus.compose.transient), measured on demand
        when a plan's evaluation first asks for it."""
        return replace(o, transient=Transient(
            self._answer_transient, sd[0], sd[1], o.freq_mhz, self.backend.default_sms,
            o.sequential, o.settings))

    def _answer_transient(self, need: Need) -> Measurement | None:
        if self.transient_note is not None:
            return None
        try:
            return self._answer(need)
        except TransientUnmeasurable as exc:
            self.transient_note = str(exc)
            return None

    def _method_recipes(self, method: Method, fronts: KeyFrontiers | None
                        ) -> dict[tuple[int, str], list[Recipe]]:
        searched = method.needs_search
        hit = self._recipes.get(method.name)
        # a searched method's recipes hold the partition fronts they were built from: a
        # profile lists its needs before measuring the steps, which can add settings to
        # the fronts (each partition at its default SMs), and composes after
        if hit is not None and (not searched or hit[0] == fronts):
            return hit[1]
        method.check_runs_on(self.ps.job)
        if method.needs_search and fronts is None:
            raise SpecError(f"{method.name} needs the partitions' search results")
        freqs = (self.f_max,) if method.clocks == "max" else self.freqs
        out: dict[tuple[int, str], list[Recipe]] = {}
        for stage in range(self.ps.job.virtual_stages):
            for d in DIRECTIONS:
                recipes: list[Recipe] = []
                for f in freqs:
                    for source in method.options:
                        recipes.append(SOURCE_RECIPES.get(source)(self, stage, d, f, fronts))
                out[(stage, d)] = recipes
        self._recipes[method.name] = (fronts if searched else None, out)
        return out

    def _default_overlap(self, stage: int, d: str, f: int) -> Whole:
        """Every partition at the backend's default SMs, launched at its first slot."""
        sms = self.backend.default_sms
        parts: list[Need] = []
        for step in self.ps.layouts[(stage, d)].steps:
            if step.kind == "partition":
                assert step.key is not None
                p = self.ps[step.key]
                parts.append(Need.of_partition(p, Knobs(f, sms, p.slots[0].name)))
            else:
                parts.append(self._fixed(step, f))
        return Whole(f, Total(tuple(parts)))

    def _fixed(self, step: Step, f: int) -> Need:
        """A step no knob of Kareus's tunes: ops back to back, or a weight gradient GEMM
        beside its input-gradient collective (NCCL's default channels, launched with it)."""
        sms = self.backend.default_sms
        if step.kind == "overlap":
            assert step.unit is not None
            return Need.of_partition(step.unit, Knobs(f, sms, step.unit.slots[0].name))
        return Need.of_ops(step.ops, f, sms)

    def _steps(self, steps: Sequence[Step], f: int) -> Total:
        return Total(tuple(self._fixed(step, f) for step in steps))

    def _sequential(self, stage: int, d: str, f: int) -> Whole:
        """Megatron-LM: the whole microbatch, collectives blocking (but for the
        input-gradient all-reduce beside the weight gradient GEMM), default SMs."""
        pre, layers, post = self.ps.sequential_steps(stage, d)
        layer = Scaled(self._steps(self.ps.sequential_layer[d], f), layers)
        total = Total((self._steps(pre, f), layer, self._steps(post, f)), from_zero=False)
        return Whole(f, total, sequential=True)

    def _composed(self, stage: int, d: str, f: int, fronts: KeyFrontiers) -> Combined:
        layout = self.ps.layouts[(stage, d)]
        fixed = tuple(self._fixed(step, f) for step in layout.steps
                      if step.kind != "partition")
        keys: dict[str, KeyChoice] = {}
        for key, count in layout.partition_counts().items():
            opts = fronts.get(key, {}).get(f)
            if opts:
                keys[key] = KeyChoice(count, tuple(opts))
                continue
            p = self.ps[key]
            default = PartitionSetting(self.backend.default_sms, p.slots[0].name)
            keys[key] = KeyChoice(count, fallback=Need.of_partition(p, Knobs.at(f, default)),
                                  default=default)
        return Combined(f, fixed, keys)

    # Pipeline costs ----------------------------------------------------------------------

    def _pipeline_needs(self) -> list[Need]:
        sms = self.backend.default_sms
        out: list[Need] = []
        for g in self.ps.graph.stages:
            out += [Need.of_ops((t,), self.f_max, sms) for t in g.transfers]
            if g.iteration_end:
                out.append(Need.of_ops(g.iteration_end, self.f_max, sms))
        return out

    def pipeline_costs(self) -> PipelineCosts:
        job, b = self.ps.job, self.backend
        self.answer_all(self._pipeline_needs())
        sms = b.default_sms
        act, grad, end, fixed = [], [], [], []
        for g in self.ps.graph.stages:
            # each transfer once, on the sender (kareus.plans.schedule: both ends wait)
            sends = {t.name: self._answers[Need.of_ops((t,), self.f_max, sms)]
                     for t in g.transfers}
            act.append(sends["send_activation"].time_s if g.send_activation else 0.0)
            grad.append(sends["send_grad"].time_s if g.send_grad else 0.0)
            e = (self._answers[Need.of_ops(g.iteration_end, self.f_max, sms)]
                 if g.iteration_end else None)
            end.append(e.time_s if e else 0.0)
            fixed.append(job.num_microbatches * sum(m.dynamic_energy_j for m in sends.values())
                         + (e.dynamic_energy_j if e else 0.0))
        # per (virtual) stage: graph.stages has pp x virtual_pipeline of them
        return PipelineCosts(job.pp, job.num_microbatches, job.num_gpus, b.static_power_w,
                             tuple(act), tuple(grad), tuple(end), tuple(fixed),
                             vp=job.virtual_pipeline)

    def _answer(self, need: Need) -> Measurement:
        hit = self._answers.get(need)
        if hit is None:
            b = self.backend
            hit = (b.answer(need).measurement if isinstance(b, JournalFirst)
                   else measure_need(b, need))
            self._answers[need] = hit
        return hit


def _searched(c: Composer, stage: int, d: str, f: int, fronts: KeyFrontiers | None
              ) -> Recipe:
    assert fronts is not None  # a method that needs search is refused without its fronts
    return c._composed(stage, d, f, fronts)


SOURCE_RECIPES.add(lambda c, stage, d, f, _: c._sequential(stage, d, f), SEQUENTIAL.name)
SOURCE_RECIPES.add(lambda c, stage, d, f, _: c._default_overlap(stage, d, f),
                   DEFAULT_OVERLAP.name)
SOURCE_RECIPES.add(_searched, SEARCHED.name)
