"""Figures and reports: the time-energy frontiers of every method, and what they mean."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from kareus.plans.methods import (
    ISO_REFERENCE,
    PROPOSED,
    THROUGHPUT_BASELINE,
    all_methods,
    display_name,
)
from kareus.plans.plan import Plan
from kareus.plans.units import (
    ENERGY_DISPLAY,
    TIME_DISPLAY,
    display_unit,
    format_energy_j,
    format_number,
    format_power_w,
    format_time_s,
)
from kareus.results.result import OptimizeResult, highlighted_method

POWER_LIMITED = "Megatron-LM under a power limit, simulated"
"""The frontier figure's series of the power-limited Megatron-LM runs: whole iterations
simulated by the emulator, where every method's frontier (Megatron-LM's point included) is
composed from partition measurements; its 100% point is Megatron-LM's plan simulated, so it
sits off the composed Megatron-LM point by the composition error (report.md says by how
much)."""
def figure_title(result: OptimizeResult) -> str:
    """The job, and for numbers of a fake device, that they are (a figure travels alone)."""
    fake = f"\n{result.numbers['note']}" if result.fake and result.numbers else ""
    return result.job.describe() + fake


def frontier_figure(frontiers: dict[str, list[tuple[float, float]]], path: Path,
                    title: str) -> list[str]:
    """One plot: iteration time (x) against iteration energy (y), one line per method.
    The PNG's Description metadata lists the methods drawn; returns their names."""
    import matplotlib.pyplot as plt

    fig, drawn = frontier_axes(frontiers, title)
    meta = {"Description": "methods: " + ", ".join(display_name(m) for m in drawn)}
    fig.savefig(path, metadata=meta if str(path).endswith(".png") else None)
    plt.close(fig)
    return drawn


def frontier_axes(frontiers: dict[str, list[tuple[float, float]]], title: str
                  ) -> tuple[Any, list[str]]:
    """The frontier figure, drawn (the caller closes it), and the series drawn: the
    legend outside the axes, right of them, so that it covers no point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {m.name: m for m in all_methods()}
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=120, layout="constrained")
    # the axes' units by the largest point (a tiny job's ms and J, not 0.010 s, 0.01 kJ)
    every = [p for pts in frontiers.values() for p in pts] or [(1.0, 1.0)]
    t_unit, t_scale = display_unit(max(t for t, _ in every), TIME_DISPLAY)
    e_unit, e_scale = display_unit(max(e for _, e in every), ENERGY_DISPLAY)
    drawn: list[str] = []
    for method, pts in frontiers.items():
        if not pts:
            continue
        rec = records.get(method)
        xs = [t / t_scale for t, _ in sorted(pts)]
        ys = [e / e_scale for _, e in sorted(pts)]
        single = len(pts) == 1
        # a series that is no method of the registry (the power-limited Megatron-LM
        # runs): dashed, in a colour no method uses
        ax.plot(xs, ys, linestyle="none" if single else ("-" if rec else "--"),
                marker=rec.marker if rec else "x", markersize=9 if single else 4,
                color=rec.color if rec else "#8c564b", label=_label(method, frontiers),
                alpha=0.9)
        drawn.append(method)
    ax.set_xlabel(f"iteration time ({t_unit})")
    ax.set_ylabel(f"iteration energy, all GPUs ({e_unit})")
    ax.set_title(f"Time-energy frontiers\n{title}", fontsize=10)
    ax.grid(True, alpha=0.3)
    # beside the axes, like the note on which way is better: neither covers a point
    fig.legend(fontsize=8, loc="outside right upper", title="better: faster and less energy",
               title_fontsize=8)
    return fig, drawn


def _label(method: str, frontiers: dict[str, list[tuple[float, float]]]) -> str:
    """A series' legend entry; where Megatron-LM at max clock is drawn twice (composed, and
    simulated at 100% of TDP), each says which it is."""
    if not (frontiers.get(POWER_LIMITED) and frontiers.get(THROUGHPUT_BASELINE)):
        return display_name(method)
    if method == THROUGHPUT_BASELINE:
        return f"{display_name(method)} (composed, as every method)"
    if method == POWER_LIMITED:
        return (f"{POWER_LIMITED}\n(whole iterations, 100% of TDP first: off\nthe composed "
                f"point by the composition error)")
    return display_name(method)


def figure_frontiers(result: OptimizeResult) -> dict[str, list[tuple[float, float]]]:
    """The methods' frontiers, and the power-limited Megatron-LM runs as one more
    (kareus.workflows.power_limited), for the frontier figure."""
    fronts = result.frontier_points()
    if not result.power_limited:
        return fronts
    return {**fronts, POWER_LIMITED: sorted(
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
    fake = " (fake GPU)" if result.fake else ""
    lines = [f"# Kareus plans for {job.describe()}{fake}", "", headline(result), "",
             *_left_out_lines(result.left_out),
             *_sources_lines(result.sources), "## What was searched", "",
             *_searches_lines(result)]
    lines += ["## Frontiers", "", "![frontiers](frontier.png)", "",
              "| method | plans | fastest: time, energy | least energy: time, energy |",
              "|---|---|---|---|"]
    for method, plans in result.plans.items():
        fast = min(plans, key=lambda p: p.time_s)
        low = min(plans, key=lambda p: p.energy_j)
        lines.append(f"| {display_name(method)} | {len(plans)} | {_te(fast)} | {_te(low)} |")
    shown = display_name(highlighted_method(result))
    lines += ["", f"![fastest {shown} plan](timeline-max-throughput.png)",
              f"![least-energy {shown} plan](timeline-min-energy.png)", "",
              "## Metrics (as the Kareus paper defines them)", "", *metrics_table(
                  result.metrics), "", *_METRICS_IN_WORDS, "",
              _validation_line(result.validation_max_error, *result.validated_plans()), "",
              *_validation_table(result.validation())]
    seq = [p for p in result.plans.get(PROPOSED, []) if p.execution.sequential]
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


def _te(p: Plan) -> str:
    return f"{format_time_s(p.time_s)}, {format_energy_j(p.energy_j)}"


def _power_lines(result: OptimizeResult) -> list[str]:
    """Cluster power of each method's fastest and least-energy plans (kareus.plans.power)."""
    rows = []
    for method, plans in result.plans.items():
        ends = [min(plans, key=lambda p: p.time_s), min(plans, key=lambda p: p.energy_j)]
        if any(p.power is None for p in ends):
            continue
        cells = [f"{format_power_w(p.power.mean_w)} / {format_power_w(p.power.peak_w)}"
                 for p in ends if p.power is not None]
        rows.append(f"| {display_name(method)} | {cells[0]} | {cells[1]} |")
    if not rows:
        return []
    window = next(p.power.window_s for ps in result.plans.values() for p in ps
                  if p.power is not None)
    limited = [f"{r['limit_fraction']:.0%}: {format_time_s(r['time_s'])}, "
               f"{format_energy_j(r['energy_j'])}, {format_power_w(r['mean_power_w'])}"
               for r in result.power_limited or []]
    return ["## Power", "",
            f"Cluster power over the iteration, mean / peak of the {window:g} s moving "
            f"average, from each plan's composed timeline (static power on every GPU, "
            f"each bar at its mean dynamic power; iterations back to back); the timelines "
            f"above show the power over time below each plan's schedule. "
            f"`kareus plan --power-cap-kw KW` picks among the plans under a cap.", "",
            "| method | fastest plan | least-energy plan |", "|---|---|---|", *rows, "",
            *([f"Megatron-LM at max clock under a GPU power limit (of TDP; time, energy, "
               f"mean power; simulated): {'; '.join(limited)}.", "",
               *_two_megatrons(result), ""] if limited else []),
            *iso_power_markdown([("this job", result.iso_power)])]


def _two_megatrons(result: OptimizeResult) -> list[str]:
    """Why the power-limited runs' 100% row is not the frontier's Megatron-LM point: one
    is simulated, the other composed."""
    plans = result.plans.get(THROUGHPUT_BASELINE)
    full = next((r for r in result.power_limited or [] if r["limit_fraction"] == 1.0), None)
    if not plans or full is None:
        return []
    p = plans[0]
    return [f"Megatron-LM at max clock appears twice: the frontier's point ({_te(p)}) is "
            f"composed from partition measurements, as every method's plans are, so that "
            f"the methods compare on one footing; the power-limited runs are whole "
            f"iterations simulated by the emulator, its power limiter running, and at 100% "
            f"of TDP ({format_time_s(full['time_s'])}, {format_energy_j(full['energy_j'])}) "
            f"the same plan differs from its composed point by the composition error the "
            f"validation above measures. The metrics and the iso-power levels use the composed "
            f"point; the iso-power table's power-limited times are the simulated runs'."]


def _searches_lines(result: OptimizeResult) -> list[str]:
    if not result.searches:
        return ["No partition was searched: no method that ran uses the partitions.", ""]
    lines = ["| partition | samples | measured this run | reused | frontier | stopped | "
             "est. GPU profiling (GPU-h) |", "|---|---|---|---|---|---|---|"]
    for s in result.searches:
        lines.append(f"| {s.partition} | {len(s.samples)} | {s.measured_this_run} | "
                     f"{s.reused_from_journal} | {len(s.frontier)} | {s.stopped} | "
                     f"{format_number(s.profiling_cost_s / 3600, 3)} |")
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
    m = result.metrics.get(PROPOSED)
    if not m:
        why = result.left_out.get(PROPOSED)
        return _provenance(result) + ("Kareus was not among the methods run." if why is None
                                      else f"Kareus was left out: {why}.")

    def pct(key: str) -> str:
        v = m.get(key)
        return "n/a" if v is None else f"{v * 100:.1f}%"

    return (f"{_provenance(result)}Against Perseus, Kareus uses "
            f"{pct('iso_time_energy_reduction')} less energy at the same iteration time and "
            f"is {pct('iso_energy_time_reduction')} faster for the same energy; its fastest "
            f"plan is {pct('max_throughput_time_reduction_vs_megatron')} faster than "
            f"Megatron-LM with {pct('max_throughput_energy_reduction_vs_megatron')} less "
            f"energy.")


def _provenance(result: OptimizeResult) -> str:
    """Where the numbers come from, first: in bold for a fake device's."""
    if not result.numbers:
        return ""
    note = result.numbers["note"]
    note = note[0].upper() + note[1:]
    return f"**{note}.** " if result.fake else f"*{note}.* "


def iso_power_markdown(levels: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """Iso-power rows, per (config, its levels): at Megatron-LM's mean cluster power and
    at 80% of it, Kareus's, Perseus's and the power-limited Megatron-LM's iteration times
    and Kareus's saving (kareus.workflows.power_limited)."""
    rows = []
    for name, lvs in levels:
        for lv in lvs:
            t = lv["time_s"]
            rows.append(
                f"| {name} | {lv['level_fraction']:.0%} ({format_power_w(lv['level_w'])}) | "
                f"{_s(t.get(PROPOSED))} | {_s(lv['megatron_power_limited_time_s'])} | "
                f"{_s(t.get(ISO_REFERENCE))} | {_pct(lv['kareus_time_saving_vs_power_limited'])} "
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
    return "n/a" if x is None else format_time_s(x)
