"""`power_figure` (issue 26): a plan's cluster power over one iteration as a PNG, with and
without a cap; the per-rank traces it stacks add up to the plan; nothing is left behind
when it cannot draw."""

import dataclasses

import matplotlib.image as mpimg
import numpy as np
import pytest
from PIL import Image

from kareus.errors import KareusError, SpecError
from kareus.plans.plan import PlanPower, TimelineEntry
from kareus.plans.power import trace_of
from kareus.results.power_figure import power_figure, rank_colors, rank_traces
from kareus.results.resultdir import ResultDir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plans(small_result):
    """The fastest and the least-energy kareus plan of one fast optimize."""
    rd = ResultDir(small_result)
    front = sorted(rd.frontier("kareus"), key=lambda p: p["time_s"])
    return [rd.read_plan(front[0]["plan"])[0], rd.read_plan(front[-1]["plan"])[0]]


def description(png) -> str:
    with Image.open(png) as img:
        return img.text.get("Description", "")


def pure_red(png) -> int:
    """Pixels of the cap's colour (matplotlib's "red"; tab10 has no such red)."""
    rgb = mpimg.imread(png)[..., :3]
    return int(((rgb[..., 0] > 0.9) & (rgb[..., 1] < 0.1) & (rgb[..., 2] < 0.1)).sum())


@pytest.mark.parametrize("which", [0, 1], ids=["fastest", "least-energy"])
def test_writes_a_png_without_and_with_a_cap(plans, tmp_path, which):
    plan = plans[which]
    assert plan.power is not None
    plain, capped = tmp_path / "power.png", tmp_path / "capped.png"
    power_figure(plan, plain, "kareus-1")
    cap_w = plan.power.peak_w * 1.1
    power_figure(plan, capped, "kareus-1", window_s=1.0, cap_w=cap_w)
    for png in (plain, capped):
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
        with Image.open(png) as img:
            assert img.size[0] > 600 and img.size[1] > 300
    # the peak stated is the one the plan recorded (1 s window); the cap when given
    assert f"peak over 1 s: {plan.power.peak_w / 1e3:.3f} kW" in description(plain)
    assert description(plain).endswith("cap: none")
    assert description(capped).endswith(f"cap: {cap_w / 1e3:.3f} kW")
    assert pure_red(plain) == 0 < pure_red(capped)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capped.png", "power.png"]


def test_overwrites_atomically_and_draws_another_window(plans, tmp_path):
    png = tmp_path / "p.png"
    png.write_bytes(b"old")
    power_figure(plans[0], png, "t", window_s=0.25)
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "peak over 0.25 s" in description(png)
    assert [p.name for p in tmp_path.iterdir()] == ["p.png"]


def test_the_ranks_add_up_to_the_plan(plans):
    for plan in plans:
        ranks = rank_traces(plan)
        assert len(ranks) == plan.power.pp
        assert sum(r.energy_j for r in ranks) == pytest.approx(plan.energy_j, rel=1e-9)
        # every rank draws at least its GPUs' static power, all the time
        floor = plan.power.gpus_per_rank * plan.power.static_power_w
        assert all(r.watts.min() >= floor * (1 - 1e-12) for r in ranks)
        # at any moment, the ranks' power is the cluster's: the bars of a rank by hand
        t = np.linspace(0.0, plan.time_s, 997, endpoint=False)
        total = sum(r.at(t) for r in ranks)
        by_hand = np.full_like(t, plan.power.pp * floor)
        for e in plan.timeline:
            if e.time_s > 0:
                on = (t >= e.start_s) & (t < e.start_s + e.time_s)
                by_hand += on * plan.power.gpus_per_rank * e.dynamic_energy_j / e.time_s
        assert np.allclose(total, by_hand, rtol=1e-9)


def test_the_dashed_line_peaks_at_the_recorded_peak(plans):
    """The moving average drawn, on a fine grid, reaches the peak the plan recorded (up to
    the grid) and never exceeds it."""
    for plan in plans:
        trace = trace_of(plan.timeline, plan.time_s, plan.power)
        t = np.linspace(0.0, plan.time_s, 20001)
        avg = trace.moving_average_w(t, 1.0)
        spread = trace.max_w - float(trace.watts.min())
        assert avg.max() <= plan.power.peak_w * (1 + 1e-9)
        assert avg.max() >= plan.power.peak_w - spread * plan.time_s / 20000
        # over a whole iteration: the mean, everywhere
        assert np.allclose(trace.moving_average_w(t, plan.time_s), plan.power.mean_w,
                           rtol=1e-9)


def test_a_plan_without_power_or_a_bad_window_writes_nothing(plans, tmp_path):
    old = dataclasses.replace(plans[0], power=None)
    with pytest.raises(KareusError, match="power"):
        power_figure(old, tmp_path / "old.png", "t")
    for window in (0.0, -1.0):
        with pytest.raises(SpecError, match="window"):
            power_figure(plans[0], tmp_path / "bad.png", "t", window_s=window)
    assert list(tmp_path.iterdir()) == []


def test_virtual_stages_draw_on_their_rank(plans, tmp_path):
    """Interleaved 1F1B: virtual stage s runs on rank s % pp. pp = 2, 2 GPUs per rank,
    static 50 W: rank 0 holds stages 0 and 2 (0..1 s at 100 J, 2..4 s at 400 J: 100 W and
    200 W per GPU), rank 1 stages 1 and 3 (1..2 s at 300 J: 300 W)."""
    bars = [TimelineEntry(0, 0, "forward", 0.0, 1.0, 1410, True, 100.0),
            TimelineEntry(1, 0, "forward", 1.0, 1.0, 1410, True, 300.0),
            TimelineEntry(2, 0, "forward", 2.0, 2.0, 1410, True, 400.0),
            TimelineEntry(3, 0, "backward", 1.0, 0.0, 1410, True, 0.0)]
    plan = dataclasses.replace(plans[0], time_s=4.0, energy_j=2400.0, timeline=bars,
                               power=PlanPower(600.0, 800.0, 1.0, 2, 2, 50.0))
    r0, r1 = rank_traces(plan)
    t = np.array([0.5, 1.5, 2.5, 3.5])
    # rank 0: 2 * (50 + 100), 2 * 50, 2 * (50 + 200), same; rank 1: 100, 2 * (50 + 300), ...
    assert r0.at(t).tolist() == pytest.approx([300.0, 100.0, 500.0, 500.0])
    assert r1.at(t).tolist() == pytest.approx([100.0, 700.0, 100.0, 100.0])
    # static 2 ranks * 2 GPUs * 50 W * 4 s = 800 J, dynamic 2 * (100 + 300 + 400) = 1600 J;
    # (rank 0: 400 + 2 * 500 J, rank 1: 400 + 2 * 300 J); the cluster: 400 W, 800 W,
    # 600 W, 600 W: its 1 s peak is 800 W
    assert (r0.energy_j, r1.energy_j) == pytest.approx((1400.0, 1000.0))
    png = tmp_path / "vp.png"
    power_figure(plan, png, "interleaved", window_s=1.0, cap_w=800.0)
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert description(png) == "peak over 1 s: 0.800 kW; cap: 0.800 kW"


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_rank_fills_are_none_of_the_timelines_other_colours(n):
    """Issue 34: the timeline's caption names orange for the DP sync, and the power panel
    below it filled stage 1 with the same orange; the cap line is red."""
    from matplotlib.colors import to_rgb

    from kareus.results.timeline import ITERATION_END_COLOR

    others = [np.array(to_rgb(c)) for c in (ITERATION_END_COLOR, "red")]
    fills = rank_colors(n)
    assert len(fills) == n
    for fill in fills:
        assert min(np.abs(np.array(fill[:3]) - o).sum() for o in others) > 0.5
