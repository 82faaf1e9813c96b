"""compare.md's sensitivity section, rendered from compare.json's ``sensitivity`` section
(the plain data kareus.workflows.sensitivity.run_sensitivity returns): the per-preset
ranges of the headline metrics, each constant's values, basis and mean effect, and the
[min..max] note after a headline cell."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def _pp(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}"


def range_note(section: Mapping[str, Any] | None, label: str | None, metric: str) -> str:
    """' [min..max]' (percent) after a compare.md cell of preset ``label`` (None: the best
    over the ranged presets); '' where there is no range."""
    if not section:
        return ""
    where = section["best"] if label is None else section["presets"].get(label, {})
    r = where.get("ranges", {}).get(metric)
    if not r or r["min"] is None:
        return ""
    return f" [{_pp(r['min'])}..{_pp(r['max'])}]"


def sensitivity_markdown(section: Mapping[str, Any], metrics: Sequence[str],
                         heads: Sequence[str]) -> list[str]:
    """compare.md's section: per preset the ranges, per constant its values, basis and
    mean effect, and the constants skipped."""
    cols = " | ".join(heads)
    lines = ["## Sensitivity of the headline (Kareus)", "",
             "Each emulator constant below at the low and at the high end of its plausible "
             "range, one at a time; the nominal search's settings re-predicted and "
             f"{', '.join(section['recomposed_methods'])} recomposed (the search is not "
             "rerun; docs/emulator.md, \"Sensitivity of the headline\"). Cells: point "
             "value, then [min / median / max] over the nominal and the perturbed runs, "
             "percent.", "", f"| config | {cols} |", "|---|" + "---|" * len(heads)]
    for label, p in section["presets"].items():
        cells = [_cell(p["ranges"][k]) for k in metrics]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if len(section["presets"]) > 1:
        lines.append("| best of these | " + " | ".join(
            _cell(section["best"]["ranges"][k]) for k in metrics) + " |")
    lines += ["", "Change from the nominal, low end / high end, mean over the presets "
              "(percentage points):", "", f"| constant | low .. high | {cols} |",
              "|---|---|" + "---|" * len(heads)]
    for c in section["constants"]:
        span = "; ".join(f"{g}: {v['low']:.4g} .. {v['high']:.4g} (nominal {v['nominal']:.4g})"
                         for g, v in c["values"].items())
        lines.append(f"| `{c['name']}` | {span} | "
                     + " | ".join(_mean_shift(section, c["name"], k) for k in metrics) + " |")
    lines += ["", "Basis of each range:", ""]
    lines += [f"- `{c['name']}`: {c['basis']}." for c in section["constants"]]
    lines += [f"- `{s['name']}`: skipped ({s['reason']})." for s in section["skipped"]]
    return [*lines, ""]


def _cell(r: Mapping[str, Any]) -> str:
    return f"{_pp(r['point'])} [{_pp(r['min'])} / {_pp(r['median'])} / {_pp(r['max'])}]"


def _mean_shift(section: Mapping[str, Any], constant: str, metric: str) -> str:
    shifts: dict[str, list[float]] = {"low": [], "high": []}
    for p in section["presets"].values():
        base = p["nominal"][metric]
        for run in p["runs"]:
            v = run["metrics"][metric]
            if run["constant"] == constant and v is not None and base is not None:
                shifts[run["side"]].append((v - base) * 100)
    return " / ".join(f"{statistics.mean(v):+.2f}" if v else "n/a" for v in shifts.values())
