"""Composing from a journal alone (`kareus optimize --measurements`, or after profiling on
real GPUs): the composer over its measurements, the one error listing what it lacks (with
the command that measures it, and the run holding its lock, if one does), the compose
step itself, and how many of its numbers were fitted."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from kareus.backends.base import Backend
from kareus.backends.journaled import JournaledBackend, MissingMeasurement
from kareus.backends.needs import summarize
from kareus.backends.registry import BackendSpec, cost_model_kinds
from kareus.backends.replay import open_replay
from kareus.compose.methods import method_frontiers
from kareus.compose.options import Composer, key_frontiers
from kareus.compose.pipeline import PipelinePoint, Solver
from kareus.plans.methods import Method
from kareus.search.loop import SearchResult
from kareus.store import in_use_note
from kareus.workload.workload import Workload


def fitted_summary(replay: JournaledBackend) -> dict[str, Any]:
    """How many of the numbers composition used were fitted rather than measured
    (kareus.profiling.step_fit), and the largest held-out error of their fits."""
    errors = [e for n in replay.fitted_used if (e := replay.fitted_error(n)) is not None]
    return {"count": len(errors),
            "max_time_rel_error": max((abs(t) for t, _e in errors), default=0.0),
            "max_energy_rel_error": max((abs(e) for _t, e in errors), default=0.0)}


def measured_composer(workload: Workload, journal: str, identity: str | None,
                       fill: Backend | None = None) -> Composer:
    """A composer over the journal's measurements alone (``fill``: what it lacks)."""
    replay = open_replay(journal, workload.job, identity, fill=fill)
    return Composer(workload.partitions, replay, workload.job.freqs_mhz)


def refuse_missing(journal: str, composer: Composer, methods: Sequence[Method]) -> None:
    """One error listing what composing ``methods`` needs and the journal lacks."""
    replay = composer.backend
    assert isinstance(replay, JournaledBackend)
    fronts = key_frontiers({k: replay.samples(k) for k in composer.ps.keys})
    missing = replay.lacks(composer.needs(methods, fronts))
    if missing:
        raise MissingMeasurement(
            f"journal {journal} lacks {len(missing)} measurements this job's "
            f"composition needs (backend {replay.identity()}): {summarize(missing)}; "
            f"measure them with `kareus profile` with this job's options and --journal "
            f"{journal}, or pass --fill-missing {' or '.join(cost_model_kinds())}"
            f"{in_use_note(journal)}")


def compose_from_journal(workload: Workload, journal: str, identity: str | None,
                         fill: BackendSpec | None, composer: Composer | None,
                         methods: Sequence[Method], solver: Solver,
                         say: Callable[[str], None]
                         ) -> tuple[list[SearchResult], Composer,
                                    dict[str, list[PipelinePoint]], dict[str, Any]]:
    """Optimize's compose step from ``journal`` alone: (the journal's searches, the
    composer, each method's frontier, the sources: the journal, its backend, what ``fill``
    filled in, what was fitted). What the journal lacks is one error listing it, or the
    fill backend's number where the user opted in; ``composer``: the one built while the
    inputs were checked (`measured_composer`), not built twice."""
    with (fill.open(workload) if fill is not None else nullcontext()) as fallback:
        composer = composer or measured_composer(workload, journal, identity, fallback)
        replay = composer.backend
        assert isinstance(replay, JournaledBackend)
        journaled = {k: replay.samples(k) for k in workload.keys}
        fronts = key_frontiers(journaled)
        say(f"composing from {journal} ({replay.identity()})")
        searches = [SearchResult.from_journal(k, v) for k, v in journaled.items()]
        solved = method_frontiers(composer, methods, fronts, say, solver)
        composer.pipeline_costs()
    sources = {"measurements": journal, "backend": replay.identity(),
               "filled_from": fill.name if fill and replay.filled else None,
               "filled": [n.describe() for n in replay.filled],
               "fitted": fitted_summary(replay)}
    return searches, composer, solved, sources
