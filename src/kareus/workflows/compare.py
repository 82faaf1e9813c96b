"""`kareus compare`: every preset of a suite through `optimize`, side by side.

    DIR/compare.json, DIR/compare.md   the comparison
    DIR/PRESET.png                     each preset's frontiers
    DIR/PRESET/                        each preset's result directory (its journal: a rerun
                                       reuses its measurements)
    DIR/.kareus-compare, DIR/.kareus-compare.lock   the marker, the lock of the run

DIR is Kareus's (`CompareDir`, with the rules of `kareus.core.owned_dir`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.core.lock import Lock
from kareus.core.owned_dir import OwnedDir
from kareus.errors import KareusError
from kareus.job.presets import JOB_PRESETS
from kareus.job.sources import build_job
from kareus.plans.methods import (
    ISO_REFERENCE,
    all_methods,
    display_name,
)
from kareus.profiling.executors import ExecutorSpec
from kareus.results.report import figure_frontiers, frontier_figure, iso_power_markdown
from kareus.results.resultdir import ResultDir
from kareus.results.sensitivity_report import range_note, sensitivity_markdown
from kareus.search.loop import SearchConfig
from kareus.workflows.optimize import OptimizeRequest, OptimizeRun, check_optimize
from kareus.workflows.sensitivity import (
    HEADLINE_METHOD,
    SensitivityCase,
    SensitivitySpec,
    run_sensitivity,
)
from kareus.workload.workload import Workload

SUITES = {"kareus": [f"kareus-{i}" for i in range(1, 11)],
          # micro-batch 1 (the sequence split) near the public dgxc-benchmarking Llama 3.1
          # rows (kareus.job.presets says how each differs)
          "mbs1": ["llama3.1-8b-h100-mbs1", "llama3.3-70b-h100-mbs1"]}

# The paper's headline numbers (docs/anchors.md §4): best case over its ten workloads.
PAPER = {
    "iso_time_energy_reduction": 0.283,
    "iso_energy_time_reduction": 0.275,
    "max_throughput_time_reduction_vs_megatron": 0.149,
    "max_throughput_energy_reduction_vs_megatron": 0.221,
}

METRIC_COLUMNS = ("iso_time_energy_reduction", "iso_energy_time_reduction",
                  "max_throughput_time_reduction_vs_megatron",
                  "max_throughput_energy_reduction_vs_megatron")
HEADS = ("iso-time energy vs Perseus", "iso-energy time vs Perseus",
         "max-throughput time vs Megatron", "max-throughput energy vs Megatron")


class CompareDir(OwnedDir):
    """The directory `kareus compare` writes: compare.json, compare.md, PRESET.png, and
    each preset's result directory PRESET/ (`ResultDir`, written by its `optimize` in
    place, within this one). Its own files are built beside it and swapped in whole at
    the end; the preset results (their journals above all) are carried over by hard
    links, never copied or moved (`kareus.core.owned_dir`)."""

    marker = ".kareus-compare"
    what = "compare directory"
    lock_name = ".kareus-compare.lock"
    written_files = ("compare.json", "compare.md", *(f"{p}.png" for p in JOB_PRESETS))
    kept_dirs = tuple((p, ResultDir) for p in JOB_PRESETS)
    content = "the comparison"
    not_written = ("the comparison was not written (each preset's journal keeps its "
                   "measurements: rerun to write it)")

    @classmethod
    def legacy(cls, path: Path) -> bool:
        """Written before the marker: a compare.json of a suite."""
        return cls.json_with(path / "compare.json", "comparison",
                             ("schema_version", "suite", "configs"))

    def check_writable(self) -> None:
        """Fail before any work when the directory cannot be one (`OwnedDir.check_place`:
        anything in it that Kareus did not write, in its preset results too)."""
        self.check_place()

    def lock(self) -> Lock:
        """The directory locked for one run (`OwnedDir.locked`)."""
        return self.locked(self.check_writable)


@dataclass
class SuiteRun:
    """A comparison whose inputs were checked and whose directory is locked: `run` does
    the work."""

    suite: str
    out: CompareDir
    runs: list[tuple[str, OptimizeRun]]
    budget: int
    seed: int
    noise: float
    workers: int | None
    sensitivity: SensitivitySpec | None
    held: Lock | None = None

    def run(self, log: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Every preset through `optimize` (into its result directory inside the compare
        directory), then compare.json, compare.md and the figures swapped in whole."""
        try:
            return self._run(log)
        finally:
            if self.held is not None:
                self.held.release()

    def _run(self, log: Callable[[str], None] | None) -> dict[str, Any]:
        sens = self.sensitivity
        ranged = sens.chosen(SUITES[self.suite]) if sens is not None else []
        cases: list[SensitivityCase] = []
        self.out.prepare()
        configs = []
        figures: list[tuple[str, Any, str]] = []
        for preset, prepared in self.runs:
            if log:
                log(f"{preset}: optimizing")
            job = prepared.workload.job
            r = prepared.run()
            assert r is not None  # the emulator: no rank measures only
            if log and prepared.left_out_line:
                log(f"{preset}: {prepared.left_out_line}")
            figures.append((preset, figure_frontiers(r), job.describe()))
            configs.append({
                "preset": preset,
                "job": job.describe(),
                "methods": {m: {"frontier": [{"time_s": t, "energy_j": e} for t, e in pts]}
                            for m, pts in r.frontier_points().items()},
                "metrics": {m: {k: r.metrics.get(m, {}).get(k) for k in METRIC_COLUMNS}
                            for m in r.plans},
                "validation_max_rel_error": r.validation_max_error,
                "validation": r.validation(),
                "left_out": r.left_out,
                "iso_power": r.iso_power,
                "megatron_power_limited": r.power_limited,
            })
            if preset in ranged:
                cases.append(SensitivityCase.from_searches(
                    preset, job, r.searches, r.metrics.get(HEADLINE_METHOD, {})))
        doc = {"schema_version": SCHEMA_VERSION, "suite": self.suite, "budget": self.budget,
               "seed": self.seed, "noise": self.noise, "configs": configs,
               "paper_headline": PAPER,
               "sensitivity": None if sens is None else run_sensitivity(
                   cases, METRIC_COLUMNS, sens.constants, self.workers, log)}

        def fill(tmp: Path) -> None:
            for preset, fronts, title in figures:
                frontier_figure(fronts, tmp / f"{preset}.png", title)
            (tmp / "compare.json").write_text(json.dumps(doc, indent=1))
            (tmp / "compare.md").write_text(compare_markdown(doc))

        self.out.swap(fill, str(os.getpid()))
        return doc


def prepare_suite(suite: str, out_dir: str | Path, budget: int = 100, seed: int = 0,
                  noise: float = 0.0, workers: int | None = None,
                  sensitivity: SensitivitySpec | None = None) -> SuiteRun:
    """Everything that can fail on bad input (the suite, the sensitivity options, the
    directory and every preset's result directory in it, the backend, the budget, the
    workers), checked before any work; then the directory locked (`CompareDir.lock`):
    a refusal creates nothing."""
    from kareus.backends.registry import model_spec

    if suite not in SUITES:
        raise KareusError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
    if sensitivity is not None:
        sensitivity.check(SUITES[suite])
    out = CompareDir(out_dir)
    out.check_writable()
    spec = model_spec(noise=noise, seed=seed)
    config = SearchConfig(budget=budget, seed=seed)
    runs = []
    for preset in SUITES[suite]:
        assert preset in JOB_PRESETS
        runs.append((preset, check_optimize(OptimizeRequest(
            Workload.build(build_job(preset)), str(Path(out_dir) / preset), config, spec,
            ExecutorSpec(workers=workers), within=str(out.target())))))
    return SuiteRun(suite, out, runs, budget, seed, noise, workers, sensitivity,
                    held=out.lock())  # last: a refusal creates nothing


def run_suite(suite: str, out_dir: str | Path, budget: int = 100, seed: int = 0,
              noise: float = 0.0, workers: int | None = None,
              log: Callable[[str], None] | None = None,
              sensitivity: SensitivitySpec | None = None) -> dict[str, Any]:
    """`prepare_suite`, then `SuiteRun.run`. ``sensitivity``: also the headline's ranges
    over the least-known emulator constants (kareus.workflows.sensitivity), in
    compare.json's ``sensitivity`` and compare.md."""
    return prepare_suite(suite, out_dir, budget, seed, noise, workers, sensitivity).run(log)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def compare_markdown(doc: dict[str, Any]) -> str:
    sens = doc.get("sensitivity")
    lines = [f"# Kareus suite `{doc['suite']}` (emulator, budget {doc['budget']}, seed "
             f"{doc['seed']})", "",
             "Reductions (higher is better), one row per workload and method."
             + (" Kareus's cells: [min..max] over the emulator's least-known constants "
                "(section below)." if sens else ""), "",
             "| config | job | method | " + " | ".join(HEADS) + " |",
             "|---|---|---|" + "---|" * len(HEADS)]
    names = [m.name for m in all_methods() if m.name != ISO_REFERENCE]
    best: dict[str, dict[str, float | None]] = {m: dict.fromkeys(METRIC_COLUMNS)
                                               for m in names}
    for c in doc["configs"]:
        for m in (m for m in names if m in c["metrics"]):
            cells = []
            for k in METRIC_COLUMNS:
                v = c["metrics"][m][k]
                cells.append(_pct(v) + (range_note(sens, c["preset"], k)
                                        if m == HEADLINE_METHOD else ""))
                b = best[m][k]
                if v is not None and (b is None or v > b):
                    best[m][k] = v
            lines.append(f"| {c['preset']} | {c['job']} | {display_name(m)} | "
                         + " | ".join(cells) + " |")
    lines += ["", "| best over the suite | " + " | ".join(HEADS) + " |",
              "|---|" + "---|" * len(HEADS)]
    whole = sens is not None and len(sens["presets"]) == len(doc["configs"])
    lines += [f"| {display_name(m)} | " + " | ".join(
        _pct(best[m][k]) + (range_note(sens, None, k) if whole and m == HEADLINE_METHOD
                            else "") for k in METRIC_COLUMNS) + " |" for m in names]
    lines += ["| Kareus paper (up to) | " + " | ".join(_pct(doc["paper_headline"][k])
                                                      for k in METRIC_COLUMNS) + " |", ""]
    lines += iso_power_markdown([(c["preset"], c.get("iso_power") or [])
                                 for c in doc["configs"]])
    if sens:
        lines += sensitivity_markdown(sens, METRIC_COLUMNS, HEADS)
    return "\n".join(lines)
