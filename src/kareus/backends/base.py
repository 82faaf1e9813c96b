"""The two seams between measuring and planning.

- `Backend` measures: a partition at a setting and clock, or a run of ops outside
  partitions (embedding, LM head and loss, a solo first segment, an exposed last
  collective, pipeline send/receive, data-parallel sync), each back to back on the compute
  stream with collectives blocking it. It has an identity for the journal and a profiling
  cost. The emulator, the NVML backend (real GPUs) and the journal replay are Backends.
- `CostModel` predicts, deterministically (no noise, no GPU): the search's prior and, on
  machines without a GPU, the ground truth of validation. The emulator is one.

Search and composition see only these protocols (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from kareus.backends.needs import Answer, Need
from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.job.hardware import GPUSpec
from kareus.plans.execution import ExecutionPlan
from kareus.workload.ops import Op
from kareus.workload.partition import Partition


@runtime_checkable
class Backend(Protocol):
    name: str
    """"emulator", "nvml", "replay", ..."""

    @property
    def gpu(self) -> GPUSpec: ...

    @property
    def static_power_w(self) -> float:
        """Power of the GPU blocked in communication: static energy = it x time."""
        ...

    @property
    def protocol(self) -> MeasurementProtocol:
        """How one measurement is taken, hence what it costs on a real GPU."""
        ...

    @property
    def default_sms(self) -> int:
        """SMs (CTAs) a collective gets when nothing chooses them (NCCL's own choice)."""
        ...

    @property
    def supported_freqs_mhz(self) -> tuple[int, ...]: ...

    def identity(self) -> str:
        """What makes two measurements of the same thing comparable (journal key)."""
        ...

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        """One partition: its compute on the compute stream and its collective on the
        communication stream with ``knobs.sms`` SMs, launched before ``knobs.slot``."""
        ...

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        """Ops back to back on the compute stream; collectives among them block it and run
        with ``sms`` SMs (None: `default_sms`)."""
        ...


@runtime_checkable
class CostModel(Protocol):
    """Deterministic predictions: the same question always gets the same answer."""

    @property
    def gpu(self) -> GPUSpec: ...

    def predict(self, partition: Partition, knobs: Knobs) -> Measurement: ...

    def predict_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement: ...


@runtime_checkable
class JournalFirst(Backend, Protocol):
    """A Backend that looks in a journal before it measures (kareus.backends.journaled):
    each answer says whether it was measured now, taken from the journal, or filled in."""

    def holds(self, need: Need) -> bool:
        """The journal answers ``need`` without measuring."""
        ...

    def lacks(self, needs: Iterable[Need]) -> list[Need]:
        """What of ``needs`` the journal does not answer (nothing is measured)."""
        ...

    def answer(self, need: Need) -> Answer:
        """``need``'s measurement, journaled before it is returned, and its origin."""
        ...


class WrappedBackend:
    """Base of a Backend that wraps another (journal first, rank 0's numbers, ...): what
    describes the GPU and how it is measured is the inner backend's."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name

    @property
    def gpu(self) -> GPUSpec:
        return self.inner.gpu

    @property
    def static_power_w(self) -> float:
        return self.inner.static_power_w

    @property
    def protocol(self) -> MeasurementProtocol:
        return self.inner.protocol

    @property
    def default_sms(self) -> int:
        return self.inner.default_sms

    @property
    def supported_freqs_mhz(self) -> tuple[int, ...]:
        return self.inner.supported_freqs_mhz

    def identity(self) -> str:
        return self.inner.identity()


def backend_info(backend: Backend) -> dict[str, object]:
    """What a journal stores of a backend so that a replay can stand in for it."""
    pr = backend.protocol
    return {"name": backend.name, "gpu": backend.gpu.name,
            "static_power_w": backend.static_power_w, "default_sms": backend.default_sms,
            # whether it answers wait transients (kareus.backends.needs.TransientRun)
            "transients": hasattr(backend, "measure_transient"),
            "protocol": {"window_s": pr.window_s, "cooldown_s": pr.cooldown_s,
                         "settle_s": pr.settle_s}}


class SimulatedStage(Protocol):
    """One stage of a simulated iteration, per GPU."""

    @property
    def index(self) -> int: ...

    @property
    def busy_s(self) -> float: ...

    @property
    def dynamic_energy_j(self) -> float: ...


class SimulatedIteration(Protocol):
    """A whole iteration run continuously: totals over all GPUs, and per stage."""

    @property
    def time_s(self) -> float: ...

    @property
    def energy_j(self) -> float: ...

    @property
    def static_energy_j(self) -> float: ...

    @property
    def dynamic_energy_j(self) -> float: ...

    @property
    def num_gpus(self) -> int: ...

    @property
    def mean_power_per_gpu_w(self) -> float: ...

    @property
    def stages(self) -> Sequence[SimulatedStage]: ...

    def to_dict(self, with_instructions: bool = False) -> dict[str, Any]: ...

    def breakdown(self) -> list[dict[str, dict[str, float]]]:
        """Per stage, one GPU's time and energy by where they go (``{class: {"time_s",
        "energy_j"}}``); times add up to the iteration's."""
        ...


class PlanSimulator(Protocol):
    """Runs a whole plan as one continuous iteration (validation of composed plans)."""

    def run(self, plan: ExecutionPlan, with_instructions: bool = False
            ) -> SimulatedIteration: ...
