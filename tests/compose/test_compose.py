import pytest

from kareus.backends.emulator import emulator_for
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.backends.measuring import journal_first
from kareus.compose.instruction import InstructionOption, KeyOption, combine, pareto_front
from kareus.compose.options import Composer, key_frontiers
from kareus.compose.pipeline import PipelineCosts, evaluate, solve_frontier
from kareus.compose.plans import timeline, to_execution_plan
from kareus.core import PartitionSetting
from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.plans.methods import get_method
from kareus.search import SearchConfig, run_search
from kareus.workload.workload import Workload


def _c(n):
    return PartitionSetting(n, None)


def test_two_partition_combination_by_hand():
    # key a (x2): (1, 5) or (2, 3); key b (x1): (3, 1) or (1, 4); fixed part (10, 10)
    per_key = {
        "a": (2, [KeyOption(1.0, 5.0, _c(1)), KeyOption(2.0, 3.0, _c(2))]),
        "b": (1, [KeyOption(3.0, 1.0, _c(3)), KeyOption(1.0, 4.0, _c(4))]),
    }
    got = combine(10.0, 10.0, 1200, per_key)
    # all four sums: a1b1 (15, 21), a1b2 (13, 24), a2b1 (17, 17), a2b2 (15, 20)
    # a1b1 (15, 21) is dominated by a2b2 (15, 20)
    assert [(o.time_s, o.dynamic_energy_j) for o in got] == [(13.0, 24.0), (15.0, 20.0),
                                                              (17.0, 17.0)]
    assert got[1].setting_dict() == {"a": _c(2), "b": _c(4)}
    assert all(o.freq_mhz == 1200 for o in got)


def test_pareto_front_drops_dominated_and_duplicates():
    opts = [InstructionOption(1, 5, 1), InstructionOption(1, 5, 2), InstructionOption(2, 6, 3),
            InstructionOption(3, 1, 4)]
    assert [(o.time_s, o.dynamic_energy_j) for o in pareto_front(opts)] == [(1, 5), (3, 1)]


def _costs(pp=2, mb=3):
    return PipelineCosts(pp, mb, gpus=pp, static_power_w=1.0,
                         send_activation_s=(0.0,) * pp, send_grad_s=(0.0,) * pp,
                         end_s=(0.0,) * pp, fixed_dynamic_j=(0.0,) * pp)


def test_pipeline_evaluation_by_hand():
    # one stage, two microbatches: F0 F1 B0 B1 back to back
    opts = {(0, "forward"): [InstructionOption(1.0, 10.0, 1410)],
            (0, "backward"): [InstructionOption(2.0, 20.0, 1410)]}
    costs = _costs(pp=1, mb=2)
    choice = {(0, m, d): 0 for m in range(2) for d in ("forward", "backward")}
    p = evaluate(opts, costs, choice)
    assert p.time_s == pytest.approx(6.0)
    assert p.dynamic_energy_j == pytest.approx(60.0)
    assert p.energy_j == pytest.approx(60.0 + 1 * 6.0 * 1.0)


def test_timeline_ends_each_stage_with_its_end_of_iteration_work_by_hand():
    """Two stages, one microbatch, 1 s per instruction, no transfers; stage 0 ends with
    0.5 s of data-parallel sync and optimizer step, stage 1 with 0.2 s. Stage 1's backward
    finishes at 3 s, stage 0's at 4 s: the end bars run 4..4.5 and 3..3.2, and only stage
    0's is critical."""
    opts = {(s, d): [InstructionOption(1.0, 1.0, 1200)] for s in range(2)
            for d in ("forward", "backward")}
    costs = PipelineCosts(2, 1, gpus=2, static_power_w=1.0, send_activation_s=(0.0, 0.0),
                          send_grad_s=(0.0, 0.0), end_s=(0.5, 0.2), fixed_dynamic_j=(0, 0))
    point = evaluate(opts, costs, {(s, 0, d): 0 for s in range(2)
                                   for d in ("forward", "backward")})
    assert point.time_s == pytest.approx(4.5)
    ends = {e.stage: e for e in timeline(point, costs, 1410) if e.kind == "end"}
    assert (ends[0].start_s, ends[0].time_s) == pytest.approx((4.0, 0.5))
    assert (ends[1].start_s, ends[1].time_s) == pytest.approx((3.0, 0.2))
    assert ends[0].critical and not ends[1].critical
    assert {e.microbatch for e in ends.values()} == {-1}
    assert {e.freq_mhz for e in ends.values()} == {1410}


def test_solver_trades_time_for_energy():
    fast_slow = [InstructionOption(1.0, 10.0, 1410), InstructionOption(1.5, 6.0, 900)]
    opts = {(s, d): list(fast_slow) for s in range(2) for d in ("forward", "backward")}
    front = solve_frontier(opts, _costs())
    assert len(front) >= 2
    times = [p.time_s for p in front]
    energies = [p.energy_j for p in front]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)
    # the ends: everything fast, everything slow
    assert front[0].time_s == pytest.approx(evaluate(opts, _costs(), {
        k: 0 for k in front[0].choice}).time_s)


@pytest.fixture(scope="module")
def k1():
    job = build_job("kareus-1")
    w = Workload.build(job)
    ps, b = w.partitions, emulator_for(w)
    sim = IterationSimulator(ps, b)
    fronts = key_frontiers({k: [(s.knobs, s.measurement) for s in run_search(
        ps[k], journal_first(b, None, job), job.freqs_mhz,
        SearchConfig(budget=40)).samples] for k in ps.keys})
    return job, ps, sim, Composer(ps, b, job.freqs_mhz), fronts


def test_methods_have_the_right_clocks(k1):
    _job, _ps, _sim, comp, fronts = k1
    for method, n_freq in (("megatron", 1), ("nanobatch", 1), ("perseus", 18),
                           ("nanobatch_perseus", 18), ("kareus_no_freq", 1)):
        opts = comp.options(get_method(method), fronts)
        freqs = {o.freq_mhz for v in opts.values() for o in v}
        assert len(freqs) <= n_freq and (n_freq > 1 or freqs == {1410}), method
    with pytest.raises(SpecError, match="search results"):
        comp.options(get_method("kareus"), None)
    with pytest.raises(SpecError, match="unknown method"):
        get_method("zeus")


def test_every_plan_matches_its_simulation(k1):
    _job, _ps, sim, comp, fronts = k1
    costs = comp.pipeline_costs()
    for method in ("perseus", "nanobatch_perseus", "kareus"):
        opts = comp.options(get_method(method), fronts)
        for i, pt in enumerate(solve_frontier(opts, costs)):
            plan = to_execution_plan(f"{method}-{i}", pt.picks, 1410, method != "perseus")
            r = sim.run(plan)
            assert r.time_s == pytest.approx(pt.time_s, rel=0.03)
            assert r.energy_j == pytest.approx(pt.energy_j, rel=0.03)
