"""The directory `kareus optimize` writes, and the only module that knows its layout:

    DIR/journal.sqlite   every measurement (a rerun reuses them)
    DIR/result.json      per method its frontier of {time_s, energy_j, plan}, the metrics,
                         the validation of every plan, the searches
    DIR/plans/<id>.json  every plan on every frontier
    DIR/frontier.png     all methods' frontiers on one plot
    DIR/timeline-max-throughput.png, DIR/timeline-min-energy.png
                         the 1F1B timelines of Kareus's fastest and least-energy plans
    DIR/report.md        what was searched, the frontiers, the metrics, how to apply a plan

A run builds its result in a temporary directory beside DIR and swaps it in at the end;
result.json and every plan file carry the run's id and the job's id, and a plan file that
result.json does not list, or that another run wrote, is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.core.atomic import remove_tree, replace_dir
from kareus.core.jsonfile import read_json_object
from kareus.errors import KareusError
from kareus.plans.plan import Plan
from kareus.results.result import OptimizeResult

_HIGHLIGHTS = ("max-throughput", "min-energy")


def highlighted_plans(result: OptimizeResult) -> dict[str, Plan]:
    """Kareus's fastest and least-energy plans (the first method's where Kareus did not
    run): what report.md and the timeline pictures show first."""
    plans = result.plans.get("kareus") or next(iter(result.plans.values()), [])
    if not plans:
        return {}
    return {"max-throughput": min(plans, key=lambda p: (p.time_s, p.energy_j)),
            "min-energy": min(plans, key=lambda p: (p.energy_j, p.time_s))}


class ResultDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def journal(self) -> Path:
        return self.path / "journal.sqlite"

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

    # Writing ------------------------------------------------------------------------------

    def check_writable(self, job_id: str | None = None, force: bool = False) -> None:
        """Fail before any work starts when the directory cannot be one, or holds the result
        of another job (unless ``force``: the journal keeps both jobs' measurements)."""
        if self.path.exists() and not self.path.is_dir():
            raise KareusError(f"cannot create {self.path}: it is a file, not a directory")
        if job_id is None or force or not self.result_file.is_file():
            return
        try:
            other = read_json_object(self.result_file, "result").get("job_id")
        except KareusError:
            return  # unreadable: replaced by this run
        if other is not None and other != job_id:
            raise KareusError(f"{self.path} holds the result of another job ({other}); "
                              f"choose another --out, or --force to replace it")

    def prepare(self) -> None:
        """The directory, with its journal; leftovers of killed runs are removed."""
        self.check_writable()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KareusError(f"cannot create {self.path}: {exc}") from None
        for stale in self.path.parent.glob(f".{self.path.name}.tmp-*"):
            remove_tree(stale)

    def write(self, result: OptimizeResult) -> None:
        """Build the new result beside the directory, then swap it in
        (kareus.core.atomic.replace_dir): a reader sees the old result or the new one,
        never a mix. The journal and any other file of the directory are carried over
        (hard links: the journal is never absent or copied)."""
        from kareus.results.report import frontier_figure, markdown_report, timeline_figure

        job_doc = result.job.model_dump(mode="json")
        stamp = {"run_id": result.run_id, "job_id": result.job_id}

        def fill(tmp: Path) -> None:
            new = ResultDir(tmp)
            new.plans_dir.mkdir()
            for plans in result.plans.values():
                for p in plans:
                    new.plan_file(p.id).write_text(json.dumps({**p.to_dict(job_doc), **stamp}))
            frontier_figure(result.frontier_points(), new.figure, result.job.describe())
            for which, plan in highlighted_plans(result).items():
                timeline_figure(plan, new.timeline(which), result.job.describe())
            new.report.write_text(markdown_report(result, self.path))
            new.result_file.write_text(json.dumps(result.to_dict(), indent=1))
            self._carry_over(tmp)

        try:
            replace_dir(self.path, fill, result.run_id or "run")
        except OSError as exc:
            raise KareusError(f"cannot write the result to {self.path}: {exc}") from None

    def _carry_over(self, tmp: Path) -> None:
        """Everything in the directory that is not a result file goes into the new one."""
        ours = {self.result_file.name, self.plans_dir.name, self.figure.name,
                self.report.name, *(self.timeline(w).name for w in _HIGHLIGHTS)}
        for entry in self.path.iterdir():
            if entry.name in ours:
                continue
            if entry.is_file():
                os.link(entry, tmp / entry.name)
            else:
                os.rename(entry, tmp / entry.name)

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
        methods = self.read_result().get("methods")
        if not isinstance(methods, dict) or method not in methods:
            known = ", ".join(methods) if isinstance(methods, dict) else "none"
            raise KareusError(f"{path} has no method {method!r}; methods: {known}")
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
                              f"--result {self.path} --json` shows its plans")
        doc = read_json_object(self.plan_file(plan_id), "plan")
        if doc.get("run_id") != result.get("run_id"):
            raise KareusError(f"{self.plan_file(plan_id)} was written by another run than "
                              f"{self.result_file}; rerun `kareus optimize`")
        plan = Plan.from_dict(doc)
        job = doc.get("job") or result["job"]
        return plan, job

    def owns(self, path: str | Path) -> bool:
        """Whether ``path`` is one of this result directory's own files."""
        p = Path(path).resolve()
        root = self.path.resolve()
        own = {self.result_file.name, self.figure.name, self.report.name, self.journal.name,
               self.journal.name + "-wal", self.journal.name + "-shm"}
        return (p.parent == root and p.name in own) or p.is_relative_to(root / "plans")
