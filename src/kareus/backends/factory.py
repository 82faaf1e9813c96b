"""Opening a backend by name, as a context manager (a real GPU's clocks are guarded for
exactly as long as the backend is open)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kareus.backends.base import MeasurementProtocol
from kareus.errors import SpecError
from kareus.spec import JobSpec

BACKENDS = ("emulator", "nvml")


@contextmanager
def open_backend(job: JobSpec, name: str = "emulator", *, noise: float = 0.0, seed: int = 0,
                 calibration: str | Path | None = None, allow_clock_changes: bool = False,
                 gpu_index: int = 0, protocol: MeasurementProtocol | None = None
                 ) -> Iterator:
    if name == "emulator":
        from kareus.backends.emulator import EmulatorBackend

        yield EmulatorBackend(job, calibration=calibration, noise=noise, seed=seed,
                              protocol=protocol)
        return
    if name == "nvml":
        from kareus.backends.nvml import NvmlBackend
        from kareus.gpu.clock_guard import ClockGuard
        from kareus.gpu.device import ZeusDevice

        device = ZeusDevice(gpu_index)
        with ClockGuard(device, allow_changes=allow_clock_changes) as guard:
            yield NvmlBackend(job, device, guard, protocol=protocol,
                              torch_device=f"cuda:{gpu_index}")
        return
    raise SpecError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")


def check_frequency_search(backend_name: str, freqs: tuple[int, ...],
                           allow_clock_changes: bool) -> None:
    """A real GPU searches several clocks only when it may change them."""
    if backend_name == "nvml" and len(freqs) > 1 and not allow_clock_changes:
        raise SpecError("a search over frequencies on a real GPU needs --allow-clock-changes;"
                        " without it, pass --freqs with the one clock the GPU runs at")
