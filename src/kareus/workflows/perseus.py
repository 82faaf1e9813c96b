"""Perseus interop: a per-instruction profile in Zeus's format -> 1F1B frontier plans.

The profile is read and validated by kareus.job.perseus_profile. Every (stage, direction)
becomes one sequential InstructionOption per profiled frequency (dynamic energy = energy -
static power x time); kareus.compose.pipeline solves the 1F1B frontier; each frontier
point becomes a Plan, written as Kareus JSON and as the frequency schedule Zeus's
PointSolution scheduler runs (kareus.plans.export), into a directory swapped in whole
(`ImportDir`: only what Kareus writes, one run at a time). docs/perseus.md has more.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.compose.instruction import InstructionOption
from kareus.compose.pipeline import PipelineCosts, PipelinePoint, solve_frontier
from kareus.compose.plans import timeline, to_execution_plan
from kareus.core.atomic import write_text_atomic
from kareus.core.lock import Lock
from kareus.core.owned_dir import OwnedDir
from kareus.errors import KareusError, SpecError
from kareus.job.hardware import get_gpu
from kareus.job.perseus_profile import PerseusProfile, read_profile
from kareus.plans.export import export_plan
from kareus.plans.plan import Plan

METHOD = "perseus"

MAX_INSTRUCTIONS = 1024
"""The largest 1F1B pipeline solved: stages x microbatches x 2 (forward, backward)
instructions, 256 microbatches for two stages, 64 for eight. At this size a solve took at
most ~2 CPU-minutes here, and 8 for twice as many instructions (docs/perseus.md has the
measurements); lowtime's longest call (Rust, which no signal interrupts) well under a
second. Issue 21: a million microbatches ran for minutes and took ~40 s to react to
SIGTERM."""


def static_power(static_power_w: float | None, gpu: str | None) -> tuple[float, str]:
    """The static power to subtract and where it comes from: ``--static-power-w`` when
    given (it wins over the catalog), else the GPU catalog's value for ``gpu``."""
    if static_power_w is not None:
        if not (math.isfinite(static_power_w) and static_power_w >= 0):
            raise KareusError(f"--static-power-w must be >= 0, not {static_power_w}")
        return float(static_power_w), "--static-power-w"
    if gpu is None:
        raise KareusError("give --static-power-w W or --gpu NAME (its catalog static "
                          "power): energy minus static power x time is what the solver "
                          "trades")
    spec = get_gpu(gpu)
    return spec.static_power_w, f"GPU catalog: {spec.name}"


def instruction_options(profile: PerseusProfile, static_power_w: float
                        ) -> dict[tuple[int, str], list[InstructionOption]]:
    """Per (stage, direction), one sequential option per profiled frequency, fastest
    clock first; dynamic energy = energy - static power x time (SpecError if negative)."""
    out: dict[tuple[int, str], list[InstructionOption]] = {}
    for (s, d, f), t in sorted(profile.time_s.items(), key=lambda x: (x[0][:2], -x[0][2])):
        dyn = profile.energy_j[(s, d, f)] - static_power_w * t
        if dyn < 0:
            raise SpecError(f"{profile.source}: stage {s} {d} at {f} MHz uses "
                            f"{profile.energy_j[(s, d, f)]:g} J in {t:g} s, less than the "
                            f"static power {static_power_w:g} W alone; lower the static "
                            f"power")
        out.setdefault((s, d), []).append(InstructionOption(t, dyn, f, sequential=True))
    return out


def pipeline_costs(profile: PerseusProfile, microbatches: int, static_power_w: float,
                   p2p_time_s: float = 0.0) -> PipelineCosts:
    """The 1F1B pipeline: every P2P transfer takes ``p2p_time_s`` (the profile has none),
    no end-of-iteration work, no dynamic energy outside instructions."""
    if microbatches < 1:
        raise KareusError(f"--microbatches must be at least 1, not {microbatches}")
    check_size(profile.pp, microbatches)
    if not (math.isfinite(p2p_time_s) and p2p_time_s >= 0):
        raise KareusError(f"--p2p-time-s must be >= 0, not {p2p_time_s}")
    pp = profile.pp
    return PipelineCosts(pp, microbatches, pp * profile.gpus_per_stage, static_power_w,
                         (p2p_time_s,) * pp, (p2p_time_s,) * pp, (0.0,) * pp, (0.0,) * pp)


def check_size(pp: int, microbatches: int) -> None:
    """At most `MAX_INSTRUCTIONS` instructions in the pipeline."""
    if 2 * pp * microbatches > MAX_INSTRUCTIONS:
        raise KareusError(f"--microbatches {microbatches} is too many: {pp} stages x "
                          f"{microbatches} microbatches x 2 is {2 * pp * microbatches} "
                          f"pipeline instructions, and the solver takes at most "
                          f"{MAX_INSTRUCTIONS} (at most {MAX_INSTRUCTIONS // (2 * pp)} "
                          f"microbatches for {pp} stages; docs/perseus.md)")


def perseus_plans(profile: PerseusProfile, costs: PipelineCosts) -> list[Plan]:
    """The 1F1B time-energy frontier (kareus.compose.pipeline), fastest first, as Plans
    named perseus-000, perseus-001, ..."""
    options = instruction_options(profile, costs.static_power_w)
    points: list[PipelinePoint] = solve_frontier(options, costs)
    plans = []
    for i, pt in enumerate(sorted(points, key=lambda x: x.time_s)):
        ex = to_execution_plan(f"{METHOD}-{i:03d}", pt.picks, profile.freqs_mhz[0], False)
        plans.append(Plan(ex.name, METHOD, pt.time_s, pt.energy_j, ex,
                          timeline=timeline(pt, costs, profile.freqs_mhz[0])))
    return plans


class ImportDir(OwnedDir):
    """The directory import-perseus writes: summary.json, plans/ID.json, zeus/ID.py; its
    marker and its lock (`kareus.core.owned_dir` keeps the user's files safe)."""

    marker = ".kareus-import"
    what = "import-perseus output"
    lock_name = ".kareus-import.lock"
    written_files = ("summary.json",)
    written_dirs = (("plans", ".json"), ("zeus", ".py"))
    content = "the plans"

    @classmethod
    def legacy(cls, path: Path) -> bool:
        """Written before the marker: a summary.json of an import."""
        return cls.json_with(path / "summary.json", "summary", ("schema_version", "frontier"))

    def check_writable(self, force: bool = False) -> None:
        """Fail before any work when the directory cannot be one (`OwnedDir.check_place`:
        an existing directory that is not an earlier import's output is never replaced,
        with or without ``force``), or is an earlier import's output and not ``force``."""
        real = self.check_place()
        if real is not None and not force and self.is_mine(real) and any(
                (real / name).exists() for name in ("summary.json", "plans", "zeus")):
            raise KareusError(f"{self.path} holds an earlier import-perseus output; "
                              f"choose another --out, or --force to replace it")

    def lock(self, force: bool = False) -> Lock:
        """The directory locked for one run (`OwnedDir.locked`)."""
        return self.locked(lambda: self.check_writable(force))


def check_out_dir(out: str | Path, force: bool) -> ImportDir:
    """``out`` if it may be written (`ImportDir.check_writable`)."""
    out_dir = ImportDir(out)
    out_dir.check_writable(force)
    return out_dir


def import_perseus(source: str | Path, out: str | Path, microbatches: int,
                   static_power_w: float | None = None, gpu: str | None = None,
                   p2p_time_s: float = 0.0, force: bool = False,
                   say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Read a Perseus profile, solve its 1F1B frontier, write ``out``/summary.json,
    ``out``/plans/ID.json (Kareus) and ``out``/zeus/ID.py (Zeus PointSolution schedule),
    atomically. Returns the summary. ``say``: told when the solve starts."""
    out_dir = check_out_dir(out, force)
    watts, watts_source = static_power(static_power_w, gpu)
    profile = read_profile(source)
    if gpu is not None:
        spec = get_gpu(gpu)
        for f in profile.freqs_mhz:
            try:
                spec.check_freq(f)
            except SpecError as exc:
                raise SpecError(f"{profile.source}: {exc}") from None
    costs = pipeline_costs(profile, microbatches, watts, p2p_time_s)
    if say is not None:
        say(f"solving the 1F1B frontier of {profile.pp} stages x {microbatches} "
            f"microbatches")
    plans = perseus_plans(profile, costs)
    summary = _summary(profile, costs, watts_source, plans)
    job = {"pp": profile.pp, "num_microbatches": microbatches, "num_gpus": costs.gpus,
           "source": profile.source}
    with out_dir.lock(force):  # last: a refusal creates nothing
        out_dir.prepare()
        _write_dir(out_dir, plans, job, summary)
    return summary


def _summary(profile: PerseusProfile, costs: PipelineCosts, watts_source: str,
             plans: list[Plan]) -> dict[str, Any]:
    p2p = costs.send_activation_s[0] if costs.send_activation_s else 0.0
    frontier = [{"plan": p.id, "time_s": p.time_s, "energy_j": p.energy_j,
                 "freqs_mhz": sorted(set(p.execution.instruction_freqs.values())),
                 "plan_file": f"plans/{p.id}.json", "zeus_file": f"zeus/{p.id}.py"}
                for p in plans]
    return {
        "schema_version": SCHEMA_VERSION, "source": profile.source, "format": profile.fmt,
        "pp": profile.pp, "microbatches": costs.microbatches,
        "gpus_per_stage": profile.gpus_per_stage, "num_gpus": costs.gpus,
        "frequencies_mhz": list(profile.freqs_mhz), "static_power_w": costs.static_power_w,
        "static_power_source": watts_source, "p2p_time_s": p2p,
        "p2p_source": "--p2p-time-s" if p2p > 0 else "assumed 0: not in the profile",
        "frontier": frontier,
        "fastest": min(plans, key=lambda p: (p.time_s, p.energy_j)).id,
        "least_energy": min(plans, key=lambda p: (p.energy_j, p.time_s)).id,
    }


def _write_dir(out_dir: ImportDir, plans: list[Plan], job: dict[str, Any],
               summary: dict[str, Any]) -> None:
    """Build the directory beside ``out_dir``, then move or swap it in
    (`OwnedDir.swap`): a reader sees the old directory or the new one, never a mix."""

    def fill(tmp: Path) -> None:
        (tmp / "plans").mkdir()
        (tmp / "zeus").mkdir()
        for plan in plans:
            export_plan(plan, job, "json", tmp / "plans" / f"{plan.id}.json")
            export_plan(plan, job, "zeus", tmp / "zeus" / f"{plan.id}.py")
        write_text_atomic(tmp / "summary.json", json.dumps(summary, indent=1) + "\n")

    out_dir.swap(fill, str(os.getpid()))
