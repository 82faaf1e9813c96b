"""`kareus profile`: measure everything composition needs, journal first.

1. The partitions, through the search loop (MBO by default; exhaustive on request).
2. Every other number composing the iteration takes, per clock of the search list: each
   instruction's fixed steps (ops outside partitions, the solo first segment, the exposed
   last collective, embedding and LM head with the loss, forward and backward), the
   sequential Megatron-LM execution the baselines use, the default-overlap settings of the
   Nanobatching baselines, the pipeline send/receive and the data-parallel sync. These are
   the composition's own needs (`Composer.needs`, listed before anything is measured),
   less what the journal holds, so the list is exactly what `kareus optimize
   --measurements` will ask for, and nothing is measured twice. They are measured one
   clock at a time, from the highest (a GPU settles once per clock).

Under torchrun every rank of the TP/CP group runs the kernels and the collective in
lockstep, every rank decides on rank 0's numbers (`AgreedBackend`), and rank 0 journals.
On one process the collective is a single-GPU stand-in. Without ``allow_clock_changes``
no clock is touched: the job's one clock (``--freqs``) must be the one the GPU runs at,
and a measurement at another is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kareus.backends.base import CostModel
from kareus.backends.journaled import JournaledBackend
from kareus.backends.measuring import JournalPolicy, open_measuring
from kareus.backends.needs import Need
from kareus.backends.registry import BackendSpec, open_prior
from kareus.compose.methods import method_frontiers
from kareus.compose.options import Composer, KeyFrontiers, key_frontiers
from kareus.core import Measurement, MeasurementProtocol
from kareus.errors import KareusError
from kareus.job.spec import JobSpec
from kareus.plans.methods import Method, all_methods, runnable_methods
from kareus.profiling.cost import CostSummary, StepsOutcome, group_gpus
from kareus.profiling.step_fit import FitPolicy, measure_steps
from kareus.search.loop import SearchConfig, SearchResult, run_search
from kareus.store import Journal
from kareus.workload.workload import Workload

ProfileProgress = Callable[[str, int, int], None]
"""progress(partition key or COMPOSITION, done, total)."""

COMPOSITION = "composition steps"
"""The progress label of the measurements outside partitions."""

DEFAULT_PRIOR = "emulator"
"""The prior `kareus profile` and `kareus optimize` on a real GPU profile with: every GPU
Kareus plans for has a model in the emulator (docs/gpu.md, "What a profile costs")."""


@dataclass
class ProfileResult:
    searches: list[SearchResult]
    steps: StepsOutcome | None = None
    """The steps outside partitions (None: not profiled, ``--partitions-only``)."""
    identity: str = ""
    """The measuring backend's identity: its measurements' key in the journal."""
    cost: CostSummary | None = None
    """What the run measured and its protocol cost (also in the journal's profile_runs)."""

    def to_dict(self) -> dict[str, Any]:
        return {"searches": [s.to_dict() for s in self.searches],
                "steps": self.steps.to_dict() if self.steps is not None else None,
                "cost": self.cost.to_dict() if self.cost is not None else None,
                "backend": self.identity}

    def summarise(self, workload: Workload, protocol: MeasurementProtocol,
                  parallel_groups: int = 1) -> CostSummary:
        """The run's cost, from what it measured (`cost`)."""
        steps = self.steps or StepsOutcome()
        per_search = [s.profiling_cost_s for s in self.searches]
        part_cost = sum(per_search)
        wall = (max(per_search, default=0.0) if parallel_groups > 1 else part_cost)
        self.cost = CostSummary(
            partition_settings=sum(s.measured_this_run for s in self.searches),
            partition_cost_s=part_cost, steps_measured=steps.measured,
            steps_fitted=steps.fitted, steps_cost_s=steps.cost_s,
            transients=steps.transients,
            group_gpus=group_gpus(workload),
            gpus_per_node=workload.job.gpus_per_node, parallel_groups=parallel_groups,
            wall_s=wall + steps.cost_s, protocol=protocol, estimate=False,
            partitions=len(self.searches),
            clock_changes=sum(s.clock_changes for s in self.searches) + steps.settles)
        return self.cost


def torchrun_rank() -> int:
    """This process's rank under torchrun (0 on a plain process)."""
    return int(os.environ.get("RANK", "0"))


def check_profile(workload: Workload, backend: BackendSpec, config: SearchConfig,
                  keys: Sequence[str] | None = None, here: bool = True,
                  with_prior: bool = False) -> list[str]:
    """Unknown keys and bad settings fail before any work starts; the keys to profile."""
    chosen = list(keys or workload.keys)
    backend.check(workload.job, here)
    for k in chosen:
        config.check(workload[k].knob_space_size(len(workload.job.freqs_mhz)), with_prior)
    return chosen


def profile(job: JobSpec | Workload, journal: str, backend: BackendSpec,
            config: SearchConfig | None = None, keys: Sequence[str] | None = None,
            progress: ProfileProgress | None = None, composition: bool = True,
            checked: bool = False, policy: FitPolicy | None = None,
            prior: str | None = None) -> ProfileResult:
    """Profile the partitions ``keys`` (default: all) and, with ``composition``, every
    number composing the job's iteration needs. ``checked``: the caller checked the
    inputs already (`check_profile`). ``policy``: how the steps outside partitions are
    measured (default: a few clocks each, the others fitted). ``prior``: a cost model's
    kind ("emulator") whose predictions inform the searches and the steps' fits
    (default: none; `SearchConfig.informed` is the search to run with it)."""
    from kareus.gpu.distributed import torchrun_group  # torch only where a group runs

    workload = job if isinstance(job, Workload) else Workload.build(job)
    job = workload.job
    model = open_prior(prior, job)
    cfg = config or SearchConfig.profiling(model is not None)
    chosen = list(keys or workload.keys) if checked else check_profile(
        workload, backend, cfg, keys, with_prior=model is not None)
    parts = [workload[k] for k in chosen]
    with torchrun_group() as group:
        several = group.world_size > 1
        for p in parts:
            if several and p.collective.group_size != group.world_size:
                raise KareusError(f"{p.key} runs over {p.collective.group_size} GPUs; launch "
                                  f"torchrun with --nproc-per-node {p.collective.group_size}")
        spec = (backend.for_rank(group.local_rank, group.device)
                if several and backend.capabilities.process_per_gpu else backend)
        # rank 0 journals; a group measured together decides on rank 0's numbers
        journaling = JournalPolicy(record=group.rank == 0,
                                   agree=group.agree if several else None)
        with Journal(journal) as store, open_measuring(
                spec, workload, store, group=group, policy=journaling) as measured:
            # without clock changes the job's one clock (the spec's check): the nvml
            # backend refuses to measure while the GPU runs another
            searches = []
            for p in parts:
                report = (lambda d, n, k=p.key: progress(k, d, n)) if progress else None
                searches.append(run_search(p, measured, job.freqs_mhz, cfg, model,
                                           progress=report,
                                           agree=group.agree if several else None))
            result = ProfileResult(searches, identity=measured.identity())
            if composition:
                result.steps = measure_composition(workload, measured, (
                    lambda d, n: progress(COMPOSITION, d, n)) if progress else None, policy,
                    model)
            cost = result.summarise(workload, measured.protocol)
            if group.rank == 0:
                store.record_profile_run(measured.job_id, measured.identity(), cost.to_dict())
        return result


def journal_frontiers(keys: Sequence[str], backend: JournaledBackend) -> KeyFrontiers:
    """Each partition's per-clock fronts from every setting the journal holds of it."""
    return key_frontiers({k: backend.samples(k) for k in keys})


def measure_composition(workload: Workload, backend: JournaledBackend,
                        report: Callable[[int, int], None] | None = None,
                        policy: FitPolicy | None = None, prior: CostModel | None = None
                        ) -> StepsOutcome:
    """Measure what composing every method needs and the journal lacks, journaling each
    number: the steps outside partitions as ``policy`` says (default: a few clocks per
    step measured, the others fitted; kareus.profiling.step_fit; through ``prior``'s
    shapes where it is given), one clock at a time
    from the highest; then the wait transients its plans charge. ``report(done, total)``
    after each step."""
    policy = policy or FitPolicy()
    composer = Composer(workload.partitions, backend, workload.job.freqs_mhz)
    methods = _runnable(workload)
    needs = composer.needs(methods, journal_frontiers(workload.keys, backend))
    todo = backend.lacks(needs)
    before = backend.measured
    outcome = StepsOutcome(needed=len(todo))
    done = 0
    if report is not None:
        report(0, len(todo))

    def measure(batch: Sequence[Need]) -> list[Measurement]:
        nonlocal done
        out = []
        for need in batch:
            got = backend.answer(need)
            if got.origin == "measured":
                outcome.charge(backend.protocol, need.knobs.freq_mhz)
            out.append(got.measurement)
            done += 1
            if report is not None:
                report(done, len(todo))
        return out

    fit = measure_steps(todo, measure, policy, prior)
    for need, (m, info) in fit.fitted.items():
        backend.store_fitted(need, m, info.time_rel_error, info.energy_rel_error,
                             info.measured_freqs_mhz)
        outcome.note_fit(info)
    outcome.fitted = len(fit.fitted)
    outcome.series, outcome.failed_series = fit.series, fit.failed_series
    if report is not None:
        report(len(todo), len(todo))
    # wait transients (kareus.compose.transient): which option runs after which wait is
    # known only when a plan is evaluated, so every method is composed once, as optimize
    # composes it; evaluating its plans measures and journals the transients they charge
    steps = backend.measured
    method_frontiers(composer, methods, journal_frontiers(workload.keys, backend))
    outcome.transients = backend.measured - steps
    outcome.measured = steps - before
    return outcome


def composition_needs(workload: Workload, backend: JournaledBackend) -> list[Need]:
    """What composing every method from the journal's partition measurements asks for and
    the journal lacks (nothing is measured)."""
    composer = Composer(workload.partitions, backend, workload.job.freqs_mhz)
    return backend.lacks(composer.needs(_runnable(workload),
                                        journal_frontiers(workload.keys, backend)))


def _runnable(workload: Workload) -> tuple[Method, ...]:
    """The methods composing can use on this job: with a microbatch not split into
    nanobatches, Megatron-LM's and Perseus's (no partition, no default overlap)."""
    return runnable_methods(all_methods(), workload.job)[0]
