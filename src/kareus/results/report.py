"""Figures and reports: the time-energy frontiers of every method, and what they mean."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kareus.plans.methods import ISO_REFERENCE, THROUGHPUT_BASELINE, all_methods, display_name
from kareus.plans.plan import Plan
from kareus.results.result import OptimizeResult, highlighted_method


def frontier_figure(frontiers: dict[str, list[tuple[float, float]]], path: Path,
                    title: str) -> list[str]:
    """One plot: iteration time (x) against iteration energy (y), one line per method.
    The PNG's Description metadata lists the methods drawn; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {m.name: m for m in all_methods()}
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    drawn: list[str] = []
    for method, pts in frontiers.items():
        if not pts:
            continue
        rec = records.get(method)
        xs = [t for t, _ in sorted(pts)]
        ys = [e / 1e3 for _, e in sorted(pts)]
        single = len(pts) == 1
        # a series that is no method of the registry (the power-limited Megatron-LM
        # runs): dashed, in a colour no method uses
        ax.plot(xs, ys, linestyle="none" if single else ("-" if rec else "--"),
                marker=rec.marker if rec else "x", markersize=9 if single else 4,
                color=rec.color if rec else "#8c564b", label=display_name(method),
                alpha=0.9)
        drawn.append(method)
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("iteration energy, all GPUs (kJ)")
    ax.set_title(f"Time-energy frontiers\n{title}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.annotate("better: faster and less energy", xy=(0.02, 0.03), xycoords="axes fraction",
                fontsize=8, color="#555555")
    fig.tight_layout()
    meta = {"Description": "methods: " + ", ".join(display_name(m) for m in drawn)}
    fig.savefig(path, metadata=meta if str(path).endswith(".png") else None)
    plt.close(fig)
    return drawn


def figure_frontiers(result: OptimizeResult) -> dict[str, list[tuple[float, float]]]:
    """The methods' frontiers, and the power-limited Megatron-LM runs as one more
    (kareus.workflows.power_limited), for the frontier figure."""
    fronts = result.frontier_points()
    if not result.power_limited:
        return fronts
    return {**fronts, "Megatron-LM, power-limited": sorted(
        (r["time_s"], r["energy_j"]) for r in result.power_limited)}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def metrics_table(metrics: dict[str, dict[str, float | None]]) -> list[str]:
    ref, base = display_name(ISO_REFERENCE), display_name(THROUGHPUT_BASELINE)
    lines = [f"| method | iso-time energy reduction vs {ref} | iso-energy time reduction vs "
             f"{ref} | max-throughput time vs {base} | max-throughput energy vs {base} |",
             "|---|---|---|---|---|"]
    for method, m in metrics.items():
        lines.append(
            f"| {display_name(method)} | {_pct(m.get('iso_time_energy_reduction'))} | "
            f"{_pct(m.get('iso_energy_time_reduction'))} | "
            f"{_pct(m.get('max_throughput_time_reduction_vs_megatron'))} | "
            f"{_pct(m.get('max_throughput_energy_reduction_vs_megatron'))} |")
    return lines


def markdown_report(result: OptimizeResult, out: Path) -> str:
    job = result.job
    lines = [f"# Kareus plans for {job.describe()}", "", headline(result), "",
             *_left_out_lines(result.left_out),
             *_sources_lines(result.sources), "## What was searched", "",
             *_searches_lines(result)]
    lines += ["## Frontiers", "", "![frontiers](frontier.png)", "",
              "| method | plans | fastest (s, kJ) | least energy (s, kJ) |", "|---|---|---|---|"]
    for method, plans in result.plans.items():
        fast = min(plans, key=lambda p: p.time_s)
        low = min(plans, key=lambda p: p.energy_j)
        lines.append(f"| {display_name(method)} | {len(plans)} | {fast.time_s:.3f}, "
                     f"{fast.energy_j / 1e3:.2f} | {low.time_s:.3f}, {low.energy_j / 1e3:.2f} |")
    shown = display_name(highlighted_method(result))
    lines += ["", f"![fastest {shown} plan](timeline-max-throughput.png)",
              f"![least-energy {shown} plan](timeline-min-energy.png)", "",
              "## Metrics (as the Kareus paper defines them)", "", *metrics_table(
                  result.metrics), "", *_METRICS_IN_WORDS, "",
              _validation_line(result.validation_max_error, *result.validated_plans()), "",
              *_validation_table(result.validation())]
    seq = [p for p in result.plans.get("kareus", []) if p.execution.sequential]
    if seq:
        lines += [f"{len(seq)} Kareus plans run some instructions without overlap "
                  f"(Megatron-style), where overlap did not pay.", ""]
    lines += _power_lines(result)
    where = shlex.quote(str(out))
    lines += ["## Applying a plan", "",
              f"    kareus plan --result {where} --deadline SECONDS",
              f"    kareus plan --result {where} --energy-budget JOULES",
              f"    kareus plan --result {where} --max-throughput --json",
              f"    kareus plan --result {where} --power-cap-kw KW",
              "",
              "Each plan file in `plans/` holds the clock of every pipeline instruction and "
              "the collective SMs and launch slot of every partition.", ""]
    return "\n".join(lines)


def _power_lines(result: OptimizeResult) -> list[str]:
    """Cluster power of each method's fastest and least-energy plans (kareus.plans.power)."""
    rows = []
    for method, plans in result.plans.items():
        ends = [min(plans, key=lambda p: p.time_s), min(plans, key=lambda p: p.energy_j)]
        if any(p.power is None for p in ends):
            continue
        cells = [f"{p.power.mean_w / 1e3:.2f} / {p.power.peak_w / 1e3:.2f}"
                 for p in ends if p.power is not None]
        rows.append(f"| {display_name(method)} | {cells[0]} | {cells[1]} |")
    if not rows:
        return []
    window = next(p.power.window_s for ps in result.plans.values() for p in ps
                  if p.power is not None)
    limited = [f"{r['limit_fraction']:.0%}: {r['time_s']:.3f} s, "
               f"{r['mean_power_w'] / 1e3:.2f} kW" for r in result.power_limited or []]
    return ["## Power", "",
            f"Cluster power over the iteration, mean / peak of the {window:g} s moving "
            f"average, kW, from each plan's composed timeline (static power on every GPU, "
            f"each bar at its mean dynamic power; iterations back to back); the timelines "
            f"above show the power over time below each plan's schedule. "
            f"`kareus plan --power-cap-kw KW` picks among the plans under a cap.", "",
            "| method | fastest plan | least-energy plan |", "|---|---|---|", *rows, "",
            *([f"Megatron-LM at max clock under a GPU power limit (of TDP; time, mean "
               f"power; simulated): {'; '.join(limited)}.", ""] if limited else []),
            *iso_power_markdown([("this job", result.iso_power)])]


def _searches_lines(result: OptimizeResult) -> list[str]:
    if not result.searches:
        return ["No partition was searched: no method that ran uses the partitions.", ""]
    lines = ["| partition | samples | measured this run | reused | frontier | stopped | "
             "est. GPU profiling (GPU-h) |", "|---|---|---|---|---|---|---|"]
    for s in result.searches:
        lines.append(f"| {s.partition} | {len(s.samples)} | {s.measured_this_run} | "
                     f"{s.reused_from_journal} | {len(s.frontier)} | {s.stopped} | "
                     f"{s.profiling_cost_s / 3600:.2f} |")
    return [*lines, "", PROFILING_NOTE, ""]


PROFILING_NOTE = (
    "*est. GPU profiling*: what measuring this run's new settings costs on a real GPU "
    "under the measurement protocol (its window and cooldown per setting, plus its settle "
    "time after each clock change): an estimate from the settings measured, not the time "
    "this run took (an emulator run uses no GPU).")


def _left_out_lines(left_out: dict[str, str]) -> list[str]:
    """The methods that could not run the job, one line per reason."""
    by_reason: dict[str, list[str]] = {}
    for m, why in left_out.items():
        by_reason.setdefault(why, []).append(f"`{m}`")
    return [*(f"Left out {', '.join(ms)}: {why}." for why, ms in by_reason.items()),
            ""] if left_out else []


def _sources_lines(sources: dict[str, Any] | None) -> list[str]:
    """Where the numbers came from, when they were read from a journal."""
    if sources is None:
        return []
    lines = ["## Measurements", "",
             f"Composed from the journal `{sources['measurements']}`, measurements of "
             f"backend `{sources['backend']}`; nothing was searched by this run."]
    filled = sources.get("filled") or []
    if filled:
        lines += ["", f"**{len(filled)} numbers came from the {sources['filled_from']}, not "
                      f"from measurements** (`--fill-missing {sources['filled_from']}`):", ""]
        lines += [f"- {n}" for n in filled]
    else:
        lines += ["Every number is from the journal."]
    fitted = sources.get("fitted") or {}
    if fitted.get("count"):
        lines += ["", f"{fitted['count']} of those numbers were fitted, not measured: steps "
                      f"outside partitions measured at a few clocks by `kareus profile` and "
                      f"fitted at the others, each fit checked at a held-out clock (largest "
                      f"held-out error {fitted['max_time_rel_error']:.2%} in time, "
                      f"{fitted['max_energy_rel_error']:.2%} in energy; docs/gpu.md)."]
    return [*lines, ""]


def _validation_table(per_method: dict[str, dict[str, float]]) -> list[str]:
    if not per_method:
        return []
    lines = ["| method | plans | time: max, median error | energy: max, median error |",
             "|---|---|---|---|"]
    for m, v in per_method.items():
        lines.append(f"| {display_name(m)} | {v['plans']:.0f} | "
                     f"{v['time_max_rel_error'] * 100:.2f}%, "
                     f"{v['time_median_rel_error'] * 100:.2f}% | "
                     f"{v['energy_max_rel_error'] * 100:.2f}%, "
                     f"{v['energy_median_rel_error'] * 100:.2f}% |")
    return [*lines, ""]


def _validation_line(error: float | None, simulated: int, plans: int) -> str:
    if error is None:
        return ("The plans were not simulated: no cost model describes the backend that "
                "measured them.")
    which = ("Every plan was" if simulated == plans else
             f"{simulated} of the {plans} plans (a stratified sample of each method's "
             f"frontier: its fastest, its least-energy, evenly between; `kareus optimize "
             f"--validate-plans N` sets how many) were")
    return (f"{which} simulated by the emulator as one whole iteration: each "
            f"instruction one continuous timeline, the power limiter's state carried across "
            f"partitions, instructions and clock changes (it does not add up the partition "
            f"measurements composition used). The largest relative difference between "
            f"composed and simulated time or energy is {error * 100:.2f}%; per method:")


def timeline_figure(plan: Plan, path: Path, title: str, clocks_mhz: Sequence[int] = (),
                    pp: int | None = None,
                    panel: Callable[[Any], None] | None = None) -> None:
    """The plan's 1F1B timeline: one row per pipeline rank (``pp`` of them; every stage its
    own rank when not given), instructions coloured by clock (F/B and the microbatch
    written on wide bars, then ``.chunk`` with interleaved 1F1B: a virtual stage's chunk
    is stage // pp), transfers grey, critical instructions outlined; cropped to what is
    drawn. The colour scale spans ``clocks_mhz`` (the job's clocks:
    every timeline of a job on one scale) and the plan's own clocks; a PNG's Description
    metadata states it ("SM clock scale: LO..HI MHz"). ``panel``: draws a second panel
    below, on the same time axis (the plan's power over time: kareus.results.power_figure).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    entries = plan.timeline
    stages = 1 + max((e.stage for e in entries), default=0)
    ranks = pp or stages
    clocks = [*clocks_mhz, *(e.freq_mhz for e in entries if e.kind not in ("send", "end"))
              ] or [0]
    lo, hi = min(clocks), max(clocks)
    norm = Normalize(lo, hi) if lo < hi else Normalize(lo - 1, hi + 1)
    cmap = colormaps["viridis"]
    if panel is None:
        fig, ax = plt.subplots(figsize=(10, 0.9 + 0.55 * ranks), dpi=120,
                               layout="constrained")
    else:
        fig, (ax, below) = plt.subplots(
            2, 1, figsize=(10, 4.4 + 0.55 * ranks), dpi=120, layout="constrained",
            height_ratios=(0.9 + 0.55 * ranks, 3.5))
        panel(below)
    end = max((e.start_s + e.time_s for e in entries), default=1.0)
    # one collection per row and kind (a patch per bar took 20 s for a 16-stage pipeline)
    rows: dict[tuple[int, str], dict[str, list]] = {}
    for e in entries:
        y = ranks - 1 - e.stage % ranks
        kind = e.kind if e.kind in ("send", "end") else "instruction"
        bars = rows.setdefault((y, kind), {"x": [], "face": [], "edge": [], "width": []})
        bars["x"].append((e.start_s, e.time_s))
        if kind != "instruction":
            bars["face"].append("#bbbbbb" if kind == "send" else "#7a5195")
            bars["edge"].append("none")
            bars["width"].append(0.0)
            continue
        bars["face"].append(cmap(norm(e.freq_mhz)))
        bars["edge"].append("black" if e.critical else "white")
        bars["width"].append(1.6 if e.critical else 0.4)
        if e.time_s > 0.025 * end:
            chunk = f".{e.stage // ranks}" if stages > ranks else ""
            ax.text(e.start_s + e.time_s / 2, y, f"{e.kind[0].upper()}{e.microbatch}{chunk}",
                    ha="center", va="center", fontsize=7, color="white")
    for (y, kind), bars in rows.items():
        height = 0.7 if kind == "instruction" else 0.35
        ax.broken_barh(bars["x"], (y - height / 2, height), facecolors=bars["face"],
                       edgecolors=bars["edge"], linewidths=bars["width"],
                       zorder=2 if kind == "instruction" else 1)
    row = "rank" if stages > ranks else "stage"
    ax.set_yticks(range(ranks), [f"{row} {ranks - 1 - i}" for i in range(ranks)])
    ax.set_ylim(-0.5, ranks - 0.5)
    ax.set_xlim(0, end * 1.005)
    ax.set_xlabel("time (s)" if panel is None else " ")  # a panel below has the axis label
    ax.set_title(f"{plan.id}: {plan.time_s:.3f} s, {plan.energy_j / 1e3:.2f} kJ\n{title}",
                 fontsize=9)
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.01,
                       aspect=8 + 4 * ranks)
    bar.set_label("SM clock (MHz)")
    # on the x label's line, left: no row of its own
    # short enough to end before the centred x label on the smallest figure
    ax.annotate("outlined: critical path; grey: transfers; purple: DP sync and optimizer step",
                xy=(0, 0.5),
                xycoords=("axes fraction", ax.xaxis.label), va="center", fontsize=7,
                color="#555555")
    meta = {"Description": f"SM clock scale: {norm.vmin:g}..{norm.vmax:g} MHz"}
    fig.savefig(path, bbox_inches="tight", pad_inches=0.05,
                metadata=meta if str(path).endswith(".png") else None)
    plt.close(fig)


_METRICS_IN_WORDS = [
    "- *Iso-time energy*: take Perseus's fastest plan; among this method's plans that are "
    "no slower, the least energy, as a saving against that Perseus plan.",
    "- *Iso-energy time*: take Perseus's least-energy plan; among this method's plans that "
    "use no more energy, the fastest, as a saving against that Perseus plan.",
    "- *Max-throughput time and energy*: this method's fastest plan against Megatron-LM's "
    "one plan (every instruction at max clock): how much shorter, and how much less "
    "energy.",
    "",
    "Every frontier point is the least-energy plan found for its iteration time (slack "
    "filled), so no saving comes from a baseline wasting energy off its critical path.",
]


def headline(result: OptimizeResult) -> str:
    """One sentence: Kareus's savings against Perseus and Megatron-LM."""
    m = result.metrics.get("kareus")
    if not m:
        why = result.left_out.get("kareus")
        return ("Kareus was not among the methods run." if why is None else
                f"Kareus was left out: {why}.")

    def pct(key: str) -> str:
        v = m.get(key)
        return "n/a" if v is None else f"{v * 100:.1f}%"

    return (f"Against Perseus, Kareus uses {pct('iso_time_energy_reduction')} less energy at "
            f"the same iteration time and is {pct('iso_energy_time_reduction')} faster for "
            f"the same energy; its fastest plan is "
            f"{pct('max_throughput_time_reduction_vs_megatron')} faster than Megatron-LM with "
            f"{pct('max_throughput_energy_reduction_vs_megatron')} less energy.")


def iso_power_markdown(levels: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """Iso-power rows, per (config, its levels): at Megatron-LM's mean cluster power and
    at 80% of it, Kareus's, Perseus's and the power-limited Megatron-LM's iteration times
    and Kareus's saving (kareus.workflows.power_limited)."""
    rows = []
    for name, lvs in levels:
        for lv in lvs:
            t = lv["time_s"]
            rows.append(
                f"| {name} | {lv['level_fraction']:.0%} ({lv['level_w'] / 1e3:.2f} kW) | "
                f"{_s(t.get('kareus'))} | {_s(lv['megatron_power_limited_time_s'])} | "
                f"{_s(t.get('perseus'))} | {_pct(lv['kareus_time_saving_vs_power_limited'])} "
                f"| {_pct(lv['kareus_time_saving_vs_perseus'])} |")
    if not rows:
        return []
    return ["## Iso-power", "",
            "At Megatron-LM's mean cluster power (max clock) and at 80% of it: each "
            "method's fastest plan whose mean power stays there, and Megatron-LM at max "
            "clock under a lowered GPU power limit (the emulator's limiter at 100..50% of "
            "TDP, interpolated between limits); time saved by Kareus (higher is better).",
            "", "| config | power | Kareus s | Megatron-LM power-limited s | Perseus s | "
            "vs power-limited | vs Perseus |", "|---|---|---|---|---|---|---|", *rows, ""]


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
