"""Steps fitted through a prior (kareus.profiling.prior_fit via measure_steps): the GPU
is a curve of step_fit's tests times a ratio the prior does not know; what is fitted is
checked against that curve, computed apart."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.backends.needs import Need
from kareus.core import Measurement
from kareus.profiling.prior_fit import RatioCheck, noise_allowance
from kareus.profiling.step_fit import FitPolicy, measure_steps, planned_clocks
from tests.profiling.test_step_fit import (
    CLOCKS,
    CURVE,
    STATIC_W,
    Curve,
    Recorder,
    _clock_lists,
    _series,
    step_measurement,
)


def _gpu(curve: Curve, time_ratio: Callable[[float], float],
         energy_ratio: Callable[[float], float],
         held: Callable[[int], float | None] = lambda f: None
         ) -> Callable[[Need], Measurement]:
    """The GPU: ``curve`` scaled by the ratios (of the clock it ran), held to ``held(f)``
    by its power limiter where that is not None."""
    def answer(n: Need) -> Measurement:
        f = n.knobs.freq_mhz
        run = held(f) or float(f)
        return step_measurement(run, curve.time(run) * time_ratio(run),
                                curve.energy(run) * energy_ratio(run))
    return answer


def _prior(curve: Curve, held: Callable[[int], float | None] = lambda f: None
           ) -> Callable[[Need], Measurement]:
    return lambda n: curve.measurement(n.knobs.freq_mhz, held(n.knobs.freq_mhz))


@settings(max_examples=60, deadline=None)
@given(clocks=_clock_lists(), level=st.floats(0.7, 1.4), slope=st.floats(-0.2, 0.2),
       e_level=st.floats(0.6, 1.5), e_slope=st.floats(-0.2, 0.2))
def test_a_level_drifting_linearly_in_the_clock_is_fitted_exactly_from_three_clocks(
        clocks, level, slope, e_level, e_slope):
    gpu = _gpu(CURVE, lambda f: level + slope * f / 1e3, lambda f: e_level + e_slope * f / 1e3)
    rec = Recorder(gpu)
    needs = _series(clocks)
    report = measure_steps(needs, rec, FitPolicy(), prior=_prior(CURVE))
    assert report.failed_series == 0
    measured = sorted((n.knobs.freq_mhz for n in report.measured), reverse=True)
    assert len(measured) == 3 and measured[0] == max(clocks) and measured[-1] == min(clocks)
    assert len(rec.calls) == 3 and set(report.fitted) | set(report.measured) == set(needs)
    # what the estimate plans (kareus.profiling.estimate) is what was measured
    assert set(measured) == set(planned_clocks(sorted(clocks, reverse=True), FitPolicy(),
                                               informed=True))
    for n, (m, info) in report.fitted.items():
        want = gpu(n)
        assert m.time_s == pytest.approx(want.time_s, rel=1e-9)
        assert m.dynamic_energy_j == pytest.approx(want.dynamic_energy_j, rel=1e-9)
        assert m.static_energy_j == pytest.approx(STATIC_W * want.time_s, rel=1e-9)
        assert info.measured_freqs_mhz == tuple(measured)


def test_a_ratio_that_bends_falls_back_to_the_steps_own_shape():
    """The prior's curve is of another shape than the GPU's (a fixed part the GPU lacks:
    the ratio 8 / (6x + 4) bends; a ratio (a + b/f) / (c/f) would be a line in f, which
    the fit follows): the check through the prior fails, and the series is fitted with
    step_fit's own shape (five anchors and a check), exactly."""
    floor = Curve(a=0.0, b=8e-3, c0=0.05, c1=0.12, c2=0.3)  # the GPU: all SM-bound
    prior = Curve(a=6e-3, b=4e-3, c0=0.05, c1=0.12, c2=0.3)
    gpu = _gpu(floor, lambda f: 1.0, lambda f: 1.0)
    rec = Recorder(gpu)
    report = measure_steps(_series(CLOCKS), rec, FitPolicy(), prior=_prior(prior))
    assert report.failed_series == 0
    assert len(report.measured) == 6  # the prior's 3, then the own shape's 5 anchors + 1
    for n, (m, _info) in report.fitted.items():
        assert m.time_s == pytest.approx(floor.time(n.knobs.freq_mhz), rel=1e-9)


def test_clocks_the_prior_predicts_throttled_are_measured_never_fitted():
    held = lambda f: 1150.0 if f >= 1200 else None  # noqa: E731
    gpu = _gpu(CURVE, lambda f: 1.1, lambda f: 0.9, held)
    rec = Recorder(gpu)
    needs = _series(CLOCKS)
    report = measure_steps(needs, rec, FitPolicy(), prior=_prior(CURVE, held))
    top = {f for f in CLOCKS if f >= 1200}
    assert top <= {n.knobs.freq_mhz for n in report.measured}
    assert not top & {n.knobs.freq_mhz for n in report.fitted}
    assert len(report.measured) == len(top) + 3
    for n, (m, _info) in report.fitted.items():
        assert m.time_s == pytest.approx(gpu(n).time_s, rel=1e-9)


def test_a_top_the_limiter_holds_though_the_prior_did_not_is_scanned_down():
    """The GPU's limiter holds 1410..1270 MHz (the prior's does not): each is measured,
    from the top down, one a round, until 1200 MHz runs free; the fit's range is
    1200..220 MHz, its anchors its ends, one clock held out."""
    held = lambda f: 1240.0 if f >= 1270 else None  # noqa: E731
    gpu = _gpu(CURVE, lambda f: 1.05, lambda f: 1.2, held)
    rec = Recorder(gpu)
    report = measure_steps(_series(CLOCKS), rec, FitPolicy(), prior=_prior(CURVE))
    measured = {n.knobs.freq_mhz for n in report.measured}
    assert {1410, 1340, 1270, 1200, 220} <= measured and len(measured) == 6
    assert all(n.knobs.freq_mhz < 1200 for n in report.fitted)
    order = [n.knobs.freq_mhz for n in rec.calls]
    assert order.index(1340) < order.index(1270) < order.index(1200)
    for n, (m, _info) in report.fitted.items():
        want = gpu(n)
        assert m.time_s == pytest.approx(want.time_s, rel=1e-9)
        assert m.dynamic_energy_j == pytest.approx(want.dynamic_energy_j, rel=1e-9)


def test_noisy_steps_are_fitted_and_a_bent_one_among_them_fails():
    """Twelve steps measured with 3% noise set the allowance (three standard deviations of
    their held-out errors); a step whose ratio to the prior jumps by 40% in mid-range is
    never fitted through it, however noisy the others."""
    rng = np.random.default_rng(1)

    def answer(n: Need) -> Measurement:
        f = n.knobs.freq_mhz
        m = CURVE.measurement(f)
        if n.ops_key == "bent#1":
            return step_measurement(f, m.time_s * (1.4 if f < 900 else 1.0),
                                    m.dynamic_energy_j)
        a, b = rng.normal(1.0, 0.03, 2)
        return step_measurement(f, m.time_s * a, m.dynamic_energy_j * b)

    noisy = [n for i in range(12) for n in _series(CLOCKS, f"noisy{i}#1")]
    report = measure_steps([*noisy, *_series(CLOCKS, "bent#1")], Recorder(answer),
                           FitPolicy(), prior=_prior(CURVE))
    bent = [n for n in report.fitted if n.ops_key == "bent#1"]
    for n in bent:  # fitted by its own shape at most, never through the prior's
        assert report.fitted[n][1].measured_freqs_mhz != (1410, 850, 220)
    assert len({n.ops_key for n in report.fitted}) >= 10


def test_the_allowance_is_three_standard_deviations_of_the_held_out_errors():
    checks = [RatioCheck(e, -2 * e) for e in (0.01, -0.02, 0.03, -0.04, 0.05)]
    t, e = noise_allowance(checks, 0.01)
    assert t == pytest.approx(3 * 0.03 / 0.6745)
    assert e == pytest.approx(3 * 0.06 / 0.6745)
    assert noise_allowance(checks[:2], 0.01) == (0.01, 0.01)  # too few: the tolerance
    assert noise_allowance([RatioCheck(0, 0)] * 5, 0.01) == (0.01, 0.01)
