"""`kareus profile`: its inputs checked before any work starts (and before any progress
shows), then the profile run in this process (under torchrun: this rank of the group) or
on a Ray cluster (kareus.workflows.profile_ray)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kareus.backends.registry import BackendSpec
from kareus.errors import SpecError
from kareus.search.loop import SearchConfig
from kareus.store import Journal
from kareus.workflows.executors import ExecutorSpec
from kareus.workflows.profile import (
    ProfileProgress,
    ProfileResult,
    check_profile,
    profile,
    torchrun_rank,
)
from kareus.workflows.profile_ray import profile_ray
from kareus.workload.workload import Workload

PROFILE_STRATEGIES = ("mbo", "exhaustive")
"""A profile searches by MBO, or measures every setting."""


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

    @property
    def quiet(self) -> bool:
        """A torchrun rank other than 0: it measures and reports nothing."""
        return torchrun_rank() != 0

    def run(self, progress: ProfileProgress | None = None) -> ProfileResult:
        """On the Ray cluster when the executor is Ray, else in this process (under
        torchrun: this rank of the group)."""
        args = (self.workload, self.journal, self.backend, self.config, self.keys, progress,
                self.composition)
        if self.executor is not None and self.executor.distributed:
            return profile_ray(*args, executor=self.executor, retries=self.retries,
                               checked=True)
        return profile(*args, checked=True)


def prepare_profile(workload: Workload, journal: str, backend: BackendSpec,
                    config: SearchConfig, keys: Sequence[str] | None = None,
                    composition: bool = True, executor: ExecutorSpec | None = None,
                    retries: int = 2) -> ProfileRun:
    """`kareus profile`, checked before any work starts (and before any progress shows):
    the journal opens, the keys exist, the backend's and the search's settings hold (on
    Ray the GPU is checked where it opens, on a rank)."""
    if config.strategy not in PROFILE_STRATEGIES:
        raise SpecError(f"--strategy must be {' or '.join(PROFILE_STRATEGIES)}, got "
                        f"{config.strategy!r}")
    if retries < 0:
        raise SpecError(f"--ray-retries must be >= 0, got {retries}")
    Journal(journal).close()
    distributed = executor is not None and executor.distributed
    if executor is not None:
        executor.check()
    chosen = check_profile(workload, backend, config, keys, here=not distributed)
    return ProfileRun(workload, journal, backend, config, chosen, composition, executor,
                      retries)
