"""The emulator backend: measurements computed by the timeline instead of a GPU."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import numpy as np

from kareus.backends.emulator.params import EmulatorParams, load_params
from kareus.backends.emulator.physics import GPUPhysics
from kareus.backends.emulator.timeline import RunResult, Timeline
from kareus.backends.needs import TransientRun, TransientUnmeasurable
from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.errors import SpecError
from kareus.job.hardware import DEFAULT_GPU, GPUSpec, get_gpu
from kareus.job.spec import JobSpec
from kareus.workload.ops import Op, ops_signature
from kareus.workload.partition import Partition
from kareus.workload.workload import Workload


class TransientMeasurer(Protocol):
    """What measures a backend's wait transients (kareus.backends.emulator.transient)."""

    def measure(self, run: TransientRun, freq_mhz: int) -> Measurement: ...


def internode_groups(job: JobSpec) -> frozenset[str]:
    """Groups whose collectives cross nodes, for Megatron's rank order tp-cp-dp-pp (a
    pipeline send says itself whether it leaves the node: `Collective.crosses_nodes`)."""
    if job.tp * job.cp * (job.dp or 1) > job.gpus_per_node:
        return frozenset({"dp"})  # the gradient-sync group spans nodes
    return frozenset()


def network_share_bytes_s(job: JobSpec) -> float:
    """Network bandwidth per GPU of the job's node when its traffic leaves the node. The
    GPUs sending off a node at once are the pipeline stage's on it (tp x cp x dp of them,
    at most the node's: a stage's TP ranks each send their copy of the same microbatch's
    activation together, and the data-parallel replicas run the same schedule); a
    gradient sync spanning nodes runs on every GPU of the node at once, which is the same
    count, since its group spans nodes only when a stage fills them."""
    senders = min(job.tp * job.cp * (job.dp or 1), job.gpus_per_node)
    return job.node_spec.internode_share_bytes_s(senders)


class EmulatorBackend:
    """A `Backend` and a `CostModel` (kareus.backends.base). As a backend it is
    deterministic for a seed; ``noise`` adds that relative standard deviation to the time
    and to the dynamic energy of every measurement (0: exact).

    The noise of a measurement depends on (seed, what is measured, how many times this
    backend measured it before), not on the order of the calls: a search that is resumed,
    or run in another process, sees the same values for the same settings."""

    name = "emulator"

    def __init__(
        self,
        job: JobSpec | None = None,
        gpu: GPUSpec | str | None = None,
        params: EmulatorParams | None = None,
        calibration: str | Path | None = None,
        noise: float = 0.0,
        seed: int = 0,
        protocol: MeasurementProtocol | None = None,
        power_limit_w: float | None = None,
        workload: Workload | None = None,
    ) -> None:
        """``power_limit_w``: the board power limit the limiter holds (default: the GPU's
        TDP), as `nvidia-smi -pl` sets it (the power-limited Megatron-LM baseline).
        ``workload``: what this backend was opened for (its job, unless ``job`` is given;
        `emulator_for` opens one that measures the workload's wait transients)."""
        self.workload = workload
        if job is None and workload is not None:
            job = workload.job
        if gpu is None:
            gpu = job.gpu_spec if job is not None else get_gpu(DEFAULT_GPU)
        self.gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.params = params or load_params(self.gpu, calibration)
        if noise < 0 or noise > 0.5:
            raise SpecError(f"noise must be between 0 and 0.5, got {noise}")
        self.noise = noise
        self.seed = seed
        self._repeats: dict[str, int] = {}
        self.protocol = protocol or MeasurementProtocol()
        self.static_power_w: float = self.gpu.static_power_w * self.params.static_power_scale
        self.physics = GPUPhysics(self.gpu, self.params,
                                  network_share_bytes_s(job) if job is not None else None)
        groups = internode_groups(job) if job is not None else frozenset()
        if power_limit_w is not None and not 0 < power_limit_w <= self.gpu.tdp_w:
            raise SpecError(f"a power limit must be in (0, {self.gpu.tdp_w:g}] W (the "
                            f"{self.gpu.name}'s TDP), got {power_limit_w:g}")
        self.power_limit_w = power_limit_w
        self.timeline = Timeline(self.physics, self.static_power_w,
                                 power_limit_w or self.gpu.tdp_w, groups)
        self._cache: dict[tuple[object, ...], Measurement] = {}
        self.transients: TransientMeasurer | None = None
        """What measures wait transients: the whole-iteration simulator over the workload
        (kareus.backends.emulator.transient, built on this backend, wires itself here when
        the emulator is opened for a workload); None: none is measured."""

    @property
    def supported_freqs_mhz(self) -> tuple[int, ...]:
        return self.gpu.clock_table_mhz

    @property
    def default_sms(self) -> int:
        return self.params.default_comm_sms

    def identity(self) -> str:
        """The GPU, the constants and the noise level; not the seed: a journal's
        measurements serve any later search, as real measurements would."""
        digest = hashlib.sha256(json.dumps(asdict(self.params), sort_keys=True).encode())
        limit = f":limit={self.power_limit_w:g}W" if self.power_limit_w is not None else ""
        return (f"{self.name}:{self.gpu.name}:noise={self.noise}:params="
                f"{digest.hexdigest()[:12]}{limit}")

    # Backend protocol ----------------------------------------------------------------------

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        exact = self.predict(partition, knobs)
        return self._noisy(exact, f"{partition.key}|{knobs.freq_mhz}|{knobs.sms}|{knobs.slot}")

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        exact = self.predict_ops(ops, freq_mhz, sms)
        if self.noise == 0:
            return exact  # no noise label to build
        return self._noisy(exact, f"{ops_signature(ops)}|{freq_mhz}|{sms or self.default_sms}")

    def measure_transient(self, run: TransientRun, freq_mhz: int) -> Measurement:
        """A wait transient (kareus.backends.emulator.transient), noise-free: its use is
        the difference from the same loop's steady run, which noise would swamp."""
        self.gpu.check_freq(freq_mhz)
        if self.transients is None:
            raise TransientUnmeasurable(
                "an emulator not opened for a workload measures no wait transients (open it "
                "with kareus.backends.emulator.emulator_for or its spec)")
        return self.transients.measure(run, freq_mhz)

    # CostModel protocol: exact (noise-free) predictions, cached ------------------------------

    def predict(self, partition: Partition, knobs: Knobs) -> Measurement:
        self.check_knobs(knobs)
        launch = partition.launch_index(knobs.slot)
        key = ("p", partition.compute_ops, partition.collective, knobs.freq_mhz, knobs.sms,
               launch)
        hit = self._cache.get(key)
        if hit is None:
            r = self.timeline.steady(partition.compute_ops, knobs.freq_mhz,
                                     side=partition.collective, side_sms=knobs.sms,
                                     launch_index=launch)
            hit = self._cache[key] = self._to_measurement(r)
        return hit

    def predict_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        """Ops back to back on the compute stream; collectives among them block it."""
        self.gpu.check_freq(freq_mhz)
        sms = sms or self.default_sms
        key = ("s", tuple(ops), freq_mhz, sms)
        hit = self._cache.get(key)
        if hit is None:
            r = self.timeline.steady(tuple(ops), freq_mhz, blocking_sms=sms)
            hit = self._cache[key] = self._to_measurement(r)
        return hit

    def check_knobs(self, knobs: Knobs) -> None:
        self.gpu.check_freq(knobs.freq_mhz)
        if not 1 <= knobs.sms < self.gpu.sm_count:
            raise SpecError(
                f"{knobs.sms} SMs for the collective: use 1..{self.gpu.sm_count - 1} on "
                f"{self.gpu.name}"
            )

    def _to_measurement(self, r: RunResult) -> Measurement:
        f_mean = r.freq_time_mhz_s / r.time_s if r.time_s > 0 else 0.0
        return Measurement.from_time_energy(r.time_s, r.energy_j, self.static_power_w, f_mean)

    def _noisy(self, m: Measurement, label: str) -> Measurement:
        if self.noise == 0:
            return m
        count = self._repeats.get(label, 0)
        self._repeats[label] = count + 1
        digest = hashlib.blake2b(f"{label}|{count}".encode(), digest_size=8).digest()
        rng = np.random.default_rng([self.seed, int.from_bytes(digest, "little")])
        eps_t, eps_e = rng.normal(0.0, self.noise, size=2)
        t = m.time_s * max(0.05, 1.0 + eps_t)
        dyn = max(0.0, m.dynamic_energy_j * (1.0 + eps_e))
        # static energy follows the measured time, so energy never falls below static x time
        return Measurement.from_time_energy(t, dyn + self.static_power_w * t,
                                            self.static_power_w, m.effective_freq_mhz)
