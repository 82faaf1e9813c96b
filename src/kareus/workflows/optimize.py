"""`kareus optimize`: search every partition, compose every method's frontier, validate the
plans, write the result directory (kareus.results.resultdir)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from kareus.backends.base import PlanSimulator
from kareus.backends.factory import BackendSpec, open_backend, plan_simulator
from kareus.backends.journaled import JournaledBackend
from kareus.backends.needs import summarize
from kareus.backends.replay import MissingMeasurement, ReplayBackend
from kareus.compose.methods import method_frontiers
from kareus.compose.options import Composer, key_frontiers
from kareus.compose.pipeline import PipelineCosts, PipelinePoint
from kareus.compose.plans import timeline, to_execution_plan
from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.plans.methods import Method, all_methods, get_method
from kareus.plans.metrics import method_metrics
from kareus.plans.plan import Plan
from kareus.results.result import OptimizeResult
from kareus.results.resultdir import ResultDir
from kareus.search.loop import SearchConfig, SearchResult
from kareus.store import Journal, job_id
from kareus.workflows.executors import ExecutorSpec, TaskProgress, make_task, run_tasks
from kareus.workflows.profile import profile
from kareus.workload.partition import PartitionSet

FILL_MISSING = ("emulator",)


def check_optimize(job: JobSpec, out_dir: str, config: SearchConfig,
                   backend: BackendSpec, executor: ExecutorSpec, force: bool = False,
                   measurements: str | None = None, fill_missing: str | None = None
                   ) -> None:
    """Everything that can fail on bad input, checked before any work starts."""
    executor.check()
    ResultDir(out_dir).check_writable(job_id(job), force)
    if fill_missing is not None and fill_missing not in FILL_MISSING:
        raise SpecError(f"--fill-missing takes {', '.join(FILL_MISSING)}, got "
                        f"{fill_missing!r}")
    if fill_missing is not None and measurements is None:
        raise SpecError("--fill-missing needs --measurements JOURNAL")
    if measurements is not None:
        if not Path(measurements).is_file():
            raise SpecError(f"journal not found: {measurements}")
        if fill_missing is None:
            check_measurements(job, measurements, backend.replay_identity)
        else:
            ReplayBackend(measurements, job, backend.replay_identity)  # one backend, its GPU
        return
    backend.check(job)
    ps = PartitionSet.from_job(job)
    for key in ps.keys:
        config.check(ps[key].knob_space_size(len(job.freqs_mhz)), False)


def optimize(job: JobSpec, out_dir: str, config: SearchConfig,
             backend: BackendSpec | None = None, executor: ExecutorSpec | None = None,
             methods: Sequence[str] | None = None, progress: TaskProgress | None = None,
             stage: Callable[[str], None] | None = None, force: bool = False,
             measurements: str | None = None, fill_missing: str | None = None
             ) -> OptimizeResult:
    """Search, compose, validate, write ``out_dir`` (kareus.results.resultdir). ``force``: replace
    the result of another job in ``out_dir`` (its measurements stay in the journal).

    ``measurements``: compose from that journal alone (no search, no emulator number);
    what it lacks is one error listing it, unless ``fill_missing="emulator"`` takes those
    numbers from the emulator (and the result says which). A real-GPU backend profiles
    everything into the result's journal first (kareus.workflows.profile), then composes from it."""
    spec = backend or BackendSpec()
    rd = ResultDir(out_dir)
    rd.check_writable(job_id(job), force)
    rd.prepare()
    say = stage or (lambda _msg: None)
    chosen = all_methods() if methods is None else tuple(get_method(m) for m in methods)
    timings: dict[str, float] = {}
    if measurements is None and spec.name in ("nvml", "fakegpu"):
        t0 = time.perf_counter()
        say(f"profiling every partition and composition step on {spec.name}")
        profiled = profile(job, str(rd.journal), spec, config, progress=progress)
        timings["profile"] = time.perf_counter() - t0
        measurements = str(rd.journal)
        spec = replace(spec, replay_identity=profiled.identity)  # not another backend's
    if measurements is not None:
        searches, solved, sources, f_max, costs = _compose_measured(
            job, measurements, spec.replay_identity, fill_missing, chosen, say, timings)
        simulator = None  # the emulator is no ground truth for measured numbers
    else:
        searches, solved, f_max, costs = _search_and_compose(
            job, rd, config, spec, executor, chosen, progress, say, timings)
        sources = None
        simulator = plan_simulator(job, spec.calibration) if spec.name == "emulator" else None
    t0 = time.perf_counter()
    plans, worst = _plans(chosen, solved, f_max, simulator, costs)
    timings["validate"] = time.perf_counter() - t0
    metrics = method_metrics({m: [(p.time_s, p.energy_j) for p in v] for m, v in plans.items()})
    result = OptimizeResult(job, plans, searches, metrics, worst, timings, sources=sources)
    result.run_id = result.content_id()
    rd.write(result)
    return result


Solved = dict[str, list[PipelinePoint]]


def check_measurements(job: JobSpec, journal: str, identity: str | None = None,
                       methods: Sequence[Method] | None = None) -> None:
    """One error listing everything composing ``methods`` (default: all) from ``journal``
    needs and the journal lacks, with the command that measures it; a dry run of the
    composition, nothing is solved."""
    ps = PartitionSet.from_job(job)
    dry = ReplayBackend(journal, job, identity, collect=True)
    fronts = key_frontiers({k: dry.samples(k) for k in ps.keys})
    Composer(ps, dry, job.freqs_mhz).ask_all(methods or all_methods(), fronts)
    if dry.missing:
        raise MissingMeasurement(
            f"journal {journal} lacks {len(dry.missing)} measurements this job's "
            f"composition needs (backend {dry.identity()}): {summarize(dry.missing)}; "
            f"measure them with `kareus profile` with this job's options and --journal "
            f"{journal}, or pass --fill-missing emulator")


def _search_and_compose(job: JobSpec, rd: ResultDir, config: SearchConfig, spec: BackendSpec,
                        executor: ExecutorSpec | None, chosen: Sequence[Method],
                        progress: TaskProgress | None, say: Callable[[str], None],
                        timings: dict[str, float]
                        ) -> tuple[list[SearchResult], Solved, int, PipelineCosts]:
    ps = PartitionSet.from_job(job)
    t0 = time.perf_counter()
    searches: list[SearchResult] = []
    if any(m.needs_search for m in chosen):
        say(f"searching {len(ps.keys)} partitions")
        tasks = [make_task(job, key, config, spec, journal=str(rd.journal))
                 for key in ps.keys]
        searches = run_tasks(tasks, executor, progress)
    timings["search"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    fronts = key_frontiers({r.partition: [(s.knobs, s.measurement) for s in r.samples]
                            for r in searches})
    with open_backend(job, spec) as measuring, Journal(rd.journal) as journal:
        b = JournaledBackend(measuring, journal, journal.register_job(job))
        composer = Composer(ps, b, job.freqs_mhz)
        solved = method_frontiers(composer, chosen, fronts, say)
        costs = composer.pipeline_costs()  # measured already: from the journal
    timings["compose"] = time.perf_counter() - t0
    return searches, solved, composer.f_max, costs


def _compose_measured(job: JobSpec, journal: str, identity: str | None,
                      fill_missing: str | None, chosen: Sequence[Method],
                      say: Callable[[str], None], timings: dict[str, float]
                      ) -> tuple[list[SearchResult], Solved, dict[str, Any], int,
                                 PipelineCosts]:
    """Every number from ``journal``: a dry run lists what it lacks (one error), or the
    emulator fills it where the user opted in."""
    t0 = time.perf_counter()
    ps = PartitionSet.from_job(job)
    if fill_missing is None:
        check_measurements(job, journal, identity, chosen)
    with (open_backend(job, BackendSpec()) if fill_missing == "emulator"
          else nullcontext()) as fallback:
        replay = ReplayBackend(journal, job, identity, fallback=fallback)
        say(f"composing from {journal} ({replay.identity()})")
        journaled = {k: replay.samples(k) for k in ps.keys}
        fronts = key_frontiers(journaled)
        searches = [SearchResult.from_journal(k, v) for k, v in journaled.items()]
        composer = Composer(ps, replay, job.freqs_mhz)
        solved = method_frontiers(composer, chosen, fronts, say)
        costs = composer.pipeline_costs()
    timings["compose"] = time.perf_counter() - t0
    sources = {"measurements": journal, "backend": replay.identity(),
               "filled_from": fill_missing if replay.filled else None,
               "filled": [n.describe() for n in replay.filled]}
    return searches, solved, sources, composer.f_max, costs


def _plans(methods: Sequence[Method], solved: dict[str, list[PipelinePoint]], f_max: int,
           simulator: PlanSimulator | None, costs: PipelineCosts
           ) -> tuple[dict[str, list[Plan]], float | None]:
    """Each frontier point as a Plan, simulated as one whole iteration where a simulator is
    given; the largest relative error between composed and simulated time or energy."""
    plans: dict[str, list[Plan]] = {}
    worst: float | None = None if simulator is None else 0.0
    for method in methods:
        plans[method.name] = []
        for i, pt in enumerate(solved[method.name]):
            execution = to_execution_plan(f"{method.name}-{i:03d}", pt.picks, f_max,
                                          method.overlap)
            sim_t = sim_e = None
            if simulator is not None and worst is not None:
                r = simulator.run(execution)
                sim_t, sim_e = r.time_s, r.energy_j
                worst = max(worst, abs(sim_t / pt.time_s - 1), abs(sim_e / pt.energy_j - 1))
            plans[method.name].append(Plan(execution.name, method.name, pt.time_s,
                                           pt.energy_j, execution, sim_t, sim_e,
                                           timeline(pt, costs)))
    return plans, worst
