"""The fixed baseline plans `kareus simulate` runs (the full set of methods, with planned
clocks, is composed in kareus.compose.build):

``megatron`` (Megatron-LM: max clock, microbatches not split, every collective
blocks the compute stream) and ``nanobatch`` (every microbatch split in two; each
collective is launched as soon as its input is ready, i.e. before the first compute op of
the partition that hides it, with NCCL's default number of channels; max clock).
"""

from __future__ import annotations

from kareus.errors import SpecError
from kareus.execution import ExecutionPlan
from kareus.spec import JobSpec

BASELINES = ("megatron", "nanobatch")


def baseline_plan(method: str, job: JobSpec, freq_mhz: int | None = None) -> ExecutionPlan:
    """The plan a baseline method runs, at max clock unless ``freq_mhz`` is given."""
    gpu = job.gpu_spec
    f = gpu.check_freq(freq_mhz) if freq_mhz is not None else gpu.max_freq_mhz
    if method == "megatron":
        return ExecutionPlan("megatron", overlap=False, default_freq_mhz=f)
    if method == "nanobatch":
        return ExecutionPlan("nanobatch", overlap=True, default_freq_mhz=f, default_slot="first")
    raise SpecError(f"unknown method {method!r}; known: {', '.join(BASELINES)}")
