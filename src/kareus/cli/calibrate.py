"""`kareus calibrate`: the emulator against public measurements, or against this GPU."""

from typing import Annotated, Optional

import typer

from kareus import SCHEMA_VERSION
from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.calibration import (
    fit_params,
    measure_and_compare,
    write_calibration,
)
from kareus.backends.registry import BackendSpec
from kareus.cli.app import JsonFlag, app, console, print_json, table
from kareus.cli.options import with_backend
from kareus.errors import KareusError
from kareus.job.sources import build_job
from kareus.workflows.anchors import all_anchors
from kareus.workload.workload import Workload


@app.command()
@with_backend()
def calibrate(
    backend: BackendSpec,
    preset: Annotated[str, typer.Option(
        "--preset", "-p", help="nvml: the job whose partitions are measured.")] = "kareus-1",
    out: Annotated[Optional[str], typer.Option(
        "--out", help="nvml: write fitted emulator parameters to this JSON file.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Emulator: each public anchor (docs/anchors.md) next to the emulator's value. nvml: a
    fixed set of partitions and ops measured on this GPU at its current clock, next to the
    emulator, with fitted corrections written to --out."""
    if backend.capabilities.real_gpu:
        _calibrate_gpu(preset, out, backend, json_out)
        return
    if not backend.capabilities.anchors:
        raise KareusError(f"calibrate compares the emulator with public anchors or with a "
                          f"real GPU: not --backend {backend.name}")
    # a kind with anchors takes the emulator's fitted parameters (Capabilities.anchors)
    anchors = all_anchors(getattr(backend, "calibration", None))
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION,
                    "anchors": [a.to_dict() for a in anchors]})
        return
    t = table("Emulator vs public measurements",
              ("anchor", "unit", "published", "emulated", "error"), left=("anchor",))
    for a in anchors:
        err = a.rel_error
        t.add_row(a.name, a.unit, "-" if a.published is None else f"{a.published:,.3f}",
                  f"{a.emulated:,.3f}", "no reference" if err is None else f"{err * 100:+.1f}%")
    console.print(t)


def _calibrate_gpu(preset: str, out: Optional[str], backend: BackendSpec,
                   json_out: bool) -> None:
    job = build_job(preset)
    with backend.open(Workload.build(job)) as real:
        # a real GPU's backend (Capabilities.real_gpu) shows the device it measures
        device = getattr(real, "device", None)
        if device is None:
            raise KareusError(f"calibrate measures through NVML; --backend {backend.name} "
                              f"has no device to read the clock of")
        freq = device.current_sm_clock_mhz()
        emu = EmulatorBackend(job)
        rows = measure_and_compare(job, real, freq, emu)
        params = fit_params(rows, emu.params)
        source = getattr(real, "static_power_source", "catalog")
    if out:
        write_calibration(out, job, rows, params, source, freq)
    if json_out:
        print_json({"schema_version": SCHEMA_VERSION, "freq_mhz": freq,
                    "rows": [r.to_dict() for r in rows], "written": out})
        return
    t = table(f"{job.gpu} at {freq} MHz: real vs emulated",
              ("item", "real ms", "emulated ms", "time err", "real J", "emulated J",
               "energy err"), left=("item",))
    for r in rows:
        t.add_row(r.item, f"{r.real.time_s * 1e3:.3f}", f"{r.emulated.time_s * 1e3:.3f}",
                  f"{r.time_error * 100:+.1f}%", f"{r.real.energy_j:.3f}",
                  f"{r.emulated.energy_j:.3f}", f"{r.energy_error * 100:+.1f}%")
    console.print(t)
    if out:
        console.print(f"fitted corrections written to {out} (use --calibration {out})")
