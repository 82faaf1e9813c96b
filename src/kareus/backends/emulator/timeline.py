"""Event-driven timeline of one GPU: a compute stream and a communication stream.

The compute stream runs its items in order (each compute kernel preceded by a launch gap;
a collective placed on the compute stream blocks it, as in Megatron-LM). At most one
collective runs on the communication stream, launched when the compute stream reaches a
given item (its latency phase first, then the transfer). Every start and end of a kernel
recomputes the rates: SMs held by the collective are taken from the compute kernel, HBM
bandwidth is split max-min fairly, and if the demanded power exceeds TDP the clock drops
to the highest supported clock that fits, stretching time.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kareus.backends.emulator.physics import GPUPhysics
from kareus.workload.ops import Collective, ComputeOp, Op

# Item kinds: ("gap", seconds) fixed idle time; ("op", ComputeOp); ("lat", seconds)
# collective latency; ("xfer", Collective) collective transfer.
Item = (tuple[Literal["gap", "lat"], float] | tuple[Literal["op"], ComputeOp]
        | tuple[Literal["xfer"], Collective])


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


class Timeline:
    def __init__(self, physics: GPUPhysics, static_power_w: float, tdp_w: float,
                 internode_groups: frozenset[str] = frozenset()) -> None:
        self.ph = physics
        self.static_power_w = static_power_w
        self.tdp_w = tdp_w
        self.internode_groups = internode_groups
        self._table = [float(f) for f in physics.clock_table]  # ascending
        self._cache: dict = {}

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
            side_sms: int = 0, launch_index: int | None = None, blocking_sms: int = 32
            ) -> RunResult:
        """Run ``ops`` on the compute stream at ``freq_mhz``; optionally ``side`` on the
        communication stream with ``side_sms`` SMs, launched before ``ops[launch_index]``
        (``len(ops)`` or None: after the last op). Collectives inside ``ops`` block the
        compute stream and use ``blocking_sms`` SMs."""
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
            d_m, d_s, power, f_eff = self._interval(m_cur, s_cur, f, side_sms, blocking_sms)
            dt_m = m_rem * d_m if m_cur is not None else float("inf")
            dt_s = s_rem * d_s if s_cur is not None else float("inf")
            dt = min(dt_m, dt_s)
            t += dt
            if m_cur is not None and s_cur is not None:
                overlap += dt
            energy += power * dt
            ftime += f_eff * dt
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
        return RunResult(t, energy, ftime, compute_end, overlap)

    # One interval ---------------------------------------------------------------------------

    def _interval(self, main: Item | None, side: Item | None, f_set: float, side_sms: int,
                  blocking_sms: int) -> tuple[float, float, float, float]:
        key = (main, side, f_set, side_sms, blocking_sms)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        result = self._evaluate(main, side, f_set, side_sms, blocking_sms)
        if result[2] > self.tdp_w:
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
            if side is not None and side[0] == "xfer":
                coll = side[1]
                inter = coll.group in self.internode_groups
                alloc_main, alloc_side = ph.share_hbm(
                    ph.compute_hbm_demand(op, f, sms),
                    ph.coll_hbm_demand(coll, f, side_sms, inter))
            r = ph.compute_rate(op, f, sms, alloc_main)
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
