"""`IterationResult.breakdown`: where one GPU's iteration goes, checked against counts and
FLOPs taken from the workload, not from the timeline that tallies it."""

import itertools

import pytest

from kareus.backends.emulator.iteration import IterationSimulator
from kareus.backends.emulator.timeline import KERNEL_CLASSES
from kareus.plans.methods import baseline_plan
from kareus.plans.schedule import one_f_one_b
from kareus.workload.ops import ComputeOp


@pytest.fixture(scope="module", params=["megatron", "nanobatch"])
def simulated(request, k1):
    job, ps, b = k1
    return job, ps, b, IterationSimulator(ps, b).run(baseline_plan(request.param, job),
                                                     with_instructions=True)


def test_parts_add_up_to_the_iteration(simulated):
    job, _, _, r = simulated
    rows = r.breakdown()
    assert len(rows) == job.pp
    gpus_per_stage = job.num_gpus // job.pp
    energy = 0.0
    for row in rows:
        assert set(row) == {*KERNEL_CLASSES, "transfers", "iteration_end", "pipeline_wait"}
        assert sum(v["time_s"] for v in row.values()) == pytest.approx(r.time_s, rel=1e-9)
        assert all(v["time_s"] >= -1e-12 and v["energy_j"] >= -1e-9 for v in row.values())
        energy += gpus_per_stage * sum(v["energy_j"] for v in row.values())
    assert energy == pytest.approx(r.energy_j, rel=1e-9)


def _kernels(ops) -> int:
    # an op fused into its predecessor's kernel (a dropout's mask) launches nothing
    return sum(max(1, len(op.gemm_shapes)) for op in ops
               if isinstance(op, ComputeOp) and not op.fused)


def test_launch_gaps_are_one_per_kernel(k1):
    """Megatron-LM's launch-gap time is the workload's kernel count times the gap."""
    job, ps, b = k1
    r = IterationSimulator(ps, b).run(baseline_plan("megatron", job))
    g = ps.graph
    for stage, row in zip(g.stages, r.breakdown(), strict=True):
        fwd, bwd = _kernels(g.layer_forward), _kernels(g.layer_backward)
        per_mb = stage.num_layers * (fwd * (2 if job.recompute else 1) + bwd) + _kernels(
            (*stage.forward_pre, *stage.forward_post, *stage.backward_pre,
             *stage.backward_post))
        kernels = per_mb * len(one_f_one_b(job.pp, job.num_microbatches, stage.index)) // 2
        assert row["launch_gap"]["time_s"] == pytest.approx(
            kernels * b.params.launch_overhead_s, rel=1e-6)


def test_compute_classes_cannot_beat_the_peak(k1):
    """GEMM and attention time at least their FLOPs at the GPU's peak at max clock."""
    job, ps, b = k1
    r = IterationSimulator(ps, b).run(baseline_plan("megatron", job))
    g = ps.graph
    peak = job.gpu_spec.peak_bf16_flops
    nanobatches = job.micro_batch_size // job.nanobatch_size  # layer ops are per nanobatch

    def flops_of(ops, kind: str) -> float:
        return sum(op.flops for op in ops if isinstance(op, ComputeOp) and op.kind == kind)

    for stage, row in zip(g.stages, r.breakdown(), strict=True):
        outside = (*stage.forward_pre, *stage.forward_post, *stage.backward_pre,
                   *stage.backward_post)
        for kind in ("gemm", "attention"):
            layer = flops_of((*g.layer_forward, *g.layer_backward), kind)
            recompute = flops_of(g.layer_forward, kind) if job.recompute else 0.0
            flops = job.num_microbatches * (
                nanobatches * stage.num_layers * (layer + recompute) + flops_of(outside, kind))
            assert row[kind]["time_s"] >= flops / peak
            # and not absurdly slow: above 40% of peak on this job's large kernels
            assert row[kind]["time_s"] <= flops / (0.4 * peak)


def test_kernel_classes_hold_each_instructions_time_and_dynamic_energy(simulated):
    """The per-interval tally against each instruction's own total (the run's time and
    energy, summed step by step): what the classes hold is exactly the instructions."""
    _, _, b, r = simulated
    for stage, row in zip(r.stages, r.breakdown(), strict=True):
        busy = sum(i["time_s"] for i in stage.instructions)
        dynamic = sum(i["dynamic_energy_j"] for i in stage.instructions)
        kernels = [row[c] for c in KERNEL_CLASSES]
        assert sum(v["time_s"] for v in kernels) == pytest.approx(busy, rel=1e-9)
        assert sum(v["energy_j"] for v in kernels) - b.static_power_w * busy == pytest.approx(
            dynamic, rel=1e-9)


def test_pipeline_wait_is_the_schedules_idle_time(k1):
    """Waits from the instructions' start times (when each stage is busy) rather than from
    the breakdown's remainder."""
    job, ps, b = k1
    r = IterationSimulator(ps, b).run(baseline_plan("megatron", job), with_instructions=True)
    for stage, row in zip(r.stages, r.breakdown(), strict=True):
        spans = sorted((i["start_s"], i["start_s"] + i["time_s"]) for i in stage.instructions)
        gaps = spans[0][0] + sum(b0 - a1 for (_, a1), (b0, _) in itertools.pairwise(spans))
        after = r.time_s - spans[-1][1]  # the last instruction to the iteration's end
        idle = gaps + after - row["transfers"]["time_s"] - row["iteration_end"]["time_s"]
        wait = row["pipeline_wait"]
        assert wait["time_s"] == pytest.approx(idle, rel=1e-6, abs=1e-9)
        assert wait["time_s"] > 0  # a 2-stage 1F1B has bubbles
        assert wait["energy_j"] == pytest.approx(wait["time_s"] * b.static_power_w)
