"""The validation of composed plans is not circular: the whole-iteration simulation does not
add up the measurements composition used, so an error in one partition's measurements
shows in the validation, and the correct measurements leave only the few-percent
difference between steady-state partitions and continuous instructions."""

import json

import pytest

from kareus.backends.base import WrappedBackend
from kareus.backends.emulator import EmulatorBackend, emulator_for
from kareus.backends.emulator.spec import EmulatorSpec
from kareus.compose.methods import method_frontiers
from kareus.compose.options import Composer, key_frontiers
from kareus.core import Knobs, Measurement
from kareus.job.sources import build_job
from kareus.plans.methods import get_method
from kareus.results.validation import frontier_plans as _plans
from kareus.workload.partition import Partition
from kareus.workload.workload import Workload

JOB = build_job("kareus-1", overrides={"search_freqs_mhz": (1410, 1200),
                                       "sm_choices_all_reduce": (6, 18, 30)})


class Skewed(WrappedBackend):
    """The emulator, but one partition's measured time and energy are ``factor`` off."""

    def __init__(self, inner: EmulatorBackend, key: str, factor: float) -> None:
        super().__init__(inner)
        self.key, self.factor = key, factor

    def measure(self, partition: Partition, knobs: Knobs) -> Measurement:
        m = self.inner.measure(partition, knobs)
        if partition.key != self.key:
            return m
        t, e = m.time_s * self.factor, m.energy_j * self.factor
        return Measurement.from_time_energy(t, e, self.inner.static_power_w,
                                            m.effective_freq_mhz)

    def measure_ops(self, ops, freq_mhz, sms=None):  # type: ignore[no-untyped-def]
        return self.inner.measure_ops(ops, freq_mhz, sms)


def _worst_errors(backend, calibration=None) -> tuple[float, float]:
    """Largest relative time and energy errors over Kareus's frontier plans."""
    ps = Workload.build(JOB).partitions
    samples = {k: [(kn, backend.measure(ps[k], kn)) for kn in
                   (Knobs(f, n, s) for f in JOB.freqs_mhz for n in ps[k].sm_choices
                    for s in ps[k].launch_options)] for k in ps.keys}
    composer = Composer(ps, backend, JOB.freqs_mhz)
    kareus = get_method("kareus")
    solved = method_frontiers(composer, [kareus], key_frontiers(samples), lambda _m: None)
    simulator = EmulatorSpec(calibration=calibration).plan_simulator(Workload.build(JOB))
    plans, _ = _plans([kareus], solved, composer.f_max, simulator,
                      composer.pipeline_costs())
    ps_ = plans["kareus"]
    return (max(abs(p.simulated_time_s / p.time_s - 1) for p in ps_),
            max(abs(p.simulated_energy_j / p.energy_j - 1) for p in ps_))


@pytest.fixture(scope="module")
def honest():
    return _worst_errors(emulator_for(Workload.build(JOB)))


def test_correct_measurements_validate_within_a_few_percent_but_not_zero(honest):
    t, e = honest
    assert 0 < max(t, e) < 0.05


def test_an_error_in_one_partition_shows_in_the_validation(honest):
    t, e = _worst_errors(Skewed(EmulatorBackend(JOB), "bwd_mlp", 1.2))
    assert t > honest[0] + 0.03 and e > honest[1] + 0.02


def test_without_the_limiters_memory_composed_and_simulated_agree(tmp_path):
    """With the memoryless limiter (tau = 0) each kernel is throttled on its own, alone or
    in a whole instruction, so partitions do add up: the validation error vanishes. The
    limiter's memory, carried across partitions, is what the validation measures."""
    cal = tmp_path / "tau0.json"
    # the host (kareus.backends.emulator.host) is the simulation's alone: composition adds
    # up partitions measured in loops whose host keeps ahead, so it is switched off here
    cal.write_text(json.dumps({"emulator_params": {
        "limiter_tau_s": 0, "host_module_s": 0, "host_basic_op_s": 0}}))
    t, e = _worst_errors(emulator_for(Workload.build(JOB), calibration=str(cal)), str(cal))
    assert max(t, e) < 1e-6
