"""The built-in strategies, registered by name: "mbo" (ours), "published" (the same loop in
the published Kareus configuration, `SearchConfig.as_published`), "random" and
"exhaustive". Another strategy subclasses `Strategy` and is registered with
`register_strategy`; `get_strategy` and `strategy_names` read the registry."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kareus.backends.base import CostModel
from kareus.errors import SpecError
from kareus.search.acquisition import Candidates, select_batch
from kareus.search.config import (
    SearchConfig,
    Strategy,
    get_strategy,
    register_strategy,
    strategy_names,
)
from kareus.search.design import initial_design
from kareus.search.prior import prior_design, prior_values
from kareus.search.state import SearchState
from kareus.search.surrogate import Surrogate, make_surrogate

__all__ = ["Exhaustive", "ModelBased", "Published", "RandomSearch", "Strategy",
           "get_strategy", "register_strategy", "strategy_names"]


@register_strategy
class ModelBased(Strategy):
    """Multi-objective Bayesian optimisation: a seeded initial design, then batches chosen
    by the surrogates' acquisition passes, until the budget is spent or the frontier stops
    improving (docs/search.md)."""

    name = "mbo"
    profiles = True
    summary = "ours, the default (GP surrogates, the per-clock pass)"

    def check(self, config: SearchConfig, space_size: int, with_prior: bool) -> None:
        super().check(config, space_size, with_prior)
        init = config.initial_size(with_prior)
        if config.budget < init:
            raise SpecError(f"budget {config.budget} is smaller than the initial design "
                            f"({init})")

    def run(self, state: SearchState, config: SearchConfig, rng: np.random.Generator,
            prior: CostModel | None) -> str:
        space = state.space
        model = _Model.of(state, config, prior)
        init = min(config.initial_size(prior is not None), state.budget)
        missing = init - len(state.samples)
        if missing > 0:
            measured_idx = {space.index[k] for k in state.samples}
            if model.prior_y is not None:
                idx = prior_design(space, model.prior_y, missing, rng, measured_idx)
            else:
                idx = initial_design(space, missing, rng, measured_idx)
            state.take([space.settings[i] for i in idx])
        # hypervolume history against a reference fixed by the initial data, so it can
        # only grow
        worst = np.max([(s.measurement.time_s, s.measurement.dynamic_energy_j)
                        for s in state.samples.values()], axis=0)
        state.record_hypervolume(worst)
        batch_no = 0
        while len(state.samples) < state.budget:
            batch = model.next_batch(state, config, batch_no)
            if batch is None:
                return "exhausted"
            state.take([space.settings[i] for i in batch])
            batch_no += 1
            state.record_hypervolume(worst)
            history = state.history
            if config.tolerance > 0 and len(history) > config.patience:
                now, then = history[-1][1], history[-1 - config.patience][1]
                if now <= 0 or (now - then) / now < config.tolerance:
                    return "converged"
        return "budget"


@dataclass
class _Model:
    """The surrogates' inputs over the whole space, and the last batch's fit (a GP starts
    its kernel fit from it)."""

    features: np.ndarray
    freq: np.ndarray
    static_w: float
    prior_y: np.ndarray | None
    ratio_to: np.ndarray | None
    n_prior: int
    previous: Surrogate | None = None

    @classmethod
    def of(cls, state: SearchState, config: SearchConfig, prior: CostModel | None
           ) -> _Model:
        space = state.space
        prior_y = prior_values(space, prior) if prior is not None else None
        features = space.features
        if prior_y is not None:
            features = np.column_stack([features,
                                        np.log(prior_y) - np.log(prior_y).mean(axis=0)])
        # with a prior, the trees learn the ratio measured / predicted; the GP takes the
        # prediction as an input of a linear kernel term beside its knob kernel, so it
        # learns how far the GPU follows the emulator and models the rest from the knobs (a
        # GPU that differs in kind leaves a ratio as rough as the times themselves)
        ratio_to = prior_y if config.surrogate.kind != "gp" else None
        n_prior = 2 if prior_y is not None and ratio_to is None else 0
        freq = np.array([k.freq_mhz for k in space.settings])
        return cls(features, freq, state.backend.static_power_w, prior_y, ratio_to, n_prior)

    def next_batch(self, state: SearchState, config: SearchConfig, batch_no: int
                   ) -> list[int] | None:
        """Setting indices of the next batch; None when nothing is left to measure."""
        space = state.space
        measured = [space.index[k] for k in state.samples]
        free = np.setdiff1d(np.arange(len(space)), measured)
        if len(free) == 0:
            return None
        y = np.array([(max(s.measurement.time_s, 1e-12),
                       max(s.measurement.dynamic_energy_j, 1e-12))
                      for s in (state.samples[space.settings[i]] for i in measured)])
        target = y / self.ratio_to[measured] if self.ratio_to is not None else y
        model = make_surrogate(config.surrogate, config.seed * 7919 + batch_no,
                               self.previous, n_prior=self.n_prior)
        model.fit(self.features[measured], target)
        self.previous = model
        # every setting at once: the unmeasured are the candidates, the measured the
        # incumbents when the surrogate's values stand for them
        mean, std = model.predict(self.features)
        if self.ratio_to is not None:
            mean, std = mean * self.ratio_to, std * self.ratio_to
        freq = self.freq
        cands = Candidates(free, freq[free], mean[free, 0], mean[free, 1], std[free, 0],
                           std[free, 1], space.features[free], config.optimism)
        size = min(config.batch_size, state.budget - len(state.samples))
        # "model": what the surrogate believes the measured settings are, so a measurement
        # that came out 5% low by noise does not stand as a front nothing can improve on
        incumbent = mean[measured] if config.incumbent == "model" else y
        return select_batch(cands, incumbent[:, 0], incumbent[:, 1], freq[measured],
                            space.features[measured], self.static_w, size, config.shares,
                            config.reference)


@register_strategy
class Published(ModelBased):
    """The model-based loop in the published Kareus configuration."""

    name = "published"
    summary = "the published Kareus search (XGBoost ensembles, its four passes)"
    profiles = False  # for comparing searches (benchmarks/search_efficiency.py)

    def configure(self, config: SearchConfig) -> SearchConfig:
        return config.as_published()


@register_strategy
class RandomSearch(Strategy):
    """Settings drawn uniformly without replacement, up to the budget."""

    name = "random"
    summary = "settings drawn at random"

    def run(self, state: SearchState, config: SearchConfig, rng: np.random.Generator,
            prior: CostModel | None) -> str:
        free = [k for k in state.space.settings if k not in state.samples]
        order = rng.permutation(len(free))
        state.take([free[i] for i in order[: max(0, state.budget - len(state.samples))]])
        return "budget"


@register_strategy
class Exhaustive(Strategy):
    """Every setting of the space, once."""

    name = "exhaustive"
    profiles = True
    summary = "every setting"
    fills_space = True

    def check(self, config: SearchConfig, space_size: int, with_prior: bool) -> None:
        return None  # budget, batches and passes do not apply

    def budget(self, config: SearchConfig, space_size: int) -> int:
        return space_size

    def run(self, state: SearchState, config: SearchConfig, rng: np.random.Generator,
            prior: CostModel | None) -> str:
        state.take(list(state.space.settings))
        return "budget"
