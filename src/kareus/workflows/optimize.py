"""`kareus optimize`: search every partition, compose every method's frontier, validate the
plans, write the result directory (kareus.results.resultdir).

An `OptimizeRequest` says what to optimize and how, once (the CLI builds it);
`prepare_optimize` checks everything in it that can fail on bad input, before any work
starts, and returns an `OptimizeRun`, whose `run` calls the command's steps in order on
the workload built once: measure (search, or profile), compose, validate, the
power-limited baseline, write. Each step's machinery lives where its concept does: the
searches and profiling in kareus.profiling, composing in kareus.compose (from a journal
alone: kareus.workflows.measured), the plans and their validation in
kareus.results.validation, the baseline in kareus.workflows.power_limited, the result
directory in kareus.results.resultdir.

Where the numbers come from is the backend spec's to say (its capabilities): one with a
cost model is searched and validated by simulation; one that profiles first (real GPUs)
measures everything into the result's journal, then composes from it; ``measurements``
composes from a journal alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kareus.backends.base import PlanSimulator
from kareus.backends.journaled import JournaledBackend
from kareus.backends.measuring import open_measuring
from kareus.backends.registry import (
    BackendSpec,
    backend_kind,
    cost_model_kinds,
    default_spec,
    numbers_from,
    replay_spec,
)
from kareus.backends.replay import open_replay
from kareus.compose.methods import method_frontiers
from kareus.compose.options import Composer, key_frontiers
from kareus.compose.pipeline import SOLVERS, Solver
from kareus.core.lock import Lock
from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.plans.methods import (
    THROUGHPUT_BASELINE,
    Method,
    all_methods,
    get_method,
    left_out_line,
    left_out_reasons,
    runnable_methods,
)
from kareus.plans.metrics import method_metrics
from kareus.plans.plan import Plan
from kareus.profiling.executors import ExecutorSpec, TaskProgress, make_tasks, run_tasks
from kareus.profiling.profile import DEFAULT_PRIOR, check_profile, profile, torchrun_rank
from kareus.results.result import OptimizeResult
from kareus.results.resultdir import ResultDir
from kareus.results.validation import Solved, default_validation_sample, frontier_plans
from kareus.search.loop import SearchConfig, SearchResult
from kareus.workflows.measured import compose_from_journal, measured_composer, refuse_missing
from kareus.workflows.power_limited import LimitedRun, iso_power, power_limited_megatron
from kareus.workload.workload import Workload

Say = Callable[[str], None]


@dataclass(frozen=True)
class OptimizeRequest:
    """What to optimize and how: everything `kareus optimize` (or a preset of `kareus
    compare`) asks, in one value; `check_optimize` checks it."""

    job: JobSpec | Workload
    """The workload, or a job to build it from."""
    out_dir: str
    config: SearchConfig
    backend: BackendSpec | None = None
    """Where the numbers come from (default: `default_spec`, the emulator)."""
    executor: ExecutorSpec | None = None
    """Where the searches run (default: local processes)."""
    methods: Sequence[str] | None = None
    """The methods asked for (default: all)."""
    force: bool = False
    """Replace the result of another job in ``out_dir`` (its measurements stay in the
    journal)."""
    measurements: str | None = None
    """Compose from that journal alone (no search, no emulator number)."""
    fill_missing: str | None = None
    """With ``measurements``: a backend with a cost model fills what the journal lacks
    (the result says which numbers)."""
    solver: str = "lp"
    """The pipeline solver (kareus.compose.pipeline.solve_frontier)."""
    validate_plans: int | None = None
    """Per method, how many frontier plans the emulator simulates (a stratified sample,
    kareus.results.validation); None: `default_validation_sample` of the pipeline's size."""
    within: str | None = None
    """The compare directory whose preset result ``out_dir`` is (`ResultDir` ``within``);
    None: a directory of its own."""


@dataclass
class Measured:
    """The measure step's outcome: the searches run now, or the journal (and the backend
    identity in it) to compose from alone."""

    searches: list[SearchResult] = field(default_factory=list)
    journal: tuple[str, str | None] | None = None


@dataclass
class Composed:
    """The compose step's outcome: each method's frontier, and where its numbers came
    from (``sources``: a journal; ``simulator``: the backend validates by simulation)."""

    searches: list[SearchResult]
    composer: Composer
    solved: Solved
    sources: dict[str, Any] | None = None
    simulator: PlanSimulator | None = None


@dataclass
class OptimizeRun:
    """An optimize whose request was checked (`check_optimize`): `run` does the work."""

    request: OptimizeRequest
    workload: Workload
    backend: BackendSpec
    """The request's backend, or the journal's replay (``measurements``)."""
    executor: ExecutorSpec
    methods: tuple[Method, ...] = ()
    """The methods that run (those that can run the job; chosen by `check`)."""
    left_out: tuple[Method, ...] = ()
    """Methods asked for that cannot run the job (`Method.runs_on`)."""
    left_out_line: str = ""
    """One line naming the methods left out and why ("" when none is)."""
    left_out_reasons: dict[str, str] = field(default_factory=dict)
    """Per method left out, why (the result's ``left_out``)."""
    fill: BackendSpec | None = None
    composer: Composer | None = None
    """Composing from a journal alone: the composer that listed the journal's lacks while
    the inputs were checked, and composes now (it is not built twice)."""
    timings: dict[str, float] = field(default_factory=dict)
    lock: Lock | None = None
    """The result directory's lock, taken by `prepare_optimize` once every input was
    checked, released when `run` ends (None on a rank that only measures)."""

    @property
    def out_dir(self) -> str:
        return self.request.out_dir

    @property
    def config(self) -> SearchConfig:
        return self.request.config

    @property
    def solver(self) -> Solver:
        return self.request.solver  # type: ignore[return-value]  # checked: SOLVERS

    def result_dir(self) -> ResultDir:
        return ResultDir(self.out_dir, within=self.request.within)

    @property
    def measures_only(self) -> bool:
        """A torchrun rank other than 0: it measures in lockstep with rank 0, which
        journals, composes and writes the result."""
        return self.backend.capabilities.process_per_gpu and torchrun_rank() != 0

    def check(self) -> None:
        """The backend, the executor, the result directory, the search settings or the
        journal, and the methods that can run the job (`check_optimize`)."""
        if self.measures_only:
            check_profile(self.workload, self.backend, self.config, with_prior=True)
            self._choose_methods()  # it profiles with DEFAULT_PRIOR, as `kareus profile`
            return
        self.executor.check()
        self.result_dir().check_writable(self.workload.job.id, self.request.force)
        workload, spec, fill_missing = self.workload, self.backend, self.request.fill_missing
        source = spec.journal_source()
        if fill_missing is not None:
            if source is None:
                raise SpecError("--fill-missing needs --measurements JOURNAL")
            if fill_missing not in cost_model_kinds():
                raise SpecError(f"--fill-missing takes {', '.join(cost_model_kinds())}, "
                                f"got {fill_missing!r}")
            self.fill = backend_kind(fill_missing)()
        if source is None:
            spec.check(workload.job)
            for key in workload.keys:
                self.config.check(
                    workload[key].knob_space_size(len(workload.job.freqs_mhz)), False)
            self._choose_methods()
            return
        if not os.path.isfile(source[0]):
            raise SpecError(f"journal not found: {source[0]}")
        self._choose_methods()
        # the journal describes one backend of this job's GPU (or names the one to use),
        # and holds everything composing needs, unless the user opted in to filling it
        if self.fill is None:
            self.composer = measured_composer(workload, *source)
            refuse_missing(source[0], self.composer, self.methods)
        else:
            open_replay(source[0], workload.job, source[1])

    def _choose_methods(self) -> None:
        """The methods asked for that can run the job, and why the others cannot (said
        once: the run prints it, the result keeps it); none left is an error."""
        job, asked = self.workload.job, self.request.methods
        self.methods, self.left_out = runnable_methods(
            all_methods() if asked is None else tuple(get_method(m) for m in asked), job)
        self.left_out_line = left_out_line(self.left_out, job)
        if not self.methods:
            raise SpecError(f"no method to run: {self.left_out_line}")
        self.left_out_reasons = left_out_reasons(self.left_out, job)

    def run(self, progress: TaskProgress | None = None, stage: Say | None = None
            ) -> OptimizeResult | None:
        """Measure, compose, validate, write ``out_dir``; None on a rank that only
        measures."""
        rd = self.result_dir()
        if self.measures_only:
            rd.path.mkdir(parents=True, exist_ok=True)
            profile(self.workload, str(rd.journal), self.backend, self.config,
                    prior=DEFAULT_PRIOR)
            return None
        held = self.lock
        if held is None or not held.held:  # not prepared here, or run again
            held = self.lock = rd.lock(self.workload.job.id, self.request.force)
        try:
            rd.prepare()
            say = stage or (lambda _msg: None)
            composed = self._compose(rd, self._measure(rd, progress, say), say)
            plans, worst, per_method = self._validate(composed)
            return self._write(rd, composed, plans, worst, per_method,
                               self._power_limited(composed, plans))
        finally:
            held.release()

    def _measure(self, rd: ResultDir, progress: TaskProgress | None, say: Say) -> Measured:
        """Step 1, the numbers: the journal given; or everything profiled into the result's
        journal first (a backend that profiles first: the searches at optimize's budget,
        informed by the emulator like `kareus profile`'s, the steps fitted through it); or
        every partition searched now."""
        source = self.backend.journal_source()
        if self.backend.capabilities.profiles_first:
            t0 = time.perf_counter()
            say(f"profiling every partition and composition step on {self.backend.name}")
            profiled = profile(self.workload, str(rd.journal), self.backend, self.config,
                               progress=progress, prior=DEFAULT_PRIOR)
            self.timings["profile"] = time.perf_counter() - t0
            source = (str(rd.journal), profiled.identity)  # not another backend's
        if source is not None:
            return Measured(journal=source)
        t0 = time.perf_counter()
        searches: list[SearchResult] = []
        if any(m.needs_search for m in self.methods):
            wl = self.workload
            say(f"searching {len(wl.keys)} partitions")
            tasks = make_tasks(wl, wl.keys, self.config, self.backend, str(rd.journal))
            searches = run_tasks(tasks, self.executor, progress, workload=wl)
        self.timings["search"] = time.perf_counter() - t0
        return Measured(searches=searches)

    def _compose(self, rd: ResultDir, measured: Measured, say: Say) -> Composed:
        """Step 2, each method's frontier: from the journal alone, or from the searches'
        frontiers with the backend measuring what composing asks (and simulating the
        plans, for validation)."""
        t0 = time.perf_counter()
        if measured.journal is not None:
            searches, composer, solved, sources = compose_from_journal(
                self.workload, *measured.journal, self.fill, self.composer, self.methods,
                self.solver, say)
            self.timings["compose"] = time.perf_counter() - t0
            return Composed(searches, composer, solved, sources)
        fronts = key_frontiers({r.partition: [(s.knobs, s.measurement) for s in r.samples]
                                for r in measured.searches})
        with ExitStack() as stack:
            b = _measuring(stack, self.backend, self.workload, rd.journal)
            composer = Composer(self.workload.partitions, b, self.workload.job.freqs_mhz)
            solved = method_frontiers(composer, self.methods, fronts, say, self.solver)
            composer.pipeline_costs()  # answered already: nothing is measured after this
        self.timings["compose"] = time.perf_counter() - t0
        return Composed(measured.searches, composer, solved,
                        simulator=self.backend.plan_simulator(self.workload))

    def _validate(self, composed: Composed
                  ) -> tuple[dict[str, list[Plan]], float | None, int]:
        """Step 3, the plans of every frontier, a sample of them simulated where the
        backend can: (plans per method, the largest relative error, plans per method
        simulated)."""
        t0 = time.perf_counter()
        costs = composed.composer.pipeline_costs()
        per_method = (self.request.validate_plans if self.request.validate_plans is not None
                      else default_validation_sample(costs))
        simulated: dict[str, float] = {"validate": 0.0}
        plans, worst = frontier_plans(self.methods, composed.solved, composed.composer.f_max,
                                      composed.simulator, costs, per_method, simulated)
        # "validate": the simulations alone; "plans": the plan files' contents (execution
        # plans and timelines of every frontier point)
        self.timings["validate"] = simulated["validate"]
        self.timings["plans"] = time.perf_counter() - t0 - simulated["validate"]
        return plans, worst, per_method

    def _power_limited(self, composed: Composed, plans: dict[str, list[Plan]]
                       ) -> list[LimitedRun] | None:
        """Step 4, Megatron-LM under board power limits, where the backend simulates."""
        simulator = composed.simulator
        runs = None
        if simulator is not None and THROUGHPUT_BASELINE in plans:
            t0 = time.perf_counter()
            runs = power_limited_megatron(self.workload, self.backend)
            self.timings["power_limited"] = time.perf_counter() - t0
        return runs

    def _write(self, rd: ResultDir, composed: Composed, plans: dict[str, list[Plan]],
               worst: float | None, per_method: int, runs: list[LimitedRun] | None
               ) -> OptimizeResult:
        """Step 5, the result, written to the result directory whole."""
        sources = composed.sources
        metrics = method_metrics({m: [(p.time_s, p.energy_j) for p in v]
                                  for m, v in plans.items()})
        result = OptimizeResult(
            self.workload.job, plans, composed.searches, metrics, worst, self.timings,
            sources=sources, left_out=self.left_out_reasons,
            validation_per_method=None if composed.simulator is None else per_method,
            power_limited=None if runs is None else [r.to_dict() for r in runs],
            iso_power=iso_power(plans, runs),
            numbers=numbers_from(sources["backend"] if sources is not None
                                 else self.backend.kind))
        result.run_id = result.content_id()
        rd.write(result)
        return result


def _measuring(stack: ExitStack, spec: BackendSpec, workload: Workload, journal_path: Path
               ) -> JournaledBackend:
    """The backend composing measures through: ``spec`` opened for the workload, every
    number journaled in the result's journal (closed with ``stack``)."""
    return stack.enter_context(open_measuring(spec, workload, str(journal_path)))


def prepare_optimize(request: OptimizeRequest) -> OptimizeRun:
    """`check_optimize`, then, last, the result directory locked for the run
    (`ResultDir.lock`: another run holding it is refused); `OptimizeRun.run` releases
    it."""
    run = check_optimize(request)
    if not run.measures_only:
        rd = run.result_dir()
        # last: a refusal creates nothing
        run.lock = rd.lock(run.workload.job.id, request.force)
    return run


def check_optimize(request: OptimizeRequest) -> OptimizeRun:
    """Everything in ``request`` that can fail on bad input, checked once, before any work
    starts; nothing is created (`prepare_optimize` then locks the directory). Methods that
    cannot run the job (one whose microbatch is not split into nanobatches) are left out
    (`OptimizeRun.left_out`); none left is an error."""
    job = request.job
    workload = job if isinstance(job, Workload) else Workload.build(job)
    spec = request.backend or default_spec()
    if request.measurements is not None:
        spec = replay_spec(request.measurements, compose_only=True)
    if request.solver not in SOLVERS:
        raise SpecError(f"--pipeline-solver takes {' or '.join(SOLVERS)}, got "
                        f"{request.solver!r}")
    if request.validate_plans is not None and request.validate_plans < 0:
        raise SpecError(f"--validate-plans takes 0 or more plans per method, got "
                        f"{request.validate_plans}")
    run = OptimizeRun(request, workload, spec, request.executor or ExecutorSpec())
    run.check()
    return run


def optimize(request: OptimizeRequest, progress: TaskProgress | None = None,
             stage: Say | None = None) -> OptimizeResult | None:
    """`prepare_optimize`, then `OptimizeRun.run`."""
    return prepare_optimize(request).run(progress, stage)
