"""Surrogate models of a partition's settings: time and dynamic energy (total energy =
dynamic + static power x time is derived, never learnt), both in log space.

Two kinds (`SurrogateConfig.kind`): "gp", a Gaussian process whose kernel follows the knob
space's structure (search/gp.py, the default), and "xgboost", the published bootstrap
ensemble of gradient-boosted trees: ``n_models`` regressors per objective, each fitted to a
bootstrap resample, standardised log targets; the ensemble mean is the prediction and its
spread the uncertainty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kareus.errors import SpecError

SURROGATES = ("gp", "xgboost")


class Surrogate(Protocol):
    def fit(self, X: np.ndarray, Y: np.ndarray) -> Surrogate:
        """X: (n, d) `KnobSpace.features` rows (plus prior columns); Y: (n, k) positive
        objectives."""
        ...

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Prediction and uncertainty of each objective, in the objectives' own units."""
        ...


@dataclass(frozen=True)
class SurrogateConfig:
    """``kind`` "gp" (ours) or "xgboost"; the XGBoost settings are the published Kareus
    ones (docs/anchors.md §4)."""

    kind: str = "gp"
    n_models: int = 5
    max_depth: int = 6
    learning_rate: float = 0.3
    subsample: float = 0.8
    n_estimators: int = 100

    def check(self) -> None:
        if self.kind not in SURROGATES:
            raise SpecError(f"unknown surrogate {self.kind!r}; known: {', '.join(SURROGATES)}")


def make_surrogate(config: SurrogateConfig, seed: int,
                   previous: Surrogate | None = None, n_prior: int = 0) -> Surrogate:
    """A new surrogate; a GP starts its kernel fit from ``previous`` (the last batch's)."""
    if config.kind == "gp":
        from kareus.search.gp import KnobGPSurrogate

        warm = previous if isinstance(previous, KnobGPSurrogate) else None
        return KnobGPSurrogate(seed=seed, warm=warm, n_prior=n_prior)
    return EnsembleSurrogate(config, seed=seed)


class EnsembleSurrogate:
    def __init__(self, config: SurrogateConfig | None = None, seed: int = 0) -> None:
        self.config = config or SurrogateConfig()
        self.seed = seed
        self._models: list[list] = []
        self._mu = self._sigma = None

    def fit(self, X: np.ndarray, Y: np.ndarray) -> EnsembleSurrogate:
        """X: (n, d) features; Y: (n, k) positive objectives."""
        import xgboost as xgb  # imported lazily: a heavy import

        c = self.config
        logy = np.log(Y)
        self._mu = logy.mean(axis=0)
        self._sigma = logy.std(axis=0) + 1e-12
        Z = (logy - self._mu) / self._sigma
        rng = np.random.default_rng(self.seed)
        n = len(X)
        self._models = []
        for m in range(c.n_models):
            rows = rng.integers(0, n, size=n) if c.n_models > 1 else np.arange(n)
            params = {"max_depth": c.max_depth, "eta": c.learning_rate,
                      "subsample": c.subsample, "tree_method": "hist", "nthread": 1,
                      "seed": self.seed * 1000 + m, "objective": "reg:squarederror",
                      "verbosity": 0}
            per_objective = []
            for j in range(Y.shape[1]):
                data = xgb.DMatrix(X[rows], label=Z[rows, j])
                per_objective.append(xgb.train(params, data, num_boost_round=c.n_estimators))
            self._models.append(per_objective)
        return self

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of each objective, in the objectives' own units."""
        import xgboost as xgb

        data = xgb.DMatrix(X)
        preds = np.stack([
            np.stack([m.predict(data) for m in per_objective], axis=1)
            for per_objective in self._models
        ])  # (models, n, k), standardised log space
        logy = preds * self._sigma + self._mu
        values = np.exp(logy)
        return values.mean(axis=0), values.std(axis=0)

