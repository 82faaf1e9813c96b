"""Baselines as the real systems run them, and slack-filled frontiers."""

from dataclasses import replace

import pytest

from kareus.backends.emulator import EmulatorBackend, emulator_for
from kareus.backends.measuring import journal_first
from kareus.compose.options import Composer, key_frontiers
from kareus.compose.pipeline import evaluate, solve_frontier
from kareus.job.sources import build_job
from kareus.plans.methods import all_methods, get_method
from kareus.search import SearchConfig, run_search
from kareus.workload.workload import Workload


@pytest.fixture(scope="module", params=["kareus-1", "kareus-2"])
def solved(request):
    job = build_job(request.param)
    w = Workload.build(job)
    ps, b = w.partitions, emulator_for(w)
    fronts = key_frontiers({k: [(s.knobs, s.measurement) for s in run_search(
        ps[k], journal_first(b, None, job), job.freqs_mhz,
        SearchConfig(budget=30)).samples] for k in ps.keys})
    comp = Composer(ps, b, job.freqs_mhz)
    costs = comp.pipeline_costs()
    return {m.name: solve_frontier(comp.options(m, fronts), costs) for m in all_methods()
            }, costs


def test_no_frontier_plan_has_slack_left(solved):
    """No instruction of any frontier plan can take its next slower option (one clock
    step lower for Perseus) without lengthening the iteration, on the steady-state times
    slack is filled on (the final evaluation also charges wait transients,
    kareus.compose.transient, which slack filling does not see)."""
    fronts, costs = solved
    for method, points in fronts.items():
        for p in points:
            steady = {k: [replace(o, transient=None) for o in v] for k, v in p.options.items()}
            now = evaluate(steady, costs, p.choice)
            for iid, i in p.choice.items():
                opts = p.options[(iid[0], iid[2])]
                if i + 1 < len(opts):
                    slower = evaluate(steady, costs, {**p.choice, iid: i + 1})
                    assert slower.time_s > now.time_s, (method, iid)


def test_perseus_fastest_plan_is_megatrons_time_with_less_energy(solved):
    fronts, _costs = solved
    (mega,) = fronts["megatron"]
    fastest = fronts["perseus"][0]
    assert fastest.time_s == pytest.approx(mega.time_s, rel=1e-3)
    assert fastest.energy_j < mega.energy_j
    # the all-max-clock plan is not on Perseus's frontier when slack exists
    assert all(len({o.freq_mhz for o in p.picks.values()}) > 1 for p in fronts["perseus"])


def test_megatron_backward_overlaps_the_dgrad_all_reduce_with_wgrad():
    job = build_job("kareus-1")
    ps = Workload.build(job).partitions
    b = EmulatorBackend(job)
    overlaps = [s for s in ps.sequential_layer["backward"] if s.kind == "overlap"]
    assert [s.unit.key for s in overlaps] == ["overlap_fc1_wgrad_fc1_grad_ar",
                                              "overlap_qkv_wgrad_qkv_grad_ar"]
    for step in overlaps:
        # the weight gradient GEMM and (unfused, as kareus-1's) its main-gradient add
        *compute, coll = step.ops
        run = b.timeline.run(tuple(compute), 1410, side=coll, side_sms=b.default_sms,
                             launch_index=0)
        alone = (b.predict_ops(tuple(compute), 1410).time_s
                 + b.predict_ops((coll,), 1410).time_s)
        assert run.overlap_s > 0  # the all-reduce runs while the weight gradient computes
        assert run.time_s < alone
    # the Megatron backward instruction is shorter than with every all-reduce exposed
    comp = Composer(ps, b, job.freqs_mhz)
    megatron = comp.options(get_method("megatron"))[(0, "backward")][0]
    exposed = b.predict_ops([op for s in ps.sequential_layer["backward"] for op in s.ops],
                            1410)
    pre, n, post = ps.sequential_steps(0, "backward")
    fixed = sum(b.predict_ops(s.ops, 1410).time_s for s in (*pre, *post))
    assert megatron.time_s < fixed + n * exposed.time_s


def test_collectives_get_the_channels_nccl_picks():
    a100 = EmulatorBackend(build_job("kareus-1"))
    h100 = EmulatorBackend(build_job("llama3.3-70b-64gpu"))
    assert a100.gpu.nccl_channels == a100.default_sms == 24
    assert h100.gpu.nccl_channels == h100.default_sms == 32
    ps = Workload.build(build_job("kareus-1")).partitions
    ar = next(op for op in ps.graph.layer_forward if op.is_collective)
    assert a100.predict_ops((ar,), 1410) == a100.predict_ops((ar,), 1410, 24)
    assert a100.predict_ops((ar,), 1410) != a100.predict_ops((ar,), 1410, 32)
