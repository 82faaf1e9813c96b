"""One GPU as Kareus uses it: clocks, the energy counter, the current clock.

`ZeusDevice` drives a real GPU through Zeus's device API (which wraps NVML); `FakeDevice`
is the null object of the tests, of dry runs and of the ``fakegpu`` backend: it records
every call, keeps clocks in memory, and integrates a power model into its energy counter
(constant by default; with ``static_power_w`` set, static power plus a dynamic part that
scales with the locked clock as f^2.5, the usual f·V² with voltage rising with f).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kareus.errors import KareusError

GPU_EXTRA = ("from a clone, pip install -e '.[gpu]' (Zeus, NVML and PyTorch: a CUDA build "
             "unless a PyTorch is installed first; docs/gpu.md)")
"""How to install what real GPUs need (kareus is installed from a clone, not an index)."""


class GPUPermissionError(KareusError):
    """Changing clocks needs privileges this process does not have."""


@runtime_checkable
class GPUDevice(Protocol):
    index: int
    name: str

    def supported_clocks_mhz(self) -> tuple[int, ...]: ...

    def current_sm_clock_mhz(self) -> int: ...

    def set_locked_clocks(self, min_mhz: int, max_mhz: int) -> None: ...

    def reset_locked_clocks(self) -> None: ...

    def energy_j(self) -> float:
        """Total energy counter since an arbitrary origin, in joules."""
        ...

    def power_limit_w(self) -> float:
        """The board power limit now in force, in watts."""
        ...

    def power_limit_range_w(self) -> tuple[float, float]:
        """The lowest and highest power limit the board accepts, in watts."""
        ...

    def set_power_limit_w(self, watts: float) -> None: ...


@dataclass
class FakeDevice:
    """A GPU that exists only in memory. ``power_w`` feeds the energy counter."""

    index: int = 0
    name: str = "FakeGPU"
    default_clock_mhz: int = 1410
    clocks_mhz: tuple[int, ...] = tuple(range(1410, 209, -15))
    power_w: float = 200.0
    state_path: str | None = None
    """If set, the clock state is written there after every call (so a test can read what
    a killed process left behind)."""
    static_power_w: float | None = None
    """None: the counter integrates ``power_w`` whatever the clock."""
    calls: list[tuple] = field(default_factory=list)
    locked: tuple[int, int] | None = None
    limit_w: float | None = None
    """The board power limit (None: ``power_w``, the default); the counter's power is
    capped at it."""
    min_limit_w: float = 100.0
    _t_last: float = field(default_factory=time.monotonic)
    _energy_j: float = 0.0

    def power_at(self, freq_mhz: int) -> float:
        """The power model: ``power_w`` at the default clock, at most the power limit."""
        if self.static_power_w is None:
            return min(self.power_w, self.power_limit_w())
        dynamic = max(self.power_w - self.static_power_w, 0.0)
        return min(self.static_power_w + dynamic * (freq_mhz / self.default_clock_mhz) ** 2.5,
                   self.power_limit_w())

    def _integrate(self) -> None:
        now = time.monotonic()
        self._energy_j += (now - self._t_last) * self.power_at(self.current_sm_clock_mhz())
        self._t_last = now

    def _save(self) -> None:
        if self.state_path:
            import json

            with open(self.state_path, "w") as f:
                json.dump({"locked": self.locked, "limit_w": self.limit_w,
                           "calls": self.calls}, f)

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        return self.clocks_mhz

    def current_sm_clock_mhz(self) -> int:
        return self.locked[1] if self.locked else self.default_clock_mhz

    def set_locked_clocks(self, min_mhz: int, max_mhz: int) -> None:
        self._integrate()
        self.calls.append(("set_locked_clocks", min_mhz, max_mhz))
        self.locked = (min_mhz, max_mhz)
        self._save()

    def reset_locked_clocks(self) -> None:
        self._integrate()
        self.calls.append(("reset_locked_clocks",))
        self.locked = None
        self._save()

    def energy_j(self) -> float:
        self._integrate()
        return self._energy_j

    def power_limit_w(self) -> float:
        return self.power_w if self.limit_w is None else self.limit_w

    def power_limit_range_w(self) -> tuple[float, float]:
        return self.min_limit_w, self.power_w

    def set_power_limit_w(self, watts: float) -> None:
        self._integrate()
        self.calls.append(("set_power_limit_w", watts))
        self.limit_w = watts
        self._save()

    @property
    def clock_calls(self) -> list[tuple]:
        return [c for c in self.calls if c[0] in ("set_locked_clocks", "reset_locked_clocks")]


class ZeusDevice:
    """A real NVIDIA GPU through Zeus's device API (imported lazily)."""

    def __init__(self, index: int = 0) -> None:
        _require_nvidia_gpu(index)
        try:
            from zeus.device import get_gpus
        except ImportError:
            raise KareusError(f"the nvml backend needs Zeus: {GPU_EXTRA}") from None
        try:
            self._gpus = get_gpus()
            self.index = index
            self.name = str(self._gpus.get_name(index))
        except Exception as exc:  # NVML raises its own error types
            raise KareusError(f"cannot open GPU {index}: {exc}") from None

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        mem = max(self._gpus.get_supported_memory_clocks(self.index))
        return tuple(sorted(self._gpus.get_supported_graphics_clocks(self.index, mem),
                            reverse=True))

    def current_sm_clock_mhz(self) -> int:
        import pynvml

        handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        return int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))

    def set_locked_clocks(self, min_mhz: int, max_mhz: int) -> None:
        try:
            self._gpus.set_gpu_locked_clocks(self.index, min_mhz, max_mhz)
        except Exception as exc:
            if _no_permission(exc):
                raise GPUPermissionError(
                    "setting GPU clocks needs root or the SYS_ADMIN capability "
                    "(or run without --allow-clock-changes)") from None
            raise KareusError(f"cannot lock GPU {self.index} clocks: {exc}") from None

    def reset_locked_clocks(self) -> None:
        try:
            self._gpus.reset_gpu_locked_clocks(self.index)
        except Exception as exc:
            raise KareusError(f"cannot reset GPU {self.index} clocks: {exc}") from None

    def energy_j(self) -> float:
        return float(self._gpus.get_total_energy_consumption(self.index)) / 1000.0

    def power_limit_w(self) -> float:
        return float(self._gpus.get_power_management_limit(self.index)) / 1000.0

    def power_limit_range_w(self) -> tuple[float, float]:
        lo, hi = self._gpus.get_power_management_limit_constraints(self.index)
        return float(lo) / 1000.0, float(hi) / 1000.0

    def set_power_limit_w(self, watts: float) -> None:
        try:
            self._gpus.set_power_management_limit(self.index, round(watts * 1000))
        except Exception as exc:
            if _no_permission(exc):
                raise GPUPermissionError(
                    "setting the GPU power limit needs root or the SYS_ADMIN capability "
                    "(or run without --power-limit-w)") from None
            raise KareusError(f"cannot set GPU {self.index}'s power limit: {exc}") from None


def _no_permission(exc: Exception) -> bool:
    """NVML refused a setting for want of privileges (Zeus passes NVML's error on)."""
    return "permission" in str(exc).lower() or "NoPermission" in type(exc).__name__


def _require_nvidia_gpu(index: int) -> None:
    """One clear line where there is no NVIDIA GPU (no driver, no device, no such index),
    before Zeus is asked: its own errors on such machines are AMD or NVML tracebacks."""
    try:
        import pynvml
    except ImportError:
        raise KareusError(f"the nvml backend needs NVML's Python binding: {GPU_EXTRA}"
                          ) from None
    try:
        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise KareusError(f"no NVIDIA GPU found (NVML: {exc})") from None
    if count == 0:
        raise KareusError("no NVIDIA GPU found (NVML sees no device)")
    if index >= count:
        raise KareusError(f"no NVIDIA GPU {index}: NVML sees {count} "
                          f"(indices 0-{count - 1})")
