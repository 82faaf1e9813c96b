"""Gaussian-process surrogate with a kernel built for the knob space.

The time and the dynamic energy of a partition's settings share structure that boosted
trees fitted to a few dozen noisy points do not see (docs/search.md, "Surrogates"):

- a clock effect: every setting slows down and saves energy the same way as the clock
  falls;
- a configuration effect shared by all clocks: which (collective SMs, launch slot) is fast
  hardly depends on the clock, so a configuration measured at one clock informs it at
  every other;
- a smooth interaction of the two (the best SM count drifts as the clock moves the
  balance between compute and the collective);
- a per-configuration offset with no smoothness at all: GEMM wave and tile quantisation
  make one SM count a few tenths of a percent faster than its neighbours at every clock;
- measurement noise.

Each term is a kernel on the columns it concerns: column 0 is the clock, the next ones the
configuration (collective SMs, launch position, FLOPs before the launch, overlap flag;
`KnobSpace.features`). The signal terms are one kernel computed in numpy (`KnobKernel`);
`knob_kernel_reference` builds the same model from scikit-learn's kernel algebra
(`OnColumns`), several times slower to fit, and the tests hold the two equal. The
kernel's hyperparameters are fitted by marginal likelihood (scikit-learn), warm-started
from the previous batch's fit. Predictions leave the noise term out, so their spread is
what is not known about a setting, not the scatter of one more measurement of it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from sklearn.gaussian_process.kernels import Hyperparameter, Kernel

from kareus.search.knob_kernel import KnobKernel

KNOB_COLUMNS = 5
"""Columns of `KnobSpace.features` the kernel reads: clock, then four configuration
columns (the slot one-hot columns repeat what the ordinals say)."""


class OnColumns(Kernel):
    """``kernel`` applied to some input columns only (scikit-learn kernels see them all)."""

    def __init__(self, kernel: Kernel, columns: tuple[int, ...]) -> None:
        self.kernel = kernel
        self.columns = columns

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        params: dict[str, Any] = {"kernel": self.kernel, "columns": self.columns}
        if deep:
            params.update(("kernel__" + k, v) for k, v in self.kernel.get_params().items())
        return params

    @property
    def hyperparameters(self) -> list[Hyperparameter]:
        return [Hyperparameter("kernel__" + h.name, h.value_type, h.bounds, h.n_elements)
                for h in self.kernel.hyperparameters]

    @property
    def theta(self) -> np.ndarray:
        return np.asarray(self.kernel.theta)

    @theta.setter
    def theta(self, theta: np.ndarray) -> None:
        self.kernel.theta = theta

    @property
    def bounds(self) -> np.ndarray:
        return np.asarray(self.kernel.bounds)

    def _select(self, X: np.ndarray | None) -> np.ndarray | None:
        return None if X is None else np.asarray(X)[:, list(self.columns)]

    def __call__(self, X: np.ndarray, Y: np.ndarray | None = None,
                 eval_gradient: bool = False) -> Any:
        return self.kernel(self._select(X), self._select(Y), eval_gradient=eval_gradient)

    def diag(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(self.kernel.diag(self._select(X)))

    def is_stationary(self) -> bool:
        return bool(self.kernel.is_stationary())

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, OnColumns) and self.columns == other.columns
                and self.kernel == other.kernel)

    def __repr__(self) -> str:
        return f"{self.kernel!r}@{list(self.columns)}"


def knob_kernel(n_config: int = KNOB_COLUMNS - 1, n_prior: int = 0) -> Kernel:
    """clock + configuration + clock x configuration + per-configuration offset
    [+ linear in the prior's log predictions] + noise, on standardised targets. The noise
    term comes last (`KnobGPSurrogate` splits it off as the outermost sum's second part)."""
    from sklearn.gaussian_process.kernels import WhiteKernel

    signal = KnobKernel(n_config, n_prior, config_lengths=np.ones(n_config),
                        interaction_config_lengths=np.ones(n_config))
    return signal + WhiteKernel(1e-2, (1e-5, 1.0))


def knob_kernel_reference(n_config: int = KNOB_COLUMNS - 1, n_prior: int = 0) -> Kernel:
    """`knob_kernel` built from scikit-learn's kernel algebra: the same model, several
    times slower to fit (kept as the independent computation `KnobKernel` is tested
    against)."""
    from sklearn.gaussian_process.kernels import (
        RBF,
        ConstantKernel,
        DotProduct,
        Matern,
        WhiteKernel,
    )

    clock, config = (0,), tuple(range(1, 1 + n_config))
    prior = tuple(range(1 + n_config, 1 + n_config + n_prior))

    def on_clock() -> Kernel:
        return OnColumns(Matern(1.0, (1e-2, 1e2), nu=2.5), clock)

    def on_config() -> Kernel:
        return OnColumns(Matern(np.ones(n_config), (1e-2, 1e2), nu=2.5), config)

    # configurations differ by at least 1/20 in some column: a length of 0.01 leaves
    # exp(-12.5) between two of them, one for a configuration with itself
    offset = OnColumns(RBF(0.01, "fixed"), config)
    signal = (ConstantKernel(1.0, (1e-3, 1e2)) * on_clock()
              + ConstantKernel(1.0, (1e-3, 1e2)) * on_config()
              + ConstantKernel(0.1, (1e-4, 1e2)) * on_clock() * on_config()
              + ConstantKernel(1e-2, (1e-4, 1.0)) * offset)
    if prior:
        signal = signal + ConstantKernel(1.0, (1e-3, 1e2)) * OnColumns(
            DotProduct(1.0, (1e-3, 1e2)), prior)
    return signal + WhiteKernel(1e-2, (1e-5, 1.0))


@functools.cache
def _blas_controller() -> Any:
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _one_blas_thread() -> Any:
    """A context limiting BLAS and OpenMP to one thread. threadpoolctl's
    `threadpool_limits` scans the loaded libraries on every call (about 5 ms, 16 times per
    partition search); the controller scans them once, on the first fit, when numpy,
    scipy and scikit-learn have loaded theirs."""
    return _blas_controller().limit(limits=1)


class KnobGPSurrogate:
    """One Gaussian process per objective on log targets (standardised by scikit-learn)."""

    def __init__(self, seed: int = 0, warm: KnobGPSurrogate | None = None,
                 n_prior: int = 0) -> None:
        self.seed = seed
        self.n_prior = n_prior
        self.warm = warm
        self._fits: list[Any] = []
        self.kernels: list[Kernel] = []
        """The fitted kernels, noise term included (the next batch starts from them)."""

    def _columns(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X)
        cols = [X[:, :KNOB_COLUMNS]] + ([X[:, -self.n_prior:]] if self.n_prior else [])
        return np.column_stack(cols)

    def fit(self, X: np.ndarray, Y: np.ndarray) -> KnobGPSurrogate:
        """X: (n, d) `KnobSpace.features` rows (prior columns last); Y: (n, k) positive
        objectives."""
        # one BLAS thread: partitions are searched in parallel processes already, and the
        # same data must give the same fit in every process (bit for bit: the path of a
        # search, hence the journal's rerun rule, depends on it)
        with _one_blas_thread():
            return self._fit(X, Y)

    def _fit(self, X: np.ndarray, Y: np.ndarray) -> KnobGPSurrogate:
        import warnings

        from sklearn.exceptions import ConvergenceWarning
        from sklearn.gaussian_process import GaussianProcessRegressor

        X = self._columns(X)
        logy = np.log(Y)
        self._fits, self.kernels = [], []
        for j in range(Y.shape[1]):
            start = (self.warm.kernels[j].clone_with_theta(self.warm.kernels[j].theta)
                     if self.warm is not None and len(self.warm.kernels) > j
                     else knob_kernel(n_prior=self.n_prior))
            gp = GaussianProcessRegressor(start, normalize_y=True, n_restarts_optimizer=0,
                                          random_state=self.seed + j)
            with warnings.catch_warnings():
                # a length scale at its bound is an answer (that input does not matter)
                warnings.simplefilter("ignore", ConvergenceWarning)
                gp.fit(X, logy[:, j])
            self.kernels.append(gp.kernel_)
            signal, white = gp.kernel_.k1, gp.kernel_.k2
            clean = GaussianProcessRegressor(signal, alpha=white.noise_level, optimizer=None,
                                             normalize_y=True)
            self._fits.append(clean.fit(X, logy[:, j]))
        return self

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Median and spread of each objective in its own units (log-normal, first order)."""
        X = self._columns(X)
        with _one_blas_thread():
            mus, sds = zip(*(fit.predict(X, return_std=True) for fit in self._fits))
        mu, sd = np.column_stack(mus), np.column_stack(sds)
        values = np.exp(mu)
        return values, values * sd
