import itertools

import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.job.sources import build_job
from kareus.plans.execution import ExecutionPlan
from kareus.plans.methods import baseline_plan
from kareus.plans.schedule import one_f_one_b
from kareus.workload.workload import Workload


def test_one_f_one_b_order():
    assert one_f_one_b(2, 3, 0) == [(0, "forward"), (1, "forward"), (0, "backward"),
                                    (2, "forward"), (1, "backward"), (2, "backward")]
    assert one_f_one_b(2, 3, 1) == [(0, "forward"), (0, "backward"), (1, "forward"),
                                    (1, "backward"), (2, "forward"), (2, "backward")]
    for s in range(4):
        order = one_f_one_b(4, 8, s)
        assert sorted(order) == sorted((m, d) for m in range(8) for d in ("forward",
                                                                          "backward"))


def test_megatron_iteration_accounting(k1):
    job, ps, b = k1
    r = IterationSimulator(ps, b).run(baseline_plan("megatron", job))
    assert r.static_energy_j == pytest.approx(job.num_gpus * r.time_s * b.static_power_w)
    assert r.energy_j == pytest.approx(r.static_energy_j + r.dynamic_energy_j)
    assert r.time_s == pytest.approx(max(s.end_s for s in r.stages))
    for s in r.stages:
        assert 0 < s.busy_s <= r.time_s + 1e-9
    gpus_per_stage = job.num_gpus // job.pp
    assert r.dynamic_energy_j == pytest.approx(
        gpus_per_stage * sum(s.dynamic_energy_j for s in r.stages))


def test_instruction_energy_is_u_shaped_over_the_clock_table(k1):
    job, ps, b = k1
    sim = IterationSimulator(ps, b)
    plan = baseline_plan("nanobatch", job)
    clocks = sorted(b.gpu.clock_table_mhz)
    energy = [sim.instruction(plan, 0, "backward", f).energy_j for f in clocks]
    i = min(range(len(clocks)), key=energy.__getitem__)
    assert 0 < i < len(clocks) - 1
    assert energy[0] > energy[i] * 1.2 and energy[-1] > energy[i] * 1.05
    # falling to the minimum, rising after it (allowing the throttled plateau at the top)
    assert all(e1 >= e2 for e1, e2 in itertools.pairwise(energy[:i + 1]))
    assert all(e2 >= e1 - 1e-9 for e1, e2 in itertools.pairwise(energy[i:]))


def test_nanobatching_beats_megatron_on_time(k1):
    job, ps, b = k1
    sim = IterationSimulator(ps, b)
    mega = sim.run(baseline_plan("megatron", job))
    nano = sim.run(baseline_plan("nanobatch", job))
    assert nano.time_s < mega.time_s


def test_lower_clock_saves_dynamic_energy_and_costs_time(k1):
    job, ps, b = k1
    sim = IterationSimulator(ps, b)
    hi = sim.run(baseline_plan("megatron", job))
    lo = sim.run(baseline_plan("megatron", job, 1005))
    assert lo.time_s > hi.time_s and lo.dynamic_energy_j < hi.dynamic_energy_j


def test_per_instruction_frequencies_are_applied(k1):
    job, ps, b = k1
    sim = IterationSimulator(ps, b)
    base = ExecutionPlan("x", overlap=True, default_freq_mhz=1410, default_slot="first")
    slow_bwd = ExecutionPlan(
        "y", overlap=True, default_freq_mhz=1410, default_slot="first",
        instruction_freqs={(1, m, "backward"): 900 for m in range(job.num_microbatches)})
    a, c = sim.run(base, with_instructions=True), sim.run(slow_bwd, with_instructions=True)
    assert c.time_s > a.time_s
    freqs = {(i["direction"], i["freq_mhz"]) for i in c.stages[1].instructions}
    assert ("backward", 900) in freqs and ("forward", 1410) in freqs


@pytest.mark.parametrize("preset", ["kareus-2", "kareus-5"])
def test_other_presets_simulate(preset):
    job = build_job(preset)
    ps = Workload.build(job).partitions
    sim = IterationSimulator(ps, EmulatorBackend(job))
    for method in ("megatron", "nanobatch"):
        r = sim.run(baseline_plan(method, job))
        assert 1.0 < r.time_s < 20.0
        assert 150 < r.mean_power_per_gpu_w < 400


def test_dp_sync_counts_when_weights_are_replicated():
    job = build_job("kareus-1", overrides={"nodes": 4})
    ps = Workload.build(job).partitions
    r = IterationSimulator(ps, EmulatorBackend(job)).run(baseline_plan("megatron", job))
    base = build_job("kareus-1")
    r1 = IterationSimulator(Workload.build(base).partitions, EmulatorBackend(base)).run(
        baseline_plan("megatron", base))
    assert r.time_s > r1.time_s  # the gradient reduce-scatter and parameter all-gather
