"""The knob kernel's signal part as one scikit-learn kernel, computed directly in numpy.

Same model as the composite `kareus.search.gp.knob_kernel_reference` (a sum of products
of ConstantKernel, Matern, RBF and DotProduct, each through `OnColumns`): the same terms,
hyperparameters, bounds, initial values and log-theta order. The composite spends most of
a fit in scikit-learn's kernel-algebra bookkeeping (every `theta`, `bounds` and
`clone_with_theta` walks the tree, `hyperparameters` calls `dir()` on every node, the
gradients are stacked node by node); this class computes the squared column differences
once per call and every term and gradient from them (docs/search.md, "Surrogates").

log-theta order (the composite's, term by term):
clock scale, clock length, configuration scale, configuration lengths (one per column),
interaction scale, interaction clock length, interaction configuration lengths, offset
scale [, prior scale, prior sigma_0].
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.gaussian_process.kernels import Hyperparameter, Kernel

OFFSET_LENGTH = 0.01
"""Fixed length of the per-configuration offset: configurations differ by at least 1/20
in some column, so a length of 0.01 leaves exp(-12.5) between two of them, one for a
configuration with itself."""

SCALE_BOUNDS = (1e-3, 1e2)
INTERACTION_SCALE_BOUNDS = (1e-4, 1e2)
OFFSET_SCALE_BOUNDS = (1e-4, 1.0)
LENGTH_BOUNDS = (1e-2, 1e2)
SQRT5 = np.sqrt(5.0)

# (parameter, bounds, one element per configuration column?) in log-theta order
_PARAMS: tuple[tuple[str, tuple[float, float], bool], ...] = (
    ("clock_scale", SCALE_BOUNDS, False),
    ("clock_length", LENGTH_BOUNDS, False),
    ("config_scale", SCALE_BOUNDS, False),
    ("config_lengths", LENGTH_BOUNDS, True),
    ("interaction_scale", INTERACTION_SCALE_BOUNDS, False),
    ("interaction_clock_length", LENGTH_BOUNDS, False),
    ("interaction_config_lengths", LENGTH_BOUNDS, True),
    ("offset_scale", OFFSET_SCALE_BOUNDS, False),
)
_PRIOR_PARAMS: tuple[tuple[str, tuple[float, float], bool], ...] = (
    ("prior_scale", SCALE_BOUNDS, False),
    ("prior_sigma_0", SCALE_BOUNDS, False),
)


def _matern52(d2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Matern 5/2 of squared scaled distances, and exp(-sqrt5 d) * (1 + sqrt5 d), the
    factor every length-scale gradient shares (d/dlog l_i = 5/3 D_i * that)."""
    # in place: the optimiser calls this a few thousand times per search
    r = np.sqrt(d2)
    r *= SQRT5
    e = np.exp(-r)
    k = r * r
    k *= 1.0 / 3.0
    k += r
    k += 1.0
    k *= e
    r += 1.0
    r *= e
    return k, r


class KnobKernel(Kernel):
    """clock + configuration + clock x configuration + per-configuration offset
    [+ linear in the prior columns], on columns [clock, n_config configuration columns,
    n_prior prior columns, ...] (columns beyond those are ignored)."""

    def __init__(self, n_config: int = 4, n_prior: int = 0, clock_scale: float = 1.0,
                 clock_length: float = 1.0, config_scale: float = 1.0,
                 config_lengths: Any = 1.0, interaction_scale: float = 0.1,
                 interaction_clock_length: float = 1.0,
                 interaction_config_lengths: Any = 1.0, offset_scale: float = 1e-2,
                 prior_scale: float = 1.0, prior_sigma_0: float = 1.0) -> None:
        # stored as given: sklearn's clone checks that the constructor keeps its arguments
        self.n_config = n_config
        self.n_prior = n_prior
        self.clock_scale = clock_scale
        self.clock_length = clock_length
        self.config_scale = config_scale
        self.config_lengths = config_lengths
        self.interaction_scale = interaction_scale
        self.interaction_clock_length = interaction_clock_length
        self.interaction_config_lengths = interaction_config_lengths
        self.offset_scale = offset_scale
        self.prior_scale = prior_scale
        self.prior_sigma_0 = prior_sigma_0

    def _params(self) -> tuple[tuple[str, tuple[float, float], bool], ...]:
        return _PARAMS + (_PRIOR_PARAMS if self.n_prior else ())

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        names = ("n_config", "n_prior", *(p[0] for p in _PARAMS + _PRIOR_PARAMS))
        return {name: getattr(self, name) for name in names}

    def _per_column(self, value: Any) -> list[float]:
        """A per-column length as n_config floats (a scalar means the same for all);
        plain lists: `theta` is read several times per likelihood evaluation."""
        if np.ndim(value) == 0:
            return [float(value)] * self.n_config
        return [float(v) for v in value]

    @property
    def hyperparameters(self) -> list[Hyperparameter]:
        return [Hyperparameter(name, "numeric", bounds, self.n_config if per_column else 1)
                for name, bounds, per_column in self._params()]

    @property
    def theta(self) -> np.ndarray:
        values: list[float] = []
        for name, _, per_column in self._params():
            value = getattr(self, name)
            if per_column:
                values.extend(self._per_column(value))
            else:
                values.append(float(value))
        return np.log(values)

    @theta.setter
    def theta(self, theta: np.ndarray) -> None:
        values = np.exp(np.asarray(theta, dtype=float))
        i = 0
        for name, _, per_column in self._params():
            if per_column:
                setattr(self, name, values[i:i + self.n_config].copy())
                i += self.n_config
            else:
                setattr(self, name, float(values[i]))
                i += 1

    @property
    def bounds(self) -> np.ndarray:
        rows = [[bounds] * (self.n_config if per_column else 1)
                for _, bounds, per_column in self._params()]
        return np.log(np.array([b for row in rows for b in row], dtype=float))

    def clone_with_theta(self, theta: np.ndarray) -> KnobKernel:
        # the optimiser clones once per evaluation: skip sklearn's generic clone
        cloned = KnobKernel(self.n_config, self.n_prior)
        cloned.theta = theta
        return cloned

    def is_stationary(self) -> bool:
        # the prior's linear term depends on the inputs, not on their difference
        return not self.n_prior

    def diag(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=float)
        stationary = (self.clock_scale + self.config_scale + self.interaction_scale
                      + self.offset_scale)
        out = np.full(X.shape[0], stationary)
        if self.n_prior:
            p = self._prior(X)
            out += self.prior_scale * (self.prior_sigma_0 ** 2 + np.einsum("ij,ij->i", p, p))
        return out

    def _prior(self, X: np.ndarray) -> np.ndarray:
        start = 1 + self.n_config
        return X[:, start:start + self.n_prior]

    def __call__(self, X: np.ndarray, Y: np.ndarray | None = None,
                 eval_gradient: bool = False) -> Any:
        X = np.asarray(X, dtype=float)
        if Y is not None and eval_gradient:
            raise ValueError("Gradient can only be evaluated when Y is None.")
        Yv = X if Y is None else np.asarray(Y, dtype=float)
        nc = self.n_config
        clock2 = (X[:, None, 0] - Yv[None, :, 0]) ** 2
        # one (n, m) array per configuration column, not an (n, m, n_config) block: arrays
        # over 128 KiB are a fresh mmap per call, and at n = 100 their page faults cost as
        # much CPU as the arithmetic; planes of 80 KiB stay on the heap
        config2 = [(X[:, None, c] - Yv[None, :, c]) ** 2 for c in range(1, 1 + nc)]
        inv2 = [1.0 / v ** 2 for v in self._per_column(self.config_lengths)]
        iinv2 = [1.0 / v ** 2 for v in self._per_column(self.interaction_config_lengths)]
        c_clock, g_clock = _matern52(clock2 / self.clock_length ** 2)
        c_config, g_config = _matern52(sum(w * d for w, d in zip(inv2, config2)))
        i_clock_d = clock2 / self.interaction_clock_length ** 2
        i_clock, gi_clock = _matern52(i_clock_d)
        i_config, gi_config = _matern52(sum(w * d for w, d in zip(iinv2, config2)))
        offset = np.exp(sum(config2) * (-0.5 / OFFSET_LENGTH ** 2))
        interaction = i_clock * i_config
        K = (self.clock_scale * c_clock + self.config_scale * c_config
             + self.interaction_scale * interaction + self.offset_scale * offset)
        if self.n_prior:
            linear = self.prior_sigma_0 ** 2 + self._prior(X) @ self._prior(Yv).T
            K += self.prior_scale * linear
        if not eval_gradient:
            return K
        # d/dlog c of c * k is c * k; d/dlog l_i of a Matern 5/2 is 5/3 D_i (1 + r) e^-r
        grad = np.empty((self.n_dims, *K.shape))
        np.multiply(self.clock_scale, c_clock, out=grad[0])
        np.multiply((self.clock_scale * 5.0 / 3.0 / self.clock_length ** 2) * clock2, g_clock,
                    out=grad[1])
        np.multiply(self.config_scale, c_config, out=grad[2])
        for i in range(nc):
            np.multiply(config2[i], (self.config_scale * 5.0 / 3.0) * inv2[i], out=grad[3 + i])
            grad[3 + i] *= g_config
        j = 3 + nc
        np.multiply(self.interaction_scale, interaction, out=grad[j])
        np.multiply((self.interaction_scale * 5.0 / 3.0) * i_clock_d * gi_clock, i_config,
                    out=grad[j + 1])
        gi_config *= i_clock
        for i in range(nc):
            np.multiply(config2[i], (self.interaction_scale * 5.0 / 3.0) * iinv2[i],
                        out=grad[j + 2 + i])
            grad[j + 2 + i] *= gi_config
        j += 2 + nc
        np.multiply(self.offset_scale, offset, out=grad[j])
        if self.n_prior:
            np.multiply(self.prior_scale, linear, out=grad[j + 1])
            grad[j + 2] = self.prior_scale * 2.0 * self.prior_sigma_0 ** 2
        # scikit-learn wants (n, n, n_dims); the view costs nothing, Sum's stack copies it
        return K, np.moveaxis(grad, 0, -1)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, KnobKernel) and self.n_config == other.n_config
                and self.n_prior == other.n_prior
                and np.array_equal(self.theta, other.theta))

    def __repr__(self) -> str:
        values = ", ".join(f"{v:.3g}" for v in np.exp(self.theta))
        return f"KnobKernel(n_config={self.n_config}, n_prior={self.n_prior}; {values})"
