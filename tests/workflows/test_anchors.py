"""kareus-1's like-for-like rows (kareus.workflows.anchors): the reference is the Kareus
artifact's Perseus fastest plan, so the rows are the emulator's own Perseus fastest plan,
composed as `kareus optimize` composes it, not Megatron-LM's plan at max clock."""

import json

import pytest

from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.workflows.anchors import (
    fastest_plan,
    kareus_1_anchor,
    megatron_max_clock,
    perseus_fastest,
)

ENERGY = "kareus-1 Perseus fastest plan, instruction windows' energy (one GPU per stage)"
TIME = "kareus-1 Perseus fastest plan, critical path of instruction windows (free edges)"
POWER = "kareus-1 Perseus fastest plan, mean power per GPU over the critical path"


@pytest.fixture(scope="module")
def k1():
    job = build_job("kareus-1")
    return job, perseus_fastest(job), megatron_max_clock(job)


def test_perseus_fastest_keeps_megatrons_path_and_spends_less_off_it(k1):
    """Perseus's fastest plan is the shortest time with the instructions off the critical
    path at lower clocks: the same path as Megatron-LM at max clock, within lowtime's 1 ms
    per window, every instruction on it at max clock, some off it lower, less energy."""
    job, p, m = k1
    f_max = job.gpu_spec.max_freq_mhz
    assert abs(p.path.time_s - m.path.time_s) <= 1e-3
    assert p.path.exact_time_s == pytest.approx(m.path.exact_time_s, abs=1e-3)
    clocks = {iid: p.plan.freq(*iid) for iid in p.path.path}
    assert set(clocks.values()) == {f_max}
    lowered = {iid: f for iid, f in p.plan.instruction_freqs.items() if f < f_max}
    assert lowered and not set(lowered) & set(p.path.path)
    assert all(f <= f_max for f in p.plan.instruction_freqs.values())
    assert p.path.energy_j < m.path.energy_j
    assert p.path.mean_power_per_gpu_w < m.path.mean_power_per_gpu_w
    # the windows' energy drops by what the lowered instructions saved, and only them
    def windows(sim):
        return {(i["stage"], i["microbatch"], i["direction"]): i["dynamic_energy_j"]
                for s in sim.result.stages for i in s.instructions}
    wp, wm = windows(p), windows(m)
    assert all(wp[k] == pytest.approx(wm[k], rel=1e-9) for k in wp if k not in lowered)
    assert all(wp[k] < wm[k] for k in lowered)


def test_calibrate_rows_are_perseus_fastest_and_megatron_beside_it(k1):
    _job, p, m = k1
    rows = {a.name: a for a in kareus_1_anchor()}
    assert (rows[TIME].emulated, rows[ENERGY].emulated, rows[POWER].emulated) == (
        p.path.time_s, p.path.energy_j, p.path.mean_power_per_gpu_w)
    assert (rows[TIME].published, rows[ENERGY].published, rows[POWER].published) == (
        5.113, 2814.0, 275.0)
    beside = rows["kareus-1 Megatron at max clock, instruction windows' energy "
                  "(one GPU per stage)"]
    assert beside.published is None and beside.emulated == m.path.energy_j
    wall = rows["kareus-1 Megatron wall-clock iteration time at max clock"]
    assert wall.published is None and wall.emulated == m.result.time_s


def test_fastest_plan_takes_the_calibration(tmp_path, k1):
    """The composition and the simulation both run on the calibrated emulator (the v4
    attribution benchmark's steps depend on it)."""
    job, p, _m = k1
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"gpu": job.gpu, "emulator_params": {
        "sm_dynamic_power_w": 300.0}}))
    cooler = perseus_fastest(job, str(cal))
    assert cooler.path.energy_j < p.path.energy_j
    other = tmp_path / "other.json"  # fitted for another GPU: not applied
    other.write_text(json.dumps({"gpu": "H100-SXM", "emulator_params": {
        "sm_dynamic_power_w": 300.0}}))
    assert perseus_fastest(job, str(other)).path.energy_j == p.path.energy_j


def test_a_method_that_needs_a_search_is_refused():
    with pytest.raises(SpecError, match="needs a search"):
        fastest_plan(build_job("kareus-1"), "kareus")
