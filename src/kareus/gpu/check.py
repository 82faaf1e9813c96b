"""The library part of the GPU check (`scripts/gpu_check.py`): which GPU model to emulate
for a device, a Backend that serves one number per distinct thing measured, the time a
planned check takes, relative errors, and the markdown report.

The script composes instruction options and runs the emulator; those live above this layer
(kareus.compose, kareus.backends), so nothing here imports them: `TableBackend` is a
`Backend` by shape only.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kareus.core import Knobs, Measurement, MeasurementProtocol
from kareus.errors import KareusError
from kareus.job.hardware import GPUS, GPUSpec, gpu_names
from kareus.workload.ops import Op, ops_signature
from kareus.workload.partition import Partition

CHECK_SCHEMA_VERSION = 1

FALLBACK_GPU = "H100-SXM"


def catalog_gpu(device_name: str, fallback: str = FALLBACK_GPU) -> tuple[str, str | None]:
    """The catalog entry for a device name ("NVIDIA H200" -> "H200"), and a warning when
    the name matches none and ``fallback`` stands in."""
    n = device_name.lower()
    for gpu in GPUS.values():  # each entry's own patterns (`GPUSpec.device_names`)
        if any(re.search(pattern, n) for pattern in gpu.device_names):
            return gpu.name, None
    return fallback, (f"GPU {device_name!r} is not in the catalog ({', '.join(gpu_names())}); "
                      f"emulating {fallback}, so the errors compare two different GPU models")


def snap_clock(gpu: GPUSpec, mhz: float) -> int:
    """The catalog clock nearest a reading (a reading above the top clock is the top)."""
    return min(gpu.clock_table_mhz, key=lambda f: (abs(f - mhz), -f))


@dataclass(frozen=True)
class Request:
    """One distinct thing to measure: a partition (or an overlap unit) at an SM count and
    launch slot, or a run of ops back to back with an SM count (None: the default)."""

    key: str
    category: str
    label: str
    partition: Partition | None = None
    sms: int | None = None
    slot: str | None = None
    ops: tuple[Op, ...] = ()


def partition_request(p: Partition, sms: int, slot: str | None, category: str) -> Request:
    body = ops_signature((*p.compute_ops, p.collective))
    key = f"p|{body}|{sms}|{p.launch_index(slot)}"
    return Request(key, category, p.key, p, sms, slot)


def ops_request(ops: Sequence[Op], sms: int | None, category: str) -> Request:
    names = [op.name for op in ops]
    label = "+".join(names) if len(names) <= 4 else (
        f"{names[0]}+{names[1]}+...+{names[-1]} ({len(names)} ops)")
    return Request(f"o|{ops_signature(ops)}|{sms}", category, label, sms=sms, ops=tuple(ops))


Source = Callable[[Request], Measurement]


class TableBackend:
    """A Backend that serves one measurement per distinct request, whatever clock is
    asked: the check measures everything at the GPU's one clock, then composes from the
    table. With a ``source``, a request not yet in the table is computed by it and
    recorded (in order, under the current ``category``); without one it is an error."""

    name = "table"

    def __init__(self, gpu: GPUSpec, static_power_w: float, default_sms: int,
                 source: Source | None = None, protocol: MeasurementProtocol | None = None,
                 label: str = "table") -> None:
        self.gpu = gpu
        self.static_power_w = static_power_w
        self.default_sms = default_sms
        self.protocol = protocol or MeasurementProtocol()
        self.source = source
        self.label = label
        self.category = "step"
        self.requests: dict[str, Request] = {}
        self.values: dict[str, Measurement] = {}

    @property
    def supported_freqs_mhz(self) -> tuple[int, ...]:
        return self.gpu.clock_table_mhz

    def identity(self) -> str:
        return f"{self.name}:{self.label}:{self.gpu.name}"

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        category = "partition setting" if partition.sm_choices else self.category
        return self.get(partition_request(partition, knobs.sms,
                                          partition.resolve_slot(knobs.slot), category))

    def measure_ops(self, ops: Sequence[Op], freq_mhz: int, sms: int | None = None
                    ) -> Measurement:
        return self.get(ops_request(ops, sms, self.category))

    def get(self, request: Request) -> Measurement:
        hit = self.values.get(request.key)
        if hit is None:
            if self.source is None:
                raise KareusError(f"{self.label}: nothing measured for {request.category} "
                                  f"{request.label}")
            hit = self.put(request, self.source(request))
        return hit

    def put(self, request: Request, m: Measurement) -> Measurement:
        self.requests.setdefault(request.key, request)
        self.values[request.key] = m
        return m


# Estimates --------------------------------------------------------------------------------


def estimate_s(run_times_s: Iterable[float], protocol: MeasurementProtocol,
               warmup_runs: int, min_runs: int, overhead_s: float = 0.05) -> float:
    """Seconds to measure runs that take ``run_times_s`` each with the NVML protocol:
    warm-up runs, then at least ``min_runs`` and the window, then the cooldown."""
    return sum(warmup_runs * t + max(protocol.window_s, min_runs * t) + protocol.cooldown_s
               + overhead_s for t in run_times_s)


# Errors -----------------------------------------------------------------------------------


def rel_error(emulated: float, measured: float) -> float:
    """emulated / measured - 1 (infinite when nothing was measured)."""
    return emulated / measured - 1.0 if measured != 0 else math.inf


def error_summary(rows: Iterable[Mapping[str, Any]], group: str = "category"
                  ) -> dict[str, dict[str, float]]:
    """Per group: count, median signed and largest absolute relative error of time and
    energy."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str(r[group]), []).append(r)
    out: dict[str, dict[str, float]] = {}
    for name, rs in groups.items():
        t = [float(r["time_rel_error"]) for r in rs]
        e = [float(r["energy_rel_error"]) for r in rs]
        out[name] = {"count": len(rs),
                     "time_median": statistics.median(t), "time_max_abs": max(map(abs, t)),
                     "energy_median": statistics.median(e),
                     "energy_max_abs": max(map(abs, e))}
    return out


# The report -------------------------------------------------------------------------------


def _pct(x: float, sign: str = "+") -> str:
    return f"{x * 100:{sign}.1f}%" if math.isfinite(x) else "n/a"


def _numeric(cell: str) -> bool:
    try:
        float(cell.rstrip("%"))
    except ValueError:
        return cell in ("", "n/a")
    return True


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table; columns of numbers are right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    align = ["---:" if cells and all(_numeric(r[i]) for r in cells) else "---"
             for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in cells]
    return [*out, ""]


def _pair(row: Mapping[str, Any], field: str, scale: float, fmt: str) -> list[str]:
    m, e = row["measured"][field], row["emulated"][field]
    return [format(m * scale, fmt), format(e * scale, fmt)]


def _header(doc: Mapping[str, Any]) -> list[str]:
    gpu, clock, pr = doc["gpu"], doc["clock"], doc["protocol"]
    lines = [
        "# GPU check: the emulator against one real GPU, clocks untouched", "",
        f"- date: {doc['date']}",
        f"- command: `{doc['command']}`",
        f"- GPU {gpu['index']}: {gpu['name']}, emulated as the catalog's {gpu['catalog']}",
        f"- SM clock under load: {clock['load_mhz']} MHz (readings between measurements "
        f"{clock['readings_min_mhz']}..{clock['readings_max_mhz']} MHz); emulated at "
        f"{clock['emulated_mhz']} MHz; no clock was locked or set",
        f"- backend: {doc['backend']}; protocol: {pr['warmup_runs']} warm-up runs, window "
        f"{pr['window_s']} s, cooldown {pr['cooldown_s']} s",
        f"- job: {doc['job_summary']}",
        f"- {len(doc['measurements'])} measurements in {doc['duration_s']:.0f} s "
        f"(estimated {doc['estimate_s']:.0f} s)",
    ]
    if gpu.get("warning"):
        lines.append(f"- warning: {gpu['warning']}")
    lines += ["", "Relative error = emulated / measured - 1. One GPU runs each collective as a "
              "stand-in copy through HBM (docs/gpu.md): the emulator's link model and the SM "
              "count of a collective are not what is measured here.", ""]
    return lines


def _summary(doc: Mapping[str, Any]) -> list[str]:
    rows = [[name, int(s["count"]), _pct(s["time_median"]), _pct(s["time_max_abs"], ""),
             _pct(s["energy_median"]), _pct(s["energy_max_abs"], "")]
            for name, s in doc["summary"].items()]
    return ["## Summary", "", "Composed options compare dynamic energy; measurements total "
            "energy.", "",
            *_table(["category", "n", "time: median", "time: max abs",
                     "energy: median", "energy: max abs"], rows)]


def _measurements(doc: Mapping[str, Any]) -> list[str]:
    rows = [[r["category"], r["label"], "" if r["sms"] is None else r["sms"],
             "" if r["kind"] == "ops" else (r["slot"] or "none"),
             *_pair(r, "time_s", 1e3, ".3f"), _pct(r["time_rel_error"]),
             *_pair(r, "energy_j", 1.0, ".4g"), _pct(r["energy_rel_error"])]
            for r in doc["measurements"]]
    return ["## Measurements", "",
            *_table(["category", "what", "SMs", "slot", "measured ms", "emulated ms", "time err",
                     "measured J", "emulated J", "energy err"], rows)]


def _options(doc: Mapping[str, Any]) -> list[str]:
    rows = [[r["method"], r["stage"], r["direction"], r["option"],
             *_pair(r, "time_s", 1e3, ".3f"), _pct(r["time_rel_error"]),
             *_pair(r, "dynamic_energy_j", 1.0, ".4g"), _pct(r["energy_rel_error"])]
            for r in doc["options"]]
    fronts = [[r["method"], r["stage"], r["direction"], r["measured_options"],
               r["emulated_options"], f"{r['measured_fastest_s'] * 1e3:.3f}",
               f"{r['emulated_fastest_s'] * 1e3:.3f}", f"{r['measured_min_dynamic_j']:.4g}",
               f"{r['emulated_min_dynamic_j']:.4g}"] for r in doc["fronts"]]
    return ["## Composed instruction options", "",
            f"Every option of each method at {doc['clock']['emulated_mhz']} MHz composed from "
            "the measured numbers, against the same option composed from the emulator's "
            "predictions (dynamic energy).", "",
            *_table(["method", "stage", "direction", "option", "measured ms", "emulated ms",
                     "time err", "measured dyn. J", "emulated dyn. J", "energy err"], rows),
            "Each method's front composed from the measured numbers and from the emulator's "
            "own (its searched options may pick other settings):", "",
            *_table(["method", "stage", "direction", "options (measured)",
                     "options (emulated)", "fastest ms (measured)", "fastest ms (emulated)",
                     "min dyn. J (measured)", "min dyn. J (emulated)"], fronts)]


def render_markdown(doc: Mapping[str, Any]) -> str:
    """The check's report as markdown (`docs/gpu-check.md`)."""
    lines = [*_header(doc), *_summary(doc), *_measurements(doc), *_options(doc)]
    overhead = doc.get("executor_overhead") or []
    if overhead:
        lines += ["## Executor overhead", "",
                  "The partition runner (compute and side streams, no overlap) against the "
                  "same kernels back to back:", "",
                  *_table(["partition", "executor ms", "plain ms", "overhead"],
                          [[r["partition"], f"{r['executor_s'] * 1e3:.3f}",
                            f"{r['plain_s'] * 1e3:.3f}", _pct(r["overhead"])]
                           for r in overhead])]
    return "\n".join(lines).rstrip() + "\n"
