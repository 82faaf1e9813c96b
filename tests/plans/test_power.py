"""A plan's cluster power (kareus.plans.power, issue 26): the trace of a hand-worked
timeline, worked out by hand; properties of random timelines against an independent
brute force; bad windows and iteration times; the power of a real result and `kareus plan
--power-cap-kw / --power-cap-w-per-gpu`."""

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus.errors import SpecError
from kareus.plans.plan import DEADLINE_TOLERANCE_S, ENERGY_TOLERANCE_J, TimelineEntry
from kareus.plans.power import PowerTrace, plan_power
from kareus.results.resultdir import ResultDir
from tests.conftest import run_cli


def bar(stage: int, start: float, time: float, energy: float) -> TimelineEntry:
    return TimelineEntry(stage, 0, "forward", start, time, 1410, False, energy)


# A hand-worked timeline ------------------------------------------------------------------
#
# pp = 2 ranks, static 100 W per GPU, iteration T = 4 s. Per GPU of the stage:
#   stage 0: 0..2 s, 400 J -> 200 W dynamic; idle 2..4
#   stage 1: 1..2 s, 300 J -> 300 W; 2..4 s, 200 J -> 100 W
# With g GPUs per rank, static 2 * g * 100 = 200g W always, and the trace (W) is
#   0..1: 200g + 200g          = 400g
#   1..2: 200g + 200g + 300g   = 700g
#   2..4: 200g + 100g          = 300g
# energy 400g + 700g + 600g = 1700g J (= g * (400 + 300 + 200) bar energy + 200g * 4 static),
# mean 1700g / 4 = 425g W, instantaneous max 700g W.
# Moving averages (the trace repeats: 4..5 is 400g, 5..6 700g, ...):
#   0.5 s: a window inside 1..2 s: 700g.   1 s: exactly 1..2 s: 700g.
#   1.5 s: the window's energy grows while its end is in 1..2 s and its start in 0..1 (700g
#          in, 400g out) until the start reaches 0.5, then its end is in 2..4 (300g in, 400g
#          out): start 0.5: 0.5 * 400g + 700g = 900g J, 600g W.
#   2 s: the window [s, s + 2]'s energy has slope P(s + 2) - P(s): for s in 0..1 it is
#        300g - 400g < 0, for s in 3..4 (i.e. -1..0) 700g - 300g > 0: largest at s = 0,
#        400g + 700g = 1100g J, 550g W.
#   4 s: any window is one whole period: the mean, 425g.
#   6 s: one period plus 2 s: (1700g + 1100g) / 6 = 2800g / 6 W.
HAND = [bar(0, 0.0, 2.0, 400.0), bar(1, 1.0, 1.0, 300.0), bar(1, 2.0, 2.0, 200.0)]
HAND_PEAKS = {0.5: 700.0, 1.0: 700.0, 1.5: 600.0, 2.0: 550.0, 4.0: 425.0, 6.0: 2800.0 / 6}


@pytest.fixture(params=[1, 4], ids=["1-gpu", "4-gpus"])
def hand(request):
    g = request.param
    return g, PowerTrace.of(HAND, 4.0, pp=2, gpus_per_rank=g, static_power_w=100.0)


def test_hand_worked_trace(hand):
    g, trace = hand
    assert trace.period_s == 4.0
    assert trace.energy_j == pytest.approx(1700.0 * g, rel=1e-12)
    assert trace.mean_w == pytest.approx(425.0 * g, rel=1e-12)
    assert trace.max_w == pytest.approx(700.0 * g, rel=1e-12)
    # on a half-second grid: 0, 0.5 -> 400g; 1, 1.5 -> 700g; 2 .. 3.5 -> 300g
    t, w = trace.sample(8)
    assert t.tolist() == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5], abs=1e-12)
    assert w.tolist() == pytest.approx([g * x for x in (400, 400, 700, 700, 300, 300, 300,
                                                        300)], rel=1e-12)


@pytest.mark.parametrize("window_s", sorted(HAND_PEAKS))
def test_hand_worked_moving_average_peaks(hand, window_s):
    g, trace = hand
    assert trace.peak_w(window_s) == pytest.approx(HAND_PEAKS[window_s] * g, rel=1e-12)


def test_hand_worked_plan_power():
    p = plan_power(HAND, 4.0, pp=2, gpus_per_rank=4, static_power_w=100.0, window_s=1.5)
    assert (p.mean_w, p.peak_w) == pytest.approx((1700.0, 2400.0), rel=1e-12)
    assert (p.window_s, p.pp, p.gpus_per_rank, p.static_power_w) == (1.5, 2, 4, 100.0)


def test_a_virtual_stage_and_a_bar_without_energy_or_time():
    """Stage 2 of pp = 2 runs on rank 0: the cluster's power is the same; a bar of no
    energy or no time adds nothing."""
    moved = [bar(2, 0.0, 2.0, 400.0), *HAND[1:], bar(0, 3.0, 1.0, 0.0),
             bar(1, 3.0, 0.0, 50.0)]
    a = PowerTrace.of(HAND, 4.0, 2, 1, 100.0)
    b = PowerTrace.of(moved, 4.0, 2, 1, 100.0)
    for w in (0.5, 1.5, 6.0):
        assert b.peak_w(w) == pytest.approx(a.peak_w(w), rel=1e-12)
    assert (b.energy_j, b.max_w) == pytest.approx((a.energy_j, a.max_w), rel=1e-12)


# Bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("window_s", [0.0, -1.0, -1e-9, math.nan])
def test_a_window_must_be_positive(window_s):
    trace = PowerTrace.of(HAND, 4.0, 2, 1, 100.0)
    with pytest.raises(SpecError, match="window"):
        trace.peak_w(window_s)
    with pytest.raises(SpecError):
        plan_power(HAND, 4.0, 2, 1, 100.0, window_s=window_s)


@pytest.mark.parametrize("iteration_s", [0.0, -4.0, math.nan])
def test_an_iteration_takes_a_positive_time(iteration_s):
    with pytest.raises(SpecError, match="positive"):
        PowerTrace.of(HAND, iteration_s, 2, 1, 100.0)
    with pytest.raises(SpecError):
        plan_power(HAND, iteration_s, 2, 1, 100.0)


# Random timelines against a brute force --------------------------------------------------

@st.composite
def timelines(draw, grid: int | None = None):
    """(bars, T, pp, gpus per rank, static W); bars within [0, T]. With ``grid`` (a power
    of 2), every bar starts and ends on a multiple of T / grid, exactly (T is a multiple of
    1/8: no rounding puts an edge a hair off the grid)."""
    T = draw(st.integers(2, 160)) / 8 if grid else draw(st.floats(0.2, 20.0))
    pp = draw(st.integers(1, 4))
    gpr = draw(st.integers(1, 8))
    static = draw(st.just(0.0) | st.floats(1.0, 300.0))
    bars = []
    for _ in range(draw(st.integers(0, 12))):
        stage = draw(st.integers(0, 2 * pp - 1))
        if grid:
            a = draw(st.integers(0, grid - 1))
            b = draw(st.integers(a + 1, grid))
            start, time = T * a / grid, T * (b - a) / grid
        else:
            start = T * draw(st.floats(0.0, 0.99))
            time = (T - start) * draw(st.floats(0.01, 1.0))
        bars.append(bar(stage, start, time, draw(st.floats(0.1, 2000.0))))
    return bars, T, pp, gpr, static


def brute_energy(bars, T, pp, gpr, static, t: np.ndarray) -> np.ndarray:
    """Cluster energy from 0 to each of ``t`` (periodic trace), bar by bar."""
    def partial(r):  # within one period
        e = pp * gpr * static * r
        for b in bars:
            e = e + gpr * b.dynamic_energy_j / b.time_s * np.clip(r - b.start_s, 0.0, b.time_s)
        return e

    k = np.floor(t / T)
    # r may round a hair outside [0, T]; partial is continuous there (no jump of a period)
    return k * partial(T) + partial(t - k * T)


def brute_power_range(bars, T, pp, gpr, static) -> tuple[float, float]:
    """(min, max) of the instantaneous power: it changes only where a bar starts or ends,
    so the midpoints between those edges see every value."""
    edges = sorted({0.0, T, *(b.start_s for b in bars),
                    *(min(b.start_s + b.time_s, T) for b in bars)})
    mids = [(x + y) / 2 for x, y in itertools.pairwise(edges) if y > x]
    watts = [pp * gpr * static + sum(gpr * b.dynamic_energy_j / b.time_s for b in bars
                                     if b.start_s <= m < b.start_s + b.time_s) for m in mids]
    return min(watts), max(watts)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(timelines(), st.floats(0.02, 3.5))
def test_random_timelines_against_a_brute_force(tl, window_frac):
    bars, T, pp, gpr, static = tl
    trace = PowerTrace.of(bars, T, pp, gpr, static)
    total = gpr * sum(b.dynamic_energy_j for b in bars) + pp * gpr * static * T
    assert trace.energy_j == pytest.approx(total, rel=1e-9)
    assert trace.mean_w == pytest.approx(total / T, rel=1e-9)
    lo, hi = brute_power_range(bars, T, pp, gpr, static)
    assert trace.max_w == pytest.approx(hi, rel=1e-9)
    scale = 1e-9 * hi + 1e-12

    w = window_frac * T
    peak = trace.peak_w(w)
    assert trace.mean_w - scale <= peak <= trace.max_w + scale
    # the window's mean on a fine grid of starts, exactly: a lower bound of the peak, and
    # short of it by at most (hi - lo) * step / w (the mean moves that fast at most)
    starts = np.linspace(0.0, T, 4001)
    step = T / 4000
    means = (brute_energy(bars, T, pp, gpr, static, starts + w)
             - brute_energy(bars, T, pp, gpr, static, starts)) / w
    assert means.max() <= peak + scale
    assert peak <= means.max() + (hi - lo) * step / w + scale
    assert peak <= means.max() + 0.03 * (hi - lo) + scale  # "a few percent"

    for k in (1, 2, 3):  # whole periods: every window holds k iterations
        assert trace.peak_w(k * T) == pytest.approx(trace.mean_w, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(timelines(grid=32))
def test_a_short_window_sees_the_instantaneous_peak(tl):
    """Every step of the trace lasts at least T / 32: a window shorter fits in the highest."""
    bars, T, pp, gpr, static = tl
    trace = PowerTrace.of(bars, T, pp, gpr, static)
    _lo, hi = brute_power_range(bars, T, pp, gpr, static)
    for frac in (1e-6, 1e-3, 1 / 33, 1 / 32):
        assert trace.peak_w(frac * T) == pytest.approx(hi, rel=1e-9)


# A real result and `kareus plan` with a power cap ----------------------------------------

@pytest.fixture(scope="module")
def result(small_result):
    return small_result, json.loads((small_result / "result.json").read_text())


@pytest.fixture(scope="module")
def kareus(result):
    """The kareus frontier of result.json, fastest first; each point has its 1 s peak."""
    _out, doc = result
    return sorted(doc["methods"]["kareus"]["frontier"], key=lambda p: (p["time_s"],
                                                                        p["energy_j"]))


def test_every_plan_records_its_power(result):
    _out, doc = result
    points = [p for m in doc["methods"].values() for p in m["frontier"]]
    assert len(points) > 10
    for p in points:
        assert p["mean_power_w"] * p["time_s"] == pytest.approx(p["energy_j"], rel=1e-9)
        assert p["peak_power_w"] >= p["mean_power_w"]
        assert p["power_window_s"] == 1.0


def test_a_plan_file_power_matches_its_timeline(result, kareus):
    """The plan file's timeline gives the plan's energy: static power on every GPU for the
    iteration plus each bar's dynamic energy on each GPU of its rank."""
    out, doc = result
    job = doc["job"]
    gpus = job["pp"] * job.get("tp", 1) * job.get("dp", 1)
    plan, _job = ResultDir(out).read_plan(kareus[0]["plan"])
    assert plan.power is not None
    assert plan.power.pp * plan.power.gpus_per_rank == gpus
    dyn = sum(e.dynamic_energy_j for e in plan.timeline) * plan.power.gpus_per_rank
    static = gpus * plan.power.static_power_w * plan.time_s
    assert dyn + static == pytest.approx(plan.energy_j, rel=1e-9)


def _gpus(doc) -> int:
    job = doc["job"]
    return int(job["pp"] * job.get("tp", 1) * job.get("dp", 1))


def _pick(out, *args):
    r = run_cli("plan", "--result", str(out), *args, "--json")
    assert r.code == 0, r.err
    return r.json()["id"]


def _one_line_error(r):
    assert r.code == 2, (r.code, r.out, r.err)
    assert len(r.err.strip().splitlines()) == 1, r.err
    assert "Traceback" not in r.err + r.out
    return r.err


def _fastest(points):
    return min(points, key=lambda p: (p["time_s"], p["energy_j"]))["plan"]


def test_a_cap_alone_picks_the_fastest_plan_under_it(result, kareus):
    out, doc = result
    peaks = sorted({p["peak_power_w"] for p in kareus})
    assert len(peaks) >= 3  # the cap must leave out plans
    for cap_w in (peaks[0] + 1.0, (peaks[1] + peaks[2]) / 2, peaks[-1] + 1.0):
        want = _fastest([p for p in kareus if p["peak_power_w"] <= cap_w])
        assert _pick(out, "--power-cap-kw", str(cap_w / 1e3)) == want
        per_gpu = cap_w / _gpus(doc)
        assert _pick(out, "--power-cap-w-per-gpu", repr(per_gpu)) == want
    # just above the smallest peak: not the fastest plan of all
    assert _pick(out, "--power-cap-kw", str((peaks[0] + 1.0) / 1e3)) != kareus[0]["plan"]


def test_a_cap_under_every_peak_is_one_line_with_the_range(result, kareus):
    out, doc = result
    low = min(p["peak_power_w"] for p in kareus) - 100.0
    for args in (("--power-cap-kw", str(low / 1e3)),
                 ("--power-cap-w-per-gpu", str(low / _gpus(doc)))):
        err = _one_line_error(run_cli("plan", "--result", str(out), *args))
        assert "range" in err


def test_both_cap_options_are_refused(result, kareus):
    out, _doc = result
    high = str(max(p["peak_power_w"] for p in kareus))
    _one_line_error(run_cli("plan", "--result", str(out), "--power-cap-kw", high,
                            "--power-cap-w-per-gpu", "1000"))


@pytest.mark.parametrize("fast, cap", [(3, 0), (12, 5), (14, 14), (8, 8), (2, 10)])
def test_a_cap_with_a_deadline(result, kareus, fast, cap):
    """The least-energy plan under the cap within the deadline (the deadline: plan
    ``fast``'s time; the cap: plan ``cap``'s peak); none: one line."""
    out, _doc = result
    fast, cap = min(fast, len(kareus) - 1), min(cap, len(kareus) - 1)
    deadline, cap_w = kareus[fast]["time_s"], kareus[cap]["peak_power_w"] + 1e-3
    ok = [p for p in kareus if p["peak_power_w"] <= cap_w
          and p["time_s"] <= deadline + DEADLINE_TOLERANCE_S]
    args = ("--power-cap-kw", repr(cap_w / 1e3), "--deadline", repr(deadline))
    if not ok:
        _one_line_error(run_cli("plan", "--result", str(out), *args))
        return
    want = min(ok, key=lambda p: (p["energy_j"], p["time_s"]))["plan"]
    assert _pick(out, *args) == want


def test_a_cap_with_an_energy_budget(result, kareus):
    """The fastest plan under the cap within the budget: here the cap, not the budget,
    leaves out the fastest plans."""
    out, _doc = result
    budget = max(p["energy_j"] for p in kareus)
    cap_w = kareus[len(kareus) // 2]["peak_power_w"] + 1e-3
    ok = [p for p in kareus if p["peak_power_w"] <= cap_w
          and p["energy_j"] <= budget + ENERGY_TOLERANCE_J]
    want = _fastest(ok)
    assert want != kareus[0]["plan"]
    assert _pick(out, "--power-cap-kw", repr(cap_w / 1e3), "--energy-budget",
                 repr(budget)) == want


def test_a_longer_window_lowers_the_peak_the_cap_sees(result, kareus):
    """Over a whole iteration the peak is the mean: a cap between the fastest plan's mean
    and its 1 s peak rules it out at 1 s and keeps it at its iteration's length."""
    out, _doc = result
    fastest = kareus[0]
    cap_kw = repr((fastest["mean_power_w"] + fastest["peak_power_w"]) / 2 / 1e3)
    assert _pick(out, "--power-cap-kw", cap_kw) != fastest["plan"]
    assert _pick(out, "--power-cap-kw", cap_kw, "--power-window-s",
                 repr(fastest["time_s"])) == fastest["plan"]


def test_plan_show_draws_the_power_over_time(result, kareus, tmp_path):
    out, _doc = result
    png = tmp_path / "power.png"
    r = run_cli("plan", "show", "--result", str(out), "--plan", kareus[0]["plan"],
                "--power-png", str(png), "--power-cap-kw", "100", "--json")
    assert r.code == 0, r.err
    assert r.json()["power_png"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = run_cli("plan", "show", "--result", str(out), "--plan", kareus[0]["plan"],
                    "--power-png", str(png))
    assert again.code == 2 and "Traceback" not in again.err  # exists: --force to overwrite
    bad = run_cli("plan", "show", "--result", str(out), "--plan", kareus[0]["plan"],
                  "--power-png", str(tmp_path / "p2.png"), "--power-cap-kw", "-1")
    assert bad.code == 2 and "--power-cap-kw must be positive" in bad.err
    assert not (tmp_path / "p2.png").exists()


def test_plan_show_png_has_the_power_panel_below_the_timeline(result, kareus, tmp_path):
    import matplotlib.image

    from kareus.plans.plan import Plan
    from kareus.results.timeline import timeline_figure

    out, _doc = result
    png = tmp_path / "timeline.png"
    r = run_cli("plan", "show", "--result", str(out), "--plan", kareus[0]["plan"],
                "--png", str(png))
    assert r.code == 0, r.err
    plan = Plan.from_dict(json.loads((out / "plans" / f"{kareus[0]['plan']}.json")
                                     .read_text()))
    alone = tmp_path / "alone.png"
    timeline_figure(plan, alone, "x", pp=2)  # the timeline without the panel
    with_panel = matplotlib.image.imread(png).shape[0]
    assert with_panel > 1.8 * matplotlib.image.imread(alone).shape[0]
