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

import fnmatch
import json
import os
import shlex
from pathlib import Path
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.core.atomic import is_marked, remove_leftovers, replace_dir
from kareus.core.jsonfile import read_json_object
from kareus.core.lock import Lock, lock_file
from kareus.errors import KareusError
from kareus.plans.plan import Plan
from kareus.results.result import OptimizeResult

_TIMELINES = "timeline-*.png"
MARKER = ".kareus-result"
"""Written into a result directory as it is made: what says it is Kareus's (one written
before the marker: its result.json)."""


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
        self.given = str(path)
        """The path as the user gave it (``Path("")`` would read as the current one)."""
        self.path = Path(path)

    @property
    def journal(self) -> Path:
        return self.path / "journal.sqlite"

    @property
    def lock_file(self) -> Path:
        """Held by the run writing the directory (and by `kareus profile` on its journal)."""
        return lock_file(self.journal)

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

    def target(self) -> Path:
        """Where the result is written: the directory, or where a link to it leads."""
        return Path(os.path.realpath(self.path))

    # What is Kareus's ---------------------------------------------------------------------

    def _scratch_names(self) -> set[str]:
        """What a directory may hold without being a result: the journal (a killed run's),
        its SQLite files and lock, the marker."""
        j = self.journal.name
        return {j, f"{j}-wal", f"{j}-shm", f"{j}-journal", self.lock_file.name, MARKER}

    def _result_names(self) -> set[str]:
        return {self.result_file.name, self.figure.name, self.report.name}

    def _kind(self, entry: Path) -> str | None:
        """"scratch" (`_scratch_names`), "result" (what a write replaces), or None (not
        Kareus's)."""
        name = entry.name
        if name in self._scratch_names():
            return "scratch" if not entry.is_dir() else None
        if name == self.plans_dir.name:
            return "result" if entry.is_dir() and not entry.is_symlink() else None
        if name in self._result_names() or fnmatch.fnmatchcase(name, _TIMELINES):
            return "result" if entry.is_file() and not entry.is_symlink() else None
        return None

    @staticmethod
    def is_result(path: Path) -> bool:
        """Whether ``path`` is a result directory Kareus wrote: marked by its write, or
        (written before the marker) with a result.json of Kareus's."""
        if is_marked(path, MARKER):
            return True
        doc = path / "result.json"
        if path.is_symlink() or doc.is_symlink() or not doc.is_file():
            return False
        try:
            content = read_json_object(doc, "result")
        except KareusError:
            return False
        return content.get("schema_version") is not None and "job_id" in content

    def _foreign(self, real: Path) -> list[str]:
        """What ``real`` holds that Kareus did not write, relative to it."""
        out = sorted(e.name for e in real.iterdir() if self._kind(e) is None)
        plans = real / self.plans_dir.name
        if plans.is_dir() and not plans.is_symlink():
            try:
                listed: set[str] | None = ResultDir(real).plan_ids()
            except KareusError:
                listed = None
            out += sorted(f"{plans.name}/{e.name}" for e in plans.iterdir()
                          if e.is_symlink() or not e.is_file() or e.suffix != ".json"
                          or (listed is not None and e.stem not in listed))
        return out

    def _refusal(self, real: Path) -> str | None:
        """Why the existing directory ``real`` cannot take a result (None: it can)."""
        names = {e.name for e in real.iterdir() if self._kind(e) == "scratch"}
        if names == {e.name for e in real.iterdir()}:
            return None  # empty, or only a killed run's journal
        if not self.is_result(real):
            return (f"{self.path} is not empty and is not a Kareus result directory (a "
                    f"result directory holds only what Kareus writes); choose a new or "
                    f"empty directory for --out")
        foreign = self._foreign(real)
        if foreign:
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            return (f"{self.path} holds files Kareus did not write ({shown}); a result "
                    f"directory holds only what Kareus writes: move them out, or choose "
                    f"another --out")
        return None

    def _refuse_place(self, real: Path) -> None:
        """The current, root and home directories, one holding the current directory,
        and one inside another result are never a result directory."""
        try:
            cwd: Path | None = Path.cwd().resolve()
        except OSError:  # the current directory was removed: it is nowhere
            cwd = None
        where = (("the root directory", real == Path(real.anchor)),
                 ("your home directory", real == Path(os.path.expanduser("~")).resolve()),
                 ("the current directory", real == cwd),
                 ("a directory holding the current directory",
                  cwd is not None and cwd.is_relative_to(real)))
        for what, hit in where:
            if hit:
                raise KareusError(f"--out {self.given} is {what}; name a directory of its "
                                  f"own for the result (e.g. runs/NAME)")
        for parent in real.parents:
            if self.is_result(parent):
                raise KareusError(f"--out {self.given} is inside the result directory "
                                  f"{parent}, which the next run there replaces whole; "
                                  f"choose a directory outside it")

    # Writing ------------------------------------------------------------------------------

    def check_writable(self, job_id: str | None = None, force: bool = False) -> None:
        """Fail before any work starts when the directory cannot be one (the current, root
        or home directory, one inside another result, a file, a directory holding anything
        Kareus did not write), or holds the result of another job (unless ``force``: the
        journal keeps both jobs' measurements)."""
        if not self.given.strip():
            raise KareusError("--out is empty; name the directory for the result")
        real = self.target()
        self._refuse_place(real)
        if real.exists() and not real.is_dir():
            raise KareusError(f"cannot create {self.path}: it is a file, not a directory")
        if not real.is_dir():
            return
        problem = self._refusal(real)
        if problem:
            raise KareusError(problem)
        if job_id is None or force or not self.result_file.is_file():
            return
        try:
            other = read_json_object(self.result_file, "result").get("job_id")
        except KareusError:
            return  # unreadable: replaced by this run
        if other is not None and other != job_id:
            raise KareusError(f"{self.path} holds the result of another job ({other}); "
                              f"choose another --out, or --force to replace it")

    def lock(self, job_id: str | None = None, force: bool = False) -> Lock:
        """The directory (made if missing), locked for one run until the lock is released
        or the process ends; checked again under the lock (`check_writable`). Another
        run holding it: one error naming its PID."""
        self.check_writable(job_id, force)
        self._make()
        held = Lock.take(self.target() / self.lock_file.name, str(self.path))
        try:
            self.check_writable(job_id, force)
        except BaseException:
            held.release()
            raise
        return held

    def _make(self) -> None:
        try:
            self.target().mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KareusError(f"cannot create {self.path}: {exc}") from None

    def prepare(self) -> None:
        """The directory, with its journal; what killed runs left beside it is removed
        where it is marked as theirs (never anything else)."""
        self.check_writable()
        self._make()
        remove_leftovers(self.target(), MARKER)

    def write(self, result: OptimizeResult) -> None:
        """Build the new result beside the directory (marked as Kareus's), then swap it in
        (kareus.core.atomic.replace_dir): a reader sees the old result or the new one,
        never a mix. The journal (and its lock) is carried over by hard links: never
        absent, copied or moved. A link is followed: its target gets the result."""
        from kareus.results.report import frontier_figure, markdown_report, timeline_figure

        job_doc = result.job.model_dump(mode="json")
        stamp = {"run_id": result.run_id, "job_id": result.job_id}
        real = self.target()

        def fill(tmp: Path) -> None:
            new = ResultDir(tmp)
            new.plans_dir.mkdir()
            for plans in result.plans.values():
                for p in plans:
                    new.plan_file(p.id).write_text(json.dumps({**p.to_dict(job_doc), **stamp}))
            frontier_figure(result.frontier_points(), new.figure, result.job.describe())
            for which, plan in highlighted_plans(result).items():
                timeline_figure(plan, new.timeline(which), result.job.describe(),
                                clocks_mhz=result.job.freqs_mhz)
            new.report.write_text(markdown_report(result, self.path))
            new.result_file.write_text(json.dumps(result.to_dict(), indent=1))
            self._carry_over(real, tmp)

        try:
            replace_dir(real, fill, result.run_id or "run", MARKER)
        except OSError as exc:
            raise KareusError(f"cannot write the result to {self.path}: {exc}") from None

    def _carry_over(self, real: Path, tmp: Path) -> None:
        """The journal, its SQLite files and its lock go into the new directory (hard
        links); the rest is the old result, dropped with it. Anything else (it appeared
        during the run) stops the write: a result directory holds only what Kareus
        writes, and nothing of the user's is ever moved or removed."""
        if not real.is_dir():
            return
        problem = self._refusal(real)
        if problem:
            raise KareusError(f"{problem}; the result was not written (the journal keeps "
                              f"every measurement: rerun to write it)")
        for entry in real.iterdir():
            if self._kind(entry) == "scratch" and entry.name != MARKER:
                os.link(entry, tmp / entry.name, follow_symlinks=False)

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
                              f"list --result {shlex.quote(str(self.path))}` lists its plans")
        doc = read_json_object(self.plan_file(plan_id), "plan")
        if doc.get("run_id") != result.get("run_id"):
            raise KareusError(f"{self.plan_file(plan_id)} was written by another run than "
                              f"{self.result_file}; rerun `kareus optimize`")
        plan = Plan.from_dict(doc)
        job = doc.get("job") or result["job"]
        return plan, job

    def owns(self, path: str | Path) -> bool:
        """Whether ``path`` is one of this result directory's own files: what a run
        writes or carries over (the timelines, the journal and its lock included)."""
        p = Path(path).resolve()
        root = self.path.resolve()
        own = self._scratch_names() | self._result_names()
        return ((p.parent == root and (p.name in own or fnmatch.fnmatchcase(p.name, _TIMELINES)))
                or p.is_relative_to(root / self.plans_dir.name))
