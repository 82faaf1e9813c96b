"""One interval of the timeline: the items running on the two streams at one clock.

An interval is a stretch of time in which the set of running items does not change: at
most one compute-stream item and at most one communication-stream item. `Intervals`
answers how long each would take at the interval's rates, the GPU's power meanwhile, and
(the memoryless limiter) the clock at which that power fits TDP. Answers are cached: a
sweep meets the same items at the same clock over and over.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Literal

from kareus.backends.emulator.physics import GPUPhysics
from kareus.workload.ops import Collective, ComputeOp

# Item kinds: ("gap", seconds) launch gap; ("host", seconds) wait for the host to issue
# the next kernel (host.py); ("op", ComputeOp); ("lat", seconds) collective latency;
# ("xfer", Collective) collective transfer.
Item = (tuple[Literal["gap", "host", "lat"], float] | tuple[Literal["op"], ComputeOp]
        | tuple[Literal["xfer"], Collective])


class Intervals:
    """Rates and power of one interval on one GPU (cached per items, clock and SMs)."""

    def __init__(self, physics: GPUPhysics, static_power_w: float, tdp_w: float,
                 internode_groups: frozenset[str] = frozenset()) -> None:
        self.ph = physics
        self.static_power_w = static_power_w
        self.tdp_w = tdp_w
        self.internode_groups = internode_groups
        self._table = [float(f) for f in physics.clock_table]  # ascending
        self._cache: dict = {}

    def internode(self, coll: Collective) -> bool:
        """A collective over the network: a pipeline send between nodes, or a group that
        spans nodes."""
        return coll.crosses_nodes or coll.group in self.internode_groups

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
                inter = self.internode(coll)
                coll_demand = ph.coll_hbm_demand(coll, f, side_sms, inter)
                alloc_main, alloc_side = ph.share_hbm(
                    ph.compute_hbm_demand(op, f, sms), coll_demand)
                # the collective's HBM traffic in this interval stalls the kernel's loads
                contention = ph.contention_slowdown(min(coll_demand, alloc_side))
            r = ph.compute_rate(op, f, sms, alloc_main, contention)
            d_main = r.duration_s
            power += r.sm_power_w + r.link_power_w  # link: a CP ring inside attention
            hbm += r.hbm_bytes_s
        elif main is not None and main[0] in ("gap", "host", "lat"):
            # a launch gap or a wait for the host: static power (as any wait) and
            # whatever the side collective draws
            d_main = main[1]
            alloc_side = ph.hbm_bw
            if main[0] == "lat":
                power += ph.coll_latency_power(blocking_sms, f)
        elif main is not None and main[0] == "xfer":
            coll = main[1]
            inter = self.internode(coll)
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
            inter = self.internode(coll)
            r = ph.coll_rate(coll, f, side_sms, alloc_side, inter)
            d_side = r.duration_s
            power += r.sm_power_w + r.link_power_w
            hbm += r.hbm_bytes_s
        power += ph.hbm_power(hbm)
        return d_main, d_side, power, f
