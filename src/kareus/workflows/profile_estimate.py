"""`kareus profile --dry-run`: what a profile will measure and cost, before anything runs.

Counts, per kind:
- partition settings: the search's budget per partition (every setting for an exhaustive
  profile), less what the journal holds of it: an upper bound, since the search stops
  early once its hypervolume stops improving;
- the steps outside partitions: the numbers composition needs and the journal lacks,
  grouped by step, each measured at the clocks `kareus.workflows.step_fit` plans (the
  anchors and a held-out clock, and every clock above the highest anchor the power
  limiter does not hold down, as the noise-free emulator predicts it for the job's GPU)
  and fitted at the others; with the prior, the two ends of the range the emulator
  predicts free of the limiter, a held-out clock, and every clock above the range (a
  limiter the emulator does not foresee costs more than this: docs/gpu.md); the bound if
  every fit failed is every clock;
- settles: the search measures each batch one clock at a time, so a batch of ``b``
  settings over ``F`` clocks takes the expected number of distinct clocks,
  ``F (1 - (1 - 1/F)^b)``; the steps are measured phase by phase, one clock at a time.

What the journal holds is subtracted where the backend opens on this machine (the
emulator, a replay); a real GPU's journal entries are keyed by its identity, which needs
the GPU, so its estimate is of a profile from scratch.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from kareus.backends.base import Backend
from kareus.backends.journaled import JournaledBackend
from kareus.backends.needs import Need, measure_need
from kareus.backends.registry import BackendSpec, spec_from_options
from kareus.compose.options import Composer, key_frontiers
from kareus.core import MeasurementProtocol
from kareus.search.loop import SearchConfig
from kareus.store import Journal
from kareus.workflows.executors import ExecutorSpec
from kareus.workflows.prior_fit import informed_range
from kareus.workflows.profile import _runnable
from kareus.workflows.profile_cost import CostSummary, expected_clock_changes, group_gpus
from kareus.workflows.step_fit import (
    FitPolicy,
    held_down,
    plan_anchors,
    planned_clocks,
    series_key,
)
from kareus.workload.workload import Workload


def estimate_profile(workload: Workload, journal: str, backend: BackendSpec,
                     config: SearchConfig, keys: Sequence[str], composition: bool = True,
                     policy: FitPolicy | None = None, executor: ExecutorSpec | None = None,
                     prior: str | None = None) -> CostSummary:
    """The cost of ``kareus profile`` with these inputs (checked by the caller).
    ``prior``: the profile's (its steps are fitted through it, kareus.workflows.prior_fit;
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
            n = max(0, (space if config.strategy == "exhaustive"
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
        clock_changes=changes + step_changes, steps_upper_bound=bound)


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
    if backend.capabilities.real_gpu or not Path(journal).is_file():
        return None
    store = stack.enter_context(Journal(journal))
    inner = stack.enter_context(backend.open(workload))
    return JournaledBackend(inner, store, store.register_job(workload.job), record=False)


def _search_settles(n: int, clocks: int, config: SearchConfig, with_prior: bool) -> float:
    """Expected clock changes of a search measuring ``n`` settings: its initial design,
    then batches, each measured one clock at a time."""
    if config.strategy == "exhaustive":
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
    the steps are fitted through the emulator prior (kareus.workflows.prior_fit)."""
    with spec_from_options("emulator", {}).open(workload) as emulator:
        # nothing journaled: the needs' structure alone, which any backend enumerates
        backend = measured or JournaledBackend.in_memory(emulator, workload.job)
        return _count_steps(workload, backend, policy, protocol, emulator, informed)


def _count_steps(workload: Workload, backend: JournaledBackend, policy: FitPolicy,
                 protocol: MeasurementProtocol, predictor: Backend, informed: bool
                 ) -> tuple[int, int, float, int]:
    composer = Composer(workload.partitions, backend, workload.job.freqs_mhz)
    fronts = key_frontiers({k: backend.samples(k) for k in workload.keys})
    todo = [n for n in backend.lacks(composer.needs(_runnable(workload), fronts))
            if n.transient is None]
    series: dict[tuple, list[Need]] = {}
    for n in todo:
        series.setdefault(series_key(n), []).append(n)
    clocks_of = {k: sorted({n.knobs.freq_mhz for n in v}, reverse=True)
                 for k, v in series.items()}
    first: set[int] = set()  # clocks of the first phase: anchors and steps measured whole
    checks: set[int] = set()  # of the second: held-out clocks and throttled tops
    measured = 0
    for k, clocks in clocks_of.items():
        plan, anchors = _planned(series[k], clocks, policy, predictor, informed)
        measured += len(plan)
        first.update(anchors if len(plan) < len(clocks) else plan)
        if len(plan) < len(clocks):
            checks.update(set(plan) - set(anchors))
    # measured phase by phase (kareus.workflows.step_fit), each one clock at a time
    changes = len(first) + len(checks)
    return measured, len(todo), _protocol_s(protocol, measured, changes), changes


def _planned(needs: Sequence[Need], clocks: list[int], policy: FitPolicy,
             predictor: Backend, informed: bool) -> tuple[list[int], list[int]]:
    """The clocks a series is measured at where every fit passes, and its anchors.
    Through the prior: the ends of the clocks it predicts free of the power limiter and a
    held-out clock, with every clock above them (the limiter measured, not fitted)."""
    if informed and policy.enabled:
        at = {n.knobs.freq_mhz: n for n in needs}
        free = informed_range(at, {f: measure_need(predictor, n) for f, n in at.items()},
                              held_down)
        if len(free) >= policy.min_clocks:
            plan = planned_clocks(free, policy, informed=True)
            top = [f for f in clocks if f not in free]
            return top + plan, top + plan_anchors(free, policy.informed_anchors)
    plan = planned_clocks(clocks, policy)
    anchors = plan_anchors(clocks, policy.anchors)
    if len(plan) < len(clocks):
        plan = plan + _throttled_top(needs, anchors, plan, predictor)
    return plan, anchors


def _throttled_top(needs: Sequence[Need], anchors: Sequence[int], planned: Sequence[int],
                   predictor: Backend) -> list[int]:
    """The clocks `measure_steps` measures beyond ``planned`` because an anchor is held
    below its clock: every clock above the highest anchor that is not (predicted)."""
    at = {n.knobs.freq_mhz: n for n in needs}
    throttled = {f for f in anchors if held_down(measure_need(predictor, at[f]), f)}
    if not throttled:
        return []
    top_free = max((f for f in anchors if f not in throttled), default=min(at))
    return [f for f in sorted(at, reverse=True) if f > top_free and f not in planned]
