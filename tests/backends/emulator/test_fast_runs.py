"""The fast methods of the timeline against the reference they replace: runs that follow
cached constant-clock profiles (`Timeline.run`) against interval-by-interval simulation
(`run_stepwise`), and the steady state's closed form against simulating it
(`steady(reference=True)`). They must agree to round-off, throttled or not."""

from dataclasses import fields, replace

import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.backends.emulator.limiter import LimiterState
from kareus.core import Knobs
from kareus.job.sources import build_job
from kareus.plans.methods import baseline_plan
from kareus.workload.layer import gemm
from kareus.workload.workload import Workload

REL = 1e-9  # round-off: the fast methods sum the same intervals in another order


def _backend(preset: str, tau_s: float | None = None) -> tuple:
    job = build_job(preset)
    b = EmulatorBackend(job)
    if tau_s is not None:
        b.physics.p = replace(b.physics.p, limiter_tau_s=tau_s)
        b.timeline.__init__(b.physics, b.static_power_w, b.gpu.tdp_w,  # type: ignore[misc]
                            b.timeline.internode_groups)
    return job, Workload.build(job).partitions, b


def _settings(job, p, count: int) -> list[Knobs]:
    grid = [Knobs(f, n, s) for f in job.freqs_mhz for n in p.sm_choices
            for s in p.launch_options]
    return grid[:: max(1, len(grid) // count)]


def _assert_same(fast, ref) -> None:
    for f in fields(ref):
        a, b = getattr(fast, f.name), getattr(ref, f.name)
        if b is None:  # the host's lag, for a run given none
            assert a is None, f.name
        elif isinstance(b, tuple):
            assert len(a) == len(b)
            assert all(x == pytest.approx(y, rel=REL, abs=1e-15) for x, y in zip(a, b))
        else:
            assert a == pytest.approx(b, rel=REL, abs=1e-15), f.name


CASES = [("kareus-1", None), ("llama3.3-70b-64gpu", None), ("llama3.3-70b-64gpu", 0.001),
         ("kareus-2", 0.05), ("kareus-1", 0.0)]  # tau = 0: the memoryless limiter


@pytest.mark.parametrize(("preset", "tau_s"), CASES)
def test_steady_matches_the_simulated_steady_state(preset, tau_s):
    """Every partition at a spread of settings: the closed form where it applies, the
    profile-following simulation elsewhere, against the stepwise simulation."""
    job, ps, b = _backend(preset, tau_s)
    throttled = 0
    for key in ps.keys:
        p = ps[key]
        for k in _settings(job, p, 6):
            args = (p.compute_ops, k.freq_mhz, p.collective, k.sms,
                    p.launch_index(k.slot))
            fast = b.timeline.steady(*args)
            ref = b.timeline.steady(*args, reference=True)
            _assert_same(fast, ref)
            throttled += fast.freq_time_mhz_s < k.freq_mhz * fast.time_s * (1 - 1e-6)
    if preset.startswith("llama"):
        assert throttled > 0  # the H100's MLP partitions dither at the limit


def test_steady_of_short_and_sustained_runs_matches():
    """Runs of ops: short (mean field), sustained GEMMs (throttled), light (closed form)."""
    _, _, b = _backend("llama3.3-70b-64gpu")
    big, small = gemm("g8k", 8192, 8192, 8192), gemm("g1k", 1024, 1024, 1024)
    for ops in [(small,), (big,), (big, small) * 3, (small,) * 40]:
        for f in (1980, 1500, 1005):
            _assert_same(b.timeline.steady(ops, f), b.timeline.steady(ops, f, reference=True))


@pytest.mark.parametrize("preset", ["kareus-1", "llama3.3-70b-64gpu"])
def test_runs_from_any_limiter_state_match_the_stepwise_run(preset):
    """One run from states anywhere in the limiter's cycle: the result, its per-class
    tally and the state it leaves."""
    job, ps, b = _backend(preset)
    tl = b.timeline
    lim = tl.limiter
    assert lim is not None
    for key in ps.keys:
        p = ps[key]
        for k in _settings(job, p, 3):
            for avg, cap_step, phase in [(150.0, 0, 0.0), (0.99 * b.gpu.tdp_w, 2, 0.7),
                                         (1.2 * b.gpu.tdp_w, 0, 0.95), (b.gpu.tdp_w, 5, 0.3)]:
                cap = float(job.gpu_spec.clock_table_mhz[cap_step])
                args = (p.compute_ops, k.freq_mhz, p.collective, k.sms,
                        p.launch_index(k.slot))
                st_fast = LimiterState(avg, cap, phase * lim.tick_s)
                st_ref = LimiterState(avg, cap, phase * lim.tick_s)
                _assert_same(tl.run(*args, state=st_fast), tl.run_stepwise(*args, state=st_ref))
                assert st_fast.cap_mhz == st_ref.cap_mhz
                assert st_fast.avg_power_w == pytest.approx(st_ref.avg_power_w, rel=REL)
                assert st_fast.since_tick_s == pytest.approx(st_ref.since_tick_s, rel=REL,
                                                             abs=1e-12)


def test_a_whole_iteration_matches_the_stepwise_timeline():
    """The continuous simulation (limiter state carried from step to step)."""
    job, ps, b = _backend("kareus-1")
    _, _, ref_b = _backend("kareus-1")
    ref_b.timeline.run = ref_b.timeline.run_stepwise  # type: ignore[method-assign]
    for method in ("megatron", "nanobatch"):
        plan = baseline_plan(method, job)
        fast = IterationSimulator(ps, b).run(plan)
        ref = IterationSimulator(ps, ref_b).run(plan)
        assert fast.time_s == pytest.approx(ref.time_s, rel=REL)
        assert fast.energy_j == pytest.approx(ref.energy_j, rel=REL)
