import pytest

pytest.importorskip("torch")

from kareus.backends.base import Backend
from kareus.backends.emulator import EmulatorBackend
from kareus.backends.journaled import JournaledBackend
from kareus.backends.nvml import NvmlBackend
from kareus.core import Knobs, MeasurementProtocol
from kareus.errors import SpecError
from kareus.gpu.clock_guard import ClockGuard
from kareus.gpu.device import FakeDevice
from kareus.job.sources import build_job
from kareus.search import SearchConfig, run_search
from kareus.store import Journal, job_id
from kareus.workload.workload import Workload
from tests.gpu.test_kernels import TINY

FAST = MeasurementProtocol(window_s=0.005, cooldown_s=0.0, settle_s=0.0)
JOB = build_job(overrides=TINY)
PS = Workload.build(JOB).partitions


def _backend(dev, allow, tmp_path):
    guard = ClockGuard(dev, allow_changes=allow, lock_dir=str(tmp_path))
    return NvmlBackend(JOB, dev, guard, protocol=FAST, torch_device="cpu", warmup_runs=1,
                       min_runs=2)


def test_measures_at_the_current_clock_without_touching_it(tmp_path):
    dev = FakeDevice(power_w=150.0)
    b = _backend(dev, False, tmp_path)
    m = b.measure(PS["fwd_attn"], Knobs(1410, 12, "linear_0"))
    assert m.time_s > 0 and m.energy_j == pytest.approx(150.0 * m.time_s, rel=0.3)
    assert m.effective_freq_mhz == 1410
    with pytest.raises(SpecError, match="--allow-clock-changes"):
        b.measure(PS["fwd_attn"], Knobs(1200, 12, "linear_0"))
    assert dev.clock_calls == []


def test_clock_changes_when_allowed_are_restored(tmp_path):
    dev = FakeDevice()
    with ClockGuard(dev, allow_changes=True, lock_dir=str(tmp_path)) as guard:
        b = NvmlBackend(JOB, dev, guard, protocol=FAST, torch_device="cpu", warmup_runs=1)
        m = b.measure(PS["fwd_mlp"], Knobs(1200, 6, None))
        assert dev.locked == (1200, 1200) and m.effective_freq_mhz == 1200
        b.measure(PS["fwd_mlp"], Knobs(1200, 9, None))  # same clock: no second lock call
        assert dev.clock_calls == [("set_locked_clocks", 1200, 1200)]
    assert dev.locked is None


def test_a_search_on_the_nvml_backend_journals_like_the_emulator(tmp_path):
    dev = FakeDevice()
    b = _backend(dev, False, tmp_path)
    cfg = SearchConfig(budget=12, initial=4, batch_size=4, tolerance=0)
    path = tmp_path / "j.sqlite"
    with Journal(path) as j:
        jid = j.register_job(JOB)
        # without clock changes the search covers the current clock only
        r = run_search(PS["bwd_mlp"], JournaledBackend(b, j, jid), (1410,), cfg)
    assert r.measured_this_run == 12
    em = EmulatorBackend(JOB)
    with Journal(path) as j:
        rows = j.samples(job_id(JOB), "bwd_mlp", b.identity())
        jid2 = j.register_job(JOB)
        run_search(PS["bwd_mlp"], JournaledBackend(em, j, jid2), (1410,), cfg)
        summary = {(e["partition"], e["backend"]): e["measurements"] for e in j.summary()}
    assert len(rows) == 12 and b.identity() == "nvml:A100-40GB"
    assert summary[("bwd_mlp", "nvml:A100-40GB")] == 12
    assert summary[("bwd_mlp", em.identity())] == 12
    assert dev.clock_calls == []


def test_static_power_measured_on_the_spot_is_recorded(tmp_path):
    dev = FakeDevice(power_w=90.0)
    b = _backend(dev, False, tmp_path)
    assert b.static_power_source == "catalog" and b.identity() == "nvml:A100-40GB"
    assert b.measure_static_power(0.05) == pytest.approx(90.0, rel=0.05)
    assert b.static_power_source == "measured"
    assert b.identity().startswith("nvml:A100-40GB:static=")
    m = b.measure(PS["fwd_mlp"], Knobs(1410, 6, None))
    assert m.static_energy_j == pytest.approx(b.static_power_w * m.time_s)


def test_is_a_backend_and_measures_runs_of_ops(tmp_path):
    dev = FakeDevice(power_w=120.0)
    b = _backend(dev, False, tmp_path)
    assert isinstance(b, Backend)
    p = PS["fwd_mlp"]
    ops = [*p.compute_ops, p.collective]  # the partition without overlap, serially
    m = b.measure_ops(ops, 1410)
    assert m.time_s > 0 and m.energy_j == pytest.approx(120.0 * m.time_s, rel=0.3)
    assert m.effective_freq_mhz == 1410
    assert b.measure_ops(ops[:1], 1410, sms=8).time_s > 0
    with pytest.raises(SpecError, match="--allow-clock-changes"):
        b.measure_ops(ops, 1200)
    assert dev.clock_calls == []
