"""The power-limited Megatron-LM baseline (kareus.workflows.power_limited): on the
emulator it draws at most its board power limit and runs slower at lower limits; the
iso-power comparison picks each method's fastest plan at or under a power level, and
interpolates the baseline between limits."""

import itertools

import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.spec import EmulatorSpec
from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.plans.execution import ExecutionPlan
from kareus.plans.plan import Plan, PlanPower
from kareus.workflows.power_limited import (
    LimitedRun,
    iso_power,
    limited_time_at,
    power_limited_megatron,
)
from kareus.workload.workload import Workload

JOB = build_job("kareus-1", overrides={"num_microbatches": 4})


@pytest.fixture(scope="module")
def runs():
    out = power_limited_megatron(Workload.build(JOB), EmulatorSpec())
    assert out is not None
    return out


def test_each_limit_is_drawn_at_most_and_lower_limits_run_slower(runs):
    assert [r.limit_fraction for r in runs] == sorted(
        (r.limit_fraction for r in runs), reverse=True)
    for r in runs:
        per_gpu_w = r.mean_power_w / JOB.num_gpus
        assert r.limit_w == pytest.approx(JOB.gpu_spec.tdp_w * r.limit_fraction)
        assert per_gpu_w <= r.limit_w * 1.01, (r.limit_fraction, per_gpu_w)
    times = [r.time_s for r in runs]
    assert all(b > a for a, b in itertools.pairwise(times))
    # the lowest limit binds: it runs well below the TDP's power, and slower
    assert runs[-1].mean_power_w < 0.75 * runs[0].mean_power_w
    assert runs[-1].time_s > 1.1 * runs[0].time_s


def test_a_limit_above_the_tdp_or_not_positive_is_refused():
    for bad in (0.0, -5.0, JOB.gpu_spec.tdp_w + 1):
        with pytest.raises(SpecError, match="power limit"):
            EmulatorBackend(JOB, power_limit_w=bad)
    assert "limit=" in EmulatorBackend(JOB, power_limit_w=200.0).identity()
    assert "limit=" not in EmulatorBackend(JOB).identity()


def _plan(method: str, i: int, time_s: float, mean_w: float) -> Plan:
    return Plan(f"{method}-{i:03d}", method, time_s, mean_w * time_s,
                ExecutionPlan("x", overlap=False, default_freq_mhz=1410),
                power=PlanPower(mean_w, mean_w * 1.1, 1.0, 2, 8, 60.0))


def test_iso_power_by_hand():
    plans = {"megatron": [_plan("megatron", 0, 4.0, 5000.0)],
             "perseus": [_plan("perseus", 0, 4.0, 5000.0), _plan("perseus", 1, 4.5, 4000.0),
                         _plan("perseus", 2, 5.0, 3500.0)],
             "kareus": [_plan("kareus", 0, 3.6, 5200.0), _plan("kareus", 1, 3.8, 4900.0),
                        _plan("kareus", 2, 4.2, 3900.0)]}
    limited = [LimitedRun(1.0, 400.0, 4.0, 4.0 * 5000.0),
               LimitedRun(0.5, 200.0, 5.0, 5.0 * 3000.0)]
    at_100, at_80 = iso_power(plans, limited)
    assert at_100["level_w"] == 5000.0 and at_80["level_w"] == 4000.0
    # at 5 kW: Kareus's fastest plan at or under it is the 4.9 kW one (3.8 s)
    assert at_100["time_s"]["kareus"] == 3.8 and at_100["time_s"]["perseus"] == 4.0
    assert at_100["megatron_power_limited_time_s"] == 4.0
    assert at_100["kareus_time_saving_vs_power_limited"] == pytest.approx(1 - 3.8 / 4.0)
    # at 4 kW: Kareus 4.2 s, Perseus 4.5 s; the baseline halfway between 3 and 5 kW: 4.5 s
    assert at_80["time_s"]["kareus"] == 4.2 and at_80["time_s"]["perseus"] == 4.5
    assert at_80["megatron_power_limited_time_s"] == pytest.approx(4.5)
    assert at_80["kareus_time_saving_vs_perseus"] == pytest.approx(1 - 4.2 / 4.5)
    assert limited_time_at(limited, 2000.0) is None  # below the lowest limit's power
