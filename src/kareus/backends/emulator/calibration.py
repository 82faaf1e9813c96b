"""Emulator vs real GPU: measure a fixed small set at the current clock, compare with the
emulator, and fit corrections the emulator can load (`--calibration FILE`).

The set: every partition of the job at a middle setting (the median SM choice, launch
before the second slot) and two ops outside partitions (the LM head GEMM and the final
RMSNorm, a memory-bound kernel). The fit scales, from the medians of real / emulated:
GEMM efficiency and the flash-attention scale (compute-bound time), HBM efficiency
(memory-bound time) and the SM dynamic power (dynamic energy). It is deliberately coarse:
four numbers that move the emulator's predictions toward this GPU, not a re-derivation of
the model.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kareus import SCHEMA_VERSION
from kareus.backends.base import Backend
from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.emulator.params import EmulatorParams
from kareus.core import Knobs, Measurement
from kareus.job.spec import JobSpec
from kareus.workload.ops import Op
from kareus.workload.partition import Partition, PartitionSet
from kareus.workload.workload import Workload

CalibrationItem = tuple[str, str, tuple[Partition, Knobs] | Op]
"""(label, kind, what): a partition at a setting (kind "partition"), or one op."""


@dataclass(frozen=True)
class CalibrationRow:
    item: str
    kind: str
    """"partition", "gemm" or "memory"."""
    real: Measurement
    emulated: Measurement

    @property
    def time_error(self) -> float:
        return self.emulated.time_s / self.real.time_s - 1

    @property
    def energy_error(self) -> float:
        return self.emulated.energy_j / self.real.energy_j - 1

    def to_dict(self) -> dict:
        return {"item": self.item, "kind": self.kind, "real": asdict(self.real),
                "emulated": asdict(self.emulated), "time_rel_error": self.time_error,
                "energy_rel_error": self.energy_error}


def calibration_set(ps: PartitionSet, freq_mhz: int) -> list[CalibrationItem]:
    items: list[CalibrationItem] = []
    for p in ps.partitions.values():
        sms = sorted(p.sm_choices)[len(p.sm_choices) // 2]
        slot = p.slots[min(1, len(p.slots) - 1)].name
        items.append((f"{p.key} ({sms} SMs, {slot})", "partition",
                      (p, Knobs(freq_mhz, sms, slot))))
    last = ps.graph.stages[-1]
    for op in last.forward_post:
        if op.name == "lm_head":
            items.append(("lm_head GEMM", "gemm", op))
        if op.name == "final_norm":
            items.append(("final RMSNorm", "memory", op))
    return items


def measure_and_compare(job: JobSpec, real_backend: Backend, freq_mhz: int,
                        emulator: EmulatorBackend | None = None) -> list[CalibrationRow]:
    ps = Workload.build(job).partitions
    emu = emulator or EmulatorBackend(job)
    rows = []
    for label, kind, what in calibration_set(ps, freq_mhz):
        if isinstance(what, tuple):  # kind == "partition"
            p, knobs = what
            real, sim = real_backend.measure(p, knobs), emu.predict(p, knobs)
        else:
            real = real_backend.measure_ops((what,), freq_mhz)
            sim = emu.predict_ops((what,), freq_mhz)
        rows.append(CalibrationRow(label, kind, real, sim))
    return rows


def fit_params(rows: list[CalibrationRow], base: EmulatorParams) -> EmulatorParams:
    def ratio(kinds, attr):
        vals = [getattr(r.real, attr) / getattr(r.emulated, attr) for r in rows
                if r.kind in kinds and getattr(r.emulated, attr) > 0
                and getattr(r.real, attr) > 0]
        return statistics.median(vals) if vals else 1.0

    slow_compute = ratio(("partition", "gemm"), "time_s")  # > 1: the GPU is slower
    slow_memory = ratio(("memory",), "time_s")
    hungry = ratio(("partition", "gemm", "memory"), "dynamic_energy_j")

    def clamp(x, lo=0.05, hi=1.0):
        return min(hi, max(lo, x))

    return replace(
        base,
        gemm_efficiency=clamp(base.gemm_efficiency / slow_compute),
        attention_efficiency_scale=clamp(base.attention_efficiency_scale / slow_compute,
                                         hi=2.0),
        hbm_efficiency=clamp(base.hbm_efficiency / slow_memory),
        sm_dynamic_power_w=max(1.0, base.sm_dynamic_power_w * hungry),
    )


def write_calibration(path: str | Path, job: JobSpec, rows: list[CalibrationRow],
                      params: EmulatorParams, static_source: str, freq_mhz: int) -> None:
    base = EmulatorBackend(job).params
    changed = {k: v for k, v in asdict(params).items() if asdict(base)[k] != v}
    Path(path).write_text(json.dumps({
        "schema_version": SCHEMA_VERSION,
        "gpu": job.gpu,
        "freq_mhz": freq_mhz,
        "static_power_source": static_source,
        "emulator_params": changed,
        "measurements": [r.to_dict() for r in rows],
    }, indent=1))
