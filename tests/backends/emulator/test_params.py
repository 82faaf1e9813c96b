"""Calibration files and the attention scale."""

import json
from dataclasses import replace

import pytest

from kareus.backends.emulator.params import default_params, load_params
from kareus.backends.emulator.physics import GPUPhysics
from kareus.errors import SpecError
from kareus.job.hardware import get_gpu
from kareus.workload.ops import ComputeOp

A100 = get_gpu("A100-40GB")


def _attn(keys: int = 4096, causal: bool = False) -> ComputeOp:
    return ComputeOp("core_attn", "attention", 1e12, 1e8, "attn", attn_keys=keys,
                     attn_causal=causal)


def test_a_calibration_file_from_before_v3_loads_as_an_attention_scale(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"gpu": "A100-40GB", "emulator_params": {
        "attention_efficiency": 0.31, "attention_bwd_efficiency": 0.25,
        "gemm_efficiency": 0.5}}))
    params = load_params(A100, path)
    assert params.attention_efficiency_scale == pytest.approx(0.5)  # 0.31 / v2's 0.62
    assert params.gemm_efficiency == 0.5
    path.write_text(json.dumps({"gpu": "A100-40GB", "emulator_params": {"nope": 1}}))
    with pytest.raises(SpecError, match="unknown parameter 'nope'"):
        load_params(A100, path)


def test_attention_scale_multiplies_the_efficiency_and_gemm_efficiency_does_not_move_it():
    base = GPUPhysics(A100, default_params(A100)).attention_efficiency(_attn())
    for scale in (0.8, 1.05):
        p = replace(default_params(A100), attention_efficiency_scale=scale)
        assert GPUPhysics(A100, p).attention_efficiency(_attn()) == pytest.approx(
            min(0.95, base * scale))
    slower_gemm = replace(default_params(A100), gemm_efficiency=0.8)
    assert GPUPhysics(A100, slower_gemm).attention_efficiency(_attn()) == pytest.approx(base)


def test_attention_runs_nearer_its_peak_on_longer_rows_and_without_a_mask():
    ph = GPUPhysics(A100, default_params(A100))
    effs = [ph.attention_efficiency(_attn(k, True)) for k in (512, 1024, 4096, 16384)]
    assert effs == sorted(effs)
    assert ph.attention_efficiency(_attn(4096, True)) < ph.attention_efficiency(_attn(4096))


def test_an_attention_op_must_say_how_many_keys_its_rows_see():
    with pytest.raises(ValueError, match="attn_keys"):
        ComputeOp("core_attn", "attention", 1e12, 1e8, "attn")


def test_a_gpu_without_published_runs_takes_the_a100s_efficiency():
    a40 = get_gpu("A40")
    a100 = GPUPhysics(A100, default_params(A100)).attention_efficiency(_attn())
    assert GPUPhysics(a40, default_params(a40)).attention_efficiency(_attn()) == (
        pytest.approx(a100))
