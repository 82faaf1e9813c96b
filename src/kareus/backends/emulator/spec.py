"""The emulator's kind: no GPU, deterministic for a seed, and a cost model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import ClassVar

from kareus.backends.base import Backend, CostModel, PlanSimulator
from kareus.backends.options import option
from kareus.backends.registry import (
    Agree,
    BackendSpec,
    Capabilities,
    CollectiveFactory,
    Provenance,
)
from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.workload.workload import Workload


@dataclass(frozen=True)
class EmulatorSpec(BackendSpec):
    kind: ClassVar[str] = "emulator"
    summary: ClassVar[str] = "no GPU, a model of the job's GPU"
    capabilities: ClassVar[Capabilities] = Capabilities(cost_model=True, anchors=True)
    provenance: ClassVar[Provenance] = Provenance(
        "emulator", "emulator: modelled times and energies of the job's GPU, no GPU "
                    "measured (docs/emulator.md)")
    noise: float = option(0.0, flag="--noise", help="Emulator measurement noise: relative "
                          "std of time and dynamic energy.")
    """Relative standard deviation of time and dynamic energy (0: exact)."""
    calibration: str | None = option(None, flag="--calibration", help="JSON file of fitted "
                                     "emulator parameters.")
    """JSON file of fitted parameters (`kareus calibrate --backend nvml --out`)."""

    def check(self, job: JobSpec, here: bool = True) -> None:
        super().check(job, here)
        if not 0 <= self.noise <= 0.5:
            raise SpecError(f"noise must be between 0 and 0.5, got {self.noise}")
        if self.calibration is not None:
            from kareus.backends.emulator.params import load_params

            load_params(job.gpu_spec, self.calibration)

    def open(self, workload: Workload, collectives: CollectiveFactory | None = None,
             agree: Agree | None = None) -> AbstractContextManager[Backend]:
        return self._open(workload)

    @contextmanager
    def _open(self, workload: Workload) -> Iterator[Backend]:
        # the backend and what measures its wait transients, wired here: the transients
        # run the whole-iteration simulator, which is built on the backend
        from kareus.backends.emulator.transient import emulator_for

        yield emulator_for(workload, calibration=self.calibration, noise=self.noise,
                           seed=self.seed, protocol=self.protocol)

    def cost_model(self, job: JobSpec) -> CostModel:
        """The emulator with its nominal (or calibrated) constants, without noise."""
        from kareus.backends.emulator.backend import EmulatorBackend

        return EmulatorBackend(job, calibration=self.calibration)

    def plan_simulator(self, workload: Workload) -> PlanSimulator:
        """The emulator's whole-iteration simulation, noise-free."""
        from kareus.backends.emulator.backend import EmulatorBackend
        from kareus.backends.emulator.iteration import IterationSimulator

        return IterationSimulator(workload.partitions,
                                  EmulatorBackend(workload.job, calibration=self.calibration))

    def power_limited_simulator(self, workload: Workload, power_limit_w: float
                                ) -> PlanSimulator:
        """The same, its limiter holding ``power_limit_w`` per GPU instead of the TDP."""
        from kareus.backends.emulator.backend import EmulatorBackend
        from kareus.backends.emulator.iteration import IterationSimulator

        return IterationSimulator(workload.partitions, EmulatorBackend(
            workload.job, calibration=self.calibration, power_limit_w=power_limit_w))
