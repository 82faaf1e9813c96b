import numpy as np
import pytest
from sklearn.gaussian_process.kernels import Matern

from kareus.search.gp import KnobGPSurrogate, OnColumns, knob_kernel
from kareus.search.surrogate import SurrogateConfig, make_surrogate


def test_on_columns_is_the_kernel_of_those_columns_with_its_gradient():
    rng = np.random.default_rng(0)
    X, Y = rng.random((7, 4)), rng.random((5, 4))
    base = Matern([0.5, 2.0], nu=2.5)
    k = OnColumns(Matern([0.5, 2.0], nu=2.5), (1, 3))
    assert np.allclose(k(X, Y), base(X[:, [1, 3]], Y[:, [1, 3]]))
    K, grad = k(X, eval_gradient=True)
    K0, grad0 = base(X[:, [1, 3]], eval_gradient=True)
    assert np.allclose(K, K0) and np.allclose(grad, grad0)
    assert np.allclose(k.diag(X), 1.0)
    assert np.allclose(k.theta, base.theta) and np.allclose(k.bounds, base.bounds)
    moved = k.clone_with_theta(np.log([0.1, 0.2]))
    assert np.allclose(moved.kernel.length_scale, [0.1, 0.2]) and moved.columns == (1, 3)
    assert [h.name for h in k.hyperparameters] == ["kernel__length_scale"]


def _knob_features(freq, sms, slot):
    """KnobSpace-like columns: clock, SMs, launch position, FLOPs before launch, overlap."""
    return np.column_stack([freq / 1410, sms / 30, slot / 4, slot / 4, np.ones_like(freq)])


def _grid():
    f, n, s = np.meshgrid(np.arange(900, 1411, 30.0), np.arange(3, 31, 3.0),
                          np.arange(4.0), indexing="ij")
    return f.ravel(), n.ravel(), s.ravel()


def _time(f, n, s, dip=0.0):
    # smooth in every knob, plus SM count 12 a few percent faster at every clock
    base = (1410 / f) * (1 + 0.02 * (n / 30 - 0.5) ** 2 + 0.01 * s)
    return base * np.where(n == 12, 1 - dip, 1.0)


def test_gp_learns_the_knob_structure_and_knows_where_it_has_not_looked():
    f, n, s = _grid()
    X, t = _knob_features(f, n, s), _time(f, n, s)
    Y = np.column_stack([t, 0.2 * (f / 1410) ** 2])
    rng = np.random.default_rng(1)
    seen = rng.choice(len(X), 60, replace=False)
    model = KnobGPSurrogate(seed=0).fit(X[seen], Y[seen])
    mean, spread = model.predict(X)
    assert np.median(np.abs(mean / Y - 1)) < 0.01
    unseen = np.setdiff1d(np.arange(len(X)), seen)
    assert np.all(spread >= 0)
    assert np.median(spread[unseen, 0]) > np.median(spread[seen, 0])


def test_a_configuration_fast_at_some_clocks_is_predicted_fast_at_the_others():
    # SM count 12 is 3% faster than its smooth neighbours (9 and 15) at every clock; it is
    # measured at five clocks only, with 1% noise; at the other clocks the GP must carry
    # the offset over, not interpolate it away
    f, n, s = _grid()
    X, t = _knob_features(f, n, s), _time(f, n, s, dip=0.03)
    rng = np.random.default_rng(2)
    is12 = n == 12
    seen = np.concatenate([rng.choice(np.flatnonzero(~is12), 100, replace=False),
                           rng.choice(np.flatnonzero(is12 & (s == 1)), 5, replace=False)])
    noisy = t[seen] * (1 + 0.01 * rng.standard_normal(len(seen)))
    model = KnobGPSurrogate(seed=0).fit(X[seen], np.column_stack([noisy, noisy]))
    mean, _ = model.predict(X)
    unseen12 = np.setdiff1d(np.flatnonzero(is12 & (s == 1)), seen)
    for i in unseen12:
        neighbours = np.flatnonzero((f == f[i]) & (s == 1) & np.isin(n, (9, 15)))
        assert mean[i, 0] < mean[neighbours, 0].min()


def test_warm_start_continues_from_the_previous_fit():
    f, n, s = _grid()
    X, t = _knob_features(f, n, s), _time(f, n, s)
    Y = np.column_stack([t, t])
    first = make_surrogate(SurrogateConfig(kind="gp"), 0).fit(X[:50], Y[:50])
    second = make_surrogate(SurrogateConfig(kind="gp"), 1, first)
    assert isinstance(second, KnobGPSurrogate) and second.warm is first
    second.fit(X[:60], Y[:60])
    assert len(second.kernels) == 2
    xgb = make_surrogate(SurrogateConfig(kind="xgboost"), 0, first)
    assert not isinstance(xgb, KnobGPSurrogate)


def test_knob_kernel_reads_the_clock_and_configuration_columns_only():
    f, n, s = _grid()
    X = _knob_features(f, n, s)[:20]
    extra = np.column_stack([X, np.random.default_rng(0).random((20, 3))])  # prior columns
    k = knob_kernel()
    assert np.allclose(k(X), k(extra))


def test_unknown_surrogate_is_a_spec_error():
    from kareus.errors import SpecError

    with pytest.raises(SpecError, match="unknown surrogate"):
        SurrogateConfig(kind="forest").check()


def test_prior_columns_carry_what_the_knobs_cannot():
    # times rough in the configuration (a random value per SM count and slot) that the
    # prior knows up to a 10% scale and a clock-dependent tilt: with the prior's log
    # predictions as the last columns, 25 points suffice; from the knobs alone they do not
    f, n, s = _grid()
    rng = np.random.default_rng(3)
    rough = rng.uniform(1.0, 1.5, size=(31, 4))[n.astype(int), s.astype(int)]
    t = (1410 / f) * rough
    prior_t = 0.9 * t * (f / 1410) ** 0.1
    X = np.column_stack([_knob_features(f, n, s), np.log(prior_t), np.log(prior_t)])
    Y = np.column_stack([t, t])
    seen = rng.choice(len(X), 25, replace=False)
    with_prior = KnobGPSurrogate(seed=0, n_prior=2).fit(X[seen], Y[seen])
    without = KnobGPSurrogate(seed=0).fit(X[seen, :-2], Y[seen])
    err_with = np.mean(np.abs(with_prior.predict(X)[0][:, 0] / t - 1))
    err_without = np.mean(np.abs(without.predict(X[:, :-2])[0][:, 0] / t - 1))
    assert err_with < 0.005 and err_without > 0.02
