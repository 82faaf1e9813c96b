"""The nvml kind and its CPU stand-in fakegpu: their options, the checks before any work
starts (a GPU, its driver, the permissions asked for), and opening the device under its
clock and power-limit guards. The measuring itself is `kareus.backends.nvml.backend`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar

from kareus.backends.base import Backend
from kareus.backends.nvml.backend import CollectiveFactory, NvmlBackend
from kareus.backends.options import option
from kareus.backends.registry import Agree, BackendSpec, Capabilities, Provenance
from kareus.errors import KareusError, SpecError
from kareus.gpu.clock_guard import ClockGuard
from kareus.gpu.device import GPUDevice
from kareus.gpu.kernels import import_torch
from kareus.gpu.power_guard import PowerLimitGuard
from kareus.gpu.runtimes import DEFAULT_RUNTIME, check_runtime
from kareus.job.spec import JobSpec
from kareus.workload.workload import Workload


@dataclass(frozen=True)
class NvmlSpec(BackendSpec):
    """A real NVIDIA GPU: PyTorch kernels, energy from Zeus/NVML (the gpu extra)."""

    kind: ClassVar[str] = "nvml"
    summary: ClassVar[str] = "a real NVIDIA GPU (the gpu extra)"
    capabilities: ClassVar[Capabilities] = Capabilities(
        real_gpu=True, process_per_gpu=True, profiles_first=True)
    provenance: ClassVar[Provenance] = Provenance(
        "gpu", "measured on GPUs: their timings and NVML energy counters")
    allow_clock_changes: bool = option(
        False, flag="--allow-clock-changes", help="Real GPUs: let Kareus lock SM clocks "
        "(always reset on exit). Without it no clock is touched.")
    """Kareus may lock SM clocks (always reset on exit)."""
    power_limit_w: float | None = option(
        None, flag="--power-limit-w", positive=True, help="Real GPUs: measure with the "
        "board power limit set to this many watts (needs --allow-power-limit-changes; "
        "restored on exit; journaled as another backend). A profile per limit gives "
        "Megatron-LM under a power limit (docs/power.md).")
    """Measure with the board power limit set to this (kareus.gpu.power_guard); None: the
    limit in force is not touched."""
    allow_power_limit_changes: bool = option(
        False, flag="--allow-power-limit-changes", help="Real GPUs: let Kareus set the "
        "board power limit (always restored on exit).")
    """Kareus may set the board power limit (always restored on exit)."""
    gpu_index: int = option(0, flag="--gpu-index", help="Real GPUs: which GPU.")
    torch_device: str | None = None
    """Where the kernels run (default ``cuda:<gpu_index>``)."""
    runtime: str = option(
        DEFAULT_RUNTIME, flag="--runtime", help="Real GPUs (and fakegpu): whose code computes a "
        "partition: kernels (the project's own, the default) or megatron (Megatron-Core's "
        "own modules, what its training runs: the megatron extra, docs/megatron.md). "
        "Journaled as another backend.")
    """Whose code computes a partition: the project's kernels, or ``megatron``:
    Megatron-Core's modules (kareus.gpu.runtimes; the megatron extra)."""

    def check(self, job: JobSpec, here: bool = True) -> None:
        super().check(job, here)
        if self.gpu_index < 0:
            raise SpecError(f"--gpu-index must be >= 0, got {self.gpu_index}")
        if self.power_limit_w is not None and not self.power_limit_w > 0:
            raise SpecError(f"--power-limit-w must be positive, got {self.power_limit_w:g}")
        if self.power_limit_w is not None and not self.allow_power_limit_changes:
            raise SpecError(f"--power-limit-w {self.power_limit_w:g} needs "
                            f"--allow-power-limit-changes (the limit is restored on exit)")
        if here:
            # no GPU, no NVML, no Zeus, no PyTorch: say so before any work starts, and
            # before asking for permissions that would not help
            self._check_device(job)
            import_torch()
        check_runtime(self.runtime, job)
        if len(job.freqs_mhz) > 1 and not self.allow_clock_changes:
            raise SpecError("a search over frequencies on a real GPU needs "
                            "--allow-clock-changes; without it, pass --freqs with the one "
                            "clock the GPU runs at")

    def _check_device(self, job: JobSpec) -> None:
        try:
            self._device(job)
        except KareusError as exc:
            raise SpecError(f"{exc}; --backend {self.kind} needs an NVIDIA GPU with its "
                            f"driver: without one, --backend fakegpu runs the same path on "
                            f"the CPU (docs/gpu.md)") from None

    def open(self, workload: Workload, collectives: CollectiveFactory | None = None,
             agree: Agree | None = None) -> AbstractContextManager[Backend]:
        return self._open(workload, collectives, agree)

    @contextmanager
    def _open(self, workload: Workload, collectives: CollectiveFactory | None,
              agree: Agree | None) -> Iterator[Backend]:
        job = workload.job
        device = self._device(job)
        with ExitStack() as stack:
            guard = stack.enter_context(ClockGuard(
                device, allow_changes=self.allow_clock_changes, lock_dir=self._lock_dir(stack)))
            if self.power_limit_w is not None:
                stack.enter_context(PowerLimitGuard(
                    device, allow_changes=self.allow_power_limit_changes)
                ).set(self.power_limit_w)
            yield NvmlBackend(job, device, guard, protocol=self.protocol,
                              torch_device=self.torch_device or self._default_device(),
                              collective=collectives, name=self.kind, agree=agree,
                              runtime=self.runtime, power_limit_w=self.power_limit_w)

    def for_rank(self, local_rank: int, device: str | None) -> NvmlSpec:
        return replace(self, gpu_index=local_rank, torch_device=self.torch_device or device)

    def _default_device(self) -> str:
        return f"cuda:{self.gpu_index}"

    def _lock_dir(self, stack: ExitStack) -> str | None:
        return None  # a real GPU's clock lock is the machine's

    def _device(self, job: JobSpec) -> GPUDevice:
        from kareus.gpu.device import ZeusDevice

        return ZeusDevice(self.gpu_index)


@dataclass(frozen=True)
class FakeGpuSpec(NvmlSpec):
    """nvml's whole path, real kernels included, on the CPU: a device in memory with the
    job's GPU's clock table and a power model from its catalog entry (TDP at the maximum
    clock, catalog static power) and a simulated energy counter."""

    kind: ClassVar[str] = "fakegpu"
    summary: ClassVar[str] = ("nvml's real kernels on the CPU with a simulated energy "
                              "counter (the GPU path without a GPU)")
    capabilities: ClassVar[Capabilities] = Capabilities(
        process_per_gpu=True, profiles_first=True)
    provenance: ClassVar[Provenance] = Provenance(
        "fake-gpu", "fake GPU: CPU timings and a fake energy counter; not a measurement of "
                    "any GPU")

    def _default_device(self) -> str:
        return "cpu"

    def _lock_dir(self, stack: ExitStack) -> str | None:
        # a fake GPU's clock lock lives in a directory of its own: fake GPUs of concurrent
        # processes share indices, real ones do not
        return stack.enter_context(tempfile.TemporaryDirectory())

    def _device(self, job: JobSpec) -> GPUDevice:
        from kareus.gpu.device import FakeDevice

        g = job.gpu_spec
        return FakeDevice(index=self.gpu_index, name=f"fake {g.name}",
                          default_clock_mhz=g.max_freq_mhz, clocks_mhz=g.clock_table_mhz,
                          power_w=g.tdp_w, static_power_w=g.static_power_w)
