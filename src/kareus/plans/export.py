"""Exporting a plan: Kareus's own JSON, or the frequency schedule Zeus serves.

Zeus's pipeline frequency optimizer server runs a precomputed solution with its
`PointSolution` scheduler (3D-parallel jobs: `PointSolution3D`, which gives every DP/TP
rank its pipeline stage's schedule). That scheduler reads a Python literal: one list per
pipeline stage of ("forward" | "backward", MHz) pairs in the stage's execution order. We
write that literal with `repr` of plain lists, tuples, strings and ints; Kareus itself
never evaluates files. That scheduler runs plain 1F1B, one model chunk per stage: a plan of
an interleaved pipeline (``virtual_pipeline > 1``) is refused; its JSON export (whose job
carries ``virtual_pipeline``) runs it. Zeus's server serves one schedule for the whole run:
re-planning while training (kareus.runtime.plan_switcher: a new deadline, power cap or a
straggler's pace) is not available through this export; it needs the result directory and
Kareus's runtime (docs/runtime.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from kareus.core.atomic import write_text_atomic
from kareus.errors import KareusError, SpecError
from kareus.plans.plan import Plan
from kareus.plans.schedule import one_f_one_b

FORMATS = ("json", "zeus")


def zeus_schedule(plan: Plan, pp: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """Per pipeline stage, its instructions in 1F1B order with their clocks."""
    ex = plan.execution
    return [[(d, int(ex.freq(s, m, d))) for m, d in one_f_one_b(pp, microbatches, s)]
            for s in range(pp)]


def export_plan(plan: Plan, job: dict, fmt: str, out: str | Path) -> None:
    if fmt not in FORMATS:
        raise KareusError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    path = Path(out)
    if fmt == "json":
        _write(path, json.dumps(plan.to_dict(job), indent=1))
        return
    try:
        pp, mbs = int(job["pp"]), int(job["num_microbatches"])
        vp = int(job.get("virtual_pipeline", 1))
    except (KeyError, TypeError, ValueError):
        raise KareusError("the plan's job lacks pp / num_microbatches") from None
    if vp > 1:
        raise SpecError(f"Zeus's PointSolution scheduler runs plain 1F1B, one model chunk "
                        f"per stage; this plan interleaves {vp} chunks per rank "
                        f"(virtual_pipeline {vp}): export it with --format json")
    schedule = zeus_schedule(plan, pp, mbs)
    _write(path,
           "# Kareus plan " + plan.id + ": per pipeline stage, (instruction, SM clock in MHz)\n"
           "# in 1F1B execution order; load with Zeus's PointSolution(3D) scheduler.\n"
           + repr(schedule) + "\n")


def _write(path: Path, text: str) -> None:
    try:
        write_text_atomic(path, text)
    except OSError as exc:
        raise KareusError(f"cannot write {path}: {exc}") from None
