"""The directory `kareus optimize` writes, and the only module that knows its layout:

    DIR/journal.sqlite   every measurement (a rerun reuses them)
    DIR/result.json      per method its frontier of {time_s, energy_j, plan}, the metrics,
                         the validation of every plan, the searches
    DIR/plans/<id>.json  every plan on every frontier
    DIR/frontier.png     all methods' frontiers on one plot
    DIR/timeline-max-throughput.png, DIR/timeline-min-energy.png
                         the 1F1B timelines of Kareus's fastest and least-energy plans
    DIR/report.md        what was searched, the frontiers, the metrics, how to apply a plan

    DIR/.kareus-result   the marker: DIR is Kareus's (a result written before it: its
                         result.json)
    DIR/journal.sqlite.lock  held by the run writing DIR (kareus.core.lock)

A run locks DIR, builds its result in a temporary directory beside DIR (marked as
Kareus's) and swaps it in at the end; only the journal is carried over. A result directory
holds only what Kareus writes: a directory holding anything else, the current, root or
home directory and one inside another result are refused before any work. result.json
and every plan file carry the run's id and the job's id, and a plan file that result.json
does not list, or that another run wrote, is refused.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.core.jsonfile import read_json_object
from kareus.core.lock import Lock, lock_file
from kareus.core.owned_dir import OwnedDir
from kareus.errors import KareusError
from kareus.plans.plan import Plan
from kareus.results.result import OptimizeResult, highlighted_method

_TIMELINES = "timeline-*.png"
JOURNAL = "journal.sqlite"
MARKER = ".kareus-result"
"""Written into a result directory as it is made: what says it is Kareus's (one written
before the marker: its result.json)."""


def highlighted_plans(result: OptimizeResult) -> dict[str, Plan]:
    """The fastest and least-energy plans of `highlighted_method` (Kareus, where it ran):
    what report.md and the timeline pictures show first."""
    plans = result.plans.get(highlighted_method(result), [])
    if not plans:
        return {}
    return {"max-throughput": min(plans, key=lambda p: (p.time_s, p.energy_j)),
            "min-energy": min(plans, key=lambda p: (p.energy_j, p.time_s))}


class ResultDir(OwnedDir):
    marker = MARKER
    what = "result directory"
    lock_name = lock_file(JOURNAL).name
    written_files = ("result.json", "frontier.png", "report.md", _TIMELINES)
    written_dirs = (("plans", ".json"),)
    scratch = (JOURNAL, f"{JOURNAL}-wal", f"{JOURNAL}-shm", f"{JOURNAL}-journal",
               f"{JOURNAL}.v1-backup")  # kareus.store: written before an upgrade
    content = "the result"
    not_written = ("the result was not written (the journal keeps every measurement: "
                   "rerun to write it)")

    @property
    def journal(self) -> Path:
        return self.path / JOURNAL

    @property
    def result_file(self) -> Path:
        return self.path / "result.json"

    @property
    def figure(self) -> Path:
        return self.path / "frontier.png"

    @property
    def report(self) -> Path:
        return self.path / "report.md"

    def timeline(self, which: str) -> Path:
        """The timeline picture of the max-throughput or min-energy Kareus plan."""
        return self.path / f"timeline-{which}.png"

    @property
    def plans_dir(self) -> Path:
        return self.path / "plans"

    def plan_file(self, plan_id: str) -> Path:
        if not plan_id or "/" in plan_id or "\\" in plan_id or plan_id.startswith("."):
            raise KareusError(f"invalid plan id {plan_id!r}")
        return self.plans_dir / f"{plan_id}.json"

    # What is Kareus's ---------------------------------------------------------------------

    @classmethod
    def legacy(cls, path: Path) -> bool:
        """Written before the marker: a result.json of Kareus's."""
        return cls.json_with(path / "result.json", "result", ("schema_version", "job_id"))

    @classmethod
    def is_result(cls, path: Path) -> bool:
        """Whether ``path`` is a result directory Kareus wrote."""
        return cls.is_mine(path)

    def _foreign_in(self, sub: Path, suffix: str) -> list[str]:
        """Besides what is no plan file, a plan file result.json does not list."""
        out = super()._foreign_in(sub, suffix)
        try:
            listed: set[str] | None = ResultDir(sub.parent).plan_ids()
        except KareusError:
            listed = None
        if listed is not None:
            out += sorted(f"{sub.name}/{e.name}" for e in sub.iterdir()
                          if e.is_file() and not e.is_symlink() and e.suffix == suffix
                          and e.stem not in listed)
        return out

    # Writing ------------------------------------------------------------------------------

    def check_writable(self, job_id: str | None = None, force: bool = False) -> None:
        """Fail before any work starts when the directory cannot be one
        (`OwnedDir.check_place`), or holds the result of another job (unless ``force``:
        the journal keeps both jobs' measurements)."""
        real = self.check_place()
        if real is None or job_id is None or force or not self.result_file.is_file():
            return
        try:
            other = read_json_object(self.result_file, "result").get("job_id")
        except KareusError:
            return  # unreadable: replaced by this run
        if other is not None and other != job_id:
            raise KareusError(f"{self.path} holds the result of another job ({other}); "
                              f"choose another --out, or --force to replace it")

    def lock(self, job_id: str | None = None, force: bool = False) -> Lock:
        """The directory locked for one run (`OwnedDir.locked`), checked by
        `check_writable` before and under the lock."""
        return self.locked(lambda: self.check_writable(job_id, force))

    def write(self, result: OptimizeResult) -> None:
        """Build the new result beside the directory (marked as Kareus's), then swap it in
        (`OwnedDir.swap`): a reader sees the old result or the new one, never a mix. The
        journal (and its lock) is carried over by hard links: never absent, copied or
        moved. A link is followed: its target gets the result."""
        from kareus.results.power_figure import power_panel
        from kareus.results.report import (
            figure_frontiers,
            figure_title,
            frontier_figure,
            markdown_report,
        )
        from kareus.results.timeline import clock_scale_mhz, timeline_figure

        job_doc = result.job.model_dump(mode="json")
        stamp = {"run_id": result.run_id, "job_id": result.job_id}

        def fill(tmp: Path) -> None:
            new = ResultDir(tmp)
            new.plans_dir.mkdir()
            for plans in result.plans.values():
                for p in plans:
                    new.plan_file(p.id).write_text(json.dumps({**p.to_dict(job_doc), **stamp}))
            title = figure_title(result)
            frontier_figure(figure_frontiers(result), new.figure, title)
            for which, plan in highlighted_plans(result).items():
                # with the plan's power over time below its timeline
                panel = (power_panel(plan, title)[1] if plan.power is not None else None)
                timeline_figure(plan, new.timeline(which), title,
                                clocks_mhz=clock_scale_mhz(result.job), pp=result.job.pp,
                                panel=panel)
            new.report.write_text(markdown_report(result, self.path))
            new.result_file.write_text(json.dumps(result.to_dict(), indent=1))

        self.swap(fill, result.run_id or "run")

    # Reading ------------------------------------------------------------------------------

    def read_result(self) -> dict[str, Any]:
        doc = read_json_object(self.result_file, "result")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise KareusError(f"{self.result_file}: unsupported schema_version "
                              f"{doc.get('schema_version')!r}")
        return doc

    def frontier(self, method: str) -> list[dict[str, Any]]:
        """The method's frontier points: dicts with time_s, energy_j, plan."""
        path = self.result_file
        doc = self.read_result()
        methods = doc.get("methods")
        if not isinstance(methods, dict) or method not in methods:
            known = ", ".join(methods) if isinstance(methods, dict) else "none"
            left_out = doc.get("left_out")
            why = (f" ({method} was left out: {left_out[method]})"
                   if isinstance(left_out, dict) and method in left_out else "")
            raise KareusError(f"{path} has no method {method!r}{why}; methods: {known}")
        front = methods[method].get("frontier")
        if not isinstance(front, list) or not front:
            raise KareusError(f"{path}: method {method} has an empty frontier")
        try:
            return [{"time_s": float(p["time_s"]), "energy_j": float(p["energy_j"]),
                     "plan": str(p["plan"])} for p in front]
        except (KeyError, TypeError, ValueError):
            raise KareusError(f"{path}: corrupt frontier of {method}") from None

    def plan_ids(self, result: dict[str, Any] | None = None) -> set[str]:
        """The plans result.json lists (``result``: its content, when already read)."""
        methods = (result if result is not None else self.read_result()).get("methods")
        if not isinstance(methods, dict):
            return set()
        return {str(p.get("plan")) for m in methods.values() if isinstance(m, dict)
                for p in m.get("frontier", []) if isinstance(p, dict)}

    def read_plan(self, plan_id: str) -> tuple[Plan, dict[str, Any]]:
        """A plan of this result and the job it is for. A plan file that result.json does
        not list, or that another run wrote, is refused."""
        result = self.read_result()
        if plan_id not in self.plan_ids(result):
            raise KareusError(f"{self.result_file} lists no plan {plan_id!r}; `kareus plan "
                              f"list --result {shlex.quote(str(self.path))}` lists its plans")
        doc = read_json_object(self.plan_file(plan_id), "plan")
        if doc.get("run_id") != result.get("run_id"):
            raise KareusError(f"{self.plan_file(plan_id)} was written by another run than "
                              f"{self.result_file}; rerun `kareus optimize`")
        plan = Plan.from_dict(doc)
        job = doc.get("job") or result["job"]
        return plan, job
