"""What `kareus optimize` writes and prints reads as it should: timelines cropped to what is
drawn and on one colour scale, metric cells that say what they compare to (n/a where there
is none), the profiling cost marked as an estimate, commands that survive a shell."""

import json
import shlex
from pathlib import Path

import matplotlib.image as mpimg
import pytest
from PIL import Image

from kareus.job.spec import JobSpec
from kareus.plans.plan import Plan
from kareus.results import report
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
    report.timeline_figure(plan, tmp_path / "t.png", "title")
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
        report.timeline_figure(p, tmp_path / f"{p.id}.png", "t", clocks_mhz=job.freqs_mhz)
    assert [clock_scale(tmp_path / f"{p.id}.png") for p in (fast, low)] == [
        "SM clock scale: 1200..1410 MHz"] * 2


def test_report_timelines_share_one_scale(run):
    out, _ = run
    assert [clock_scale(out / f"timeline-{which}.png")
            for which in ("max-throughput", "min-energy")] == [
        "SM clock scale: 1200..1410 MHz"] * 2


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
