"""GEMM tiles by shape (gemm.py): the tile choice, its efficiency, and what the emulator's
GEMM time does with shape and SMs."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.backends.emulator.gemm import (
    LARGE_SMEM_TILES,
    SM86_TILES,
    GemmModel,
    k_efficiency,
    tile_catalog,
)
from kareus.backends.emulator.params import default_params
from kareus.backends.emulator.physics import GPUPhysics
from kareus.job.hardware import get_gpu
from kareus.workload.layer import gemm


def physics(gpu: str = "A100-40GB", **overrides) -> GPUPhysics:
    spec = get_gpu(gpu)
    return GPUPhysics(spec, replace(default_params(spec), **overrides))


A100 = physics()
H100 = physics("H100-SXM")


def tile(ph: GPUPhysics, shape, sms: int) -> str:
    return ph.gemm.choice(shape, sms).tile.name


def seconds(ph: GPUPhysics, shape, sms: int, f_mhz: float | None = None) -> float:
    return ph.compute_time(gemm("g", *shape), f_mhz or ph.f_max, sms)


def test_skinny_and_square_gemms_pick_different_tiles():
    square = tile(A100, (8192, 8192, 8192), 108)
    qkv = tile(A100, (16384, 640, 3072), 108)  # N = 640: a 256-wide tile pads it to 768
    small = tile(A100, (2048, 640, 3072), 108)  # 40 large tiles would leave 68 SMs idle
    assert square == "128x256"
    assert qkv == "256x128"  # 640 = 5 x 128, no padding
    assert small not in (square, qkv)


def test_skinny_gemm_beats_the_one_large_tile_model():
    """The QKV GEMM of a TP8 Llama 3.2 3B layer: with the single 128x256 tile it padded N to
    768 and lost a wave (~220 TFLOP/s); its best tile recovers most of that."""
    op = gemm("qkv", 32768, 640, 3072)
    tflops = op.flops / A100.compute_time(op, 1410, 108) / 1e12
    assert tflops > 270


def test_choice_follows_the_available_sms_where_quantisation_pays():
    one_wave = (12 * 128, 11 * 256, 8192)  # exactly 132 tiles of 128x256 on an H100
    assert tile(H100, one_wave, 132) == "128x256"
    assert tile(H100, one_wave, 108) != "128x256"  # 132 large tiles would run two waves
    large_on_108 = 2 * 2 * 128 * 256 * 8192 / (H100.gemm.eff_max * k_efficiency(8192, 128))
    assert H100.gemm.choice(one_wave, 108).work_flop < large_on_108


def test_plain_cublas_keeps_the_whole_gpu_tile():
    """gemm_tile_plan_sms = N: the heuristic plans for the whole GPU whatever a collective
    holds, so the one-wave GEMM runs two waves on 108 SMs (the published ~2x, anchors §3)."""
    plain = physics("H100-SXM", gemm_tile_plan_sms=132)
    one_wave = (12 * 128, 11 * 256, 8192)
    c = plain.gemm.choice(one_wave, 108)
    assert (c.tile.name, c.waves) == ("128x256", 2)
    assert seconds(plain, one_wave, 108) == pytest.approx(2 * seconds(plain, one_wave, 132))
    assert seconds(H100, one_wave, 108) < seconds(plain, one_wave, 108)


def test_efficiency_grows_with_k():
    effs = [A100.gemm.choice((8192, 8192, k), 108).efficiency for k in (64, 256, 1024, 8192)]
    assert effs == sorted(effs) and len(set(effs)) == 4
    rates = [2 * 8192 * 8192 * k / seconds(A100, (8192, 8192, k), 108)
             for k in (64, 256, 1024, 8192)]
    assert rates == sorted(rates)
    assert effs[-1] < A100.gemm.eff_max


def test_smaller_tiles_are_less_efficient():
    for catalog in (LARGE_SMEM_TILES, SM86_TILES):
        by_area = sorted(catalog, key=lambda t: -t.m * t.n)
        reuse = [t.reuse for t in by_area]
        assert reuse == sorted(reuse, reverse=True)
        assert max(reuse) == 1.0


def test_a40_has_no_256_wide_tiles():
    assert tile_catalog(get_gpu("A40")) == SM86_TILES
    assert all(max(t.m, t.n) <= 128 for t in SM86_TILES)
    assert tile(physics("A40"), (8192, 8192, 8192), 84) == "128x128"


def test_padded_shape_is_never_slower_than_the_padded_out_one():
    for n in (640, 641, 700, 767):
        assert seconds(A100, (16384, n, 3072), 108) <= seconds(A100, (16384, 768, 3072), 108)


def test_tensor_busy_and_cache():
    plan = A100.gemm.plan(((8192, 8192, 8192),), 108)
    assert plan is A100.gemm.plan(((8192, 8192, 8192),), 108)
    assert plan.tensor_busy == pytest.approx(k_efficiency(8192, A100.gemm.k0))
    short = A100.gemm.plan(((8192, 8192, 256),), 108)
    assert short.tensor_busy < plan.tensor_busy <= 1.0
    with pytest.raises(ValueError):
        A100.gemm.choice((128, 128, 128), 0)
    with pytest.raises(ValueError):
        GemmModel((), 0.9, 128)


dims = st.integers(min_value=1, max_value=20000)
ks = st.integers(min_value=1, max_value=30000)
gpus = st.sampled_from([A100, H100, physics("A40"), physics("H100-SXM", gemm_tile_plan_sms=132)])


@settings(max_examples=300, deadline=None)
@given(gpus, dims, dims, ks, st.integers(1, 132), st.integers(1, 132),
       st.sampled_from([900, 1200, 1410]))
def test_time_is_monotone_non_increasing_in_sms(ph, m, n, k, s1, s2, f):
    lo, hi = sorted((min(s1, ph.n_sm), min(s2, ph.n_sm)))
    assert seconds(ph, (m, n, k), hi, f) <= seconds(ph, (m, n, k), lo, f) * (1 + 1e-12)


@settings(max_examples=300, deadline=None)
@given(gpus, dims, dims, ks, st.integers(0, 3000), st.integers(1, 132))
def test_a_larger_gemm_is_never_faster(ph, m, n, k, extra, sms):
    """Padding never makes a GEMM faster than a larger one: time is monotone in m, n, k.
    A heuristic planning for other SMs than the GEMM gets (plain cuBLAS beside a
    collective) can pick a tile that is worse there, so it is checked on the SMs it plans
    for."""
    sms = ph.gemm.plan_sms or min(sms, ph.n_sm)
    t = seconds(ph, (m, n, k), sms)
    for bigger in ((m + extra, n, k), (m, n + extra, k), (m, n, k + extra)):
        assert t <= seconds(ph, bigger, sms) * (1 + 1e-12)


@settings(max_examples=300, deadline=None)
@given(gpus, dims, dims, ks, st.integers(1, 132))
def test_throughput_never_exceeds_the_best_tile(ph, m, n, k, sms):
    sms = min(sms, ph.n_sm)
    rate = 2.0 * m * n * k / seconds(ph, (m, n, k), sms)
    peak = ph.gpu.flop_per_clock_per_sm * ph.f_max * 1e6 * sms
    assert rate <= peak * ph.gemm.eff_max * k_efficiency(k, ph.gemm.k0) * (1 + 1e-9)
