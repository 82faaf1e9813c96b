"""A plan's cluster power over one iteration, drawn (issue 26): each pipeline rank's power
stacked, the cluster's total, its moving average over the power cap's window, the cap."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kareus.errors import KareusError
from kareus.plans.outfile import write_file_atomic
from kareus.plans.plan import Plan, TimelineEntry
from kareus.plans.power import DEFAULT_WINDOW_S, PowerTrace, trace_of


def row_name(stages: int, ranks: int) -> str:
    """What a row of a plan's figures is called: "stage" where every pipeline rank holds
    one stage, "rank" where ranks hold several (interleaved 1F1B's virtual stages). The
    timeline and the power panel below it name their rows alike."""
    return "rank" if stages > ranks else "stage"


def rank_colors(n: int) -> list[tuple[float, float, float, float]]:
    """The fill of each of ``n`` stacked ranks: shades of one blue, dark to light. Not a
    qualitative map: its orange and red are the timeline's DP-sync bars and the cap line
    in the same figure (kareus.results.timeline)."""
    from matplotlib import colormaps

    blues = colormaps["Blues"]
    return [blues(0.85 - 0.45 * i / max(1, n - 1)) for i in range(n)]


def rank_traces(plan: Plan) -> list[PowerTrace]:
    """Each pipeline rank's power: its GPUs' static power and its bars' dynamic power (a
    bar of virtual stage s runs on rank s % pp); together they make the plan's trace."""
    if plan.power is None:
        raise KareusError(f"plan {plan.id} was written before plans recorded their power; "
                          f"run `kareus optimize` again to draw it")
    pw = plan.power
    bars: list[list[TimelineEntry]] = [[] for _ in range(pw.pp)]
    for e in plan.timeline:
        bars[e.stage % pw.pp].append(e)
    return [PowerTrace.of(b, plan.time_s, 1, pw.gpus_per_rank, pw.static_power_w)
            for b in bars]


def power_figure(plan: Plan, path: Path, title: str, window_s: float = DEFAULT_WINDOW_S,
                 cap_w: float | None = None) -> None:
    """Draw the plan's power over one iteration into ``path`` (written atomically; a PNG's
    Description metadata states the peak and the cap): each rank's power stacked, the
    cluster total, its moving average over ``window_s`` (dashed), the cap ``cap_w`` (red)
    when given. KareusError for a plan without recorded power."""
    desc, panel = power_panel(plan, title, window_s, cap_w)

    def draw(tmp: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4.5), dpi=120, layout="constrained")
        try:
            panel(ax)
            fig.savefig(tmp, metadata={"Description": desc} if str(tmp).endswith(".png")
                        else None)
        finally:
            plt.close(fig)

    write_file_atomic(path, draw)


def power_panel(plan: Plan, title: str, window_s: float = DEFAULT_WINDOW_S,
                cap_w: float | None = None) -> tuple[str, Callable[[Any], None]]:
    """(a description of the peak and the cap, a function drawing the plan's power over
    time on a matplotlib Axes): what `power_figure` draws, for a panel of another figure
    (the timeline of `kareus plan show --png`)."""
    ranks = rank_traces(plan)
    assert plan.power is not None  # rank_traces checked
    row = row_name(1 + max((e.stage for e in plan.timeline), default=0), plan.power.pp)
    total = trace_of(plan.timeline, plan.time_s, plan.power)
    peak = total.peak_w(window_s)  # SpecError for a window that is not positive
    t_end = plan.time_s
    # every rank's edges: the stacked steps change exactly there
    edges = np.unique(np.concatenate([r.times_s for r in ranks]))
    x = np.append(edges, t_end)
    ys = []
    for r in ranks:
        w = r.at(edges)
        ys.append(np.append(w, w[-1]) / 1e3)  # the last step holds to the iteration's end
    line = np.append(w := total.at(edges), w[-1]) / 1e3  # the sum of the ranks
    t = np.linspace(0.0, t_end, 1000)
    avg = total.moving_average_w(t, window_s) / 1e3
    desc = f"peak over {window_s:g} s: {peak / 1e3:.3f} kW; cap: " + (
        "none" if cap_w is None else f"{cap_w / 1e3:.3f} kW")

    def _draw(ax: Any) -> None:
        ax.stackplot(x, *ys, step="post", colors=rank_colors(len(ys)),
                     labels=[f"{row} {i}" for i in range(len(ys))], alpha=0.75)
        ax.step(x, line, where="post", color="black", linewidth=1.0,
                label="cluster total")
        ax.plot(t, avg, "--", color="#333333", linewidth=1.4,
                label=f"{window_s:g} s moving average (peak {peak / 1e3:.2f} kW)")
        tops = [float(line.max()), float(avg.max())]
        if cap_w is not None:
            ax.axhline(cap_w / 1e3, color="red", linewidth=1.4,
                       label=f"cap {cap_w / 1e3:.2f} kW")
            tops.append(cap_w / 1e3)
        ax.set_xlim(0, t_end)
        ax.set_ylim(0, max(tops) * 1.08 or 1.0)
        ax.set_xlabel("time in the iteration (s)")
        ax.set_ylabel("cluster power (kW)")
        ax.set_title(f"{plan.id}: {plan.time_s:.3f} s, mean {total.mean_w / 1e3:.2f} kW, "
                     f"{window_s:g} s peak {peak / 1e3:.2f} kW\n{title}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0),
                  ncol=1 + len(ys) // 12)

    return desc, _draw
