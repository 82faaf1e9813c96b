"""Megatron-LM at its own micro-batch size (issue 23): an iteration of MBS 1 simulates,
and matches MBS 2 with the same tokens per iteration (twice the microbatches)."""

import math

import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.iteration import IterationResult, IterationSimulator
from kareus.job.sources import build_job
from kareus.plans.methods import baseline_plan
from kareus.workload.workload import Workload
from tests.workload.test_unsplit import sequential_microbatch_flops

PP1_MBS1 = dict(model="llama3.1-8b", gpu="H100-SXM", nodes=1, gpus_per_node=8, tp=1, pp=1,
                cp=2, dp=4, micro_batch_size=1, seq_length=8192, num_microbatches=32,
                recompute=False)


def _megatron(preset: str, **overrides) -> tuple[Workload, IterationResult]:
    wl = Workload.build(build_job(preset, overrides=overrides))
    sim = IterationSimulator(wl.partitions, EmulatorBackend(wl.job))
    return wl, sim.run(baseline_plan("megatron", wl.job))


def _finite(r: IterationResult) -> None:
    for x in (r.time_s, r.energy_j, r.static_energy_j, r.dynamic_energy_j):
        assert math.isfinite(x) and x > 0
    assert r.energy_j == pytest.approx(r.static_energy_j + r.dynamic_energy_j)
    assert all(0 < s.busy_s <= r.time_s + 1e-9 for s in r.stages)


def test_megatron_at_mbs_1_matches_mbs_2_with_twice_the_microbatches():
    # at the default training settings: an unfused gradient accumulation (kareus-1's) runs
    # once per microbatch, so twice the microbatches would do more work
    one_wl, one = _megatron("kareus-1", micro_batch_size=1, num_microbatches=8, training={})
    two_wl, two = _megatron("kareus-1", micro_batch_size=2, num_microbatches=4, training={})
    _finite(one)
    _finite(two)
    # the same work per iteration, counted from the sequential steps each one runs
    for stage in range(2):
        assert 8 * sequential_microbatch_flops(one_wl.partitions, stage) == pytest.approx(
            4 * sequential_microbatch_flops(two_wl.partitions, stage), rel=1e-9)
    # ... so comparable time and energy: smaller kernels are a little less efficient,
    # more microbatches fill the pipeline better
    assert one.time_s == pytest.approx(two.time_s, rel=0.15)
    assert one.energy_j == pytest.approx(two.energy_j, rel=0.15)


def test_megatron_at_mbs_1_without_pipeline_parallelism():
    wl, r = _megatron("llama3.1-8b", **PP1_MBS1)
    assert wl.job.pp == 1 and wl.partitions.partitions == {}
    _finite(r)
    assert len(r.stages) == 1 and r.num_gpus == 8
    # every instruction back to back on the one stage: no pipeline bubble
    assert r.stages[0].busy_s == pytest.approx(r.time_s, rel=1e-6)
