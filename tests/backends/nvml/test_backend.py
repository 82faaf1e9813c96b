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


class FakeClock:
    """``time.perf_counter`` and ``time.sleep`` of kareus.backends.nvml.backend: time moves only
    when the backend sleeps or a fake run runs, and every sleep is recorded."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class FakeRunner:
    """A partition run that takes ``run_s`` of the fake clock."""

    def __init__(self, clock: FakeClock, run_s: float) -> None:
        self.clock, self.run_s = clock, run_s

    def run(self) -> None:
        self.clock.now += self.run_s

    def synchronize(self) -> None:
        pass


RESTING = MeasurementProtocol(window_s=0.005, cooldown_s=0.05, settle_s=0.03)


def _rested_backend(monkeypatch, tmp_path, protocol, guard):
    import kareus.backends.nvml.backend as nvml

    clock = FakeClock()
    monkeypatch.setattr(nvml, "time", clock)
    b = NvmlBackend(JOB, guard.device, guard, protocol=protocol, torch_device="cpu",
                    warmup_runs=1, min_runs=2)
    monkeypatch.setattr(b, "_runner", lambda partition, knobs: FakeRunner(clock, 0.001))
    return b, clock


@pytest.mark.parametrize(("protocol", "between"), [
    (RESTING, 0.05),  # the settle (0.03) runs inside the cooldown (0.05)
    (MeasurementProtocol(window_s=0.005, cooldown_s=0.01, settle_s=0.03), 0.03),
])
def test_a_clock_change_settles_inside_the_cooldown(monkeypatch, tmp_path, protocol,
                                                    between):
    dev = FakeDevice()
    with ClockGuard(dev, allow_changes=True, lock_dir=str(tmp_path)) as guard:
        b, clock = _rested_backend(monkeypatch, tmp_path, protocol, guard)
        b.measure(PS["fwd_mlp"], Knobs(1410, 6, None))
        # the first measurement waits for the clock it set to settle, and nothing after
        assert clock.sleeps == [pytest.approx(protocol.settle_s)]
        first_ended = clock.now
        b.measure(PS["fwd_mlp"], Knobs(1200, 6, None))
        assert dev.clock_calls == [("set_locked_clocks", 1410, 1410),
                                   ("set_locked_clocks", 1200, 1200)]
    rests = clock.sleeps[1:]
    assert sum(rests) == pytest.approx(between)
    assert sum(rests) == pytest.approx(
        max(protocol.cooldown_s, protocol.settle_s))  # not cooldown + settle
    assert sum(rests) < protocol.cooldown_s + protocol.settle_s - 1e-3
    # the second window starts once the rest is over; the protocol's cost of a measurement
    # after another is that rest and its window
    assert protocol.cost_s(clock_changed=True) == pytest.approx(
        protocol.window_s + between)
    assert clock.now - first_ended >= between + protocol.window_s - 1e-9


def test_the_same_clock_waits_the_cooldown_alone(monkeypatch, tmp_path):
    dev = FakeDevice()
    with ClockGuard(dev, allow_changes=True, lock_dir=str(tmp_path)) as guard:
        b, clock = _rested_backend(monkeypatch, tmp_path, RESTING, guard)
        b.measure(PS["fwd_mlp"], Knobs(1410, 6, None))
        b.measure(PS["fwd_mlp"], Knobs(1410, 9, None))
    assert clock.sleeps == [pytest.approx(RESTING.settle_s),
                            pytest.approx(RESTING.cooldown_s)]


def test_time_spent_since_the_last_window_counts_toward_the_rest(monkeypatch, tmp_path):
    dev = FakeDevice()
    with ClockGuard(dev, allow_changes=True, lock_dir=str(tmp_path)) as guard:
        b, clock = _rested_backend(monkeypatch, tmp_path, RESTING, guard)
        b.measure(PS["fwd_mlp"], Knobs(1410, 6, None))
        clock.now += 0.2  # other work (composition, the search) after the window
        b.measure(PS["fwd_mlp"], Knobs(1410, 9, None))  # cooldown already over
        b.measure(PS["fwd_mlp"], Knobs(1200, 9, None))
    assert clock.sleeps == [pytest.approx(RESTING.settle_s),
                            pytest.approx(RESTING.cooldown_s)]
