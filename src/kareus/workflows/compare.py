"""`kareus compare`: every preset of a suite through `optimize`, side by side."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kareus import SCHEMA_VERSION
from kareus.errors import KareusError
from kareus.job.presets import JOB_PRESETS
from kareus.job.sources import build_job
from kareus.plans.methods import (
    ISO_REFERENCE,
    all_methods,
    display_name,
    get_method,
    left_out_line,
)
from kareus.results.report import figure_frontiers, frontier_figure, iso_power_markdown
from kareus.results.sensitivity_report import range_note, sensitivity_markdown
from kareus.search.loop import SearchConfig
from kareus.workflows.executors import ExecutorSpec
from kareus.workflows.optimize import optimize
from kareus.workflows.sensitivity import (
    HEADLINE_METHOD,
    SensitivityCase,
    SensitivitySpec,
    run_sensitivity,
)
from kareus.workload.workload import Workload

SUITES = {"kareus": [f"kareus-{i}" for i in range(1, 11)]}

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


def run_suite(suite: str, out_dir: str | Path, budget: int = 100, seed: int = 0,
              noise: float = 0.0, workers: int | None = None,
              log: Callable[[str], None] | None = None,
              sensitivity: SensitivitySpec | None = None) -> dict[str, Any]:
    """``sensitivity``: also the headline's ranges over the least-known emulator
    constants (kareus.workflows.sensitivity), in compare.json's ``sensitivity`` and compare.md."""
    from kareus.backends.registry import spec_from_options

    if suite not in SUITES:
        raise KareusError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
    if sensitivity is not None:
        sensitivity.check(SUITES[suite])
    ranged = sensitivity.chosen(SUITES[suite]) if sensitivity is not None else []
    cases: list[SensitivityCase] = []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = []
    for preset in SUITES[suite]:
        assert preset in JOB_PRESETS
        if log:
            log(f"{preset}: optimizing")
        job = build_job(preset)
        r = optimize(Workload.build(job), str(out / preset),
                     SearchConfig(budget=budget, seed=seed),
                     spec_from_options("emulator", {"noise": noise, "seed": seed}),
                     ExecutorSpec(workers=workers))
        assert r is not None  # the emulator: no rank measures only
        if log and r.left_out:
            log(f"{preset}: " + left_out_line([get_method(m) for m in r.left_out], job))
        frontier_figure(figure_frontiers(r), out / f"{preset}.png", job.describe())
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
    doc = {"schema_version": SCHEMA_VERSION, "suite": suite, "budget": budget, "seed": seed,
           "noise": noise, "configs": configs, "paper_headline": PAPER,
           "sensitivity": None if sensitivity is None else run_sensitivity(
               cases, METRIC_COLUMNS, sensitivity.constants, workers, log)}
    (out / "compare.json").write_text(json.dumps(doc, indent=1))
    (out / "compare.md").write_text(compare_markdown(doc))
    return doc


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
