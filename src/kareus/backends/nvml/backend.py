"""The real-GPU backend: a partition's real kernels, measured with the GPU's energy counter.

Measurement protocol (docs/anchors.md §4, configurable): lock the clock (only with
--allow-clock-changes); wait until `settle_s` has passed since a change and `cooldown_s`
since the previous window ended; warm up; repeat the partition for at least `window_s`
seconds between two reads of the energy counter. Time and energy per run are the window's
totals over the repetitions. The clock changes at the start of the cooldown, so the
settle runs inside it: a measurement costs window + max(cooldown, settle), and nothing
waits after the last one (`MeasurementProtocol.cost_s`).
Static energy uses the catalog's static power (or one measured on the spot and passed in),
and the Measurement records which.

Without --allow-clock-changes no clock is ever touched: the GPU is measured at the clock
it runs, which NVML reports, and a setting at any other clock is refused.

torch, Zeus and NVML are imported lazily (see kareus.gpu.device, kareus.gpu.kernels).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.errors import SpecError
from kareus.gpu.clock_guard import ClockGuard
from kareus.gpu.device import GPUDevice
from kareus.gpu.kernels import build_kernel, import_torch, op_shapes, stand_in_collective
from kareus.gpu.runtimes import (
    DEFAULT_RUNTIME,
    PartitionRuntime,
    Runner,
    runtime_class,
)
from kareus.job.spec import JobSpec
from kareus.workload.ops import Collective, Op
from kareus.workload.partition import Partition

CollectiveFactory = Callable[[Collective, int], Callable[[], object]]
"""Builds a real collective at an SM count (`kareus.gpu.nccl.NcclCollectives`)."""


class NvmlBackend:
    PROBE_RUNS = 8
    """Runs timed together (one synchronisation) to size the measurement window."""

    def __init__(self, job: JobSpec, device: GPUDevice, guard: ClockGuard | None = None,
                 protocol: MeasurementProtocol | None = None, torch_device: str = "cuda",
                 static_power_w: float | None = None, warmup_runs: int = 3,
                 min_runs: int = 3, collective: CollectiveFactory | None = None,
                 name: str = "nvml", agree: Callable[[int], int] | None = None,
                 runtime: str = DEFAULT_RUNTIME, power_limit_w: float | None = None) -> None:
        self.name = name
        """"nvml"; "fakegpu" for the CPU kernels with a fake device's energy counter."""
        self.power_limit_w = power_limit_w
        """The board power limit Kareus set for these measurements (None: untouched)."""
        self.job = job
        self.gpu = job.gpu_spec
        self.device = device
        self.guard = guard or ClockGuard(device, allow_changes=False)
        self.protocol = protocol or MeasurementProtocol()
        self.torch_device = torch_device
        self.static_power_source = "measured" if static_power_w is not None else "catalog"
        self.static_power_w = (static_power_w if static_power_w is not None
                               else self.gpu.static_power_w)
        self.warmup_runs = warmup_runs
        self.min_runs = min_runs
        self._collective_factory = collective
        self._agree: Callable[[int], int] = agree or (lambda n: n)
        """Rank 0's value on every rank of a group profiled together (kareus.gpu.distributed)."""
        self.runtime_name = runtime
        """Whose code computes a partition (kareus.gpu.runtimes): "kernels" or
        "megatron"."""
        self._runtime: PartitionRuntime | None = None
        self._runners: dict[tuple[str, int, str | None], Runner] = {}
        self._collectives: dict[tuple[str, int], Callable[[], object]] = {}
        self._op_runs: dict[tuple[tuple[Op, ...], int], list[Callable[[], object]]] = {}
        # each op at the shapes it was built with (a nanobatch's, or the microbatch's)
        self._op_shapes = op_shapes(job)
        self._window_ended: float | None = None
        """When the last measurement's window ended (its cooldown began)."""
        self._clock_changed: float | None = None
        """When the clock was last locked to another value (its settle began)."""

    def identity(self) -> str:
        """``nvml:<GPU>``, plus ``:limit=<W>W`` when the board power limit is below the
        GPU's TDP (its numbers are another GPU's, in effect), ``:static=<W>W`` when the
        static power was measured on the spot (its measurements' static and dynamic
        energies differ from the catalog's), plus ``:runtime=<name>`` when another runtime
        than the project's kernels computes (its numbers are other kernels' and never mix
        with theirs)."""
        parts = [self.name, self.gpu.name]
        if self.power_limit_w is not None:  # measured under a power limit Kareus set
            parts.append(f"limit={self.power_limit_w:g}W")
        if self.runtime_name != DEFAULT_RUNTIME:
            parts.append(f"runtime={self.runtime_name}")
        if self.static_power_source != "catalog":
            parts.append(f"static={self.static_power_w:.1f}W")
        return ":".join(parts)

    def measure_static_power(self, window_s: float | None = None) -> float:
        """Measure static power on the spot: the GPU holding its memory and waiting (as in
        a blocked collective) for ``window_s``; from then on static energy uses it."""
        self._sync()
        window = self.protocol.window_s if window_s is None else window_s
        e0, t0 = self._read_energy()
        time.sleep(window)
        e1, t1 = self._read_energy()
        self.static_power_w = (e1 - e0) / (t1 - t0)
        self.static_power_source = "measured"
        return self.static_power_w

    @property
    def supported_freqs_mhz(self) -> tuple[int, ...]:
        return tuple(self.device.supported_clocks_mhz())

    @property
    def default_sms(self) -> int:
        return 32

    # Clocks -------------------------------------------------------------------------------

    def _ensure_clock(self, freq_mhz: int) -> None:
        if self.guard.allow_changes:
            if self.guard.locked_mhz != freq_mhz:
                self.guard.lock(freq_mhz)
                self._clock_changed = time.perf_counter()
            return
        current = self.device.current_sm_clock_mhz()
        if freq_mhz != current:
            raise SpecError(
                f"the GPU runs at {current} MHz and clock changes are not allowed: measure "
                f"at {current} MHz, or pass --allow-clock-changes to search frequencies")

    # Measuring ----------------------------------------------------------------------------

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        self._ensure_clock(knobs.freq_mhz)
        runner = self._runner(partition, knobs)
        return self._measure_window(runner.run, runner.synchronize)

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        """Ops back to back on the compute stream, each collective blocking it. A TP/CP
        collective runs for real on the group (profiling under torchrun) with ``sms`` SMs;
        on one process, and for pipeline send/receive and data-parallel sync (whose groups
        are not this one), the single-GPU stand-in copy of its bytes runs instead."""
        self._ensure_clock(freq_mhz)
        fns = self._op_run(tuple(ops), sms or self.default_sms)

        def run() -> None:
            for fn in fns:
                fn()

        return self._measure_window(run, self._sync)

    def _op_run(self, ops: tuple[Op, ...], sms: int) -> list[Callable[[], object]]:
        fns = self._op_runs.get((ops, sms))
        if fns is None:
            torch = import_torch()
            shapes = self._op_shapes
            fns = self._op_runs[(ops, sms)] = [
                self._collective(op, sms) if isinstance(op, Collective)
                else build_kernel(op, shapes(op), self.torch_device, torch.bfloat16).run
                for op in ops]
        return fns

    def _collective(self, coll: Collective, sms: int) -> Callable[[], object]:
        if self._collective_factory is not None and coll.group in ("tp", "cp"):
            key = (f"ops:{coll.name}:{coll.kind}:{coll.bytes_:.0f}", sms)
            fn = self._collectives.get(key)
            if fn is None:
                try:
                    fn = self._collectives[key] = self._collective_factory(coll, sms)
                except ValueError:  # not over this group (its size differs): stand-in
                    fn = None
            if fn is not None:
                return fn
        return stand_in_collective(coll.bytes_, self.torch_device)

    def _sync(self) -> None:
        if self.torch_device.startswith("cuda"):
            import_torch().cuda.synchronize()

    def _runner(self, partition: Partition, knobs: Knobs) -> Runner:
        key = (partition.key, knobs.sms, knobs.slot)
        if key not in self._runners:
            # the runtime builds a partition's compute once, the collective once per SM
            # count, whatever the number of settings measured
            if self._runtime is None:
                self._runtime = runtime_class(self.runtime_name)(self.job, self.torch_device)
            ckey = (partition.key, knobs.sms if self._collective_factory else 0)
            coll = self._collectives.get(ckey)
            if coll is None:
                coll = self._collectives[ckey] = (
                    self._collective_factory(partition.collective, knobs.sms)
                    if self._collective_factory is not None
                    else stand_in_collective(partition.collective.bytes_, self.torch_device))
            self._runners[key] = self._runtime.runner(partition, knobs.slot, coll)
        return self._runners[key]

    def _rest(self) -> None:
        """Wait out the previous window's cooldown and the clock's settle, together."""
        now = time.perf_counter()
        until = max(self._window_ended + self.protocol.cooldown_s
                    if self._window_ended is not None else now,
                    self._clock_changed + self.protocol.settle_s
                    if self._clock_changed is not None else now)
        if until > now:
            time.sleep(until - now)

    def _read_energy(self) -> tuple[float, float]:
        """The energy counter and when it was read: the middle of the read, so that a
        window's energy and its time span the same interval (reading the clock before or
        after the counter let a preemption between the two reads count as energy without
        time: on a loaded machine a 10 ms window read 1% above its power)."""
        before = time.perf_counter()
        energy_j = self.device.energy_j()
        return energy_j, (before + time.perf_counter()) / 2

    def _measure_window(self, run: Callable[[], object], sync: Callable[[], None]
                        ) -> Measurement:
        self._rest()
        for _ in range(self.warmup_runs):
            run()
        sync()
        # the number of runs is fixed before the window, from one timed probe run: every
        # rank of a TP/CP group must run the collective equally often (rank 0's count is
        # agreed), or the ranks that stop early leave the others blocked in it
        p0 = time.perf_counter()
        for _ in range(self.PROBE_RUNS):  # a fixed count: every rank runs the same
            run()
        sync()
        per_run_s = max((time.perf_counter() - p0) / self.PROBE_RUNS, 1e-9)
        runs = self._agree(max(self.min_runs, math.ceil(self.protocol.window_s / per_run_s)))
        e0, t0 = self._read_energy()
        for i in range(runs):
            run()
            if (i + 1) % 8 == 0:
                sync()
        sync()
        e1, t1 = self._read_energy()
        self._window_ended = t1
        # raw energy: a dynamic energy below zero means the static power is set too high,
        # which the user should see rather than have hidden
        time_s, energy_j = (t1 - t0) / runs, (e1 - e0) / runs
        return Measurement.from_time_energy(time_s, energy_j, self.static_power_w,
                                            float(self.device.current_sm_clock_mhz()))
