"""A plan's 1F1B timeline, drawn: instructions coloured by SM clock on one scale per GPU,
transfers and the iteration's end in colours outside it, the critical path outlined."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kareus.job.spec import JobSpec
from kareus.plans.plan import Plan
from kareus.plans.units import format_energy_j, format_time_s
from kareus.results.power_figure import row_name

ITERATION_END_COLOR = "#e4572e"
"""The timelines' DP sync and optimizer step bars: orange-red, a colour outside the clock
colour map (viridis: purple, blue, green, yellow)."""
TRANSFER_COLOR = "#bbbbbb"
"""The timelines' pipeline transfers: grey, also outside the clock colour map."""
CLOCK_CMAP = "viridis"


def clock_scale_mhz(job: JobSpec) -> tuple[int, int]:
    """The timelines' SM clock colour scale: the GPU's search clocks up to its highest
    clock, one scale for every plan of a GPU (a clock keeps its colour from plan to plan
    and job to job), widened only for a job searching clocks outside it."""
    g = job.gpu_spec
    clocks = [*g.search_freqs_mhz, g.max_freq_mhz, *job.freqs_mhz]
    return min(clocks), max(clocks)


def timeline_figure(plan: Plan, path: Path, title: str, clocks_mhz: Sequence[int] = (),
                    pp: int | None = None,
                    panel: Callable[[Any], None] | None = None) -> None:
    """The plan's 1F1B timeline: one row per pipeline rank (``pp`` of them; every stage its
    own rank when not given), instructions coloured by clock (F/B and the microbatch
    written on wide bars, then ``.chunk`` with interleaved 1F1B: a virtual stage's chunk
    is stage // pp), transfers grey, the DP sync and optimizer step in ITERATION_END_COLOR
    (both outside the clock colours), critical instructions outlined; cropped to what is
    drawn. The colour scale spans ``clocks_mhz`` (`clock_scale_mhz` of the job: every
    timeline of a GPU on one scale) and the plan's own clocks; a PNG's Description
    metadata states it ("SM clock scale: LO..HI MHz"). ``panel``: draws a second panel
    below, on the same time axis (the plan's power over time: kareus.results.power_figure).
    """
    fig, _ax, norm, _bar = timeline_axes(plan, title, clocks_mhz, pp, panel)
    import matplotlib.pyplot as plt

    meta = {"Description": f"SM clock scale: {norm.vmin:g}..{norm.vmax:g} MHz"}
    fig.savefig(path, bbox_inches="tight", pad_inches=0.05,
                metadata=meta if str(path).endswith(".png") else None)
    plt.close(fig)


def timeline_axes(plan: Plan, title: str, clocks_mhz: Sequence[int] = (),
                  pp: int | None = None, panel: Callable[[Any], None] | None = None
                  ) -> tuple[Any, Any, Any, Any]:
    """What `timeline_figure` saves, drawn (the caller closes it): the figure, the
    timeline's axes, its clock colour scale (a matplotlib Normalize) and colour bar."""
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
    cmap = colormaps[CLOCK_CMAP]
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
            bars["face"].append(TRANSFER_COLOR if kind == "send" else ITERATION_END_COLOR)
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
    row = row_name(stages, ranks)
    ax.set_yticks(range(ranks), [f"{row} {ranks - 1 - i}" for i in range(ranks)])
    ax.set_ylim(-0.5, ranks - 0.5)
    ax.set_xlim(0, end * 1.005)
    ax.set_xlabel("time (s)" if panel is None else " ")  # a panel below has the axis label
    ax.set_title(f"{plan.id}: {format_time_s(plan.time_s)}, {format_energy_j(plan.energy_j)}"
                 f"\n{title}", fontsize=9)
    # right beside the timeline's axes (an inset: the layout would align it with the power
    # panel's legend below, a wide gap away)
    cax = ax.inset_axes((1.008, 0.0, 0.012, 1.0))
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), cax=cax)
    bar.set_label("SM clock (MHz)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    # on the x label's line, left: no row of its own
    # short enough to end before the centred x label on the smallest figure
    ax.annotate("outlined: critical path; grey: transfers; orange: DP sync and optimizer "
                "step", xy=(0, 0.5),
                xycoords=("axes fraction", ax.xaxis.label), va="center", fontsize=7,
                color="#555555")
    return fig, ax, norm, bar
