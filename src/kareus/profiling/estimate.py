"""`kareus profile --dry-run`: what a profile will measure and cost, before anything runs.

Counts, per kind:
- partition settings: the search's budget per partition (every setting for an exhaustive
  profile), less what the journal holds of it: an upper bound, since the search stops
  early once its hypervolume stops improving;
- the steps outside partitions: the numbers composition needs and the journal lacks,
  planned as the run plans them (`kareus.profiling.step_fit.measure_steps`, through the
  prior where the profile has one) with the noise-free emulator answering each
  measurement: the anchors, held-out clocks and throttled tops the run measures where the
  GPU behaves as the emulator predicts (a limiter the emulator does not foresee costs
  more: docs/gpu.md); the bound if every fit failed is every clock;
- settles: the search measures each batch one clock at a time, so a batch of ``b``
  settings over ``F`` clocks takes the expected number of distinct clocks,
  ``F (1 - (1 - 1/F)^b)``; the steps' settles are those of the planned run.

What the journal holds is subtracted where the backend opens on this machine (the
emulator, a replay); a real GPU's journal entries are keyed by its identity, which needs
the GPU, so its estimate is of a profile from scratch. Nothing here opens a GPU: a real
GPU's estimate counts the job's clocks (the hardware catalog's table, or --freqs), which
are the clocks its run searches, and says so; it runs without NVML.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from kareus.backends.base import Backend
from kareus.backends.journaled import JournaledBackend
from kareus.backends.measuring import READ_ONLY, journal_first, open_measuring
from kareus.backends.needs import Need, measure_need
from kareus.backends.registry import BackendSpec, model_spec
from kareus.core import Measurement, MeasurementProtocol
from kareus.job.spec import JobSpec
from kareus.profiling.cost import (
    CostSummary,
    StepsOutcome,
    expected_clock_changes,
    group_gpus,
)
from kareus.profiling.executors import ExecutorSpec
from kareus.profiling.profile import composition_needs
from kareus.profiling.step_fit import FitPolicy, measure_steps
from kareus.search.config import get_strategy
from kareus.search.loop import SearchConfig
from kareus.store import journal_exists
from kareus.workload.workload import Workload


def estimate_profile(workload: Workload, journal: str, backend: BackendSpec,
                     config: SearchConfig, keys: Sequence[str], composition: bool = True,
                     policy: FitPolicy | None = None, executor: ExecutorSpec | None = None,
                     prior: str | None = None) -> CostSummary:
    """The cost of ``kareus profile`` with these inputs (checked by the caller).
    ``prior``: the profile's (its steps are fitted through it, kareus.profiling.prior_fit;
    its searches' initial design is the prior's size where the configuration sets none)."""
    policy = policy or FitPolicy()
    job = workload.job
    protocol = backend.protocol or MeasurementProtocol()
    nf = len(job.freqs_mhz)
    with ExitStack() as stack:
        measured = _journaled(workload, journal, backend, stack)
        settings, part_cost, part_costs, changes = 0, 0.0, [], 0.0
        for k in keys:
            space = workload[k].knob_space_size(nf)
            held = len(measured.samples(k)) if measured is not None else 0
            n = max(0, (space if get_strategy(config.strategy).fills_space
                        else min(config.budget, space)) - held)
            settles = _search_settles(n, nf, config, prior is not None)
            cost = _protocol_s(protocol, n, settles)
            changes += settles
            settings += n
            part_cost += cost
            part_costs.append(cost)
        steps, bound, steps_cost, step_changes = (
            _steps(workload, measured, policy, protocol, prior is not None) if composition
            else (0, 0, 0.0, 0))
    parallel = len(keys) if executor is not None and executor.distributed and keys else 1
    wall = (max(part_costs, default=0.0) if parallel > 1 else part_cost) + steps_cost
    return CostSummary(
        partition_settings=settings, partition_cost_s=part_cost, steps_measured=steps,
        steps_fitted=bound - steps, steps_cost_s=steps_cost, transients=0,
        group_gpus=group_gpus(workload), gpus_per_node=job.gpus_per_node, parallel_groups=parallel,
        wall_s=wall, protocol=protocol, estimate=True, partitions=len(keys),
        clock_changes=changes + step_changes, steps_upper_bound=bound,
        **_clocks(job) if backend.capabilities.real_gpu else {})


def _clocks(job: JobSpec) -> dict[str, Any]:
    """The clocks a real GPU's estimate counts: the job's (the run searches the same), from
    the hardware catalog or --freqs; the estimate reads no GPU, so says which."""
    return {"clocks_mhz": job.freqs_mhz,
            "clocks_from": "--freqs" if job.search_freqs_mhz is not None
            else f"catalog:{job.gpu_spec.name}"}


def _protocol_s(protocol: MeasurementProtocol, measurements: int, clock_changes: float
                ) -> float:
    """Protocol seconds of measurements taken one after another, ``clock_changes`` of them
    at another clock than the one before (`MeasurementProtocol.cost_s`)."""
    return (clock_changes * protocol.cost_s(clock_changed=True)
            + (measurements - clock_changes) * protocol.cost_s(clock_changed=False))


def _journaled(workload: Workload, journal: str, backend: BackendSpec, stack: ExitStack
               ) -> JournaledBackend | None:
    """The journal through the profile's backend, where it opens here and the journal
    exists (read only); else None: nothing is subtracted."""
    if backend.capabilities.real_gpu or not journal_exists(journal):
        return None
    return stack.enter_context(open_measuring(backend, workload, journal, policy=READ_ONLY))


def _search_settles(n: int, clocks: int, config: SearchConfig, with_prior: bool) -> float:
    """Expected clock changes of a search measuring ``n`` settings: its initial design,
    then batches, each measured one clock at a time."""
    if get_strategy(config.strategy).fills_space:
        return float(min(n, clocks))
    first = min(n, config.initial_size(with_prior))
    total = expected_clock_changes(first, clocks)
    left = n - first
    while left > 0:
        b = min(config.batch_size, left)
        total += expected_clock_changes(b, clocks)
        left -= b
    return total


def _steps(workload: Workload, measured: JournaledBackend | None, policy: FitPolicy,
           protocol: MeasurementProtocol, informed: bool) -> tuple[int, int, float, int]:
    """(measured, measured at most, protocol seconds, clock changes) of the steps outside
    partitions. Which steps the power limiter holds below their clock (measured at the
    top clocks rather than fitted) is the noise-free emulator's prediction. ``informed``:
    the steps are fitted through the emulator prior (kareus.profiling.prior_fit)."""
    with model_spec().open(workload) as emulator:
        # nothing journaled: the needs' structure alone, which any backend enumerates
        backend = measured or journal_first(emulator, None, workload.job)
        return _count_steps(workload, backend, policy, protocol, emulator, informed)


def _count_steps(workload: Workload, backend: JournaledBackend, policy: FitPolicy,
                 protocol: MeasurementProtocol, predictor: Backend, informed: bool
                 ) -> tuple[int, int, float, int]:
    """The run's own planning (`measure_steps`, through the prior where ``informed``) with
    the noise-free emulator answering every measurement: the clocks, phases and settles
    the run takes where the GPU behaves as the emulator predicts."""
    todo = composition_needs(workload, backend)
    outcome = StepsOutcome()

    def measure(batch: Sequence[Need]) -> list[Measurement]:
        for need in batch:
            outcome.charge(protocol, need.knobs.freq_mhz)
        return [measure_need(predictor, need) for need in batch]

    def predict(need: Need) -> Measurement:
        return measure_need(predictor, need)

    report = measure_steps(todo, measure, policy, predict if informed else None)
    return len(report.measured), len(todo), outcome.cost_s, outcome.settles
