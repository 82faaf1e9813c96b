"""The method registry: one record per way of running training that Kareus plans or
compares against. Composition, optimize, metrics, reports, figures and compare iterate
over it; adding a method is adding one record (`register`).

How each baseline executes (docs/composition.md): Megatron-LM runs the whole microbatch at
max clock with every collective on the compute stream's path; Nanobatching splits each
microbatch in two and launches each collective as soon as its input is ready, with NCCL's
default thread blocks; Perseus is Megatron-LM's execution with one clock per pipeline
instruction; Nanobatching + Perseus is the default overlap with per-instruction clocks;
Kareus chooses every partition's collective SMs and launch slot per clock, and keeps the
default-overlap and sequential executions of each instruction as options.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from kareus.core import LAUNCH_FIRST
from kareus.core.registry import Registry
from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.plans.execution import ExecutionPlan


@dataclass(frozen=True)
class OptionSource:
    """How an instruction option is built (kareus.compose.options builds each source's
    options, looked up by its name), and what it asks of a job and of a profile."""

    name: str
    summary: str
    splits_microbatch: bool
    """Its options split each microbatch into two nanobatches."""
    needs_search: bool = False
    """Its options are composed from the partitions' searched frontiers."""


OPTION_SOURCES: Registry[OptionSource] = Registry("option source", lambda s: s.name)
SEQUENTIAL = OPTION_SOURCES.register(OptionSource(
    "sequential", "the Megatron-style execution (microbatch not split, collectives "
    "blocking)", splits_microbatch=False))
DEFAULT_OVERLAP = OPTION_SOURCES.register(OptionSource(
    "default_overlap", "the default overlap (Nanobatching)", splits_microbatch=True))
SEARCHED = OPTION_SOURCES.register(OptionSource(
    "searched", "the partitions' searched frontiers composed per instruction",
    splits_microbatch=True, needs_search=True))

Role = Literal["throughput_baseline", "iso_reference", "proposed"]
"""What code asks a method for instead of its name: the baseline of max-throughput metrics,
the reference of the iso-time and iso-energy metrics, the method Kareus proposes."""

ClockSet = Literal["max", "search"]
"""The clocks an instruction may run at: the GPU's max clock, or every search clock."""


@dataclass(frozen=True)
class Method:
    name: str
    display_name: str
    clocks: ClockSet
    options: tuple[str, ...]
    """Its option sources (`OPTION_SOURCES` names)."""
    overlap: bool
    """Its plans split microbatches and overlap collectives (except instructions an option
    marks sequential)."""
    color: str
    marker: str
    aliases: tuple[str, ...] = ()
    merges: tuple[str, ...] = ()
    """Methods whose option sets are contained in this one's (per instruction, per clock):
    their solved plans are plans of this method too, and its frontier keeps the best."""
    fixed_plan: bool = False
    """It runs one fixed plan at one clock (no search, no clock planning): `kareus
    simulate` can run it."""
    role: Role | None = None
    """The part it plays in metrics and reports (at most one method per role)."""

    @property
    def sources(self) -> tuple[OptionSource, ...]:
        return tuple(OPTION_SOURCES.get(s) for s in self.options)

    @property
    def needs_search(self) -> bool:
        return any(s.needs_search for s in self.sources)

    @property
    def splits_microbatch(self) -> bool:
        """Some of its options split each microbatch into two nanobatches (the default
        overlap, the searched partitions): it needs a job with an even micro-batch size
        (`JobSpec.splits_into_nanobatches`). Megatron-LM and Perseus run any size."""
        return any(s.splits_microbatch for s in self.sources)

    def runs_on(self, job: JobSpec) -> bool:
        """The method can run ``job`` (`left_out_line` says why one cannot)."""
        return job.splits_into_nanobatches or not self.splits_microbatch

    def check_runs_on(self, job: JobSpec) -> None:
        """SpecError, in one line, when the method cannot run ``job``."""
        if not self.runs_on(job):
            raise SpecError(f"{self.name} {_SPLITS} {job.nanobatch_requirement}; "
                            f"{_runnable_text(job)}")

    def baseline_plan(self, job: JobSpec, freq_mhz: int | None = None) -> ExecutionPlan:
        """The fixed plan of a method that has one, at max clock unless ``freq_mhz``."""
        if not self.fixed_plan:
            raise SpecError(f"{self.name} has no fixed plan; fixed: "
                            f"{', '.join(m.name for m in all_methods() if m.fixed_plan)}")
        self.check_runs_on(job)
        gpu = job.gpu_spec
        f = gpu.check_freq(freq_mhz) if freq_mhz is not None else gpu.max_freq_mhz
        return ExecutionPlan(self.name, overlap=self.overlap, default_freq_mhz=f,
                             default_slot=LAUNCH_FIRST if self.overlap else None)


METHODS: Registry[Method] = Registry("method", lambda m: m.name)
"""Every method, in registration order (a method follows those it merges)."""


def register(method: Method) -> Method:
    taken = set(METHODS.all_names())
    clash = {method.name, *method.aliases} & taken
    if clash:
        raise SpecError(f"method name(s) already registered: {', '.join(sorted(clash))}")
    unknown = [m for m in method.merges if m not in METHODS]
    if unknown:
        raise SpecError(f"{method.name} merges unregistered methods: {', '.join(unknown)}")
    if method.role is not None and any(m.role == method.role for m in all_methods()):
        raise SpecError(f"a method has the role {method.role} already")
    for source in method.options:
        OPTION_SOURCES.get(source)
    return METHODS.add(method, aliases=method.aliases)


def unregister(name: str) -> None:
    METHODS.remove(name)


@contextmanager
def registered(method: Method) -> Iterator[Method]:
    """``method`` is registered inside the block (tests, experiments)."""
    register(method)
    try:
        yield method
    finally:
        unregister(method.name)


def all_methods() -> tuple[Method, ...]:
    """Every registered method, in registration order (a method follows those it merges)."""
    return METHODS.values()


def method_names() -> tuple[str, ...]:
    return METHODS.names()


def by_role(role: Role) -> Method:
    """The method playing ``role``."""
    for m in all_methods():
        if m.role == role:
            return m
    raise SpecError(f"no method has the role {role}")


def _normal(text: str) -> str:
    return "".join(c for c in text.lower() if c.isalnum())


def get_method(name: str) -> Method:
    """A method by name, alias or display name, case, spaces and punctuation ignored
    ("Nanobatching+Perseus", "kareus_no_sched"); one clear error for an unknown one."""
    found = METHODS.find(name)
    if found is not None:
        return found
    wanted = _normal(name)
    for m in all_methods():
        if wanted in {_normal(n) for n in (m.name, m.display_name, *m.aliases)}:
            return m
    return METHODS.get(name)


def display_name(name: str) -> str:
    m = METHODS.find(name)
    return m.display_name if m is not None else name


register(Method("megatron", "Megatron-LM", clocks="max", options=("sequential",),
                overlap=False, color="#7f7f7f", marker="s", fixed_plan=True,
                role="throughput_baseline"))
register(Method("nanobatch", "Nanobatching", clocks="max", options=("default_overlap",),
                overlap=True, color="#bcbd22", marker="D", fixed_plan=True))
register(Method("perseus", "Perseus", clocks="search", options=("sequential",),
                overlap=False, color="#1f77b4", marker="o", role="iso_reference"))
register(Method("nanobatch_perseus", "Nanobatching + Perseus", clocks="search",
                options=("default_overlap",), overlap=True, color="#9467bd", marker="v",
                aliases=("kareus_no_sched",)))
register(Method("kareus", "Kareus", clocks="search",
                options=("searched", "default_overlap", "sequential"), overlap=True,
                color="#d62728", marker="*", merges=("perseus", "nanobatch_perseus"),
                role="proposed"))
register(Method("kareus_no_freq", "Kareus, max clock only", clocks="max",
                options=("searched", "default_overlap", "sequential"), overlap=True,
                color="#ff7f0e", marker="^"))


ISO_REFERENCE = by_role("iso_reference").name
"""The paper's iso-time and iso-energy metrics compare against this method."""
THROUGHPUT_BASELINE = by_role("throughput_baseline").name
"""Max-throughput metrics compare against this method."""
PROPOSED = by_role("proposed").name
"""The method Kareus proposes: reports' headline, `plan`'s and `replan`'s default."""


_SPLITS = "splits each microbatch into two nanobatches and needs"
_SPLIT = "split each microbatch into two nanobatches and need"


def _runnable_text(job: JobSpec) -> str:
    names = [m.name for m in all_methods() if m.runs_on(job)]
    return f"this job runs with {', '.join(names)}" if names else "no method runs this job"


def runnable_methods(methods: Sequence[Method], job: JobSpec
                     ) -> tuple[tuple[Method, ...], tuple[Method, ...]]:
    """``methods`` split into those that can run ``job`` and those left out."""
    return (tuple(m for m in methods if m.runs_on(job)),
            tuple(m for m in methods if not m.runs_on(job)))


def left_out_line(left_out: Sequence[Method], job: JobSpec) -> str:
    """One line naming the methods left out for ``job`` and why ("" when none is)."""
    if not left_out:
        return ""
    why = f"they {_SPLIT}" if len(left_out) > 1 else f"it {_SPLITS}"
    return (f"left out {', '.join(m.name for m in left_out)}: {why} "
            f"{job.nanobatch_requirement}")


def left_out_reasons(left_out: Sequence[Method], job: JobSpec) -> dict[str, str]:
    """Per method left out for ``job``: why (result.json's ``left_out``)."""
    return {m.name: f"splitting each microbatch into two nanobatches needs "
                    f"{job.nanobatch_requirement}" for m in left_out}


def baseline_plan(method: str, job: JobSpec, freq_mhz: int | None = None) -> ExecutionPlan:
    """The fixed plan of ``method`` (by name or alias)."""
    return get_method(method).baseline_plan(job, freq_mhz)
