"""Figures and reports: the time-energy frontiers of every method, and what they mean."""

from __future__ import annotations

from pathlib import Path

STYLE = {
    "megatron": dict(color="#7f7f7f", marker="s", label="Megatron-LM"),
    "nanobatch": dict(color="#bcbd22", marker="D", label="Nanobatching"),
    "perseus": dict(color="#1f77b4", marker="o", label="Perseus"),
    "nanobatch_perseus": dict(color="#9467bd", marker="v", label="Nanobatching + Perseus"),
    "kareus_no_freq": dict(color="#ff7f0e", marker="^", label="Kareus, max clock only"),
    "kareus": dict(color="#d62728", marker="*", label="Kareus"),
}

NAMES = {k: v["label"] for k, v in STYLE.items()}


def frontier_figure(frontiers: dict[str, list[tuple[float, float]]], path: Path,
                    title: str) -> None:
    """One plot: iteration time (x) against iteration energy (y), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for method, pts in frontiers.items():
        if not pts:
            continue
        style = STYLE.get(method, dict(marker="o", label=method))
        xs = [t for t, _ in sorted(pts)]
        ys = [e / 1e3 for _, e in sorted(pts)]
        single = len(pts) == 1
        ax.plot(xs, ys, linestyle="none" if single else "-", marker=style["marker"],
                markersize=9 if single else 4, color=style.get("color"),
                label=style["label"], alpha=0.9)
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("iteration energy, all GPUs (kJ)")
    ax.set_title(f"Time-energy frontiers\n{title}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.annotate("better: faster and less energy", xy=(0.02, 0.03), xycoords="axes fraction",
                fontsize=8, color="#555555")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def metrics_table(metrics: dict) -> list[str]:
    lines = ["| method | iso-time energy reduction vs Perseus | iso-energy time reduction vs "
             "Perseus | max-throughput time vs Megatron | max-throughput energy vs Megatron |",
             "|---|---|---|---|---|"]
    for method, m in metrics.items():
        lines.append(
            f"| {NAMES.get(method, method)} | {_pct(m.get('iso_time_energy_reduction'))} | "
            f"{_pct(m.get('iso_energy_time_reduction'))} | "
            f"{_pct(m.get('max_throughput_time_reduction_vs_megatron'))} | "
            f"{_pct(m.get('max_throughput_energy_reduction_vs_megatron'))} |")
    return lines


def markdown_report(result, out: Path) -> str:
    job = result.job
    lines = [f"# Kareus plans for {job.describe()}", "",
             "## What was searched", "",
             "| partition | samples | measured this run | reused | frontier | stopped | "
             "profiling (GPU-h) |", "|---|---|---|---|---|---|---|"]
    for s in result.searches:
        lines.append(f"| {s['partition']} | {len(s['samples'])} | {s['measured_this_run']} | "
                     f"{s['reused_from_journal']} | {len(s['frontier'])} | {s['stopped']} | "
                     f"{s['profiling_cost_s'] / 3600:.2f} |")
    lines += ["", "## Frontiers", "", "![frontiers](frontier.png)", "",
              "| method | plans | fastest (s, kJ) | least energy (s, kJ) |", "|---|---|---|---|"]
    for method, plans in result.plans.items():
        fast = min(plans, key=lambda p: p.time_s)
        low = min(plans, key=lambda p: p.energy_j)
        lines.append(f"| {NAMES.get(method, method)} | {len(plans)} | {fast.time_s:.3f}, "
                     f"{fast.energy_j / 1e3:.2f} | {low.time_s:.3f}, {low.energy_j / 1e3:.2f} |")
    lines += ["", "## Metrics (as the Kareus paper defines them)", "", *metrics_table(
        result.metrics), "",
        f"Every plan was simulated by the emulator's whole-iteration simulation; the largest "
        f"relative difference between predicted and simulated time or energy is "
        f"{result.validation_max_error * 100:.2f}%.", ""]
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
