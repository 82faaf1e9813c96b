"""`kareus profile`: its inputs checked before any work starts (and before any progress
shows), then the profile run in this process (under torchrun: this rank of the group) or
on a Ray cluster (kareus.profiling.ray_driver)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kareus.backends.registry import BackendSpec, check_prior
from kareus.core.lock import Lock
from kareus.errors import SpecError
from kareus.profiling.cost import CostSummary
from kareus.profiling.estimate import estimate_profile
from kareus.profiling.executors import ExecutorSpec, check_journal, journal_lock
from kareus.profiling.profile import (
    ProfileProgress,
    ProfileResult,
    check_profile,
    profile,
    torchrun_rank,
)
from kareus.profiling.ray_driver import profile_ray
from kareus.profiling.step_fit import FitPolicy
from kareus.search.config import STRATEGIES, get_strategy
from kareus.search.loop import SearchConfig
from kareus.workload.workload import Workload


def profile_strategies() -> tuple[str, ...]:
    """The strategies a profile may search with (`Strategy.profiles`)."""
    return tuple(name for name, s in STRATEGIES.items() if s.profiles)


@dataclass
class ProfileRun:
    """A profile whose inputs were checked: `run` measures."""

    workload: Workload
    journal: str
    backend: BackendSpec
    config: SearchConfig
    keys: list[str]
    composition: bool
    executor: ExecutorSpec | None
    retries: int
    policy: FitPolicy = field(default_factory=FitPolicy)
    """How the steps outside partitions are measured."""
    prior: str | None = None
    """The kind of cost model whose predictions inform the searches and the steps' fits."""
    lock: Lock | None = None
    """The journal's lock (`journal_lock`), taken by `prepare_profile` once every input
    was checked, released when `run` ends; None on a torchrun rank other than 0."""
    estimated: CostSummary | None = None
    """The estimate `prepare_profile` made (a dry run, or to check ``max_hours``)."""

    @property
    def quiet(self) -> bool:
        """A torchrun rank other than 0: it measures and reports nothing."""
        return torchrun_rank() != 0

    def estimate(self) -> CostSummary:
        """What the run will measure and cost (`kareus profile --dry-run`): the one
        `prepare_profile` made, or made now (the journal read, nothing written)."""
        if self.estimated is not None:
            return self.estimated
        return estimate_profile(self.workload, self.journal, self.backend, self.config,
                                self.keys, self.composition, self.policy, self.executor,
                                self.prior)

    def run(self, progress: ProfileProgress | None = None) -> ProfileResult:
        """On the Ray cluster when the executor is Ray, else in this process (under
        torchrun: this rank of the group). Rank 0 holds the journal's lock throughout."""
        held = self.lock
        if not self.quiet and (held is None or not held.held):
            held = self.lock = journal_lock(self.journal)
        args = (self.workload, self.journal, self.backend, self.config, self.keys, progress,
                self.composition)
        try:
            if self.executor is not None and self.executor.distributed:
                return profile_ray(*args, executor=self.executor, retries=self.retries,
                                   checked=True, policy=self.policy, prior=self.prior)
            return profile(*args, checked=True, policy=self.policy, prior=self.prior)
        finally:
            if held is not None:
                held.release()


def prepare_profile(workload: Workload, journal: str, backend: BackendSpec,
                    config: SearchConfig, keys: Sequence[str] | None = None,
                    composition: bool = True, executor: ExecutorSpec | None = None,
                    retries: int = 2, policy: FitPolicy | None = None,
                    dry_run: bool = False, prior: str | None = None,
                    max_hours: float | None = None) -> ProfileRun:
    """`kareus profile`, checked before any work starts (and before any progress shows):
    the journal opens (or can be made: `check_journal`), the keys exist, the backend's and
    the search's settings hold (on Ray the GPU is checked where it opens, on a rank), the
    estimate is within ``max_hours`` node-hours; then, last, so that a refusal creates
    nothing, the journal is locked for the run (`journal_lock`; not for a dry run, nor on
    a torchrun rank other than 0, which does not write it)."""
    if max_hours is not None and not max_hours > 0:
        raise SpecError(f"--max-hours must be positive, got {max_hours}")
    if not get_strategy(config.strategy).profiles:
        raise SpecError(f"--strategy must be {' or '.join(profile_strategies())}, got "
                        f"{config.strategy!r}")
    if retries < 0:
        raise SpecError(f"--ray-retries must be >= 0, got {retries}")
    check_journal(journal)
    distributed = executor is not None and executor.distributed
    if executor is not None:
        executor.check()
    check_prior(prior)
    # a dry run opens no backend (its estimate is arithmetic over the job and the
    # protocol), so what only the backend's machine can check (a GPU, NVML) is not asked
    chosen = check_profile(workload, backend, config, keys,
                           here=not distributed and not dry_run, with_prior=prior is not None)
    if not chosen and not composition:
        raise SpecError(f"nothing to profile with --partitions-only: "
                        f"{workload.partitions.none_reason}")
    policy = policy or FitPolicy()
    policy.check()
    run = ProfileRun(workload, journal, backend, config, chosen, composition, executor,
                     retries, policy, prior)
    if not run.quiet and (dry_run or max_hours is not None):
        run.estimated = run.estimate()
        hours = run.estimated.node_hours
        if max_hours is not None and hours > max_hours:
            raise SpecError(f"the profile's estimate, {hours:.2f} node-hours "
                            f"({run.estimated.measurements:,} measurements), exceeds "
                            f"--max-hours {max_hours:g}; lower --budget, profile fewer "
                            f"--partition, or raise --max-hours")
    if not run.quiet and not dry_run:  # last: a refusal creates nothing
        run.lock = journal_lock(journal)
    return run
