"""The directory `kareus optimize` writes, and the only module that knows its layout:

    DIR/journal.sqlite   every measurement (a rerun reuses them)
    DIR/result.json      per method its frontier of {time_s, energy_j, plan}, the metrics,
                         the validation of every plan, the searches
    DIR/plans/<id>.json  every plan on every frontier
    DIR/frontier.png     all methods' frontiers on one plot
    DIR/report.md        what was searched, the frontiers, the metrics, how to apply a plan
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.errors import KareusError
from kareus.jsonfile import read_json_object
from kareus.plan import Plan
from kareus.result import OptimizeResult


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

    @property
    def plans_dir(self) -> Path:
        return self.path / "plans"

    def plan_file(self, plan_id: str) -> Path:
        if not plan_id or "/" in plan_id or "\\" in plan_id or plan_id.startswith("."):
            raise KareusError(f"invalid plan id {plan_id!r}")
        return self.plans_dir / f"{plan_id}.json"

    # Writing ------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Fail before any work starts when the directory cannot be one."""
        if self.path.exists() and not self.path.is_dir():
            raise KareusError(f"cannot create {self.path}: it is a file, not a directory")

    def prepare(self) -> None:
        self.check_writable()
        try:
            self.plans_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KareusError(f"cannot create {self.plans_dir}: {exc}") from None

    def write(self, result: OptimizeResult) -> None:
        from kareus.report import frontier_figure, markdown_report

        job_doc = result.job.model_dump(mode="json")
        try:
            for plans in result.plans.values():
                for p in plans:
                    self.plan_file(p.id).write_text(json.dumps(p.to_dict(job_doc)))
            self.result_file.write_text(json.dumps(result.to_dict(), indent=1))
            frontier_figure(result.frontier_points(), self.figure, result.job.describe())
            self.report.write_text(markdown_report(result, self.path))
        except OSError as exc:
            raise KareusError(f"cannot write the result to {self.path}: {exc}") from None

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

    def read_plan(self, plan_id: str) -> tuple[Plan, dict[str, Any]]:
        """A plan and the job it is for (from the plan file, else from result.json)."""
        doc = read_json_object(self.plan_file(plan_id), "plan")
        plan = Plan.from_dict(doc)
        job = doc.get("job") or self.read_result()["job"]
        return plan, job
