"""`kareus optimize`: search every partition, compose every method's frontier, validate the
plans, write the result directory (kareus.results.resultdir).

`prepare_optimize` checks everything that can fail on bad input, once, before any work
starts, and returns an `OptimizeRun`; its `run` does the work on the workload built once.
Where the numbers come from is the backend spec's to say (its capabilities): one with a
cost model is searched and validated by simulation; one that profiles first (real GPUs)
measures everything into the result's journal, then composes from it; ``measurements``
composes from a journal alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from kareus.backends.base import PlanSimulator
from kareus.backends.journaled import JournaledBackend
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
from kareus.compose.pipeline import SOLVERS, PipelineCosts, PipelinePoint, Solver
from kareus.compose.plans import timeline, to_execution_plan
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
from kareus.plans.power import plan_power
from kareus.profiling.executors import ExecutorSpec, TaskProgress, make_tasks, run_tasks
from kareus.profiling.profile import DEFAULT_PRIOR, check_profile, profile, torchrun_rank
from kareus.results.result import OptimizeResult
from kareus.results.resultdir import ResultDir
from kareus.search.loop import SearchConfig, SearchResult
from kareus.store import Journal, job_id
from kareus.workflows.measured import fitted_summary, measured_composer, refuse_missing
from kareus.workflows.power_limited import iso_power, power_limited_megatron
from kareus.workload.workload import Workload

Solved = dict[str, list[PipelinePoint]]
Say = Callable[[str], None]


@dataclass
class OptimizeRun:
    """An optimize whose inputs were checked: `run` does the work."""

    workload: Workload
    out_dir: str
    config: SearchConfig
    backend: BackendSpec
    executor: ExecutorSpec
    methods: tuple[Method, ...]
    """The methods that run (those that can run the job)."""
    left_out: tuple[Method, ...] = ()
    """Methods asked for that cannot run the job (`Method.runs_on`): `left_out_line`."""
    fill: BackendSpec | None = None
    composer: Composer | None = None
    """Composing from a journal alone: the composer that listed the journal's lacks while
    the inputs were checked, and composes now (it is not built twice)."""
    timings: dict[str, float] = field(default_factory=dict)
    force: bool = False
    solver: Solver = "lp"
    """The pipeline solver (kareus.compose.pipeline.solve_frontier)."""
    validate_plans: int | None = None
    """Per method, how many frontier plans the emulator simulates (a stratified sample,
    `validation_sample`); None: `default_validation_sample` of the pipeline's size."""
    lock: Lock | None = None
    """The result directory's lock, taken by `prepare_optimize` once every input was
    checked, released when `run` ends (None on a rank that only measures)."""
    within: str | None = None
    """The compare directory whose preset result ``out_dir`` is (`ResultDir` ``within``);
    None: a directory of its own."""

    def result_dir(self) -> ResultDir:
        return ResultDir(self.out_dir, within=self.within)

    @property
    def left_out_line(self) -> str:
        """One line naming the methods left out and why ("" when none is)."""
        return left_out_line(self.left_out, self.workload.job)

    @property
    def measures_only(self) -> bool:
        """A torchrun rank other than 0: it measures in lockstep with rank 0, which
        journals, composes and writes the result."""
        return self.backend.capabilities.process_per_gpu and torchrun_rank() != 0

    def run(self, progress: TaskProgress | None = None, stage: Say | None = None
            ) -> OptimizeResult | None:
        """Search (or profile), compose, validate, write ``out_dir``; None on a rank that
        only measures."""
        rd = self.result_dir()
        if self.measures_only:
            rd.path.mkdir(parents=True, exist_ok=True)
            profile(self.workload, str(rd.journal), self.backend, self.config,
                    prior=DEFAULT_PRIOR)
            return None
        held = self.lock
        if held is None or not held.held:  # not prepared here, or run again
            held = self.lock = rd.lock(job_id(self.workload.job), self.force)
        try:
            return self._run(rd, progress, stage)
        finally:
            held.release()

    def _run(self, rd: ResultDir, progress: TaskProgress | None, stage: Say | None
             ) -> OptimizeResult:
        rd.prepare()
        say = stage or (lambda _msg: None)
        source = self.backend.journal_source()
        if self.backend.capabilities.profiles_first:
            t0 = time.perf_counter()
            say(f"profiling every partition and composition step on {self.backend.name}")
            # the searches at optimize's budget, informed by the emulator like `kareus
            # profile`'s; the steps fitted through it
            profiled = profile(self.workload, str(rd.journal), self.backend, self.config,
                               progress=progress, prior=DEFAULT_PRIOR)
            self.timings["profile"] = time.perf_counter() - t0
            source = (str(rd.journal), profiled.identity)  # not another backend's
        simulator: PlanSimulator | None = None
        sources = None
        if source is not None:
            searches, composer, solved, sources = self._compose_measured(*source, say)
        else:
            searches, composer, solved = self._search_and_compose(rd, progress, say)
            simulator = self.backend.plan_simulator(self.workload)
        t0 = time.perf_counter()
        costs = composer.pipeline_costs()
        per_method = (self.validate_plans if self.validate_plans is not None
                      else default_validation_sample(costs))
        simulated: dict[str, float] = {"validate": 0.0}
        plans, worst = _plans(self.methods, solved, composer.f_max, simulator, costs,
                              per_method, simulated)
        # "validate": the simulations alone; "plans": the plan files' contents (execution
        # plans and timelines of every frontier point)
        self.timings["validate"] = simulated["validate"]
        self.timings["plans"] = time.perf_counter() - t0 - simulated["validate"]
        metrics = method_metrics({m: [(p.time_s, p.energy_j) for p in v]
                                  for m, v in plans.items()})
        runs = None
        if simulator is not None and THROUGHPUT_BASELINE in plans:
            t0 = time.perf_counter()
            runs = power_limited_megatron(self.workload, self.backend)
            self.timings["power_limited"] = time.perf_counter() - t0
        result = OptimizeResult(self.workload.job, plans, searches, metrics, worst,
                                self.timings, sources=sources,
                                left_out=left_out_reasons(self.left_out, self.workload.job),
                                validation_per_method=None if simulator is None else per_method,
                                power_limited=None if runs is None else [
                                    r.to_dict() for r in runs],
                                iso_power=iso_power(plans, runs),
                                numbers=numbers_from(sources["backend"] if sources is not None
                                                     else self.backend.kind))
        result.run_id = result.content_id()
        rd.write(result)
        return result

    def _search_and_compose(self, rd: ResultDir, progress: TaskProgress | None, say: Say
                            ) -> tuple[list[SearchResult], Composer, Solved]:
        wl = self.workload
        t0 = time.perf_counter()
        searches: list[SearchResult] = []
        if any(m.needs_search for m in self.methods):
            say(f"searching {len(wl.keys)} partitions")
            tasks = make_tasks(wl, wl.keys, self.config, self.backend, str(rd.journal))
            searches = run_tasks(tasks, self.executor, progress, workload=wl)
        self.timings["search"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fronts = key_frontiers({r.partition: [(s.knobs, s.measurement) for s in r.samples]
                                for r in searches})
        with self.backend.open(wl) as measuring, Journal(rd.journal) as journal:
            b = JournaledBackend(measuring, journal, journal.register_job(wl.job))
            composer = Composer(wl.partitions, b, wl.job.freqs_mhz)
            solved = method_frontiers(composer, self.methods, fronts, say, self.solver)
            composer.pipeline_costs()  # answered already: nothing is measured after this
        self.timings["compose"] = time.perf_counter() - t0
        return searches, composer, solved

    def _compose_measured(self, journal: str, identity: str | None, say: Say
                          ) -> tuple[list[SearchResult], Composer, Solved, dict[str, Any]]:
        """Every number from ``journal``: what it lacks is one error listing it, or the
        fill backend's number where the user opted in."""
        wl = self.workload
        t0 = time.perf_counter()
        with (self.fill.open(wl) if self.fill is not None else nullcontext()) as fallback:
            composer = self.composer or measured_composer(wl, journal, identity, fallback)
            replay = composer.backend
            assert isinstance(replay, JournaledBackend)
            journaled = {k: replay.samples(k) for k in wl.keys}
            fronts = key_frontiers(journaled)
            say(f"composing from {journal} ({replay.identity()})")
            searches = [SearchResult.from_journal(k, v) for k, v in journaled.items()]
            solved = method_frontiers(composer, self.methods, fronts, say, self.solver)
            composer.pipeline_costs()
        self.timings["compose"] = time.perf_counter() - t0
        sources = {"measurements": journal, "backend": replay.identity(),
                   "filled_from": self.fill.name if self.fill and replay.filled else None,
                   "filled": [n.describe() for n in replay.filled],
                   "fitted": fitted_summary(replay)}
        return searches, composer, solved, sources


def prepare_optimize(job: JobSpec | Workload, out_dir: str, config: SearchConfig,
                     backend: BackendSpec | None = None, executor: ExecutorSpec | None = None,
                     methods: Sequence[str] | None = None, force: bool = False,
                     measurements: str | None = None, fill_missing: str | None = None,
                     solver: str = "lp", validate_plans: int | None = None
                     ) -> OptimizeRun:
    """`check_optimize`, then, last, the result directory locked for the run
    (`ResultDir.lock`: another run holding it is refused); `OptimizeRun.run` releases
    it."""
    run = check_optimize(job, out_dir, config, backend, executor, methods, force,
                         measurements, fill_missing, solver, validate_plans)
    if not run.measures_only:
        rd = run.result_dir()
        run.lock = rd.lock(job_id(run.workload.job), force)  # last: a refusal creates nothing
    return run


def check_optimize(job: JobSpec | Workload, out_dir: str, config: SearchConfig,
                   backend: BackendSpec | None = None, executor: ExecutorSpec | None = None,
                   methods: Sequence[str] | None = None, force: bool = False,
                   measurements: str | None = None, fill_missing: str | None = None,
                   solver: str = "lp", validate_plans: int | None = None,
                   within: str | None = None) -> OptimizeRun:
    """Everything that can fail on bad input, checked once, before any work starts;
    nothing is created (`prepare_optimize` then locks the directory). ``force``: replace
    the result of another job in ``out_dir`` (its measurements stay in the journal).
    ``measurements``: compose from that journal alone (no search, no emulator number);
    ``fill_missing``: a backend with a cost model fills what it lacks (the result says
    which numbers). ``job``: the workload, or a job to build it from. Methods that cannot
    run the job (one whose microbatch is not split into nanobatches) are left out
    (`OptimizeRun.left_out`); none left is an error. ``within``: the compare directory
    ``out_dir`` is a preset result of (`OptimizeRun.within`)."""
    workload = job if isinstance(job, Workload) else Workload.build(job)
    spec = backend or default_spec()
    ex = executor or ExecutorSpec()
    chosen, left_out = runnable_methods(
        all_methods() if methods is None else tuple(get_method(m) for m in methods),
        workload.job)
    if not chosen:
        raise SpecError(f"no method to run: {left_out_line(left_out, workload.job)}")
    if measurements is not None:
        spec = replay_spec(measurements, compose_only=True)
    if solver not in SOLVERS:
        raise SpecError(f"--pipeline-solver takes {' or '.join(SOLVERS)}, got {solver!r}")
    if validate_plans is not None and validate_plans < 0:
        raise SpecError(f"--validate-plans takes 0 or more plans per method, got "
                        f"{validate_plans}")
    run = OptimizeRun(workload, out_dir, config, spec, ex, chosen, left_out, force=force,
                      solver=solver, validate_plans=validate_plans, within=within)
    if run.measures_only:
        check_profile(workload, spec, config, with_prior=True)  # profiles with DEFAULT_PRIOR
        return run
    ex.check()
    run.result_dir().check_writable(job_id(workload.job), force)
    _check_numbers(run, fill_missing)
    return run


def _check_numbers(run: OptimizeRun, fill_missing: str | None) -> None:
    """Where the numbers come from: the journal and the fill backend, or the backend and
    the search settings."""
    workload, spec, config = run.workload, run.backend, run.config
    source = spec.journal_source()
    if fill_missing is not None:
        if source is None:
            raise SpecError("--fill-missing needs --measurements JOURNAL")
        if fill_missing not in cost_model_kinds():
            raise SpecError(f"--fill-missing takes {', '.join(cost_model_kinds())}, got "
                            f"{fill_missing!r}")
        run.fill = backend_kind(fill_missing)()
    if source is not None:
        if not os.path.isfile(source[0]):
            raise SpecError(f"journal not found: {source[0]}")
        # the journal describes one backend of this job's GPU (or names the one to use),
        # and holds everything composing needs, unless the user opted in to filling it
        if run.fill is None:
            run.composer = measured_composer(workload, *source)
            refuse_missing(source[0], run.composer, run.methods)
        else:
            open_replay(source[0], workload.job, source[1])
        return
    spec.check(workload.job)
    for key in workload.keys:
        config.check(workload[key].knob_space_size(len(workload.job.freqs_mhz)), False)


def optimize(job: JobSpec | Workload, out_dir: str, config: SearchConfig,
             backend: BackendSpec | None = None, executor: ExecutorSpec | None = None,
             methods: Sequence[str] | None = None, progress: TaskProgress | None = None,
             stage: Say | None = None, force: bool = False, measurements: str | None = None,
             fill_missing: str | None = None) -> OptimizeResult | None:
    """`prepare_optimize`, then `OptimizeRun.run`."""
    return prepare_optimize(job, out_dir, config, backend, executor, methods, force,
                            measurements, fill_missing).run(progress, stage)


def default_validation_sample(costs: PipelineCosts) -> int:
    """Plans per method the emulator simulates by default: 12 on the paper's jobs (32
    instructions; a frontier holds ~100), 4 at 128 instructions, 1 (the fastest, where the
    power limiter acts most) from 512 on (the 70B job): a whole-iteration simulation grows
    with the pipeline, and validation should cost at most a quarter of the composition
    (2 per method took a third of it on the 70B job)."""
    instructions = 2 * costs.stages * costs.microbatches
    return max(1, min(12, 512 // instructions))


def validation_sample(plans: int, per_method: int) -> list[int]:
    """Which of a frontier's ``plans`` (fastest first) to simulate: a stratified sample of
    ``per_method``: the fastest, then the least-energy, then evenly between."""
    if per_method >= plans:
        return list(range(plans))
    if per_method <= 0:
        return []
    if per_method == 1:
        return [0]
    return sorted({round(i * (plans - 1) / (per_method - 1)) for i in range(per_method)})


def _plans(methods: Sequence[Method], solved: Solved, f_max: int,
           simulator: PlanSimulator | None, costs: PipelineCosts,
           per_method: int = 1 << 30, timings: dict[str, float] | None = None
           ) -> tuple[dict[str, list[Plan]], float | None]:
    """Each frontier point as a Plan; a stratified sample of ``per_method`` plans of each
    method (`validation_sample`) simulated as one whole iteration where a simulator is
    given (their seconds added to ``timings["validate"]``); the largest relative error
    between composed and simulated time or energy."""
    plans: dict[str, list[Plan]] = {}
    worst: float | None = None if simulator is None else 0.0
    for method in methods:
        plans[method.name] = []
        sample = set(validation_sample(len(solved[method.name]), per_method))
        for i, pt in enumerate(solved[method.name]):
            execution = to_execution_plan(f"{method.name}-{i:03d}", pt.picks, f_max,
                                          method.overlap)
            sim_t = sim_e = None
            if simulator is not None and worst is not None and i in sample:
                t0 = time.perf_counter()
                r = simulator.run(execution)
                if timings is not None:
                    timings["validate"] = timings.get("validate", 0.0) + (
                        time.perf_counter() - t0)
                sim_t, sim_e = r.time_s, r.energy_j
                worst = max(worst, abs(sim_t / pt.time_s - 1), abs(sim_e / pt.energy_j - 1))
            bars = timeline(pt, costs, f_max)
            power = plan_power(bars, pt.time_s, costs.pp, costs.gpus // costs.pp,
                               costs.static_power_w)
            plans[method.name].append(Plan(execution.name, method.name, pt.time_s,
                                           pt.energy_j, execution, sim_t, sim_e, bars,
                                           power))
    return plans, worst
