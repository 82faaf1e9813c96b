"""What `kareus optimize` writes and prints reads as it should: timelines cropped to what is
drawn and on one colour scale, metric cells that say what they compare to (n/a where there
is none), the profiling cost marked as an estimate, commands that survive a shell."""

import json
import shlex
from pathlib import Path

import matplotlib
import matplotlib.image as mpimg
import matplotlib.pyplot as plt
import numpy as np
import pytest
from PIL import Image

from kareus.job.spec import JobSpec
from kareus.plans.plan import Plan
from kareus.plans.units import format_energy_j, format_time_s
from kareus.results import report, timeline
from kareus.results.power_figure import power_panel
from tests.conftest import run_cli

FAST = ("optimize", "-p", "kareus-1", "--microbatches", "4", "--freqs", "1410,1200",
        "--budget", "20", "--workers", "1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One fast optimize into a directory whose path has a space."""
    out = tmp_path_factory.mktemp("report") / "my result"
    r = run_cli(*FAST, "--out", str(out))
    assert r.code == 0, r.err
    return out, r


def blank_fraction(png: Path) -> float:
    """The share of the picture in rows or columns that are near-white from edge to edge."""
    white = (mpimg.imread(png)[..., :3] > 0.95).all(axis=2)
    rows, cols = white.all(axis=1).mean(), white.all(axis=0).mean()
    return float(1 - (1 - rows) * (1 - cols))


def clock_scale(png: Path) -> str | None:
    with Image.open(png) as img:
        return img.text.get("Description")


def _plans(out: Path) -> tuple[JobSpec, list[Plan]]:
    doc = json.loads((out / "result.json").read_text())
    ids = [p["plan"] for p in doc["methods"]["kareus"]["frontier"]]
    plans = [Plan.from_dict(json.loads((out / "plans" / f"{i}.json").read_text()))
             for i in ids]
    return JobSpec.model_validate(doc["job"]), plans


def test_timelines_are_cropped_to_what_is_drawn(run):
    out, _ = run
    for which in ("max-throughput", "min-energy"):
        # was 0.44 and 0.43 (a third of the rows blank below the axes)
        assert blank_fraction(out / f"timeline-{which}.png") < 0.25


@pytest.mark.parametrize("stages", [1, 4])
def test_timeline_of_any_depth_is_cropped(run, tmp_path, stages):
    out, _ = run
    _, plans = _plans(out)
    plan = plans[0]
    per = [e for e in plan.timeline if e.stage == 0]
    plan.timeline = [type(e)(s, e.microbatch, e.kind, e.start_s, e.time_s, e.freq_mhz,
                             e.critical) for s in range(stages) for e in per]
    timeline.timeline_figure(plan, tmp_path / "t.png", "title")
    assert blank_fraction(tmp_path / "t.png") < 0.25


def test_timelines_share_the_jobs_clock_scale(run, tmp_path):
    out, _ = run
    job, plans = _plans(out)
    fast = min(plans, key=lambda p: p.time_s)
    low = min(plans, key=lambda p: p.energy_j)
    def clocks(plan):
        return {e.freq_mhz for e in plan.timeline if e.kind in ("forward", "backward")}

    assert clocks(low) != clocks(fast)
    for p in (fast, low):
        timeline.timeline_figure(p, tmp_path / f"{p.id}.png", "t",
                               clocks_mhz=timeline.clock_scale_mhz(job))
    assert [clock_scale(tmp_path / f"{p.id}.png") for p in (fast, low)] == [
        "SM clock scale: 900..1410 MHz"] * 2


def test_report_timelines_share_one_scale(run):
    out, _ = run
    # the A100's search clocks, not this job's two (1200, 1410): one scale per GPU
    assert [clock_scale(out / f"timeline-{which}.png")
            for which in ("max-throughput", "min-energy")] == [
        "SM clock scale: 900..1410 MHz"] * 2


def test_frontier_table_says_vs_perseus_and_na(run):
    _, r = run
    header = next(line for line in r.out.splitlines() if "iso-time" in line)
    assert "iso-time E vs Perseus" in header and "iso-energy T vs Perseus" in header
    perseus = next(line for line in r.out.splitlines() if line.startswith("│ Perseus "))
    assert perseus.count("n/a") == 2


def test_report_profiling_cost_is_an_estimate(run):
    out, _ = run
    text = (out / "report.md").read_text()
    assert "| est. GPU profiling (GPU-h) |" in text
    assert "an estimate from the settings measured, not the time this run took" in text


def test_report_commands_are_quoted(run):
    out, _ = run
    text = (out / "report.md").read_text()
    commands = [line.strip() for line in text.splitlines()
                if line.strip().startswith("kareus plan")]
    assert len(commands) == 4
    for c in commands:
        assert shlex.split(c)[:4] == ["kareus", "plan", "--result", str(out)]


def test_report_metrics_na(run):
    out, _ = run
    text = (out / "report.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| Perseus | n/a"))
    assert row.count("n/a") == 2


# Pictures (issue 34, item 13): the data behind them ---------------------------------------

def test_a_clock_keeps_its_colour_on_one_gpu(run, tmp_path):
    """Two jobs of one GPU searching different clocks, and `plan show --png` of a plan of
    the result: one colour scale, so 1200 MHz is one colour everywhere."""
    out, _ = run
    job, plans = _plans(out)
    other = job.model_copy(update={"search_freqs_mhz": None})  # the A100's nine clocks
    assert timeline.clock_scale_mhz(job) == timeline.clock_scale_mhz(other) == (900, 1410)
    norms = [timeline.timeline_axes(p, "t", timeline.clock_scale_mhz(j))[2]
             for p, j in ((plans[0], job), (plans[-1], other))]
    cmap = matplotlib.colormaps[timeline.CLOCK_CMAP]
    assert cmap(norms[0](1200)) == cmap(norms[1](1200))
    png = tmp_path / "show.png"
    r = run_cli("plan", "show", "--result", str(out), "--plan", plans[0].id, "--png", str(png))
    assert r.code == 0, r.err
    assert clock_scale(png) == clock_scale(out / "timeline-max-throughput.png")
    plt.close("all")


def _distance_to_map(color, cmap):
    rgb = np.array(matplotlib.colors.to_rgb(color))
    samples = cmap(np.linspace(0, 1, 256))[:, :3]
    return float(np.min(np.linalg.norm(samples - rgb, axis=1)))


def test_non_compute_bars_are_in_no_clock_colour():
    cmap = matplotlib.colormaps[timeline.CLOCK_CMAP]
    for color in (timeline.ITERATION_END_COLOR, timeline.TRANSFER_COLOR):
        assert _distance_to_map(color, cmap) > 0.25, color  # was purple: 900 MHz's


def test_colour_bar_sits_beside_the_timeline_and_rows_share_a_name(run):
    out, _ = run
    _, plans = _plans(out)
    plan = plans[0]
    panel = power_panel(plan, "t")[1]
    fig, ax, _norm, bar = timeline.timeline_axes(plan, "t", (900, 1410), pp=2, panel=panel)
    fig.canvas.draw()
    axes, cbar = ax.get_window_extent(), bar.ax.get_window_extent()
    assert 0 <= cbar.x0 - axes.x1 < 0.03 * axes.width  # was a third of the figure away
    rows = {t.get_text().split()[0] for t in ax.get_yticklabels()}
    below = fig.axes[1] if fig.axes[1] is not bar.ax else fig.axes[2]
    legend = {t.get_text().split()[0] for t in below.get_legend().get_texts()
              if t.get_text().split()[-1].isdigit()}
    assert rows == legend == {"stage"}  # the power panel said "rank"
    plt.close(fig)


def test_frontier_legend_covers_no_point_and_both_megatrons_say_which(run):
    out, _ = run
    doc = json.loads((out / "result.json").read_text())
    fronts = {m: [(p["time_s"], p["energy_j"]) for p in v["frontier"]]
              for m, v in doc["methods"].items()}
    fronts[report.POWER_LIMITED] = [(r["time_s"], r["energy_j"])
                                    for r in doc["megatron_power_limited"]]
    fig, _drawn = report.frontier_axes(fronts, "t")
    fig.canvas.draw()
    (legend,) = fig.legends
    box = legend.get_window_extent()
    ax = fig.axes[0]
    points = np.concatenate([ax.transData.transform(line.get_xydata()) for line in ax.lines])
    inside = ((points[:, 0] >= box.x0) & (points[:, 0] <= box.x1)
              & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1))
    assert not inside.any()
    labels = [t.get_text() for t in legend.get_texts()]
    assert "Megatron-LM (composed, as every method)" in labels
    assert any(label.startswith(report.POWER_LIMITED) and "composition error" in label
               for label in labels)
    plt.close(fig)


def test_report_says_why_megatron_appears_twice(run):
    out, _ = run
    doc = json.loads((out / "result.json").read_text())
    text = (out / "report.md").read_text()
    line = next(x for x in text.splitlines() if "appears twice" in x)
    (composed,) = doc["methods"]["megatron"]["frontier"]
    full = next(r for r in doc["megatron_power_limited"] if r["limit_fraction"] == 1.0)
    assert f"({format_time_s(composed['time_s'])}, {format_energy_j(composed['energy_j'])})" \
        in line
    assert f"({format_time_s(full['time_s'])}, {format_energy_j(full['energy_j'])})" in line
    assert "composed" in line and "simulated" in line


def test_result_says_where_its_numbers_come_from(run):
    out, r = run
    doc = json.loads((out / "result.json").read_text())
    assert doc["numbers"]["backend"] == "emulator" and doc["numbers"]["fake"] is False
    assert (out / "report.md").read_text().splitlines()[2].startswith("*Emulator: ")
    assert "numbers: emulator: modelled" in r.out


def test_a_fake_gpus_result_says_so_in_every_summary(run, tmp_path):
    """Issue 34, item 12: the headline read "62.9% faster than Megatron-LM" from CPU
    timings."""
    import contextlib
    import io

    from kareus.backends.registry import numbers_from
    from kareus.cli.optimize import _print_frontiers
    from kareus.results.result import OptimizeResult

    out, _ = run
    job, plans = _plans(out)
    result = OptimizeResult(job, {"kareus": plans}, [], {"kareus": {}}, None,
                            numbers=numbers_from("fakegpu:A100-40GB"))
    assert result.fake and result.to_dict()["numbers"]["fake"] is True
    text = report.markdown_report(result, tmp_path)
    assert text.splitlines()[0].endswith("(fake GPU)")
    assert report.headline(result).startswith(
        "**Fake GPU: CPU timings and a fake energy counter; not a measurement of any GPU.**")
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        _print_frontiers(job, result, str(tmp_path))
    assert "fake GPU: CPU timings and a fake energy counter" in said.getvalue()
    assert "(fake GPU)" in said.getvalue()
    assert "not a measurement of any GPU" in report.figure_title(result)


def test_plan_show_titles_its_pictures_with_the_job(run, tmp_path, monkeypatch):
    from kareus.cli import plan as plan_cli

    out, _ = run
    job, plans = _plans(out)
    titles = []
    real = plan_cli.timeline_figure
    monkeypatch.setattr(plan_cli, "timeline_figure",
                        lambda p, path, title, **kw: (titles.append(title),
                                                      real(p, path, title, **kw)))
    r = run_cli("plan", "show", "--result", str(out), "--plan", plans[0].id, "--png",
                str(tmp_path / "t.png"))
    assert r.code == 0, r.err
    assert titles == [job.describe()]  # was the model's name alone


def test_frontier_axes_take_the_unit_of_their_magnitude():
    """A tiny job's frontier read 0.010 s and 0.008 kJ on its axes."""
    fig, _ = report.frontier_axes({"kareus": [(0.0102, 10.4), (0.011, 9.0)],
                                   "megatron": [(0.0105, 10.9)]}, "t")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "iteration time (ms)"
    assert ax.get_ylabel() == "iteration energy, all GPUs (J)"
    assert max(x for line in ax.lines for x in line.get_xdata()) == pytest.approx(11.0)
    plt.close(fig)
    fig, _ = report.frontier_axes({"kareus": [(4.178, 20910.0)]}, "t")
    assert fig.axes[0].get_ylabel().endswith("(kJ)")
    plt.close(fig)
