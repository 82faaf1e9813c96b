"""Searching one partition: its strategy (kareus.search.strategies) decides the settings,
the journal-first backend answers each one (kareus.backends.journaled).

The search keeps no journal of its own: a setting the journal holds is answered from it
(`Sample.reused`), anything else is measured, journaled and only then answered, so it is
never measured again.
"""

from __future__ import annotations

import numpy as np

from kareus.backends.base import CostModel, JournalFirst
from kareus.search.config import (
    SearchConfig,
    describe_strategies,
    get_strategy,
    strategy_names,
)
from kareus.search.result import Sample, SearchResult, frontier_hypervolume
from kareus.search.space import KnobSpace
from kareus.search.state import AgreeBatch, Progress, SearchState
from kareus.search.strategies import Strategy
from kareus.workload.partition import Partition

__all__ = ["AgreeBatch", "Progress", "Sample", "SearchConfig", "SearchResult", "Strategy",
           "describe_strategies", "frontier_hypervolume", "run_search", "strategy_names"]


def run_search(partition: Partition, backend: JournalFirst, freqs_mhz: tuple[int, ...],
               config: SearchConfig, prior: CostModel | None = None,
               progress: Progress | None = None, agree: AgreeBatch | None = None
               ) -> SearchResult:
    """Search one partition's knob space, asking ``backend`` (journal first) for each
    setting its strategy decides on.

    ``prior``: a cost model whose prediction of every setting informs the surrogates (they
    learn the ratio measured / predicted) and the initial design. ``agree``: ranks of a
    group profiled together take rank 0's batch (its surrogates decided it), so that a rank
    whose own fit differed by a rounding cannot pick other settings and deadlock the
    group's collectives.
    """
    if not isinstance(backend, JournalFirst):
        raise TypeError(f"run_search asks a journal-first backend (kareus.backends.journaled."
                        f"JournaledBackend), got {type(backend).__name__}")
    strategy = get_strategy(config.strategy)
    space = KnobSpace(partition, tuple(freqs_mhz), backend.gpu.max_freq_mhz)
    config = strategy.configure(config)
    strategy.check(config, len(space), prior is not None)
    state = SearchState(partition, backend, space, strategy.budget(config, len(space)),
                        progress, agree)
    stopped = strategy.run(state, config, np.random.default_rng(config.seed), prior)
    if state.full:
        stopped = "budget" if strategy.fills_space else "exhausted"
    if not state.history:
        state.record_hypervolume()
    return SearchResult(partition.key, config.strategy, config.seed,
                        list(state.samples.values()), state.history, state.measured,
                        state.cost_s, stopped, state.clock_changes)
