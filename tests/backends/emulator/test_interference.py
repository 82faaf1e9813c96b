"""Interference beyond SM loss: a concurrent collective's HBM traffic stalls a compute
kernel's loads (docs/emulator.md, "Interference beyond SM loss")."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.backends.emulator.anchors import overlap_anchor
from kareus.backends.emulator.params import default_params
from kareus.backends.emulator.physics import GPUPhysics
from kareus.backends.emulator.timeline import Timeline
from kareus.job.hardware import get_gpu
from kareus.workload.layer import gemm
from kareus.workload.ops import Collective

MiB = 2**20
H200 = get_gpu("H200")
GEMM = gemm("gemm_8192x3072x3072", 8192, 3072, 3072)
F = 1200.0  # low enough that no interval below exceeds the power limit
SMS = 24


def _timeline(**overrides) -> Timeline:
    ph = GPUPhysics(H200, replace(default_params(H200), **overrides))
    return Timeline(ph, H200.static_power_w, H200.tdp_w)


def _gemm_time(tl: Timeline, side) -> float:
    """The GEMM's duration in one interval beside ``side`` (with ``SMS`` SMs taken)."""
    d_main, _, _, _ = tl._evaluate(("op", GEMM), side, F, SMS, 32)
    return d_main


def test_no_slowdown_without_traffic():
    tl = _timeline()
    assert tl.ph.contention_slowdown(0.0) == 1.0
    assert _timeline(interference_coefficient=0.0).ph.contention_slowdown(1e12) == 1.0
    # a latency phase holds SMs but moves nothing: only the SM loss
    lat = _gemm_time(tl, ("lat", 20e-6))
    assert lat == pytest.approx(_gemm_time(_timeline(interference_coefficient=0.0),
                                           ("lat", 20e-6)))
    # and no collective at all: the GEMM on every SM, no slowdown
    alone = tl._evaluate(("op", GEMM), None, F, SMS, 32)[0]
    assert alone == pytest.approx(
        _timeline(interference_coefficient=0.0)._evaluate(("op", GEMM), None, F, SMS, 32)[0])


def test_slowdown_grows_with_the_collectives_traffic():
    tl, off = _timeline(), _timeline(interference_coefficient=0.0)
    ag = Collective("ag", "all_gather", "tp", 8, float(256 * MiB))  # 2 HBM bytes / bus byte
    ar = Collective("ar", "all_reduce", "tp", 8, float(256 * MiB))  # 3, same bus bandwidth
    lat = _gemm_time(tl, ("lat", 20e-6))
    t_ag, t_ar = _gemm_time(tl, ("xfer", ag)), _gemm_time(tl, ("xfer", ar))
    assert lat < t_ag < t_ar
    # without the coefficient both are the SM loss only
    assert _gemm_time(off, ("xfer", ag)) == pytest.approx(lat)
    assert _gemm_time(off, ("xfer", ar)) == pytest.approx(lat)
    # the stretch is the slowdown of the collective's traffic (the GEMM is compute-bound);
    # the GEMM's fixed ramp time is not stretched
    traffic = tl.ph.coll_hbm_demand(ar, F, SMS, False)
    fixed = tl.ph.p.gemm_fixed_s
    assert (t_ar - fixed) / (lat - fixed) == pytest.approx(
        tl.ph.contention_slowdown(traffic))
    # the same collective across nodes: a slower link, less traffic, a smaller stall
    tl_inter = _timeline()
    tl_inter.internode_groups = frozenset({"tp"})
    assert _gemm_time(tl_inter, ("xfer", ar)) < t_ar


def test_a_stalled_kernel_draws_less_power_for_the_same_arithmetic_energy():
    ph = _timeline().ph
    slow = 1.3
    r1 = ph.compute_rate(GEMM, F, 108, ph.hbm_bw)
    r2 = ph.compute_rate(GEMM, F, 108, ph.hbm_bw, slow)
    fixed = ph.p.gemm_fixed_s  # the kernel's ramp: not a stall of its loads
    assert r2.duration_s - fixed == pytest.approx(slow * (r1.duration_s - fixed))
    assert r2.sm_power_w < r1.sm_power_w
    # only the stalled SMs' base power is added over the longer time
    base = (ph.p.sm_dynamic_power_w * ph.active_sms(GEMM, 108) / ph.n_sm
            * ph.sm_power_scale(F) * ph.p.sm_base_activity)
    extra = r2.sm_power_w * r2.duration_s - r1.sm_power_w * r1.duration_s
    assert extra == pytest.approx(base * (r2.duration_s - r1.duration_s))


@settings(max_examples=200, deadline=None)
@given(c=st.floats(0.0, 5.0), e=st.floats(0.05, 3.0),
       a=st.floats(0.0, 2e13), b=st.floats(0.0, 2e13))
def test_slowdown_is_at_least_one_and_monotone_in_traffic(c, e, a, b):
    ph = GPUPhysics(H200, replace(default_params(H200), interference_coefficient=c,
                                  interference_exponent=e))
    lo, hi = sorted((a, b))
    s_lo, s_hi = ph.contention_slowdown(lo), ph.contention_slowdown(hi)
    assert 1.0 <= s_lo <= s_hi <= 1.0 + c


def test_hopper_overlap_anchors_within_five_percent():
    for a in overlap_anchor():
        assert abs(a.rel_error) <= 0.05, f"{a.name}: {a.emulated} vs {a.published}"
