"""Opening a backend from plain settings (`BackendSpec`), as a context manager: a real
GPU's clocks are guarded for exactly as long as the backend is open. The spec is plain
data, so it crosses process boundaries (search workers, Ray tasks) as a dict."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kareus.backends.base import Backend, CostModel, PlanSimulator
from kareus.core import MeasurementProtocol
from kareus.errors import SpecError
from kareus.gpu.device import GPUDevice
from kareus.job.spec import JobSpec
from kareus.workload.ops import Collective

BACKENDS = ("emulator", "nvml", "replay", "fakegpu")
PRIORS = ("none", "emulator")


@dataclass(frozen=True)
class BackendSpec:
    """Where measurements come from, and how they are taken."""

    name: str = "emulator"
    noise: float = 0.0
    """Emulator: relative standard deviation of time and dynamic energy (0: exact)."""
    seed: int = 0
    """Emulator: seed of the noise."""
    calibration: str | None = None
    """Emulator: JSON file of fitted parameters."""
    allow_clock_changes: bool = False
    """nvml: Kareus may lock SM clocks (always reset on exit)."""
    gpu_index: int = 0
    replay_journal: str | None = None
    """replay: the journal whose measurements are served."""
    replay_identity: str | None = None
    """replay: which backend's measurements (needed when the journal holds several)."""
    protocol: MeasurementProtocol | None = None
    torch_device: str | None = None
    """nvml / fakegpu: where the kernels run (default ``cuda:<gpu_index>``; fakegpu: the
    CPU)."""

    def check(self, job: JobSpec) -> None:
        """Everything that can be checked before any work starts; SpecError otherwise."""
        if self.name not in BACKENDS:
            raise SpecError(f"unknown backend {self.name!r}; available: {', '.join(BACKENDS)}")
        if not 0 <= self.noise <= 0.5:
            raise SpecError(f"noise must be between 0 and 0.5, got {self.noise}")
        pr = self.protocol
        if pr is not None and not (math.isfinite(pr.window_s + pr.cooldown_s + pr.settle_s)
                                   and pr.window_s > 0 and pr.cooldown_s >= 0
                                   and pr.settle_s >= 0):
            raise SpecError(f"--window must be positive and --cooldown, --settle at least 0;"
                            f" got {pr.window_s}, {pr.cooldown_s}, {pr.settle_s}")
        if self.gpu_index < 0:
            raise SpecError(f"--gpu-index must be >= 0, got {self.gpu_index}")
        if (self.name in ("nvml", "fakegpu") and len(job.freqs_mhz) > 1
                and not self.allow_clock_changes):
            raise SpecError("a search over frequencies on a real GPU needs "
                            "--allow-clock-changes; without it, pass --freqs with the one "
                            "clock the GPU runs at")
        if self.name == "replay":
            if not self.replay_journal:
                raise SpecError("the replay backend needs --replay-journal JOURNAL")
            if not Path(self.replay_journal).is_file():
                raise SpecError(f"journal not found: {self.replay_journal}")
        if self.name == "nvml":
            from kareus.gpu.device import ZeusDevice

            ZeusDevice(self.gpu_index)  # no GPU, no Zeus: fail before any work starts
        if self.name == "emulator" and self.calibration is not None:
            from kareus.backends.emulator.params import load_params

            load_params(job.gpu_spec, self.calibration)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> BackendSpec:
        d = dict(doc)
        if d.get("protocol") is not None:
            d["protocol"] = MeasurementProtocol(**d["protocol"])
        return cls(**d)


@contextmanager
def open_backend(job: JobSpec, spec: BackendSpec | None = None,
                 collectives: Callable[[Collective, int], Callable[[], object]] | None = None,
                 agree: Callable[[int], int] | None = None) -> Iterator[Backend]:
    """``collectives``: real GPUs, a factory of the partitions' NCCL collectives (profiling
    a TP/CP group under torchrun); None runs a single-GPU stand-in. ``agree``: rank 0's
    value on every rank of that group (so that all run each window equally often)."""
    spec = spec or BackendSpec()
    if spec.name == "emulator":
        from kareus.backends.emulator import EmulatorBackend

        yield EmulatorBackend(job, calibration=spec.calibration, noise=spec.noise,
                              seed=spec.seed, protocol=spec.protocol)
        return
    if spec.name == "replay":
        from kareus.backends.replay import ReplayBackend

        if spec.replay_journal is None:
            raise SpecError("the replay backend needs --replay-journal JOURNAL")
        yield ReplayBackend(spec.replay_journal, job, spec.replay_identity)
        return
    if spec.name in ("nvml", "fakegpu"):
        from kareus.backends.nvml import NvmlBackend
        from kareus.gpu.clock_guard import ClockGuard

        device = _device(job, spec)
        where = spec.torch_device or ("cpu" if spec.name == "fakegpu"
                                      else f"cuda:{spec.gpu_index}")
        with ExitStack() as stack:
            # a fake GPU's clock lock lives in a directory of its own: fake GPUs of
            # concurrent processes share indices, real ones do not
            lock_dir = (None if spec.name == "nvml"
                        else stack.enter_context(tempfile.TemporaryDirectory()))
            guard = stack.enter_context(
                ClockGuard(device, allow_changes=spec.allow_clock_changes, lock_dir=lock_dir))
            yield NvmlBackend(job, device, guard, protocol=spec.protocol,
                              torch_device=where, collective=collectives, name=spec.name,
                              agree=agree)
        return
    raise SpecError(f"unknown backend {spec.name!r}; available: {', '.join(BACKENDS)}")


def _device(job: JobSpec, spec: BackendSpec) -> GPUDevice:
    """The real GPU, or for ``fakegpu`` one in memory with the job's GPU's clock table and
    a power model from its catalog entry (TDP at the maximum clock, catalog static power):
    the whole real-GPU path, kernels included, on any machine."""
    if spec.name == "nvml":
        from kareus.gpu.device import ZeusDevice

        return ZeusDevice(spec.gpu_index)
    from kareus.gpu.device import FakeDevice

    g = job.gpu_spec
    return FakeDevice(index=spec.gpu_index, name=f"fake {g.name}",
                      default_clock_mhz=g.max_freq_mhz, clocks_mhz=g.clock_table_mhz,
                      power_w=g.tdp_w, static_power_w=g.static_power_w)


def nominal_cost_model(job: JobSpec, calibration: str | Path | None = None) -> CostModel:
    """The emulator with its nominal (or calibrated) constants, without noise: the search
    prior and, on machines without a GPU, the ground truth of validation."""
    from kareus.backends.emulator import EmulatorBackend

    return EmulatorBackend(job, calibration=calibration)


def check_prior(name: str | None) -> None:
    if name not in (None, *PRIORS):
        raise SpecError(f"unknown prior {name!r}; available: {', '.join(PRIORS)}")


def open_prior(name: str | None, job: JobSpec) -> CostModel | None:
    check_prior(name)
    if name in (None, "none"):
        return None
    return nominal_cost_model(job)


def plan_simulator(job: JobSpec, calibration: str | Path | None = None) -> PlanSimulator:
    """The emulator's whole-iteration simulation, noise-free."""
    from kareus.backends.emulator import EmulatorBackend
    from kareus.backends.emulator.iteration import IterationSimulator
    from kareus.workload.partition import PartitionSet

    return IterationSimulator(PartitionSet.from_job(job),
                              EmulatorBackend(job, calibration=calibration))
