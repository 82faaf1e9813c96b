"""Figures and reports: the time-energy frontiers of every method, and what they mean."""

from __future__ import annotations

from pathlib import Path

from kareus.methods import all_methods, display_name
from kareus.result import OptimizeResult


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
        ax.plot(xs, ys, linestyle="none" if single else "-",
                marker=rec.marker if rec else "o", markersize=9 if single else 4,
                color=rec.color if rec else None, label=display_name(method), alpha=0.9)
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


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def metrics_table(metrics: dict[str, dict[str, float | None]]) -> list[str]:
    lines = ["| method | iso-time energy reduction vs Perseus | iso-energy time reduction vs "
             "Perseus | max-throughput time vs Megatron | max-throughput energy vs Megatron |",
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
    lines = [f"# Kareus plans for {job.describe()}", "",
             "## What was searched", "",
             "| partition | samples | measured this run | reused | frontier | stopped | "
             "profiling (GPU-h) |", "|---|---|---|---|---|---|---|"]
    for s in result.searches:
        lines.append(f"| {s.partition} | {len(s.samples)} | {s.measured_this_run} | "
                     f"{s.reused_from_journal} | {len(s.frontier)} | {s.stopped} | "
                     f"{s.profiling_cost_s / 3600:.2f} |")
    lines += ["", "## Frontiers", "", "![frontiers](frontier.png)", "",
              "| method | plans | fastest (s, kJ) | least energy (s, kJ) |", "|---|---|---|---|"]
    for method, plans in result.plans.items():
        fast = min(plans, key=lambda p: p.time_s)
        low = min(plans, key=lambda p: p.energy_j)
        lines.append(f"| {display_name(method)} | {len(plans)} | {fast.time_s:.3f}, "
                     f"{fast.energy_j / 1e3:.2f} | {low.time_s:.3f}, {low.energy_j / 1e3:.2f} |")
    lines += ["", "## Metrics (as the Kareus paper defines them)", "", *metrics_table(
        result.metrics), "", _validation_line(result.validation_max_error), ""]
    seq = [p for p in result.plans.get("kareus", []) if p.execution.sequential]
    if seq:
        lines += [f"{len(seq)} Kareus plans run some instructions without overlap "
                  f"(Megatron-style), where overlap did not pay.", ""]
    lines += ["## Applying a plan", "",
              f"    kareus plan --result {out} --deadline SECONDS",
              f"    kareus plan --result {out} --energy-budget JOULES",
              f"    kareus plan --result {out} --max-throughput --json",
              "",
              "Each plan file in `plans/` holds the clock of every pipeline instruction and "
              "the collective SMs and launch slot of every partition.", ""]
    return "\n".join(lines)


def _validation_line(error: float | None) -> str:
    if error is None:
        return ("The plans were not simulated: no cost model describes the backend that "
                "measured them.")
    return (f"Every plan was simulated by the emulator's whole-iteration simulation; the "
            f"largest relative difference between predicted and simulated time or energy is "
            f"{error * 100:.2f}%.")
