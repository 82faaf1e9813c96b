"""The steps outside partitions measured at a few clocks and fitted at the others
(kareus.profiling.step_fit): on data of the fitted shape (time a + b/f, dynamic energy
quadratic in f) only the anchors and one held-out clock are measured and every fitted
number is the generating formula's; a series the shapes do not describe is measured at
every clock; the power limiter's throttled top of a series is measured, never fitted;
short series and a disabled policy measure everything."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus.backends.needs import Need
from kareus.core import Knobs, Measurement
from kareus.errors import SpecError
from kareus.profiling.step_fit import FitPolicy, measure_steps, planned_clocks

CLOCKS = list(range(1410, 209, -70))  # 18 clocks, 1410 down to 220 MHz
STATIC_W = 60.0


class Curve:
    """A step's time and dynamic energy: ``t(f) = a + b * 1000 / f`` seconds and
    ``e(f) = c0 + c1 x + c2 x^2`` joules with ``x = f / 1000`` (f in MHz)."""

    def __init__(self, a: float, b: float, c0: float, c1: float, c2: float,
                 static_w: float = STATIC_W) -> None:
        self.a, self.b, self.c = a, b, (c0, c1, c2)
        self.static_w = static_w

    def time(self, f: float) -> float:
        return self.a + self.b * 1000.0 / f

    def energy(self, f: float) -> float:
        x = f / 1000.0
        return self.c[0] + self.c[1] * x + self.c[2] * x * x

    def measurement(self, f: int, effective: float | None = None) -> Measurement:
        """What a GPU would report at ``f`` (run at ``effective`` when throttled: the
        step's time and energy are then the effective clock's)."""
        run = float(f) if effective is None else effective
        t, e = self.time(run), self.energy(run)
        static = self.static_w * t
        return Measurement(t, static + e, static, e, (static + e) / t, run)


CURVE = Curve(a=2e-3, b=4e-3, c0=0.05, c1=0.12, c2=0.3)


def step_measurement(freq_mhz: float, time_s: float, dynamic_j: float) -> Measurement:
    """A step's measurement at ``freq_mhz``: its static energy at ``STATIC_W``."""
    static = STATIC_W * time_s
    return Measurement(time_s, static + dynamic_j, static, dynamic_j,
                       (static + dynamic_j) / time_s, float(freq_mhz))


class Recorder:
    """A fake ``measure``: answers each need from ``answer(need)`` and records every
    batch it was asked for, in order."""

    def __init__(self, answer: Callable[[Need], Measurement]) -> None:
        self.answer = answer
        self.batches: list[list[Need]] = []

    def __call__(self, batch: Sequence[Need]) -> list[Measurement]:
        self.batches.append(list(batch))
        return [self.answer(n) for n in batch]

    @property
    def calls(self) -> list[Need]:
        return [n for b in self.batches for n in b]

    @property
    def phases(self) -> list[list[Need]]:
        return [b for b in self.batches if b]


def _series(clocks: Sequence[int], key: str = "x#1", sms: int = 24) -> list[Need]:
    return [Need(Knobs(f, sms, None), ops_key=key) for f in clocks]


def _by_curve(curves: dict[str, Curve]) -> Callable[[Need], Measurement]:
    return lambda n: curves[n.ops_key].measurement(n.knobs.freq_mhz)


def _assert_fitted_is_the_formula(need: Need, m: Measurement, curve: Curve,
                                  rel: float = 1e-9) -> None:
    f = need.knobs.freq_mhz
    assert m.time_s == pytest.approx(curve.time(f), rel=rel)
    assert m.dynamic_energy_j == pytest.approx(curve.energy(f), rel=rel)
    # static energy as measurements count it: their static power times the time
    assert m.static_energy_j / m.time_s == pytest.approx(curve.static_w, rel=1e-9)
    assert m.energy_j == pytest.approx(m.static_energy_j + m.dynamic_energy_j, rel=1e-12)
    assert m.avg_power_w == pytest.approx(m.energy_j / m.time_s, rel=1e-12)
    assert m.effective_freq_mhz == f


# Data of the fitted shape -------------------------------------------------------------------

def test_exact_data_measures_the_anchors_and_one_check_and_fits_the_rest_exactly():
    needs = _series(CLOCKS)
    rec = Recorder(_by_curve({"x#1": CURVE}))
    report = measure_steps(needs, rec, FitPolicy())
    assert (report.series, report.failed_series) == (1, 0)
    assert len(report.measured) == 6 and len(report.fitted) == 12
    assert set(report.measured) | set(report.fitted) == set(needs)
    assert not set(report.measured) & set(report.fitted)
    measured = sorted((n.knobs.freq_mhz for n in report.measured), reverse=True)
    # both ends measured, the others spread over the range: no gap of more than 5 positions
    assert measured[0] == CLOCKS[0] and measured[-1] == CLOCKS[-1]
    positions = [CLOCKS.index(f) for f in measured]
    assert max(b - a for a, b in pairwise(positions)) <= 5
    # the measurements returned are the measure function's, untouched
    for n, m in report.measured.items():
        assert m == CURVE.measurement(n.knobs.freq_mhz)
    for n, (m, info) in report.fitted.items():
        _assert_fitted_is_the_formula(n, m, CURVE)
        assert info.measured_freqs_mhz == tuple(measured)
        assert abs(info.time_rel_error) < 1e-9 and abs(info.energy_rel_error) < 1e-9


_coef = st.floats(1e-4, 10.0, allow_nan=False)


@st.composite
def _clock_lists(draw, min_size: int = 8) -> list[int]:
    clocks = draw(st.lists(st.integers(100, 2500), min_size=min_size, max_size=40,
                           unique=True))
    return sorted(clocks, reverse=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clocks=_clock_lists(), a=_coef, b=_coef, c0=_coef, c1=_coef, c2=_coef,
       static_w=st.floats(1.0, 500.0), other=st.booleans(), shuffle=st.randoms())
def test_any_curve_of_the_shape_is_fitted_exactly_highest_clock_first_and_never_twice(
        clocks, a, b, c0, c1, c2, static_w, other, shuffle):
    curves = {"x#1": Curve(a, b, c0, c1, c2, static_w)}
    needs = _series(clocks)
    if other:  # a second step over the same clocks (another SM count), its own curve
        curves["y#2"] = Curve(b, a, c2, c0, c1, static_w / 2)
        needs += _series(clocks, "y#2", sms=8)
    shuffle.shuffle(needs)  # the order needs come in does not matter
    rec = Recorder(_by_curve(curves))
    report = measure_steps(needs, rec, FitPolicy())
    calls = rec.calls
    assert len(calls) == len(set(calls))  # nothing measured twice
    for batch in rec.batches:  # each phase one clock at a time, from the highest
        freqs = [n.knobs.freq_mhz for n in batch]
        assert freqs == sorted(freqs, reverse=True)
    assert set(calls) == set(report.measured)
    assert set(report.measured) | set(report.fitted) == set(needs)
    assert not set(report.measured) & set(report.fitted)
    assert report.failed_series == 0 and report.series == len(curves)
    assert len(report.measured) == 6 * len(curves)  # 5 anchors and a held-out clock each
    for n, (m, _info) in report.fitted.items():
        _assert_fitted_is_the_formula(n, m, curves[n.ops_key])


# Curves of another shape --------------------------------------------------------------------

class OnlyAtTheFirstClocks:
    """A curve that agrees with ``curve`` at the clocks measured first (the anchors) and is
    ``factor`` off it in time (``energy_factor`` in dynamic energy) at every other clock:
    the fitted shape describes the anchors exactly and nothing between them."""

    def __init__(self, curve: Curve, factor: float, energy_factor: float = 1.0) -> None:
        self.curve, self.factor, self.energy_factor = curve, factor, energy_factor
        self.first: set[int] | None = None

    def __call__(self, batch: Sequence[Need]) -> list[Measurement]:
        if self.first is None and batch:
            self.first = {n.knobs.freq_mhz for n in batch}
        return [self.at(n.knobs.freq_mhz) for n in batch]

    def at(self, f: int) -> Measurement:
        m = self.curve.measurement(f)
        assert self.first is not None
        if f in self.first:
            return m
        t = m.time_s * self.factor
        e = m.dynamic_energy_j * self.energy_factor
        static = self.curve.static_w * t
        return Measurement(t, static + e, static, e, (static + e) / t, float(f))


@pytest.mark.parametrize(("factor", "energy_factor"), [(1.3, 1.0), (0.9, 1.0), (1.0, 1.2),
                                                       (1.0, 0.95)])
def test_a_series_off_the_shape_between_its_anchors_is_measured_at_every_clock(
        factor, energy_factor):
    bad = OnlyAtTheFirstClocks(CURVE, factor, energy_factor)
    needs = _series(CLOCKS, "bad#1")
    report = measure_steps(needs, bad, FitPolicy())
    assert report.failed_series == 1 and report.series == 1
    assert report.fitted == {}
    assert set(report.measured) == set(needs)
    for n, m in report.measured.items():  # what was measured, not a prediction
        assert m == bad.at(n.knobs.freq_mhz)


def test_a_failed_series_does_not_stop_another_from_being_fitted():
    off = Curve(CURVE.a * 3, CURVE.b, *CURVE.c)
    anchors: set[int] = set()

    def answer(batch: Sequence[Need]) -> list[Measurement]:
        if not anchors and batch:
            anchors.update(n.knobs.freq_mhz for n in batch)
        return [CURVE.measurement(f) if n.ops_key == "good#1" or f in anchors
                else off.measurement(f) for n in batch for f in [n.knobs.freq_mhz]]

    needs = _series(CLOCKS, "good#1") + _series(CLOCKS, "bad#1", sms=8)
    report = measure_steps(needs, answer, FitPolicy())
    assert report.series == 2 and report.failed_series == 1
    assert {n.ops_key for n in report.fitted} == {"good#1"}
    assert len(report.fitted) == 12
    assert {n for n in needs if n.ops_key == "bad#1"} <= set(report.measured)


@pytest.mark.parametrize("time", [
    pytest.param(lambda f: 1.0 if f > 760 else 3.0, id="step"),
    pytest.param(lambda f: max(1.0, 800.0 / f), id="memory-bound-kink"),
])
def test_a_step_or_a_kink_in_time_fails_the_held_out_check(time):
    def answer(batch: Sequence[Need]) -> list[Measurement]:
        out = []
        for n in batch:
            t = time(n.knobs.freq_mhz)
            out.append(Measurement(t, STATIC_W * t + 1.0, STATIC_W * t, 1.0,
                                   (STATIC_W * t + 1.0) / t, float(n.knobs.freq_mhz)))
        return out

    report = measure_steps(_series(CLOCKS), answer, FitPolicy())
    assert report.failed_series == 1 and report.fitted == {}


# Throttling -------------------------------------------------------------------------------

def _throttled_above(threshold: int, held_to: float) -> Callable[[Need], Measurement]:
    """The power limiter holds every clock at or above ``threshold`` to ``held_to``."""
    def answer(n: Need) -> Measurement:
        f = n.knobs.freq_mhz
        return CURVE.measurement(f, held_to if f >= threshold else None)
    return answer


@settings(max_examples=60, deadline=None)
@given(clocks=_clock_lists(), cut=st.floats(0.0, 1.0))
def test_the_throttled_top_is_measured_above_the_highest_unthrottled_anchor(clocks, cut):
    threshold = clocks[min(int(cut * len(clocks)), len(clocks) - 1)]
    held_to = threshold * 0.9  # throttled clocks run below the lowest throttled one
    rec = Recorder(_throttled_above(threshold, held_to))
    needs = _series(clocks)
    report = measure_steps(needs, rec, FitPolicy())
    anchors = {n.knobs.freq_mhz for n in rec.phases[0]}  # the first phase measured
    free = [f for f in anchors if f < threshold]
    top_free = max(free, default=min(clocks))
    measured = {n.knobs.freq_mhz for n in report.measured}
    fitted = {n.knobs.freq_mhz for n in report.fitted}
    assert {f for f in clocks if f > top_free} <= measured
    assert all(f < threshold for f in fitted)  # no throttled clock is ever fitted
    assert all(f < top_free for f in fitted)
    assert measured | fitted == set(clocks) and not measured & fitted
    assert len(rec.calls) == len(set(rec.calls))
    if len(free) >= 3:  # enough unthrottled anchors to fit: the fit holds, and only the
        # anchors, the throttled range and one held-out clock are measured
        assert report.failed_series == 0
        assert len(measured) <= len(anchors | {f for f in clocks if f > top_free}) + 1
    for n, (m, _info) in report.fitted.items():  # the unthrottled curve, exactly
        _assert_fitted_is_the_formula(n, m, CURVE)


def test_throttling_at_the_top_of_eighteen_clocks():
    threshold = 1300  # 1410 and 1340 throttled; 1270 and 1200 not, but above every anchor
    rec = Recorder(_throttled_above(threshold, 1250.0))
    report = measure_steps(_series(CLOCKS), rec, FitPolicy())
    anchors = sorted((n.knobs.freq_mhz for n in rec.phases[0]), reverse=True)
    assert anchors[0] == 1410
    top_free = max(f for f in anchors if f < threshold)
    assert top_free < 1200
    measured = {n.knobs.freq_mhz for n in report.measured}
    assert {1410, 1340, 1270, 1200} <= measured
    assert {f for f in CLOCKS if f > top_free} <= measured
    assert report.fitted and max(n.knobs.freq_mhz for n in report.fitted) < top_free
    assert report.failed_series == 0
    for n, (m, _info) in report.fitted.items():
        _assert_fitted_is_the_formula(n, m, CURVE)


# Everything measured ------------------------------------------------------------------------

@pytest.mark.parametrize(("clocks", "policy"), [
    (CLOCKS[:7], FitPolicy()),  # fewer than min_clocks (8)
    (CLOCKS[:3], FitPolicy()),
    (CLOCKS[:1], FitPolicy()),
    (CLOCKS, FitPolicy(enabled=False)),
    (CLOCKS, FitPolicy(min_clocks=19)),
])
def test_short_series_and_a_disabled_policy_measure_every_clock(clocks, policy):
    rec = Recorder(_by_curve({"x#1": CURVE}))
    needs = _series(clocks)
    report = measure_steps(needs, rec, policy)
    assert report.fitted == {} and report.failed_series == 0
    assert set(report.measured) == set(needs)
    assert sorted(rec.calls, key=lambda n: -n.knobs.freq_mhz) == rec.calls
    assert len(rec.calls) == len(needs)
    assert planned_clocks(clocks, policy) == clocks


def test_a_short_series_beside_a_long_one_is_measured_in_full_the_long_one_fitted():
    short, long = _series(CLOCKS[:5], "s#1"), _series(CLOCKS, "l#1")
    report = measure_steps(short + long, Recorder(_by_curve({"s#1": CURVE, "l#1": CURVE})),
                           FitPolicy())
    assert set(short) <= set(report.measured)
    assert {n.ops_key for n in report.fitted} == {"l#1"} and len(report.fitted) == 12


# The policy's own checks ----------------------------------------------------------------

@pytest.mark.parametrize("policy", [
    FitPolicy(anchors=2), FitPolicy(anchors=0), FitPolicy(anchors=-3),
    FitPolicy(tolerance=0.0), FitPolicy(tolerance=1.0), FitPolicy(tolerance=-0.01),
    FitPolicy(tolerance=1.5), FitPolicy(tolerance=math.nan),
])
def test_a_policy_with_too_few_anchors_or_a_tolerance_outside_0_1_is_refused(policy):
    with pytest.raises(SpecError):
        policy.check()


@pytest.mark.parametrize("policy", [FitPolicy(), FitPolicy(anchors=3),
                                    FitPolicy(tolerance=1e-6), FitPolicy(tolerance=0.999),
                                    FitPolicy(enabled=False)])
def test_a_sound_policy_passes_its_check(policy):
    policy.check()


# What the estimate plans is what is measured ----------------------------------------------

@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clocks=_clock_lists(min_size=1), anchors=st.integers(3, 9),
       min_clocks=st.integers(1, 20), enabled=st.booleans())
def test_planned_clocks_are_what_measure_steps_measures_on_exact_data(
        clocks, anchors, min_clocks, enabled):
    policy = FitPolicy(enabled=enabled, anchors=anchors, min_clocks=min_clocks)
    rec = Recorder(_by_curve({"x#1": CURVE}))
    report = measure_steps(_series(clocks), rec, policy)
    planned = planned_clocks(clocks, policy)
    assert len(planned) == len(set(planned))
    assert {n.knobs.freq_mhz for n in report.measured} == set(planned)
    assert len(rec.calls) == len(planned)
    assert report.failed_series == 0


def test_among_noisy_steps_a_kink_still_fails_and_the_noisy_ones_are_fitted():
    """The noise allowance is the median residual spread over the job's steps: four
    steps of the fitted shape measured with 3% noise set it, and a memory-bound kink
    (time max(1 ms, 0.8 s MHz / f)) whose own spread is several times larger still fails
    its check rather than excusing itself."""
    import numpy as np

    rng = np.random.default_rng(0)
    kink = lambda f: max(1e-3, 0.8 / f)  # noqa: E731

    def answer(need: Need) -> Measurement:
        f = need.knobs.freq_mhz
        if need.ops_key == "kink#1":
            return step_measurement(f, kink(f), 0.1)
        m = CURVE.measurement(f)
        a, b = rng.normal(1.0, 0.03, 2)
        return step_measurement(f, m.time_s * a, m.dynamic_energy_j * b)

    noisy = [n for i in range(4) for n in _series(CLOCKS, f"noisy{i}#1")]
    report = measure_steps([*noisy, *_series(CLOCKS, "kink#1")], Recorder(answer),
                           FitPolicy())
    assert not any(n.ops_key == "kink#1" for n in report.fitted)
    assert all(n in report.measured for n in _series(CLOCKS, "kink#1"))
    # most noisy steps pass: their fits are kept despite 3% noise
    kept = {n.ops_key for n in report.fitted}
    assert len(kept) >= 3
