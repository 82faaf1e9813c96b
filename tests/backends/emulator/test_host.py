"""The host that issues the compute stream's kernels (kareus.backends.emulator.host): the GPU
waits for it only where it is behind (after a sync, or throughout where kernels are shorter
than their issue time), every pipeline exchange empties the queue (and only those, or the
reference's timers), and the waiting costs static power."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.host import HostCosts, HostPlan, is_backward
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.backends.emulator.iteration_anchors import H100_8B_JOB
from kareus.backends.emulator.params import default_params
from kareus.backends.emulator.profiles import KERNEL_CLASSES
from kareus.job.sources import build_job
from kareus.plans.methods import baseline_plan
from kareus.plans.schedule import host_syncs, rank_order
from kareus.workload.layer import forward_ops, gemm, memory_op
from kareus.workload.ops import ComputeOp
from kareus.workload.workload import Workload

HOST = KERNEL_CLASSES.index("host_idle")
N = len(KERNEL_CLASSES)


def _backend(job, **params) -> EmulatorBackend:
    return EmulatorBackend(job, params=replace(default_params(job.gpu_spec), **params))


@pytest.fixture(scope="module")
def k1_job():
    return build_job("kareus-1")


def test_tiny_kernels_are_host_bound(k1_job):
    """Kernels shorter than their issue time: the GPU waits before every one of them, and
    the run takes the host's time plus the last kernel."""
    b = _backend(k1_job, host_basic_op_s=10e-6, limiter_tau_s=0.0)
    tl, f = b.timeline, k1_job.gpu_spec.max_freq_mhz
    ops = [memory_op(f"tiny{i}", "norm", 1e3, 1e4) for i in range(50)]
    free = tl.run(ops, f)  # no host: a measurement loop's
    hosted = tl.run(ops, f, host_lag_s=0.0)
    per_kernel = free.time_s / len(ops)
    assert per_kernel < 10e-6
    assert hosted.time_s == pytest.approx(50 * 10e-6 + per_kernel, rel=1e-9)
    assert hosted.classes[HOST] == pytest.approx(hosted.time_s - free.time_s, rel=1e-9)
    assert hosted.classes[N + HOST] == pytest.approx(
        hosted.classes[HOST] * b.static_power_w, rel=1e-9)


def test_large_kernels_lose_only_the_first_issue(k1_job):
    """Kernels longer than their issue time: after a sync the GPU waits for the first
    kernel's issue only; the host is ahead from then on."""
    b = _backend(k1_job, limiter_tau_s=0.0)
    tl, f = b.timeline, k1_job.gpu_spec.max_freq_mhz
    ops = [gemm(f"g{i}", 8192, 8192, 8192) for i in range(4)]
    free = tl.run(ops, f)
    hosted = tl.run(ops, f, host_lag_s=0.0)
    first = b.params.host_module_s
    assert hosted.classes[HOST] == pytest.approx(first, rel=1e-9)
    assert hosted.time_s == pytest.approx(free.time_s + first, rel=1e-9)
    # a host far ahead is no host at all, and keeps gaining on the GPU
    ahead = tl.run(ops, f, host_lag_s=-1.0)
    assert ahead.time_s == free.time_s and ahead.energy_j == free.energy_j
    assert ahead.host_lag_s == pytest.approx(-1.0 + 4 * first - sum(
        tl.host_plan(ops, float(f), 32).gpu_s), rel=1e-12)


def test_fast_run_matches_the_stepwise_reference_with_the_host(k1_job):
    """A partition with its side collective, the host behind at the start: the profile's
    run is the interval-by-interval reference's, under the limiter."""
    b = _backend(k1_job, host_basic_op_s=200e-6)  # behind for several kernels
    ps = Workload.build(k1_job).partitions
    p = ps[ps.keys[0]]
    slot = p.launch_options[-1]
    args = (p.compute_ops, k1_job.gpu_spec.max_freq_mhz, p.collective, 16,
            p.launch_index(p.resolve_slot(slot)))
    fast = b.timeline.run(*args, host_lag_s=0.0)
    ref = b.timeline.run_stepwise(*args, host_lag_s=0.0)
    assert fast.classes[HOST] > 0
    assert fast.time_s == pytest.approx(ref.time_s, rel=1e-9)
    assert fast.energy_j == pytest.approx(ref.energy_j, rel=1e-9)
    assert fast.host_lag_s == ref.host_lag_s


def _instruction_waits(sim: IterationSimulator, stage: int, direction: str, f: int,
                       lag: float = 0.0) -> tuple[float, float]:
    """The GPU's waits for the host over one Megatron-LM instruction from ``lag``, from
    the host's plans of its steps (not from the timeline), and the lag at its end."""
    total = 0.0
    for _, _, plan in sim._step_runs(("seq", stage, direction), f):
        waits, lag = plan.waits(lag)
        total += sum(waits or ())
    return total, lag


def _stage_waits(sim: IterationSimulator, job, stage: int, f: int, timed: bool) -> float:
    """A stage's host idle time over the iteration, walked from the host's plans: from an
    empty queue where the schedule synchronises (every instruction with the timers), the
    lag carried where it does not (kareus-1's silent transitions follow their predecessor
    at once: no gap between them)."""
    order = rank_order(job.pp, job.num_microbatches, stage)
    syncs = host_syncs(job.pp, job.num_microbatches, stage)
    total, lag = 0.0, 0.0
    for (_, _, d), synced in zip(order, syncs, strict=True):
        waits, lag = _instruction_waits(sim, stage, d, f, 0.0 if synced or timed else lag)
        total += waits
    return total


@pytest.mark.parametrize("timed", [False, True])
def test_the_host_is_behind_after_every_sync_only(k1_job, timed):
    """PP2 (kareus-1): Megatron-Core's exchanges synchronise between most instructions,
    but stage 1 goes from a steady forward to its backward, and stage 0 from a steady
    backward to the next forward, with nothing to exchange (host_syncs): there the host
    is still ahead and the GPU does not wait for it. With the reference's timers around
    every window, every instruction starts from an empty queue."""
    b = EmulatorBackend(k1_job)
    sim = IterationSimulator(Workload.build(k1_job).partitions, b)
    r = sim.run(baseline_plan("megatron", k1_job), timed_windows=timed)
    f = k1_job.gpu_spec.max_freq_mhz
    for stage, row in enumerate(r.breakdown()):
        expected = _stage_waits(sim, k1_job, stage, f, timed)
        from_empty = _stage_waits(sim, k1_job, stage, f, True)
        assert expected > 0
        assert row["host_idle"]["time_s"] == pytest.approx(expected, rel=1e-9)
        assert row["host_idle"]["energy_j"] == pytest.approx(
            expected * b.static_power_w, rel=1e-9)
        if not timed:  # the silent transitions are where the host stays ahead
            assert expected < from_empty


def test_the_timers_windows_cost_the_wall_clock_the_hosts_head_start(k1_job):
    """The same plan with and without the timers: the timed run's instructions each start
    at a sync, so its wall clock is no shorter, and it differs only where the host ran
    ahead (the silent transitions)."""
    b = EmulatorBackend(k1_job)
    sim = IterationSimulator(Workload.build(k1_job).partitions, b)
    plan = baseline_plan("megatron", k1_job)
    plain = sim.run(plan, with_instructions=True)
    timed = sim.run(plan, with_instructions=True, timed_windows=True)
    assert timed.timed_windows and not plain.timed_windows
    assert timed.time_s > plain.time_s
    for r, (p_rep, t_rep) in enumerate(zip(plain.stages, timed.stages, strict=True)):
        syncs = host_syncs(k1_job.pp, k1_job.num_microbatches, r)
        for synced, pi, ti in zip(syncs, p_rep.instructions, t_rep.instructions,
                                  strict=True):
            if synced:
                # equal but for the power limiter's memory, which carries the earlier
                # instructions' differences in (well under 0.1%)
                assert pi["time_s"] == pytest.approx(ti["time_s"], rel=1e-3)
            else:
                assert pi["time_s"] < ti["time_s"]


def test_without_a_pipeline_the_host_stays_ahead():
    """PP1: no exchange syncs between microbatches: the GPU waits for the host in the
    iteration's first instruction only (the host gains on every later one)."""
    job = build_job(overrides={**H100_8B_JOB, "num_microbatches": 3})
    b = _backend(job, host_basic_op_s=20e-6)
    sim = IterationSimulator(Workload.build(job).partitions, b)
    r = sim.run(baseline_plan("megatron", job))
    f = job.gpu_spec.max_freq_mhz
    first, lag = _instruction_waits(sim, 0, "forward", f)
    assert first > 0 and lag < 0
    (row,) = r.breakdown()
    assert row["host_idle"]["time_s"] == pytest.approx(first, rel=1e-9)
    # synchronised before each, every microbatch's forward would wait as the first did
    assert 3 * first > row["host_idle"]["time_s"]


def test_a_recomputed_forward_is_issued_again(k1_job):
    """With full recompute, the host issues a layer's forward twice per microbatch: the
    backward layer's issue time is the forward's plus the backward's own."""
    assert k1_job.recompute
    ps = Workload.build(k1_job).partitions
    host = HostCosts.of(default_params(k1_job.gpu_spec))

    def issue(ops) -> float:
        return sum(host.issue_s(op) for op in ops)

    steps = ps.sequential_layer["backward"]
    ops = [op for s in steps for op in (s.unit.compute_ops if s.kind == "overlap"
                                        else s.ops)]
    g = ps.graph
    assert issue(ops) == pytest.approx(issue(g.layer_forward) + issue(g.layer_backward))
    assert host.issue_s(next(op for op in g.layer_forward if op.name == "qkv")) == (
        host.module_s)
    assert host.issue_s(next(op for op in g.layer_forward if op.name == "rope")) == (
        host.basic_op_s)


def test_every_backward_kernel_takes_the_backward_scale(k1_job):
    """Every op of a backward instruction that is not a (recomputed) forward op is a
    backward kernel, the unfused gradient accumulation's add included (kareus-1 runs with
    gradient_accumulation_fusion off): each one's issue time is scaled by
    `host_backward_scale`."""
    assert not k1_job.training.gradient_accumulation_fusion
    ps = Workload.build(k1_job).partitions
    # the forward ops, as the forward instruction runs them and as the backward's
    # recompute runs them (with gradients: the dropout mask is written there only)
    forward = {op.name for stage in range(k1_job.pp)
               for op in _instruction_ops(ps, stage, "forward")}
    forward |= {op.name for op in forward_ops(k1_job, grad=True)}
    host = HostCosts.of(default_params(k1_job.gpu_spec))
    doubled = replace(host, backward_scale=2.0)
    seen = set()
    for stage in range(k1_job.pp):
        for op in _instruction_ops(ps, stage, "backward"):
            if isinstance(op, ComputeOp) and op.name not in forward:
                seen.add(op.name)
                assert is_backward(op), op.name
                assert doubled.issue_s(op) == 2 * host.issue_s(op) > 0, op.name
    assert {"qkv_grad_acc", "lm_head_grad_acc"} <= seen


def _instruction_ops(ps, stage: int, direction: str) -> list:
    pre, _layers, post = ps.sequential_steps(stage, direction)
    steps = [*pre, *ps.sequential_layer[direction], *post]
    return [op for s in steps for op in (s.unit.compute_ops if s.kind == "overlap"
                                         else s.ops)]


def test_issue_time_per_kind():
    host = HostCosts(100e-6, 1e-6, 2.0)
    fwd = gemm("fc1", 128, 128, 128)
    wgrad = ComputeOp("fc1_wgrad", "gemm", 1.0, 1.0, "linear", ((1, 1, 1),), opens_slot=False)
    dgrad = ComputeOp("fc1_dgrad", "gemm", 1.0, 1.0, "linear", ((1, 1, 1),))
    assert host.issue_s(fwd) == 100e-6
    assert host.issue_s(dgrad) == 200e-6  # a backward module call
    assert host.issue_s(wgrad) == 2e-6  # the module's second kernel
    assert host.issue_s(memory_op("swiglu", "activation", 1, 1)) == 1e-6
    assert host.issue_s(memory_op("embedding", "other", 1, 1)) == 100e-6


_times = st.floats(0.0, 1e-3, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_times, _times), min_size=1, max_size=30),
       st.floats(-5e-3, 1e-3, allow_nan=False))
def test_waits_are_the_least_that_respect_the_issue_times(ops, lag):
    """Every kernel starts no earlier than the host issued it, and exactly then when the
    GPU waited for it; the lag at the end is what both sides spent."""
    issue, gpu = tuple(c for c, _ in ops), tuple(d for _, d in ops)
    plan = HostPlan.of(issue, gpu)
    waits, end = plan.waits(lag)
    if waits is None:
        assert plan.hidden(lag)
        waits = (0.0,) * len(ops)
    issued = lag
    start = 0.0
    for c, d, w in zip(issue, gpu, waits, strict=True):
        issued += c
        start += w
        assert w >= 0
        assert start >= issued - 1e-15
        if w > 0:
            assert start == pytest.approx(issued, abs=1e-15)
        start += d
    assert end == pytest.approx(issued - start, abs=1e-15)
    # the GPU waits at least as much as the host is behind at its worst
    assert sum(waits) >= lag + plan.hidden_below_s - 1e-15
