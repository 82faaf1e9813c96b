import json

import pytest

pytest.importorskip("torch")

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.calibration import (
    fit_params,
    measure_and_compare,
    write_calibration,
)
from kareus.backends.nvml import NvmlBackend
from kareus.core import MeasurementProtocol
from kareus.gpu.device import FakeDevice
from kareus.job.sources import build_job
from tests.gpu.test_kernels import TINY


def test_calibration_round_trip_on_a_fake_gpu(tmp_path):
    job = build_job(overrides=TINY)
    dev = FakeDevice(power_w=180.0)
    real = NvmlBackend(job, dev, protocol=MeasurementProtocol(0.005, 0.0, 0.0),
                       torch_device="cpu", warmup_runs=1, min_runs=2)
    rows = measure_and_compare(job, real, dev.current_sm_clock_mhz())
    kinds = {r.kind for r in rows}
    assert kinds == {"partition", "gemm", "memory"}
    assert len([r for r in rows if r.kind == "partition"]) == 4
    emu = EmulatorBackend(job)
    params = fit_params(rows, emu.params)
    # a CPU is far slower than an A100: the fit lowers the efficiencies
    assert params.gemm_efficiency < emu.params.gemm_efficiency
    path = tmp_path / "cal.json"
    write_calibration(path, job, rows, params, real.static_power_source, 1410)
    doc = json.loads(path.read_text())
    assert doc["gpu"] == "A100-40GB" and doc["static_power_source"] == "catalog"
    assert "gemm_efficiency" in doc["emulator_params"]
    loaded = EmulatorBackend(job, calibration=path)
    assert loaded.params.gemm_efficiency == pytest.approx(params.gemm_efficiency)


def test_fit_is_identity_when_the_emulator_is_right():
    job = build_job(overrides=TINY)
    emu = EmulatorBackend(job)
    rows = measure_and_compare(job, EmulatorBackend(job), 1410, emu)
    params = fit_params(rows, emu.params)
    assert params == emu.params
