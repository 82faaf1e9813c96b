"""The search's settings, and the registry of strategies that run them.

A `Strategy` (as Optuna's samplers) has a name, turns a `SearchConfig` into its own
configuration (`configure`: "published" applies `SearchConfig.as_published`), checks it,
and runs the ask/tell loop on a `SearchState`: it decides settings and takes them through
the journal-first backend. The built-in strategies (kareus.search.strategies, registered
when kareus.search is imported): "mbo", ours; "published", the same loop in the published
Kareus configuration; "random"; "exhaustive".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import numpy as np

from kareus.backends.base import CostModel
from kareus.core.registry import Registry
from kareus.errors import SpecError
from kareus.search.acquisition import PUBLISHED_SHARES, PassShares
from kareus.search.state import SearchState
from kareus.search.surrogate import SurrogateConfig

INFORMED_BUDGET = 40
"""`SearchConfig.informed`'s budget per partition."""
INFORMED_BATCH = 5
"""`SearchConfig.informed`'s batch size."""
INFORMED_INITIAL = 16
"""`SearchConfig.informed`'s initial design: half along the prior's predicted frontier,
half space-filling. On a GPU the prior does not describe, a design of 10 (5 + 5) let a
misleading prior hold the search on its frontier (llama3.3-70b-64gpu's bwd_attn: 0.91 of
the exhaustive hypervolume at 40 settings against 0.97 with 16; docs/gpu.md)."""


@dataclass(frozen=True)
class SearchConfig:
    strategy: str = "mbo"
    """A registered strategy's name (`strategy_names`)."""
    budget: int = 100
    """Total samples (journal samples included); exhaustive ignores it."""
    seed: int = 0
    initial: int | None = None
    """Initial design size (default 20; 10 with an emulator prior)."""
    batch_size: int = 10
    shares: PassShares = field(default_factory=PassShares)
    """Batch shares of the acquisition passes. The published system uses
    `PUBLISHED_SHARES` (0.4, 0.2, 0.2, 0.2, 0) with the "worst" reference
    (docs/anchors.md §4); ours reaches the frontier with fewer measurements
    (benchmarks/search_efficiency.py)."""
    tolerance: float = 0.002
    """Stop when the hypervolume improved by less than this fraction over ``patience``
    batches (0 disables the rule: spend the whole budget)."""
    patience: int = 3
    reference: str = "front"
    """Reference point of the hypervolume passes: "front" (ours) or "worst" (published)."""
    optimism: float = 0.5
    """Hypervolume passes score mean - optimism x std (the surrogate's spread), so a setting
    that might beat the front gets its chance; 0 scores the mean alone."""
    surrogate: SurrogateConfig = field(default_factory=SurrogateConfig)
    incumbent: str = "model"
    """What the passes improve on: "model", the surrogate's values of the measured settings
    (ours), or "measured", the noisy measurements themselves (published)."""

    def as_published(self) -> SearchConfig:
        """The published system's search (docs/anchors.md §4), for parity: XGBoost ensembles,
        the four passes 40/20/20/20 against 1.1 x the worst observed values, no optimism,
        the noisy measurements as incumbents. Budget, seed, batches and stopping stay."""
        return replace(self, strategy="published", shares=PUBLISHED_SHARES,
                       reference="worst", optimism=0.0, incumbent="measured",
                       surrogate=replace(self.surrogate, kind="xgboost"))

    @classmethod
    def informed(cls, seed: int = 0) -> SearchConfig:
        """The search to run with a prior (`kareus profile`'s default): the prior's design
        and model reach the frontier in fewer settings (benchmarks/search_efficiency.py),
        so 40 settings instead of 100, in batches of 5 (the stopping rule can end
        the search sooner), from a larger initial design (`INFORMED_INITIAL`)."""
        return cls(budget=INFORMED_BUDGET, batch_size=INFORMED_BATCH,
                   initial=INFORMED_INITIAL, seed=seed)

    @classmethod
    def profiling(cls, with_prior: bool, seed: int = 0) -> SearchConfig:
        """A profile's default search: `informed` with a prior, else the plain default."""
        return cls.informed(seed) if with_prior else cls(seed=seed)

    def initial_size(self, with_prior: bool) -> int:
        if self.initial is not None:
            return self.initial
        return 10 if with_prior else 20

    def check(self, space_size: int, with_prior: bool) -> None:
        """The configuration its strategy runs (`Strategy.configure`), checked by it: one
        line of SpecError for the first thing wrong."""
        strategy = get_strategy(self.strategy)
        strategy.check(strategy.configure(self), space_size, with_prior)

    def check_settings(self, with_prior: bool) -> None:
        """What every model-free or model-based loop needs: budget, design, batches,
        passes, surrogate and stopping rule."""
        if self.budget < 1:
            raise SpecError(f"budget must be positive, got {self.budget}")
        if self.initial is not None and self.initial < 1:
            raise SpecError(f"the initial design needs at least 1 setting, got {self.initial}")
        if self.batch_size < 1:
            raise SpecError(f"batch size must be positive, got {self.batch_size}")
        if not isinstance(self.shares, PassShares):
            raise SpecError(f"pass shares must be a PassShares, got {self.shares!r}")
        self.shares.check()
        if self.incumbent not in ("model", "measured"):
            raise SpecError(f"incumbent must be model or measured, got {self.incumbent!r}")
        self.surrogate.check()
        if self.reference not in ("front", "worst"):
            raise SpecError(f"reference must be front or worst, got {self.reference!r}")
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0) or self.patience < 1:
            raise SpecError(f"--tolerance must be a finite number >= 0 and --patience at "
                            f"least 1, got {self.tolerance} and {self.patience}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (as ``dataclasses.asdict``): configurations cross process
        boundaries."""
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> SearchConfig:
        """The inverse of `to_dict` (and of ``dataclasses.asdict``)."""
        cfg = dict(doc)
        cfg["surrogate"] = SurrogateConfig(**cfg.get("surrogate", {}))
        if "shares" in cfg:
            cfg["shares"] = PassShares.from_dict(cfg["shares"])
        return cls(**cfg)


class Strategy:
    """A way of searching a partition's knob space."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    """One line for ``--strategy`` help."""
    fills_space: ClassVar[bool] = False
    """Takes every setting by design: a full space is its budget, not an exhaustion."""
    profiles: ClassVar[bool] = False
    """`kareus profile` may search with it: what a profile records is what Kareus
    composes from (the model-based search, or every setting); the others are for
    comparing searches."""

    def configure(self, config: SearchConfig) -> SearchConfig:
        """The configuration this strategy runs (default: ``config`` as it is)."""
        return config

    def check(self, config: SearchConfig, space_size: int, with_prior: bool) -> None:
        """SpecError, one line, if ``config`` (configured) cannot run."""
        config.check_settings(with_prior)

    def budget(self, config: SearchConfig, space_size: int) -> int:
        """Samples the search may take."""
        return min(config.budget, space_size)

    def run(self, state: SearchState, config: SearchConfig, rng: np.random.Generator,
            prior: CostModel | None) -> str:
        """Decide settings and take them (`SearchState.take`) until done; returns why it
        stopped: "budget", "converged" or "exhausted"."""
        raise NotImplementedError


STRATEGIES: Registry[Strategy] = Registry("strategy", lambda s: s.name)
S = TypeVar("S", bound=type[Strategy])


def register_strategy(cls: S) -> S:
    """Class decorator: make a strategy selectable by its name (``SearchConfig.strategy``,
    ``--strategy``)."""
    STRATEGIES.register(cls())
    return cls


def get_strategy(name: str) -> Strategy:
    return STRATEGIES.get(name)


def strategy_names() -> tuple[str, ...]:
    """The registered strategies, in registration order."""
    return STRATEGIES.names()


def describe_strategies() -> str:
    """One line naming every registered strategy with its summary (``--strategy`` help)."""
    return "; ".join(f"{name}: {s.summary}" if s.summary else name
                     for name, s in STRATEGIES.items())
