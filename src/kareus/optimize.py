"""`kareus optimize`: search every partition, compose every method's frontier, validate the
plans, write the result directory (kareus.resultdir)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kareus.backends.base import PlanSimulator
from kareus.backends.factory import BackendSpec, open_backend, plan_simulator
from kareus.backends.journaled import JournaledBackend
from kareus.compose.methods import method_frontiers
from kareus.compose.options import Composer, key_frontiers
from kareus.compose.pipeline import PipelineCosts, PipelinePoint
from kareus.compose.plans import timeline, to_execution_plan
from kareus.executors import ExecutorSpec, TaskProgress, make_task, run_tasks
from kareus.methods import Method, all_methods, get_method
from kareus.metrics import method_metrics
from kareus.partition import PartitionSet
from kareus.plan import Plan
from kareus.result import OptimizeResult
from kareus.resultdir import ResultDir
from kareus.search.loop import SearchConfig, SearchResult
from kareus.spec import JobSpec
from kareus.store import Journal, job_id


def check_optimize(job: JobSpec, out_dir: str, config: SearchConfig,
                   backend: BackendSpec, executor: ExecutorSpec, force: bool = False) -> None:
    """Everything that can fail on bad input, checked before any work starts."""
    executor.check()
    ResultDir(out_dir).check_writable(job_id(job), force)
    backend.check(job)
    ps = PartitionSet.from_job(job)
    for key in ps.keys:
        config.check(ps[key].knob_space_size(len(job.freqs_mhz)), False)


def optimize(job: JobSpec, out_dir: str, config: SearchConfig,
             backend: BackendSpec | None = None, executor: ExecutorSpec | None = None,
             methods: Sequence[str] | None = None, progress: TaskProgress | None = None,
             stage: Callable[[str], None] | None = None, force: bool = False
             ) -> OptimizeResult:
    """Search, compose, validate, write ``out_dir`` (kareus.resultdir). ``force``: replace
    the result of another job in ``out_dir`` (its measurements stay in the journal)."""
    spec = backend or BackendSpec()
    rd = ResultDir(out_dir)
    rd.check_writable(job_id(job), force)
    rd.prepare()
    ps = PartitionSet.from_job(job)
    say = stage or (lambda _msg: None)
    chosen = all_methods() if methods is None else tuple(get_method(m) for m in methods)
    timings: dict[str, float] = {}

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
        f_max = b.gpu.max_freq_mhz
    # the emulator is the ground truth of validation where it describes the backend
    simulator = plan_simulator(job, spec.calibration) if spec.name == "emulator" else None
    plans, worst = _plans(chosen, solved, f_max, simulator, costs)
    timings["compose"] = time.perf_counter() - t0
    metrics = method_metrics({m: [(p.time_s, p.energy_j) for p in v] for m, v in plans.items()})
    result = OptimizeResult(job, plans, searches, metrics, worst, timings)
    result.run_id = result.content_id()
    rd.write(result)
    return result


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
