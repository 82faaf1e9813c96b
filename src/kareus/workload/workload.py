"""The workload: everything a command derives from a job, built and checked once.

A `Workload` holds the job spec, its execution graph, the memory each stage needs (checked
against the GPU when it is built: a job that does not fit is refused there, once) and the
partitions. Search, composition, profiling and reporting receive it instead of rebuilding
it from the job. It crosses a process boundary as its job (`to_job_dict`), and the other
side builds it again, once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kareus.job.spec import JobSpec, validate_job
from kareus.workload.graph import ExecutionGraph
from kareus.workload.memory import StageMemory, check_fits, stage_memory
from kareus.workload.partition import Partition, PartitionSet, build_partitions


@dataclass(frozen=True)
class Workload:
    job: JobSpec
    graph: ExecutionGraph = field(repr=False)
    memory: tuple[StageMemory, ...] = field(repr=False)
    partitions: PartitionSet = field(repr=False)

    @classmethod
    def build(cls, job: JobSpec) -> Workload:
        """The job's graph, memory check and partitions; SpecError if it does not fit."""
        graph = ExecutionGraph.from_job(job)
        check_fits(graph)
        return cls(job, graph, tuple(stage_memory(graph)), build_partitions(graph))

    @classmethod
    def from_job_dict(cls, doc: Mapping[str, Any]) -> Workload:
        """The other side of a process boundary: the job as JSON, validated, built."""
        return cls.build(validate_job(dict(doc)))

    def to_job_dict(self) -> dict[str, Any]:
        return self.job.model_dump(mode="json")

    @property
    def keys(self) -> list[str]:
        """The partition keys, in the order of the partitions."""
        return self.partitions.keys

    def __getitem__(self, key: str) -> Partition:
        """The partition ``key``; SpecError naming the keys if there is none."""
        return self.partitions[key]
