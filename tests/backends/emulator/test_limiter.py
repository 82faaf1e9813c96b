"""The board power limiter has memory: it acts on power averaged over tau, in clock-table
steps, on compute and communication together."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.limiter import LimiterState, PowerLimiter
from kareus.job.sources import build_job
from kareus.workload.ops import Collective, ComputeOp

JOB = build_job("kareus-1")


def gemm(n: int, k: int = 8192) -> ComputeOp:
    return ComputeOp(f"gemm_{n}", "gemm", 2.0 * 8192 * n * k, 2.0 * (8192 * k + k * n),
                     "linear", gemm_shapes=((8192, n, k),))


def backend(tau_s: float = 0.01) -> EmulatorBackend:
    b = EmulatorBackend(JOB)
    b.physics.p = replace(b.physics.p, limiter_tau_s=tau_s)
    b.timeline.__init__(b.physics, b.static_power_w, b.gpu.tdp_w,  # type: ignore[misc]
                        b.timeline.internode_groups)
    return b


def test_a_burst_shorter_than_tau_is_not_throttled():
    b = backend(0.01)
    burst = (gemm(2048, 2048),)  # well under a millisecond
    r = b.timeline.run(burst, 1410)  # from an idle GPU
    assert r.time_s < 0.01 / 5
    assert r.energy_j / r.time_s > b.gpu.tdp_w  # above the limit while it lasts
    assert r.freq_time_mhz_s / r.time_s == pytest.approx(1410)  # and never throttled


def test_a_sustained_gemm_is_throttled_to_the_limit():
    b = backend(0.01)
    m = b.predict_ops((gemm(8192),), 1410)  # repeated for a window: steady state
    assert m.effective_freq_mhz < 1410 - 50
    assert m.avg_power_w == pytest.approx(b.gpu.tdp_w, rel=0.03)


def test_the_memoryless_limiter_is_tau_zero():
    b0 = backend(0.0)
    assert b0.timeline.limiter is None
    r = b0.timeline.run((gemm(2048, 2048),), 1410)
    assert r.energy_j / r.time_s <= b0.gpu.tdp_w + 1e-6  # throttled at once


def test_a_long_run_from_idle_is_throttled_within_it():
    b = backend(0.001)
    ops = (gemm(8192),) * 20  # ~50 ms of GEMM, fifty time constants
    r = b.timeline.run(ops, 1410)
    assert r.freq_time_mhz_s / r.time_s < 1380


def test_state_carries_over_and_rest_gives_clock_back():
    b = backend(0.01)
    tl = b.timeline
    st = tl.idle_state()
    for _ in range(40):
        tl.run((gemm(8192),), 1410, state=st)
    assert st.cap_mhz < 1410 and st.avg_power_w > 0.9 * b.gpu.tdp_w
    tl.rest(st, 0.2, 1410)  # 20 time constants idle
    assert st.cap_mhz == 1410
    assert st.avg_power_w == pytest.approx(b.static_power_w, rel=0.01)


def test_communication_shares_the_limit():
    """The limit holds for the board: a GEMM with a collective beside it (shorter than the
    GEMM) is held at the limit as a pair, at no higher clock than the GEMM alone."""
    b = backend(0.01)
    coll = Collective("ar", "all_reduce", "tp", 8, 32 * 2**20)
    alone = b.timeline.steady((gemm(8192),), 1410)
    paired = b.timeline.steady((gemm(8192),), 1410, side=coll, side_sms=8, launch_index=0)
    assert paired.overlap_s > 0
    assert paired.energy_j / paired.time_s == pytest.approx(b.gpu.tdp_w, rel=0.03)
    assert alone.energy_j / alone.time_s == pytest.approx(b.gpu.tdp_w, rel=0.03)


def test_steady_clock_costs_less_energy_than_dithering_to_the_same_power():
    """The Kareus paper's Theorem 1 in the emulator: set the clock the limiter settles at
    and the same work takes no more time and less energy than leaving it to dither."""
    b = backend(0.01)
    ops = (gemm(8192),)
    dithering = b.timeline.steady(ops, 1410)
    settled = int(max(f for f in b.gpu.clock_table_mhz
                      if f <= dithering.freq_time_mhz_s / dithering.time_s))
    steady = b.timeline.steady(ops, settled)
    assert steady.energy_j <= dithering.energy_j


@settings(max_examples=40, deadline=None)
@given(power=st.floats(50, 800), dt=st.floats(1e-5, 0.02), avg=st.floats(50, 800))
def test_the_average_moves_toward_the_power_and_the_clock_by_one_step(power, dt, avg):
    table = [float(f) for f in range(210, 1411, 15)]
    lim = PowerLimiter(400.0, 0.01, table)
    s = LimiterState(avg, 1200.0)
    lim.advance(s, power, min(dt, lim.tick_s), 1410)
    assert min(power, avg) - 1e-9 <= s.avg_power_w <= max(power, avg) + 1e-9
    assert abs(s.cap_mhz - 1200.0) in (0.0, 15.0)
