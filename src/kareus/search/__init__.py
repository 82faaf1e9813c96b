"""Per-partition search of the knob space: multi-objective Bayesian optimisation (default),
random and exhaustive, with a journal that never loses a measurement."""

from kareus.search.loop import SearchConfig, SearchResult, run_search

__all__ = ["SearchConfig", "SearchResult", "run_search"]
