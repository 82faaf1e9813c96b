"""Per-partition search of the knob space: multi-objective Bayesian optimisation (default),
the published configuration, random and exhaustive, as registered strategies; every
setting is asked of a journal-first backend, so no measurement is ever lost or taken
twice."""

from kareus.search.acquisition import PassShares
from kareus.search.config import SearchConfig, Strategy, get_strategy, strategy_names
from kareus.search.loop import SearchResult, run_search
from kareus.search.strategies import register_strategy

__all__ = ["PassShares", "SearchConfig", "SearchResult", "Strategy", "get_strategy",
           "register_strategy", "run_search", "strategy_names"]
