"""One run of items on a GPU's two streams, under the power limiter (docs/emulator.md).

The compute stream runs its items in order (each compute kernel preceded by a launch gap,
and by a wait for the host that issues it where a run is given the host's lag, host.py;
a collective placed on the compute stream blocks it, as in Megatron-LM). At most one
collective runs on the communication stream, launched when the compute stream reaches a
given item (its latency phase first, then the transfer). Every start and end of an item
starts a new interval (intervals.py); control ticks of the limiter cut intervals too.

Why runs are fast: between two control ticks the clock is constant, and a run at a
constant clock is always the same list of intervals, its `RunProfile` (cached per run and
clock, computed only as far as runs have needed it). A run under the limiter follows the
profile at its clock: a run with no tick inside is one step of the limiter's average (its
decay over the run composed once); a tick inside is applied at its place in the profile;
where a tick moves the clock, the run goes on interval by interval (`_intervals`, the
reference method) only until every running item is at its start, where the profile at the
new clock picks it up. The results are the reference's to round-off
(tests/backends/emulator/test_fast_runs.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

from kareus.backends.emulator.host import HostCosts, HostPlan
from kareus.backends.emulator.intervals import Intervals, Item
from kareus.backends.emulator.limiter import LimiterState, PowerLimiter
from kareus.backends.emulator.physics import GPUPhysics
from kareus.backends.emulator.profiles import (
    CLASS_OF,
    EXPOSED,
    N_CLS,
    START,
    Cursor,
    RunProfile,
    RunResult,
    Segment,
    Streams,
    canonical,
    cursor_after,
    result_of,
)
from kareus.workload.ops import Collective, Op


class StreamRunner(Intervals):
    """Runs of items on one GPU's two streams, with the limiter's memory when tau > 0."""

    MAX_PROFILES = 1024
    """Profiles kept, the oldest dropped first (a few KB each): a measurement reuses only
    its own clocks' and an iteration its steps' (~150 for a Llama-3.3-70B one), so a sweep
    need not keep every setting's."""

    def __init__(self, physics: GPUPhysics, static_power_w: float, tdp_w: float,
                 internode_groups: frozenset[str] = frozenset()) -> None:
        super().__init__(physics, static_power_w, tdp_w, internode_groups)
        tau = physics.p.limiter_tau_s
        self.limiter = PowerLimiter(tdp_w, tau, self._table) if tau > 0 else None
        self._profiles: dict[tuple, RunProfile] = {}
        self._streams: dict[tuple, Streams] = {}
        self.host = HostCosts.of(physics.p)
        self._host_plans: dict[tuple, HostPlan] = {}

    def idle_state(self) -> LimiterState:
        """A GPU that has been idle: averaged power at static, no clock held back."""
        return LimiterState(self.static_power_w, self._table[-1])

    # Items ----------------------------------------------------------------------------------

    def stream_items(self, ops: Sequence[Op], waits: Sequence[float] | None = None
                     ) -> list[list[Item]]:
        """Per op, the items it puts on the compute stream; ``waits``: per op, the time
        the GPU waits for the host to issue it (host.py)."""
        out: list[list[Item]] = []
        overhead = self.ph.p.launch_overhead_s
        for i, op in enumerate(ops):
            items: list[Item] = []
            if waits is not None and waits[i] > 0:
                items.append(("host", waits[i]))
            if isinstance(op, Collective):
                items += self.collective_items(op)
            elif op.fused:  # inside the previous op's kernel: no launch of its own
                items.append(("op", op))
            else:
                kernels = max(1, len(op.gemm_shapes))
                items += [("gap", overhead * kernels), ("op", op)]
            out.append(items)
        return out

    def host_plan(self, ops: Sequence[Op], f: float, blocking_sms: int) -> HostPlan:
        """The ops' issue times and the GPU's time for each op's items at clock ``f``, the
        compute stream alone (cached)."""
        key = (tuple(ops), f, blocking_sms)
        plan = self._host_plans.get(key)
        if plan is None:
            throttle = self.limiter is None
            gpu = []
            for items in self.stream_items(ops):
                d = 0.0
                for item in items:
                    d += (item[1] if item[0] in ("gap", "lat") else
                          self._interval(item, None, f, 0, blocking_sms, throttle)[0])
                gpu.append(d)
            plan = HostPlan.of(tuple(self.host.issue_s(op) for op in ops), tuple(gpu))
            self._host_plans[key] = plan
            if len(self._host_plans) > self.MAX_PROFILES:
                del self._host_plans[next(iter(self._host_plans))]
        return plan

    def collective_items(self, coll: Collective) -> list[Item]:
        return [("lat", self.ph.coll_latency(coll)), ("xfer", coll)]

    def streams(self, ops: Sequence[Op], side: Collective | None, launch_index: int | None,
                waits: Sequence[float] | None = None) -> Streams:
        """``side`` launched before ``ops[launch_index]`` (None: after the last op), when
        the compute stream reaches that op (after its wait for the host, if any)."""
        main: list[Item] = []
        launch_at = -1
        for i, items in enumerate(self.stream_items(ops, waits)):
            if side is not None and i == launch_index:
                launch_at = len(main)
            main += items
        if side is None:
            return Streams(tuple(main), (), -1)
        if launch_at < 0:
            launch_at = len(main)
        return Streams(tuple(main), tuple(self.collective_items(side)), launch_at)

    # Running --------------------------------------------------------------------------------

    def run(self, ops: Sequence[Op], freq_mhz: int, side: Collective | None = None,
            side_sms: int = 0, launch_index: int | None = None, blocking_sms: int = 32,
            state: LimiterState | None = None, host_lag_s: float | None = None
            ) -> RunResult:
        """Run ``ops`` on the compute stream at ``freq_mhz``; optionally ``side`` on the
        communication stream with ``side_sms`` SMs, launched before ``ops[launch_index]``
        (``len(ops)`` or None: after the last op). Collectives inside ``ops`` block the
        compute stream and use ``blocking_sms`` SMs. ``state``: the limiter's memory,
        carried in and updated (None: a GPU that has been idle). ``host_lag_s``: the
        host's lag at the start (host.py; 0 right after a sync), the result then carrying
        the lag at the end; None: a host far ahead (a measurement loop)."""
        waits = None
        if host_lag_s is not None:
            waits, lag_out = self.host_plan(ops, float(freq_mhz), blocking_sms).waits(
                host_lag_s)
        key = (tuple(ops), side, side_sms, launch_index, blocking_sms, waits)
        if self.limiter is None:  # memoryless: every interval throttled on its own
            r = self.profile(key, float(freq_mhz)).result
        else:
            st = state if state is not None else self.idle_state()
            r = self._run_limited(key, float(freq_mhz), st)
        return r if host_lag_s is None else replace(r, host_lag_s=lag_out)

    def run_stepwise(self, ops: Sequence[Op], freq_mhz: int, side: Collective | None = None,
                     side_sms: int = 0, launch_index: int | None = None,
                     blocking_sms: int = 32, state: LimiterState | None = None,
                     host_lag_s: float | None = None) -> RunResult:
        """`run` simulated interval by interval, ticks included, without profiles: the
        reference that `run` must match to round-off (tests)."""
        st = state if state is not None else self.idle_state()
        waits = None
        if host_lag_s is not None:
            waits, lag_out = self.host_plan(ops, float(freq_mhz), blocking_sms).waits(
                host_lag_s)
        acc = [0.0] * (5 + 2 * N_CLS)
        for _ in self._intervals(self.streams(ops, side, launch_index, waits),
                                 float(freq_mhz), side_sms, blocking_sms,
                                 st if self.limiter is not None else None, START, acc):
            pass
        r = result_of(acc)
        return r if host_lag_s is None else replace(r, host_lag_s=lag_out)

    # Profiles -------------------------------------------------------------------------------

    def profile(self, key: tuple, clock_mhz: float) -> RunProfile:
        """The run ``key`` = (ops, side, side SMs, launch index, blocking SMs, waits for the
        host) at a constant clock, from its start (cached)."""
        prof = self._profiles.get((key, clock_mhz))
        if prof is not None:
            return prof
        ops, side, side_sms, launch_index, blocking_sms, waits = key
        sc = self._streams.get(key)
        if sc is None:
            sc = self._streams[key] = self.streams(ops, side, launch_index, waits)
            if len(self._streams) > self.MAX_PROFILES:
                del self._streams[next(iter(self._streams))]
        acc = [0.0] * (5 + 2 * N_CLS)
        segs: list[Segment] = []
        for _ in self._intervals(sc, clock_mhz, side_sms, blocking_sms, None, START, acc,
                                 segs):
            pass
        tau = self.limiter.tau_s if self.limiter is not None else math.inf
        exps = [math.exp(-seg[0] / tau) for seg in segs]
        decay, drive = 1.0, 0.0
        index: dict[tuple, int] = {}
        for i, (seg, e) in enumerate(zip(segs, exps, strict=True)):
            # the average's steps composed: avg' = p + (avg - p) e^(-dt/tau)
            decay, drive = decay * e, seg[1] + (drive - seg[1]) * e
            ckey = canonical(seg[6])
            if ckey is not None:
                index.setdefault(ckey, i)
        prof = RunProfile(sc, clock_mhz, tuple(segs), tuple(exps), index, result_of(acc),
                          decay, drive)
        self._profiles[(key, clock_mhz)] = prof
        if len(self._profiles) > self.MAX_PROFILES:
            del self._profiles[next(iter(self._profiles))]
        return prof

    # Runs under the limiter ---------------------------------------------------------------

    def _run_limited(self, key: tuple, f_set: float, st: LimiterState) -> RunResult:
        """One run from ``st``: the profile at the clock the limiter allows, followed to
        the end or to a tick that moves the clock; then interval by interval to the first
        point where the profile at the new clock picks the run up; and so on."""
        lim = self.limiter
        assert lim is not None
        prof = self.profile(key, lim.clock(st, f_set))
        whole = prof.result
        if st.since_tick_s + whole.time_s < lim.tick_s * (1 - lim.TICK_SLACK):
            st.avg_power_w = prof.decay * st.avg_power_w + prof.drive_w  # no tick inside
            st.since_tick_s += whole.time_s
            return whole
        acc = [0.0] * (5 + 2 * N_CLS)
        i = 0
        while True:
            cur = self._follow(prof, i, f_set, st, acc)
            if cur is None:
                return result_of(acc)
            found = None
            for at in self._intervals(prof.streams, f_set, key[2], key[4], st, cur, acc):
                ckey = canonical(at)
                if ckey is not None:
                    prof = self.profile(key, lim.clock(st, f_set))
                    found = prof.index.get(ckey)
                    if found is not None:
                        break
            if found is None:
                return result_of(acc)
            i = found

    def _follow(self, prof: RunProfile, start: int, f_set: float, st: LimiterState,
                acc: list[float]) -> Cursor | None:
        """The run from the start of the profile's segment ``start``, its intervals cut at
        ticks as `_intervals` cuts them, until the run ends (None) or a tick moves the
        clock (the cursor there)."""
        lim = self.limiter
        assert lim is not None
        tick, tau = lim.tick_s, lim.tau_s
        due = tick * (1 - lim.TICK_SLACK)
        segs, exps = prof.segments, prof.exps
        for i in range(start, len(segs)):
            seg = segs[i]
            dt_seg, power, f_eff, cls, both, ends = seg[:6]
            left = dt_seg
            while True:
                u = tick - st.since_tick_s
                if u <= 0.0:  # as `until_tick() or tick_s`
                    u = tick
                done = left <= u
                piece = left if done else u
                e = exps[i] if piece == dt_seg else math.exp(-piece / tau)
                st.avg_power_w = power + (st.avg_power_w - power) * e  # as lim.advance
                st.since_tick_s += piece
                left = 0.0 if done else left - piece
                acc[0] += piece
                acc[1] += power * piece
                acc[2] += f_eff * piece
                if both:
                    acc[4] += piece
                acc[5 + cls] += piece
                acc[5 + N_CLS + cls] += power * piece
                if done and ends:
                    acc[3] = acc[0]
                if st.since_tick_s >= due:
                    lim.tick(st, f_set)
                    if lim.clock(st, f_set) != prof.clock_mhz:
                        return cursor_after(seg, dt_seg - left, done)
                if done:
                    break
        return None

    # Interval by interval: the reference ---------------------------------------------------

    @staticmethod
    def _load(sc: Streams, cur: Cursor) -> Cursor | None:
        """The cursor with the next items started where a stream is free (None: the run
        is over)."""
        mi, si, m_cur, s_cur, m_rem, s_rem, launched = cur
        main, side_items, launch_at = sc
        launched = launched or launch_at < 0
        while True:
            if not launched and mi == launch_at and m_cur is None:
                launched = True
            if m_cur is None and mi < len(main):
                m_cur, m_rem = main[mi], 1.0
                mi += 1
            if s_cur is None and launched and si < len(side_items):
                s_cur, s_rem = side_items[si], 1.0
                si += 1
            if m_cur is not None or s_cur is not None:
                return (mi, si, m_cur, s_cur, m_rem, s_rem, launched)
            if launched:
                return None
            launched = True

    def _intervals(self, sc: Streams, f: float, side_sms: int, blocking_sms: int,
                   st: LimiterState | None, cur: Cursor, acc: list[float],
                   trace: list[Segment] | None = None) -> Iterator[Cursor]:
        """The run from ``cur`` interval by interval, added to ``acc`` (time, energy,
        clock x time, compute end, overlap, then per class time and energy); yields the
        cursor at the start of each interval, before running it. With ``st``: under the
        limiter, cut at its ticks; without: at clock ``f`` throughout, throttled per
        interval only by the memoryless limiter (tau = 0). ``trace`` collects the
        intervals."""
        lim = self.limiter if st is not None else None
        throttle = self.limiter is None
        at: Cursor | None = cur
        while True:
            if at is not None and (at[2] is None or at[3] is None):  # a stream is free
                at = self._load(sc, at)
            if at is None:
                return
            yield at
            mi, si, m_cur, s_cur, m_rem, s_rem, launched = at
            f_run = f if lim is None or st is None else lim.clock(st, f)
            d_m, d_s, power, f_eff = self._interval(m_cur, s_cur, f_run, side_sms,
                                                    blocking_sms, throttle)
            dt_m = m_rem * d_m if m_cur is not None else math.inf
            dt_s = s_rem * d_s if s_cur is not None else math.inf
            dt = min(dt_m, dt_s)
            if lim is not None and st is not None:
                dt = min(dt, lim.until_tick(st) or lim.tick_s)
                lim.advance(st, power, dt, f)
            if m_cur is None:
                cls = EXPOSED
            else:
                cls = CLASS_OF[(m_cur[1].breakdown or m_cur[1].kind) if m_cur[0] == "op"
                               else m_cur[0]]
            both = m_cur is not None and s_cur is not None
            ends = m_cur is not None and dt_m <= dt
            if trace is not None:
                trace.append((dt, power, f_eff, cls, both, ends, at, d_m, d_s))
            acc[0] += dt
            acc[1] += power * dt
            acc[2] += f_eff * dt
            acc[5 + cls] += dt
            acc[5 + N_CLS + cls] += power * dt
            if both:
                acc[4] += dt
            if m_cur is not None:
                if ends:
                    m_cur = None
                    acc[3] = acc[0]
                else:
                    m_rem -= dt / d_m
            if s_cur is not None:
                if dt_s <= dt:
                    s_cur = None
                else:
                    s_rem -= dt / d_s
            at = (mi, si, m_cur, s_cur, m_rem, s_rem, launched)
