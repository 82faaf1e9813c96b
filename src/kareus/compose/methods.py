"""Every method's iteration frontier, through the method registry."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kareus.compose.options import Composer, KeyFrontiers
from kareus.compose.pipeline import PipelinePoint, Solver, merge_frontiers, solve_frontier
from kareus.plans.methods import Method


def method_frontiers(composer: Composer, methods: Sequence[Method],
                     fronts: KeyFrontiers | None,
                     say: Callable[[str], None] | None = None, solver: Solver = "lp"
                     ) -> dict[str, list[PipelinePoint]]:
    """Per method (in order), its frontier of pipeline plans (``solver``: see
    `solve_frontier`)."""
    costs = composer.pipeline_costs()
    solved: dict[str, list[PipelinePoint]] = {}
    for method in methods:
        if say is not None:
            say(f"composing {method.name}")
        points = solve_frontier(composer.options(method, fronts), costs, solver=solver)
        merged = [solved[m] for m in method.merges if m in solved]
        if merged:
            # the solve is exact only on the options' convex hulls (rounded to options, and
            # its slack filled); the plans solved in a contained sub-space are this
            # method's plans too: keep the best
            points = merge_frontiers(points, *merged)
        solved[method.name] = points
    return solved
