"""Event-driven timeline of one GPU: a compute stream and a communication stream.

The compute stream runs its items in order (each compute kernel preceded by a launch gap;
a collective placed on the compute stream blocks it, as in Megatron-LM). At most one
collective runs on the communication stream, launched when the compute stream reaches a
given item (its latency phase first, then the transfer). Every start and end of a kernel
recomputes the rates: SMs held by the collective are taken from the compute kernel, HBM
bandwidth is split max-min fairly (intervals.py; runs: streams.py).

The board's power limiter has memory (`PowerLimiter`): it acts on the power averaged over
a time constant tau, one clock-table step per control tick, for compute and communication
alike. A burst shorter than tau is not throttled; a sustained GEMM is, and then dithers
between two table clocks around the limit. ``tau = 0`` is the memoryless limiter (each
interval at the highest clock whose power fits, instantly). A measurement (`steady`) is
the GPU's periodic steady state while the run repeats, as in a profiling window; a
continuous simulation carries one `LimiterState` across runs (docs/emulator.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kareus.backends.emulator.intervals import Item
from kareus.backends.emulator.limiter import LimiterState
from kareus.backends.emulator.profiles import KERNEL_CLASSES, RunProfile, RunResult
from kareus.backends.emulator.streams import StreamRunner
from kareus.workload.ops import Collective, Op

__all__ = ["KERNEL_CLASSES", "Item", "LimiterState", "RunResult", "Timeline"]


def _fields(r: RunResult) -> tuple[float, float, float, float, float]:
    return (r.time_s, r.energy_j, r.freq_time_mhz_s, r.compute_end_s, r.overlap_s)


def _from_fields(values: Sequence[float]) -> RunResult:
    """The inverse of `_fields` (an average of runs: no per-class tally)."""
    t, e, f, c, o = values
    return RunResult(t, e, f, c, o)


class Timeline(StreamRunner):
    """One GPU's runs (`run`, streams.py), waits (`rest`) and measurements (`steady`)."""

    def rest(self, state: LimiterState, seconds: float, f_set: float) -> None:
        """``seconds`` idle at static power (waiting in the pipeline): the average decays
        and the limiter gives clock back tick by tick."""
        lim = self.limiter
        if lim is None:
            return
        left = seconds
        while left > 0:
            dt = min(left, lim.until_tick(state) or lim.tick_s)
            lim.advance(state, self.static_power_w, dt, f_set)
            left -= dt

    # A measurement: the run repeated, in the limiter's steady state ------------------------

    WARMUP_TAUS = 3.0
    MEASURE_TAUS = 2.0
    MEAN_FIELD_RUNS_PER_TICK = 4.0
    _MARGIN = 1e-9  # relative: a bound this close to the limit is simulated instead

    def steady(self, ops: Sequence[Op], freq_mhz: int, side: Collective | None = None,
               side_sms: int = 0, launch_index: int | None = None, blocking_sms: int = 32,
               reference: bool = False) -> RunResult:
        """Per run, the run repeated back to back as in a profiling window, once the
        limiter has settled. Runs several times shorter than a control tick see only their
        average power: then the mean-field limit (the runs at the two table clocks around
        the limit, mixed so that the average power is the limit) stands in for simulating
        thousands of them. Longer runs whose averaged power provably never reaches the limit
        (`_never_throttled`) are the run at the set clock; the others are simulated:
        warm-up, then the mean over whole runs of at least MEASURE_TAUS time constants.
        ``reference``: every run simulated interval by interval (`run_stepwise`), no
        closed form: the method that the fast one must match (tests)."""
        args = (ops, freq_mhz, side, side_sms, launch_index, blocking_sms)
        lim = self.limiter
        run = self.run_stepwise if reference else self.run
        if lim is None:
            return run(*args)
        at_set = None if reference else self.profile(
            (tuple(ops), side, side_sms, launch_index, blocking_sms, None), float(freq_mhz))
        # from an idle GPU (cap above the set clock) the first run is the profile at the
        # set clock unless its average crosses the limit on the way
        if at_set is not None and self._stays_under(at_set, self.static_power_w):
            first = at_set.result
        else:
            at_set, first = None, run(*args)
        if first.time_s <= 0:
            return first
        if first.time_s * self.MEAN_FIELD_RUNS_PER_TICK <= lim.tick_s:
            return self._mean_field(args, first, run)
        avg0 = first.energy_j / first.time_s
        if at_set is not None and self._never_throttled(at_set, avg0):
            return _from_fields(_fields(first))
        return self._simulate(args, LimiterState(avg0, float(freq_mhz)), run)

    def _simulate(self, args: tuple, st: LimiterState, run: Callable[..., RunResult]
                  ) -> RunResult:
        """Warm-up of WARMUP_TAUS, then the mean over whole runs of MEASURE_TAUS."""
        lim = self.limiter
        assert lim is not None
        t_warm = 0.0
        runs = 0
        while t_warm < self.WARMUP_TAUS * lim.tau_s or runs < 2:
            t_warm += run(*args, state=st).time_s
            runs += 1
        total = [0.0, 0.0, 0.0, 0.0, 0.0]
        runs = 0
        while total[0] < self.MEASURE_TAUS * lim.tau_s or runs < 1:
            r = run(*args, state=st)
            total = [a + b for a, b in zip(total, _fields(r), strict=True)]
            runs += 1
        return _from_fields([v / runs for v in total])

    def _stays_under(self, prof: RunProfile, avg_w: float) -> bool:
        """Whether the limiter's average, starting at ``avg_w``, stays at or under the limit
        at every interval's end of one run at the profile's clock (between ends it moves
        monotonically, so nowhere above either end)."""
        lim = self.limiter
        assert lim is not None
        ceiling = self.tdp_w * (1 - self._MARGIN)
        if avg_w > ceiling:
            return False
        for seg in prof.segments:
            avg_w = seg[1] + (avg_w - seg[1]) * math.exp(-seg[0] / lim.tau_s)
            if avg_w > ceiling:
                return False
        return True

    def _never_throttled(self, prof: RunProfile, avg0_w: float) -> bool:
        """Whether runs repeated at the profile's clock from average ``avg0_w`` keep the
        average at or under the limit for ever. The average at the start of run n is
        ``x* + decay^n (avg0 - x*)``, x* the periodic orbit's start (the fixed point of one
        run): along run n it stays within ``max(0, avg0 - x*)`` above the periodic orbit,
        so the orbit raised by that much bounds every run. No tick ever sees the average
        above the limit, the cap never falls below the set clock, and every run is the
        profile (the closed form of the steady state)."""
        if prof.decay >= 1.0:
            return False
        x_star = prof.drive_w / (1.0 - prof.decay)
        return self._stays_under(prof, x_star + max(0.0, avg0_w - x_star))

    def _mean_field(self, args: tuple, at_set: RunResult, run: Callable[..., RunResult]
                    ) -> RunResult:
        """Short runs under a limiter with memory: the clock settles where the average
        power meets the limit, dithering between the two table clocks around it."""
        ops, f_set, side, side_sms, launch, blocking = args
        if at_set.energy_j / at_set.time_s <= self.tdp_w:
            return at_set
        clocks = [f for f in self._table if f <= f_set]
        hi_run = at_set
        for f in reversed(clocks[:-1]):
            # one run at clock f whatever its power (a fresh state held at f)
            lo_run = run(ops, int(f), side, side_sms, launch, blocking,
                         state=LimiterState(0.0, float(f)))
            p_lo = lo_run.energy_j / lo_run.time_s
            if p_lo <= self.tdp_w:
                p_hi = hi_run.energy_j / hi_run.time_s
                alpha = (self.tdp_w - p_lo) / (p_hi - p_lo)  # share of time at the upper
                beta = (alpha / hi_run.time_s) / (alpha / hi_run.time_s
                                                  + (1 - alpha) / lo_run.time_s)
                return _from_fields([beta * a + (1 - beta) * b for a, b in zip(
                    _fields(hi_run), _fields(lo_run), strict=True)])
            hi_run = lo_run
        return hi_run  # even the lowest clock exceeds the limit: it runs there
