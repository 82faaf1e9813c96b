"""Perseus interop: a per-instruction profile in Zeus's format -> 1F1B frontier plans.

Zeus's pipeline frequency optimizer (Perseus) profiles every pipeline instruction offline
and saves it with ``InstructionProfilingResult.to_csv``
(``zeus/optimizer/pipeline_frequency/common.py``, zeus 0.16): one CSV row per (rank,
instruction type, frequency) with the columns ``rank, dp_rank, pp_rank, tp_rank, stage,
instruction, frequency, time, energy`` (``instruction`` "forward" or "backward", ``time``
in seconds and ``energy`` in joules averaged over the profiling iterations, ``stage ==
pp_rank``). The same model serialized by pydantic is a JSON list of
``OfflineProfilingResult`` objects (``forward_time``, ``forward_energy``,
``backward_time``, ``backward_energy``: frequency -> value). Both are read here, strictly.

Every (stage, direction) becomes one sequential InstructionOption per profiled frequency
(dynamic energy = energy - static power x time); kareus.compose.pipeline solves the 1F1B
frontier; each frontier point becomes a Plan, written as Kareus JSON and as the frequency
schedule Zeus's PointSolution scheduler runs (kareus.plans.export). docs/perseus.md has more.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.compose.instruction import InstructionOption
from kareus.compose.pipeline import PipelineCosts, PipelinePoint, solve_frontier
from kareus.compose.plans import timeline, to_execution_plan
from kareus.core import DIRECTIONS
from kareus.core.atomic import exchange_dirs, remove_tree, write_text_atomic
from kareus.errors import KareusError, SpecError
from kareus.job.hardware import get_gpu
from kareus.plans.export import export_plan
from kareus.plans.plan import Plan

REQUIRED_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
RANK_COLUMNS = ("rank", "dp_rank", "pp_rank", "tp_rank")
JSON_KEYS = (*RANK_COLUMNS, "forward_time", "forward_energy", "backward_time",
             "backward_energy")
METHOD = "perseus"


@dataclass(frozen=True)
class ProfileRow:
    """One profiled (rank, stage, instruction, frequency); ``where`` names its row."""

    stage: int
    instruction: str
    freq_mhz: int
    time_s: float
    energy_j: float
    rank: int | None
    where: str


@dataclass(frozen=True)
class PerseusProfile:
    """A validated profile, one GPU's view per stage: time is the slowest rank's, energy
    the mean over the stage's ranks (Zeus's 3D wrapper takes the max time and the summed
    energy of a stage's ranks)."""

    source: str
    fmt: str
    pp: int
    gpus_per_stage: int
    freqs_mhz: tuple[int, ...]
    """Profiled frequencies, highest first (the same for every stage and direction)."""
    time_s: dict[tuple[int, str, int], float]
    energy_j: dict[tuple[int, str, int], float]
    """Both keyed by (stage, direction, freq_mhz)."""


def read_profile(path: str | Path) -> PerseusProfile:
    """Parse and validate a Perseus profile: CSV, or JSON when the file ends in .json or
    starts with ``[``. Raises SpecError naming the file, the row and the problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError(f"Perseus profile not found: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read Perseus profile {p}: {exc}") from None
    text = text.removeprefix("\ufeff")  # a BOM some spreadsheets write
    is_json = p.suffix.lower() == ".json" or text.lstrip().startswith("[")
    rows = _json_rows(p, text) if is_json else _csv_rows(p, text)
    return _assemble(p, "json" if is_json else "csv", rows)


def _csv_rows(p: Path, text: str) -> list[ProfileRow]:
    reader = csv.reader(io.StringIO(text))
    header = [c.strip() for c in next(reader, [])]
    if not any(header):
        raise SpecError(f"{p}: empty; expected a CSV header with the columns "
                        f"{', '.join((*RANK_COLUMNS, *REQUIRED_COLUMNS))}")
    dupes = sorted({c for c in header if header.count(c) > 1})
    unknown = [c for c in header if c not in (*REQUIRED_COLUMNS, *RANK_COLUMNS)]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    ranks = [c for c in RANK_COLUMNS if c in header]
    for problem, cols in (("duplicate", dupes), ("unknown", unknown), ("missing", missing)):
        if cols:
            raise SpecError(f"{p} row 1: {problem} column(s) {', '.join(cols)}; Zeus's "
                            f"InstructionProfilingResult.to_csv writes "
                            f"{', '.join((*RANK_COLUMNS, *REQUIRED_COLUMNS))}")
    if ranks and len(ranks) != len(RANK_COLUMNS):
        raise SpecError(f"{p} row 1: give all of {', '.join(RANK_COLUMNS)} or none")
    rows = []
    for rec in reader:
        where = f"row {reader.line_num}"
        if not any(field.strip() for field in rec):
            continue
        if len(rec) != len(header):
            raise SpecError(f"{p} {where}: {len(rec)} fields, the header has {len(header)}")
        f = {c: v.strip() for c, v in zip(header, rec)}
        for c in ("dp_rank", "tp_rank"):
            if c in f:
                _count(p, where, c, f[c])
        rows.append(_row(p, where, f["stage"], f["instruction"], f["frequency"], f["time"],
                         f["energy"], f.get("rank"), f.get("pp_rank")))
    return rows


def _json_rows(p: Path, text: str) -> list[ProfileRow]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{p}: not JSON: {exc}") from None
    if not isinstance(doc, list):
        raise SpecError(f"{p}: expected a JSON list of Zeus OfflineProfilingResult objects")
    rows = []
    for i, entry in enumerate(doc):
        where = f"entry {i}"
        if not isinstance(entry, dict):
            raise SpecError(f"{p} {where}: not a JSON object")
        missing = [k for k in JSON_KEYS if k not in entry]
        unknown = sorted(k for k in entry if k not in JSON_KEYS)
        if missing or unknown:
            raise SpecError(f"{p} {where}: " + "; ".join(
                f"{what} key(s) {', '.join(ks)}" for what, ks in
                (("missing", missing), ("unknown", unknown)) if ks))
        for k in ("dp_rank", "tp_rank"):
            _count(p, where, k, entry[k])
        for d in DIRECTIONS:
            times, energies = entry[f"{d}_time"], entry[f"{d}_energy"]
            if not isinstance(times, dict) or not isinstance(energies, dict):
                raise SpecError(f"{p} {where}: {d}_time and {d}_energy must map frequency "
                                f"to a number")
            if set(times) != set(energies):
                raise SpecError(f"{p} {where}: {d}_time and {d}_energy have different "
                                f"frequencies")
            for freq in times:
                rows.append(_row(p, f"{where} {d} {freq} MHz", entry["pp_rank"], d, freq,
                                 times[freq], energies[freq], entry["rank"],
                                 entry["pp_rank"]))
    return rows


def _row(p: Path, where: str, stage: Any, instruction: Any, freq: Any, time_s: Any,
         energy_j: Any, rank: Any, pp_rank: Any) -> ProfileRow:
    s = _count(p, where, "stage", stage)
    if instruction not in DIRECTIONS:
        raise SpecError(f"{p} {where}: instruction {instruction!r} is not forward or "
                        f"backward")
    f = _count(p, where, "frequency", freq)
    if f == 0:
        raise SpecError(f"{p} {where}: frequency must be positive")
    r = None if rank is None else _count(p, where, "rank", rank)
    if pp_rank is not None and _count(p, where, "pp_rank", pp_rank) != s:
        raise SpecError(f"{p} {where}: pp_rank {pp_rank} differs from stage {s}")
    return ProfileRow(s, str(instruction), f, _positive(p, where, "time", time_s),
                      _positive(p, where, "energy", energy_j), r, where)


def _count(p: Path, where: str, name: str, value: Any) -> int:
    """A non-negative integer, from an int or its decimal string (never a bool)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise SpecError(f"{p} {where}: {name} {value!r} is not a non-negative integer")


def _positive(p: Path, where: str, name: str, value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        x = float(value)
    except (TypeError, ValueError):
        raise SpecError(f"{p} {where}: {name} {value!r} is not a number") from None
    if not (math.isfinite(x) and x > 0):
        raise SpecError(f"{p} {where}: {name} must be positive and finite, not {value!r}")
    return x


def _assemble(p: Path, fmt: str, rows: list[ProfileRow]) -> PerseusProfile:
    if not rows:
        raise SpecError(f"{p}: no profile rows")
    groups: dict[tuple[int, int | None, str], dict[int, ProfileRow]] = defaultdict(dict)
    rank_stage: dict[int, ProfileRow] = {}
    for r in rows:
        group = groups[(r.stage, r.rank, r.instruction)]
        if r.freq_mhz in group:
            raise SpecError(f"{p} {r.where}: duplicates {group[r.freq_mhz].where} (stage "
                            f"{r.stage}, {r.instruction}, {r.freq_mhz} MHz)")
        group[r.freq_mhz] = r
        first = rank_stage.setdefault(r.rank, r) if r.rank is not None else r
        if first.stage != r.stage:
            raise SpecError(f"{p} {r.where}: rank {r.rank} is in stage {r.stage} here but "
                            f"in stage {first.stage} at {first.where}")
    stages = sorted({s for s, _r, _d in groups})
    pp = len(stages)
    if stages != list(range(pp)):
        gap = min(set(range(max(stages) + 1)) - set(stages))
        raise SpecError(f"{p}: stages must be 0..{max(stages)} without gaps; stage {gap} "
                        f"has no rows")
    ranks = {s: sorted({r for st, r, _d in groups if st == s}, key=lambda x: x or 0)
             for s in stages}
    for s in stages:
        for rank in ranks[s]:
            for direction in DIRECTIONS:
                if (s, rank, direction) not in groups:
                    who = "" if rank is None else f" (rank {rank})"
                    raise SpecError(f"{p}: stage {s}{who} has no {direction} rows; every "
                                    f"stage needs forward and backward")
        if len(ranks[s]) != len(ranks[0]):
            raise SpecError(f"{p}: stage {s} has {len(ranks[s])} ranks, stage 0 has "
                            f"{len(ranks[0])}; every stage needs the same number")
    _check_freqs(p, groups)
    freqs = tuple(sorted(next(iter(groups.values())), reverse=True))
    time_s: dict[tuple[int, str, int], float] = {}
    energy_j: dict[tuple[int, str, int], float] = {}
    for (s, _r, d), group in groups.items():
        for f, row in group.items():
            time_s[(s, d, f)] = max(time_s.get((s, d, f), 0.0), row.time_s)
            energy_j[(s, d, f)] = energy_j.get((s, d, f), 0.0) + row.energy_j / len(ranks[s])
    return PerseusProfile(str(p), fmt, pp, len(ranks[0]), freqs, time_s, energy_j)


def _check_freqs(p: Path, groups: dict[tuple[int, int | None, str], dict[int, ProfileRow]]
                 ) -> None:
    (s0, r0, d0), ref = next(iter(groups.items()))
    for (s, r, d), group in groups.items():
        if set(group) != set(ref):
            def name(s: int, r: int | None, d: str) -> str:
                return f"stage {s} {d}" + ("" if r is None else f" (rank {r})")

            def mhz(g: dict[int, ProfileRow]) -> str:
                return ", ".join(str(f) for f in sorted(g, reverse=True))

            raise SpecError(f"{p}: inconsistent frequencies: {name(s, r, d)} is profiled at "
                            f"{mhz(group)} MHz but {name(s0, r0, d0)} at {mhz(ref)} MHz")


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
    if not (math.isfinite(p2p_time_s) and p2p_time_s >= 0):
        raise KareusError(f"--p2p-time-s must be >= 0, not {p2p_time_s}")
    pp = profile.pp
    return PipelineCosts(pp, microbatches, pp * profile.gpus_per_stage, static_power_w,
                         (p2p_time_s,) * pp, (p2p_time_s,) * pp, (0.0,) * pp, (0.0,) * pp)


def perseus_plans(profile: PerseusProfile, costs: PipelineCosts) -> list[Plan]:
    """The 1F1B time-energy frontier (kareus.compose.pipeline), fastest first, as Plans
    named perseus-000, perseus-001, ..."""
    options = instruction_options(profile, costs.static_power_w)
    points: list[PipelinePoint] = solve_frontier(options, costs)
    plans = []
    for i, pt in enumerate(sorted(points, key=lambda x: x.time_s)):
        ex = to_execution_plan(f"{METHOD}-{i:03d}", pt.picks, profile.freqs_mhz[0], False)
        plans.append(Plan(ex.name, METHOD, pt.time_s, pt.energy_j, ex,
                          timeline=timeline(pt, costs)))
    return plans


def check_out_dir(out: str | Path, force: bool) -> Path:
    """``out`` if it may be written: absent, an empty directory, or (``force``) an earlier
    import's directory (it holds summary.json), which is then replaced whole. Any other
    directory is never replaced, with or without ``force``."""
    path = Path(out)
    if (force and path.is_dir() and any(path.iterdir())
            and not (path / "summary.json").is_file()):
        raise KareusError(f"{path} is not an earlier import-perseus output (no summary.json)"
                          f"; --force replaces only those: choose another --out")
    if path.exists() and not path.is_dir():
        raise KareusError(f"--out {path} is a file, not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise KareusError(f"{path} exists and is not empty; choose another --out, or "
                          f"--force to replace it")
    return path


def import_perseus(source: str | Path, out: str | Path, microbatches: int,
                   static_power_w: float | None = None, gpu: str | None = None,
                   p2p_time_s: float = 0.0, force: bool = False) -> dict[str, Any]:
    """Read a Perseus profile, solve its 1F1B frontier, write ``out``/summary.json,
    ``out``/plans/ID.json (Kareus) and ``out``/zeus/ID.py (Zeus PointSolution schedule),
    atomically. Returns the summary."""
    path = check_out_dir(out, force)
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
    plans = perseus_plans(profile, costs)
    summary = _summary(profile, costs, watts_source, plans)
    job = {"pp": profile.pp, "num_microbatches": microbatches, "num_gpus": costs.gpus,
           "source": profile.source}
    _write_dir(path, plans, job, summary)
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


def _write_dir(path: Path, plans: list[Plan], job: dict[str, Any],
               summary: dict[str, Any]) -> None:
    """Build the directory beside ``path``, then move or swap it in: a reader sees the
    old directory or the new one, never a mix."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        remove_tree(tmp)
        (tmp / "plans").mkdir(parents=True)
        (tmp / "zeus").mkdir()
        for plan in plans:
            export_plan(plan, job, "json", tmp / "plans" / f"{plan.id}.json")
            export_plan(plan, job, "zeus", tmp / "zeus" / f"{plan.id}.py")
        write_text_atomic(tmp / "summary.json", json.dumps(summary, indent=1) + "\n")
        if path.exists():
            exchange_dirs(path, tmp)
        else:
            os.rename(tmp, path)
    except OSError as exc:
        raise KareusError(f"cannot write {path}: {exc}") from None
    finally:
        remove_tree(tmp)
