"""`KnobKernel` against the composite scikit-learn kernel it replaces (an independent
computation of the same model), and against finite differences."""

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.gaussian_process import GaussianProcessRegressor

from kareus.search.gp import knob_kernel, knob_kernel_reference
from kareus.search.knob_kernel import KnobKernel


def _features(rng, n, n_prior):
    """Knob-space-like rows: clock, four configuration columns on a grid (duplicates
    included, so the offset term sees equal configurations), prior log predictions, and
    one column no term reads."""
    clock = rng.choice(np.arange(900, 1411, 30.0), n) / 1410
    config = np.column_stack([rng.integers(1, 11, n) / 10, rng.integers(0, 4, n) / 4,
                              rng.random(n), rng.integers(0, 2, n)])
    prior = rng.normal(0.0, 1.0, (n, n_prior))
    return np.column_stack([clock, config, prior, rng.random(n)])


def _random_theta(rng, bounds):
    return rng.uniform(bounds[:, 0], bounds[:, 1])


@pytest.mark.parametrize("n_prior", [0, 2])
def test_knob_kernel_has_the_composite_kernels_hyperparameters(n_prior):
    fast, ref = knob_kernel(n_prior=n_prior), knob_kernel_reference(n_prior=n_prior)
    assert np.array_equal(fast.theta, ref.theta)
    assert np.array_equal(fast.bounds, ref.bounds)
    assert [h.n_elements for h in fast.hyperparameters] == [
        h.n_elements for h in ref.hyperparameters if not h.fixed]
    assert fast.k1.is_stationary() == ref.k1.is_stationary() == (n_prior == 0)


@pytest.mark.parametrize("n_prior", [0, 2])
@pytest.mark.parametrize("seed", range(4))
def test_knob_kernel_equals_the_composite_kernel(n_prior, seed):
    rng = np.random.default_rng(seed)
    X, Y = _features(rng, 40, n_prior), _features(rng, 15, n_prior)
    theta = _random_theta(rng, knob_kernel_reference(n_prior=n_prior).bounds)
    fast = knob_kernel(n_prior=n_prior).clone_with_theta(theta)
    ref = knob_kernel_reference(n_prior=n_prior).clone_with_theta(theta)
    K, grad = fast(X, eval_gradient=True)
    K_ref, grad_ref = ref(X, eval_gradient=True)
    scale = np.abs(K_ref).max()
    np.testing.assert_allclose(K, K_ref, rtol=1e-9, atol=1e-12 * scale)
    assert grad.shape == grad_ref.shape
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-9, atol=1e-12 * scale)
    np.testing.assert_allclose(fast(X, Y), ref(X, Y), rtol=1e-9, atol=1e-12 * scale)
    np.testing.assert_allclose(fast.diag(X), ref.diag(X), rtol=1e-12)
    np.testing.assert_allclose(fast.k1.diag(X), np.diag(fast.k1(X)), rtol=1e-12)


@pytest.mark.parametrize("n_prior", [0, 2])
def test_knob_kernel_gradient_matches_finite_differences(n_prior):
    rng = np.random.default_rng(7)
    X = _features(rng, 25, n_prior)
    kernel = knob_kernel(n_prior=n_prior).k1
    theta = _random_theta(rng, kernel.bounds)
    K, grad = kernel.clone_with_theta(theta)(X, eval_gradient=True)
    # central differences: truncation ~ step^2, rounding ~ 1e-16 * |K| / step
    step = 1e-5
    for i in range(len(theta)):
        up, down = theta.copy(), theta.copy()
        up[i] += step
        down[i] -= step
        numeric = (kernel.clone_with_theta(up)(X) - kernel.clone_with_theta(down)(X)) / (2 * step)
        np.testing.assert_allclose(grad[..., i], numeric, rtol=1e-6,
                                   atol=1e-9 * np.abs(K).max())


def test_knob_kernel_clones_and_keeps_its_parameters():
    kernel = knob_kernel(n_prior=2)
    theta = kernel.theta + 0.3
    moved = kernel.clone_with_theta(theta)
    assert np.allclose(moved.theta, theta) and np.allclose(kernel.theta + 0.3, theta)
    copy = clone(moved)
    assert copy == moved and copy.k1.n_prior == 2
    assert np.allclose(copy.k1.config_lengths, np.exp(theta[3:7]))
    copy.k1.set_params(clock_scale=2.0)
    assert copy.k1.clock_scale == 2.0 and copy != moved
    with pytest.raises(ValueError, match="Gradient"):
        KnobKernel()(np.zeros((2, 5)), np.zeros((2, 5)), eval_gradient=True)


@pytest.mark.parametrize("n_prior", [0, 2])
def test_a_fit_reaches_the_composite_kernels_likelihood(n_prior):
    rng = np.random.default_rng(11)
    X = _features(rng, 40, n_prior)[:, :-1]
    y = np.log(1 / X[:, 0] * (1 + 0.05 * (X[:, 1] - 0.5) ** 2)
               * (1 + 0.01 * rng.standard_normal(40)))
    if n_prior:
        X[:, -n_prior:] = y[:, None] + 0.05 * rng.standard_normal((40, n_prior))
    fits = [GaussianProcessRegressor(k, normalize_y=True, n_restarts_optimizer=0,
                                     random_state=0).fit(X, y)
            for k in (knob_kernel(n_prior=n_prior), knob_kernel_reference(n_prior=n_prior))]
    fast, ref = (gp.log_marginal_likelihood_value_ for gp in fits)
    # the two kernels agree to 1e-9 (above); L-BFGS-B then takes its own path through a
    # flat optimum from each one's rounding: 1.3e-6 apart with scipy 1.17.1 and numpy 2.4.6
    assert fast == pytest.approx(ref, rel=1e-5)
    # the optimum is flat along some lengths (an input that hardly matters), so compare
    # what the fits predict, not every hyperparameter
    grid = _features(np.random.default_rng(12), 30, n_prior)[:, :-1]
    np.testing.assert_allclose(fits[0].predict(grid), fits[1].predict(grid), atol=1e-4)
