"""`kareus optimize`: search every partition, compose, run every method, write the result.

DIR/journal.sqlite   every measurement (a rerun reuses them)
DIR/result.json      per method its frontier of {time_s, energy_j, plan}, the metrics,
                     the validation of every plan against the whole-iteration simulation
DIR/plans/*.json     every plan on every frontier
DIR/frontier.png     all methods' frontiers on one plot
DIR/report.md        what was searched, the frontier, the metrics, how to apply a plan
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kareus import SCHEMA_VERSION
from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.compose.build import ALIASES, METHODS, Composer, key_frontiers, to_execution_plan
from kareus.compose.pipeline import merge_frontiers, solve_frontier
from kareus.errors import KareusError
from kareus.metrics import method_metrics
from kareus.partition import PartitionSet
from kareus.plan import Plan
from kareus.search.loop import SearchConfig
from kareus.search.parallel import make_task, run_tasks
from kareus.spec import JobSpec

OVERLAPPING = {"nanobatch", "nanobatch_perseus", "kareus", "kareus_no_freq"}
SUBSPACES = ("perseus", "nanobatch_perseus")
"""Methods whose option sets are contained in Kareus's (per instruction, per clock)."""


@dataclass
class OptimizeResult:
    job: JobSpec
    plans: dict[str, list[Plan]]
    searches: list[dict]
    metrics: dict
    validation_max_error: float
    timings_s: dict[str, float] = field(default_factory=dict)

    def frontier_points(self) -> dict[str, list[tuple[float, float]]]:
        return {m: [(p.time_s, p.energy_j) for p in ps] for m, ps in self.plans.items()}

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "job": self.job.model_dump(mode="json"),
            "methods": {
                m: {"frontier": [{**{k: v for k, v in p.summary().items()
                                     if k not in ("id", "method")}, "plan": p.id}
                                 for p in ps]}
                for m, ps in self.plans.items()},
            "metrics": self.metrics,
            "validation_max_rel_error": self.validation_max_error,
            "searches": [{k: s[k] for k in ("partition", "strategy", "measured_this_run",
                                            "reused_from_journal", "stopped", "hypervolume",
                                            "profiling_cost_s")}
                         | {"samples": len(s["samples"]), "frontier": len(s["frontier"])}
                         for s in self.searches],
            "timings_s": self.timings_s,
        }


def optimize(job: JobSpec, out_dir: str | Path, config: SearchConfig, noise: float = 0.0,
             calibration: str | None = None, executor: str = "local",
             workers: int | None = None, ray_address: str | None = None,
             methods: tuple[str, ...] = METHODS,
             progress: Callable[[str, int, int], None] | None = None,
             stage: Callable[[str], None] | None = None) -> OptimizeResult:
    import time

    out = Path(out_dir)
    try:
        (out / "plans").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KareusError(f"cannot create {out / 'plans'}: {exc}") from None
    journal = str(out / "journal.sqlite")
    ps = PartitionSet.from_job(job)
    say = stage or (lambda _msg: None)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    say(f"searching {len(ps.keys)} partitions")
    tasks = [make_task(job, key, config, noise=noise, seed=config.seed,
                       calibration=calibration, journal=journal) for key in ps.keys]
    searches = run_tasks(tasks, executor, workers, ray_address, progress)
    timings["search"] = time.perf_counter() - t0

    backend = EmulatorBackend(job, calibration=calibration)
    sim = IterationSimulator(ps, backend)
    composer = Composer(ps, sim, job.freqs_mhz)
    fronts = key_frontiers({r["partition"]: r["samples"] for r in searches})
    costs = composer.pipeline_costs()
    plans: dict[str, list[Plan]] = {}
    worst = 0.0
    t0 = time.perf_counter()
    solved: dict[str, list] = {}
    for method in (ALIASES.get(m, m) for m in methods):
        say(f"composing {method}")
        options = composer.options(method, fronts)
        points = solve_frontier(options, costs)
        if method == "kareus":
            # Phillips-Dessouky follows one path through a non-convex space; Kareus's
            # options contain the default-overlap and sequential ones, so the plans solved
            # in those sub-spaces are Kareus plans too: the frontier keeps the best of all
            points = merge_frontiers(points, *(solved[m] for m in SUBSPACES if m in solved))
        solved[method] = points
        plans[method] = []
        for i, pt in enumerate(points):
            execution = to_execution_plan(f"{method}-{i:03d}", pt.picks,
                                          backend.gpu.max_freq_mhz, method in OVERLAPPING)
            r = sim.run(execution)
            worst = max(worst, abs(r.time_s / pt.time_s - 1), abs(r.energy_j / pt.energy_j - 1))
            plans[method].append(Plan(execution.name, method, pt.time_s, pt.energy_j,
                                      execution, r.time_s, r.energy_j))
    timings["compose"] = time.perf_counter() - t0
    metrics = method_metrics({m: [(p.time_s, p.energy_j) for p in v] for m, v in plans.items()})
    result = OptimizeResult(job, plans, searches, metrics, worst, timings)
    write_result(result, out)
    return result


def write_result(result: OptimizeResult, out: Path) -> None:
    from kareus.report import frontier_figure, markdown_report

    job_doc = result.job.model_dump(mode="json")
    try:
        for ps in result.plans.values():
            for p in ps:
                (out / "plans" / f"{p.id}.json").write_text(json.dumps(p.to_dict(job_doc)))
        (out / "result.json").write_text(json.dumps(result.to_dict(), indent=1))
        frontier_figure(result.frontier_points(), out / "frontier.png", result.job.describe())
        (out / "report.md").write_text(markdown_report(result, out))
    except OSError as exc:
        raise KareusError(f"cannot write the result to {out}: {exc}") from None
