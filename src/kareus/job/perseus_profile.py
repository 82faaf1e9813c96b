"""Reading a Perseus profile: Zeus's per-instruction format, parsed and validated strictly.

Zeus's pipeline frequency optimizer (Perseus) profiles every pipeline instruction offline
and saves it with ``InstructionProfilingResult.to_csv``
(``zeus/optimizer/pipeline_frequency/common.py``, zeus 0.16): one CSV row per (rank,
instruction type, frequency) with the columns ``rank, dp_rank, pp_rank, tp_rank, stage,
instruction, frequency, time, energy`` (``instruction`` "forward" or "backward", ``time``
in seconds and ``energy`` in joules averaged over the profiling iterations, ``stage ==
pp_rank``). The same model serialized by pydantic is a JSON list of
``OfflineProfilingResult`` objects (``forward_time``, ``forward_energy``,
``backward_time``, ``backward_energy``: frequency -> value). Both are read here, strictly;
kareus.workflows.perseus composes what is read. docs/perseus.md has more.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.core import DIRECTIONS, jsonfile
from kareus.errors import SpecError

REQUIRED_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
RANK_COLUMNS = ("rank", "dp_rank", "pp_rank", "tp_rank")
JSON_KEYS = (*RANK_COLUMNS, "forward_time", "forward_energy", "backward_time",
             "backward_energy")


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
        doc = jsonfile.loads(text, str(p))
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
