"""The curves of a step in the clock (kareus.profiling.step_curves): any time a + b/f and
dynamic energy c0 + c1 f + c2 f^2 is recovered exactly, with no residual spread; the noise
is the median spread over at least three steps."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.core import Measurement
from kareus.profiling.step_curves import Curves, HeldOut, pooled_spread

CLOCKS = [1980, 1800, 1605, 1410, 1200, 1005, 810]


def _m(f: int, a: float, b: float, c: tuple[float, float, float]) -> Measurement:
    x = f / 1e3
    t, e = a + b / x, c[0] + c[1] * x + c[2] * x * x
    return Measurement(t, e + 50.0 * t, 50.0 * t, e, (e + 50.0 * t) / t, float(f))


# energies in joules: no subnormal (a relative fit divides by each value; 1e-311 J is no
# measurement)
_J = st.floats(0.0, 1.0, allow_subnormal=False)


@settings(max_examples=40, deadline=None)
@given(st.floats(1e-4, 1e-2), st.floats(1e-4, 1e-2), _J, _J, _J)
def test_a_curve_of_the_shape_is_recovered_exactly(a, b, c0, c1, c2):
    points = [(f, _m(f, a, b, (c0, c1, c2))) for f in CLOCKS]
    curves = Curves.fit(points)
    for f, m in points:
        t, e = curves.predict(f)
        assert t == pytest.approx(m.time_s, rel=1e-9)
        assert e == pytest.approx(m.dynamic_energy_j, rel=1e-9, abs=1e-12)
    assert curves.spread(points) == pytest.approx((0.0, 0.0), abs=1e-9)


def test_time_off_the_shape_leaves_a_spread():
    kinked = [(f, _m(f, 1e-3 * (1.5 if f < 1300 else 1.0), 1e-3, (0.1, 0.1, 0.1)))
              for f in CLOCKS]
    assert Curves.fit(kinked).spread(kinked)[0] > 0.01


def test_the_noise_is_the_median_spread_of_three_steps_or_more():
    checks = [HeldOut(0.0, 0.0, (s, 2 * s)) for s in (0.01, 0.5, 0.02)]
    assert pooled_spread(checks) == (0.02, 0.04)
    assert pooled_spread(checks[:2]) == (0.0, 0.0)  # too few steps to tell noise
