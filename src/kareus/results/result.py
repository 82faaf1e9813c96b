"""What `kareus optimize` produces: per method its plans, the metrics, the searches."""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.job.spec import JobSpec
from kareus.plans.methods import PROPOSED
from kareus.plans.plan import Plan
from kareus.search.loop import SearchResult

_SEARCH_FIELDS = ("partition", "strategy", "stopped", "hypervolume")
_RUN_FIELDS = ("measured_this_run", "reused_from_journal", "profiling_cost_s")
_PER_RUN = ("timings_s", "this_run", "run_id")
"""What a rerun that finds everything in the journal changes in result.json: the times,
what this run measured or took from the journal, and nothing else."""


@dataclass
class OptimizeResult:
    job: JobSpec
    plans: dict[str, list[Plan]]
    """Per method (registry order), the plans of its frontier, fastest first."""
    searches: list[SearchResult]
    metrics: dict[str, dict[str, float | None]]
    validation_max_error: float | None
    """Largest relative difference between a plan's composed and simulated time or energy;
    None where no simulation validated the plans."""
    timings_s: dict[str, float] = field(default_factory=dict)
    run_id: str = ""
    """This run's id (`content_id`): result.json and every plan file of the run carry it."""
    sources: dict[str, Any] | None = None
    """Composed from a journal (`optimize --measurements`): the journal, the backend whose
    measurements were used, and every number the emulator filled in (``filled``; empty
    unless the user opted in with --fill-missing). None: searched by this run."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Methods that could not run the job, and why (`kareus.plans.methods.left_out_reasons`)."""
    validation_per_method: int | None = None
    """At most this many plans of each method were simulated (a stratified sample: the
    fastest, the least-energy, evenly between); None where no plan was."""
    power_limited: list[dict[str, float]] | None = None
    """Megatron-LM at max clock under each board power limit
    (kareus.workflows.power_limited); None where the backend cannot simulate it."""
    iso_power: list[dict[str, Any]] = field(default_factory=list)
    """Each method's time at Megatron-LM's mean cluster power and at 80% of it."""
    numbers: dict[str, Any] | None = None
    """Where the numbers come from (kareus.backends.registry.numbers_from: backend,
    source, fake, note); None in a result built without saying."""

    @property
    def fake(self) -> bool:
        """The numbers are a fake device's (CPU timings, a fake energy counter)."""
        return bool(self.numbers and self.numbers.get("fake"))

    def validated_plans(self) -> tuple[int, int]:
        """(plans simulated, plans) over every method."""
        plans = [p for ps in self.plans.values() for p in ps]
        return sum(p.simulated_time_s is not None for p in plans), len(plans)

    @property
    def job_id(self) -> str:
        return self.job.id

    def content_id(self) -> str:
        """A run id that names the result itself (timings aside): a rerun that finds
        everything in the journal writes the same result.json, run id included, and a
        plan file of any other result is told apart."""
        doc = {k: v for k, v in self.to_dict().items() if k not in _PER_RUN}
        text = json.dumps(doc, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def validation(self) -> dict[str, dict[str, float]]:
        """Per method: the largest and the median relative error (composed against the
        whole-iteration simulation) of time and of energy over its frontier plans, and the
        signed median (positive: the simulation took more than composed); and of the mean
        cluster power (energy over time: kareus.plans.power's mean is the composed plan's
        energy over its time, so this is the two errors combined; the windowed peak is not
        simulated). Empty where no plan was simulated."""
        out: dict[str, dict[str, float]] = {}
        for method, plans in self.plans.items():
            pairs = [(p.simulated_time_s / p.time_s - 1, p.simulated_energy_j / p.energy_j - 1)
                     for p in plans
                     if p.simulated_time_s is not None and p.simulated_energy_j is not None]
            if not pairs:
                continue
            dt, de = [t for t, _ in pairs], [e for _, e in pairs]
            out[method] = {
                "plans": len(pairs),
                "time_max_rel_error": max(abs(x) for x in dt),
                "time_median_rel_error": statistics.median(abs(x) for x in dt),
                "time_median_signed": statistics.median(dt),
                "energy_max_rel_error": max(abs(x) for x in de),
                "energy_median_rel_error": statistics.median(abs(x) for x in de),
                "energy_median_signed": statistics.median(de),
                "mean_power_max_rel_error": max(abs((1 + e) / (1 + t) - 1)
                                                for t, e in pairs)}
        return out

    def frontier_points(self) -> dict[str, list[tuple[float, float]]]:
        return {m: [(p.time_s, p.energy_j) for p in ps] for m, ps in self.plans.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "run_id": self.run_id,
            "job_id": self.job_id,
            "job": self.job.model_dump(mode="json"),
            "methods": {
                m: {"frontier": [{**{k: v for k, v in p.summary().items()
                                     if k not in ("id", "method")}, "plan": p.id}
                                 for p in ps]}
                for m, ps in self.plans.items()},
            "metrics": self.metrics,
            "numbers": self.numbers,
            "left_out": self.left_out,
            "validation_max_rel_error": self.validation_max_error,
            "validation": self.validation(),
            "validated_plans": dict(zip(("simulated", "of"), self.validated_plans(),
                                        strict=True)),
            "measurements": self.sources,
            "searches": [{k: getattr(s, k) for k in _SEARCH_FIELDS}
                         | {"samples": len(s.samples), "frontier": len(s.frontier)}
                         for s in self.searches],
            "megatron_power_limited": self.power_limited,
            "iso_power": self.iso_power,
            "timings_s": self.timings_s,
            "this_run": {s.partition: {k: getattr(s, k) for k in _RUN_FIELDS}
                         for s in self.searches},
        }


def highlighted_method(result: OptimizeResult) -> str:
    """Whose plans report.md and the timelines show: Kareus where it ran, else the method
    with the most plans (the first of those), e.g. Perseus where Kareus was left out."""
    if result.plans.get(PROPOSED):
        return PROPOSED
    return max(result.plans, key=lambda m: len(result.plans[m]), default=PROPOSED)
