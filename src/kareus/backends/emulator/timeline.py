"""Event-driven timeline of one GPU: a compute stream and a communication stream.

The compute stream runs its items in order (each compute kernel preceded by a launch gap;
a collective placed on the compute stream blocks it, as in Megatron-LM). At most one
collective runs on the communication stream, launched when the compute stream reaches a
given item (its latency phase first, then the transfer). Every start and end of a kernel
recomputes the rates: SMs held by the collective are taken from the compute kernel, HBM
bandwidth is split max-min fairly.

The board's power limiter has memory (`PowerLimiter`): it acts on the power averaged over
a time constant tau, one clock-table step per control tick, for compute and communication
alike. A burst shorter than tau is not throttled; a sustained GEMM is, and then dithers
between two table clocks around the limit. ``tau = 0`` is the memoryless limiter (each
interval at the highest clock whose power fits, instantly). A measurement (`steady`) is
the GPU's periodic steady state while the run repeats, as in a profiling window; a
continuous simulation carries one `LimiterState` across runs (docs/emulator.md).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kareus.backends.emulator.limiter import LimiterState, PowerLimiter
from kareus.backends.emulator.physics import GPUPhysics
from kareus.workload.ops import Collective, ComputeOp, Op

# Item kinds: ("gap", seconds) fixed idle time; ("op", ComputeOp); ("lat", seconds)
# collective latency; ("xfer", Collective) collective transfer.
Item = (tuple[Literal["gap", "lat"], float] | tuple[Literal["op"], ComputeOp]
        | tuple[Literal["xfer"], Collective])


def _fields(r: RunResult) -> tuple[float, float, float, float, float]:
    return (r.time_s, r.energy_j, r.freq_time_mhz_s, r.compute_end_s, r.overlap_s)


def _from_fields(values: Sequence[float]) -> RunResult:
    """The inverse of `_fields` (an average of runs: no per-class tally)."""
    t, e, f, c, o = values
    return RunResult(t, e, f, c, o)


KERNEL_CLASSES: tuple[str, ...] = ("gemm", "attention", "memory", "launch_gap",
                                   "collective_exposed")
"""What an interval of a run is charged to (`RunResult.classes`): the kind of the compute
stream's kernel; a launch gap; or a collective the compute stream waits for (a blocking one,
or the side one outlasting the compute). A collective beside a compute kernel is hidden:
its time is the kernel's (`RunResult.overlap_s`), its power is in the kernel's interval."""
_CLASS_OF = {"gemm": 0, "attention": 1, "memory": 2, "gap": 3, "lat": 4, "xfer": 4}
_EXPOSED = 4


@dataclass(frozen=True)
class RunResult:
    time_s: float
    energy_j: float
    freq_time_mhz_s: float
    """Integral of the effective clock over time (divide by time for the mean clock)."""
    compute_end_s: float
    """When the compute stream finished (before the end when the collective outlasts it)."""
    overlap_s: float
    """Time during which the communication stream ran alongside the compute stream."""
    classes: tuple[float, ...] = ()
    """Time (s) then energy (J, static included) per `KERNEL_CLASSES` entry: they add up to
    ``time_s`` and ``energy_j``. Set by `Timeline.run`; empty for steady-state averages."""


class Timeline:
    def __init__(self, physics: GPUPhysics, static_power_w: float, tdp_w: float,
                 internode_groups: frozenset[str] = frozenset()) -> None:
        self.ph = physics
        self.static_power_w = static_power_w
        self.tdp_w = tdp_w
        self.internode_groups = internode_groups
        self._table = [float(f) for f in physics.clock_table]  # ascending
        self._cache: dict = {}
        tau = physics.p.limiter_tau_s
        self.limiter = PowerLimiter(tdp_w, tau, self._table) if tau > 0 else None

    def idle_state(self) -> LimiterState:
        """A GPU that has been idle: averaged power at static, no clock held back."""
        return LimiterState(self.static_power_w, self._table[-1])

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

    # Items ----------------------------------------------------------------------------------

    def stream_items(self, ops: Sequence[Op]) -> list[list[Item]]:
        """Per op, the items it puts on the compute stream."""
        out: list[list[Item]] = []
        overhead = self.ph.p.launch_overhead_s
        for op in ops:
            if isinstance(op, Collective):
                out.append(self.collective_items(op))
            else:
                kernels = max(1, len(op.gemm_shapes))
                out.append([("gap", overhead * kernels), ("op", op)])
        return out

    def collective_items(self, coll: Collective) -> list[Item]:
        return [("lat", self.ph.coll_latency(coll)), ("xfer", coll)]

    # Running --------------------------------------------------------------------------------

    def run(self, ops: Sequence[Op], freq_mhz: int, side: Collective | None = None,
            side_sms: int = 0, launch_index: int | None = None, blocking_sms: int = 32,
            state: LimiterState | None = None) -> RunResult:
        """Run ``ops`` on the compute stream at ``freq_mhz``; optionally ``side`` on the
        communication stream with ``side_sms`` SMs, launched before ``ops[launch_index]``
        (``len(ops)`` or None: after the last op). Collectives inside ``ops`` block the
        compute stream and use ``blocking_sms`` SMs. ``state``: the limiter's memory,
        carried in and updated (None: a GPU that has been idle)."""
        lim = self.limiter
        st = state if state is not None else self.idle_state()
        per_op = self.stream_items(ops)
        if side is not None and launch_index is None:
            launch_index = len(ops)
        main: list[Item] = []
        launch_at = None  # position in `main` where the side collective is launched
        for i, items in enumerate(per_op):
            if side is not None and i == launch_index:
                launch_at = len(main)
            main += items
        if side is not None and launch_at is None:
            launch_at = len(main)
        side_items = self.collective_items(side) if side is not None else []

        t = energy = ftime = compute_end = overlap = 0.0
        n_cls = len(KERNEL_CLASSES)
        tally = [0.0] * (2 * n_cls)
        mi, si = 0, 0  # next item index on each stream
        m_cur: Item | None = None
        s_cur: Item | None = None
        m_rem = s_rem = 0.0  # remaining fraction of the current item
        side_launched = side is None
        f = float(freq_mhz)
        while True:
            if not side_launched and mi == launch_at and m_cur is None:
                side_launched = True
            if m_cur is None and mi < len(main):
                m_cur, m_rem = main[mi], 1.0
                mi += 1
            if s_cur is None and side_launched and si < len(side_items):
                s_cur, s_rem = side_items[si], 1.0
                si += 1
            if m_cur is None and s_cur is None:
                if not side_launched:
                    side_launched = True
                    continue
                break
            f_run = f if lim is None else lim.clock(st, f)
            d_m, d_s, power, f_eff = self._interval(m_cur, s_cur, f_run, side_sms,
                                                    blocking_sms, throttle=lim is None)
            dt_m = m_rem * d_m if m_cur is not None else float("inf")
            dt_s = s_rem * d_s if s_cur is not None else float("inf")
            dt = min(dt_m, dt_s)
            if lim is not None:
                dt = min(dt, lim.until_tick(st) or lim.tick_s)
                lim.advance(st, power, dt, f)
            t += dt
            if m_cur is not None and s_cur is not None:
                overlap += dt
            energy += power * dt
            ftime += f_eff * dt
            if m_cur is None:
                cls = _EXPOSED
            else:
                cls = _CLASS_OF[m_cur[1].kind if m_cur[0] == "op" else m_cur[0]]
            tally[cls] += dt
            tally[n_cls + cls] += power * dt
            if m_cur is not None:
                if dt_m <= dt:
                    m_cur = None
                    compute_end = t
                else:
                    m_rem -= dt / d_m
            if s_cur is not None:
                if dt_s <= dt:
                    s_cur = None
                else:
                    s_rem -= dt / d_s
        return RunResult(t, energy, ftime, compute_end, overlap, tuple(tally))

    # A measurement: the run repeated, in the limiter's steady state ------------------------

    WARMUP_TAUS = 3.0
    MEASURE_TAUS = 2.0
    MEAN_FIELD_RUNS_PER_TICK = 4.0

    def steady(self, ops: Sequence[Op], freq_mhz: int, side: Collective | None = None,
               side_sms: int = 0, launch_index: int | None = None, blocking_sms: int = 32
               ) -> RunResult:
        """Per run, the run repeated back to back as in a profiling window, once the
        limiter has settled. Runs several times shorter than a control tick see only their
        average power: then the mean-field limit (the runs at the two table clocks around
        the limit, mixed so that the average power is the limit) stands in for simulating
        thousands of them; longer runs are simulated: warm-up, then the mean over whole
        runs of at least MEASURE_TAUS time constants."""
        args = (ops, freq_mhz, side, side_sms, launch_index, blocking_sms)
        lim = self.limiter
        first = self.run(*args)
        if lim is None or first.time_s <= 0:
            return first
        if first.time_s * self.MEAN_FIELD_RUNS_PER_TICK <= lim.tick_s:
            return self._mean_field(args, first)
        st = LimiterState(first.energy_j / first.time_s, float(freq_mhz))
        t_warm = 0.0
        runs = 0
        while t_warm < self.WARMUP_TAUS * lim.tau_s or runs < 2:
            t_warm += self.run(*args, state=st).time_s
            runs += 1
        total = [0.0, 0.0, 0.0, 0.0, 0.0]
        runs = 0
        while total[0] < self.MEASURE_TAUS * lim.tau_s or runs < 1:
            r = self.run(*args, state=st)
            total = [a + b for a, b in zip(total, _fields(r), strict=True)]
            runs += 1
        return _from_fields([v / runs for v in total])

    def _mean_field(self, args: tuple, at_set: RunResult) -> RunResult:
        """Short runs under a limiter with memory: the clock settles where the average
        power meets the limit, dithering between the two table clocks around it."""
        ops, f_set, side, side_sms, launch, blocking = args
        if at_set.energy_j / at_set.time_s <= self.tdp_w:
            return at_set
        clocks = [f for f in self._table if f <= f_set]
        hi_run = at_set
        for f in reversed(clocks[:-1]):
            lo_run = self._fixed_clock_run(ops, int(f), side, side_sms, launch, blocking)
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

    def _fixed_clock_run(self, ops: Sequence[Op], f: int, side: Collective | None,
                         side_sms: int, launch: int | None, blocking: int) -> RunResult:
        """One run at clock ``f`` whatever its power (a fresh state held at ``f``)."""
        st = LimiterState(0.0, float(f))
        return self.run(ops, f, side, side_sms, launch, blocking, state=st)

    # One interval ---------------------------------------------------------------------------

    def _interval(self, main: Item | None, side: Item | None, f_set: float, side_sms: int,
                  blocking_sms: int, throttle: bool = True
                  ) -> tuple[float, float, float, float]:
        key = (main, side, f_set, side_sms, blocking_sms, throttle)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        result = self._evaluate(main, side, f_set, side_sms, blocking_sms)
        if throttle and result[2] > self.tdp_w:
            result = self._throttle(main, side, f_set, side_sms, blocking_sms)
        self._cache[key] = result
        return result

    def _throttle(self, main, side, f_set, side_sms, blocking_sms):
        """Highest supported clock below ``f_set`` whose power fits under TDP."""
        lo, hi = 0, bisect_right(self._table, f_set) - 1  # candidate indices, ascending
        best = self._evaluate(main, side, self._table[0], side_sms, blocking_sms)
        while lo <= hi:
            mid = (lo + hi) // 2
            r = self._evaluate(main, side, self._table[mid], side_sms, blocking_sms)
            if r[2] <= self.tdp_w:
                best, lo = r, mid + 1
            else:
                hi = mid - 1
        return best

    def _evaluate(self, main: Item | None, side: Item | None, f: float, side_sms: int,
                  blocking_sms: int) -> tuple[float, float, float, float]:
        """(main duration, side duration, power, clock) with this set of items at clock f."""
        ph = self.ph
        n = ph.n_sm
        side_kind = side[0] if side is not None else None
        power = self.static_power_w
        hbm = 0.0
        d_main = d_side = 0.0
        side_holds = side_sms if side_kind in ("lat", "xfer") else 0

        if main is not None and main[0] == "op":
            op = main[1]
            sms = n - side_holds
            alloc_main = alloc_side = ph.hbm_bw
            contention = 1.0
            if side is not None and side[0] == "xfer":
                coll = side[1]
                inter = coll.group in self.internode_groups
                coll_demand = ph.coll_hbm_demand(coll, f, side_sms, inter)
                alloc_main, alloc_side = ph.share_hbm(
                    ph.compute_hbm_demand(op, f, sms), coll_demand)
                # the collective's HBM traffic in this interval stalls the kernel's loads
                contention = ph.contention_slowdown(min(coll_demand, alloc_side))
            r = ph.compute_rate(op, f, sms, alloc_main, contention)
            d_main = r.duration_s
            power += r.sm_power_w
            hbm += r.hbm_bytes_s
        elif main is not None and main[0] in ("gap", "lat"):
            d_main = main[1]
            alloc_side = ph.hbm_bw
            if main[0] == "lat":
                power += ph.coll_latency_power(blocking_sms, f)
        elif main is not None and main[0] == "xfer":
            coll = main[1]
            inter = coll.group in self.internode_groups
            r = ph.coll_rate(coll, f, blocking_sms, ph.hbm_bw, inter)
            d_main = r.duration_s
            power += r.sm_power_w + r.link_power_w
            hbm += r.hbm_bytes_s
            alloc_side = ph.hbm_bw
        else:
            alloc_side = ph.hbm_bw

        if side is not None and side[0] == "lat":
            d_side = side[1]
            power += ph.coll_latency_power(side_sms, f)
        elif side is not None and side[0] == "xfer":
            coll = side[1]
            inter = coll.group in self.internode_groups
            r = ph.coll_rate(coll, f, side_sms, alloc_side, inter)
            d_side = r.duration_s
            power += r.sm_power_w + r.link_power_w
            hbm += r.hbm_bytes_s
        power += ph.hbm_power(hbm)
        return d_main, d_side, power, f
