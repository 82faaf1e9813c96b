"""What runs a partition's compute when the nvml (or fakegpu) backend measures it: the
*runtime*. Both run the same partition (its compute ops, its collective launched before
the slot's op on a side stream, joined at the end); they differ in whose code computes:

- ``kernels`` (default): the project's own kernels, one per compute op, at the job's
  per-rank shapes (kareus.gpu.kernels);
- ``megatron``: Megatron-Core's own modules of one decoder layer at the same per-rank
  shapes, through the Kareus layer's executor (kareus.integrations.megatron.profiling):
  the kernels a Megatron-Core training runs.

Measurements of different runtimes are journaled under different backend identities, so
their numbers never mix. Runtimes are entry points (``kareus.runtimes`` in pyproject.toml),
as backend kinds are (kareus.backends.registry): the Megatron one lives in an optional
integration above this layer and is imported only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kareus.core.registry import Registry
from kareus.job.spec import JobSpec
from kareus.workload.partition import Partition

Collective = Callable[[], object]


class Runner(Protocol):
    """One partition at one setting, run again and again inside a measurement window."""

    def run(self) -> None: ...

    def synchronize(self) -> None: ...


class PartitionRuntime(Protocol):
    """Builds runners for the partitions of one job on one device."""

    name: str

    def runner(self, partition: Partition, slot: str | None, collective: Collective
               ) -> Runner:
        """``partition``'s compute with ``collective`` launched before the op ``slot``
        names (None: after the last op)."""
        ...


class KernelRuntime:
    """The project's own kernels (kareus.gpu.kernels), built once per partition."""

    name = "kernels"

    def __init__(self, job: JobSpec, device: str) -> None:
        self.job, self.device = job, device
        self._kernels: dict[str, list] = {}

    def runner(self, partition: Partition, slot: str | None, collective: Collective
               ) -> Runner:
        from kareus.gpu.kernels import build_kernels
        from kareus.gpu.partition_runner import PartitionRunner

        kernels = self._kernels.get(partition.key)
        if kernels is None:
            kernels = self._kernels[partition.key] = build_kernels(partition, self.job,
                                                                   self.device)
        return PartitionRunner(kernels, collective, partition.launch_index(slot),
                               self.device)


RuntimeFactory = Callable[[JobSpec, str], PartitionRuntime]

def _missing_extra(name: str, exc: ImportError) -> str:
    return (f"the {name} runtime needs {exc.name or 'its extra'}: from a clone, "
            f"pip install -e '.[{name}]' (docs/megatron.md)")


RUNTIMES: Registry[RuntimeFactory] = Registry(
    "runtime", entry_points="kareus.runtimes", missing=_missing_extra)
"""Runtimes by name, each imported when first asked for (entry points)."""

DEFAULT_RUNTIME = KernelRuntime.name
"""What computes unless a spec names another; a backend identity names any other."""


def runtime_names() -> tuple[str, ...]:
    return RUNTIMES.names()


def runtime_class(name: str) -> RuntimeFactory:
    """The runtime ``name``; one line for an unknown one, or one whose extra is missing."""
    return RUNTIMES.get(name)


def check_runtime(name: str, job: JobSpec) -> None:
    """Fail before any work when the runtime cannot run ``job``."""
    runtime = runtime_class(name)
    check = getattr(runtime, "check_job", None)
    if check is not None:
        check(job)
