"""The board power limiter with memory (docs/emulator.md, "Power").

The board's power, compute and communication together, is averaged exponentially over a
time constant tau; every control tick (tau / 5) the limiter's cap moves one step of the
GPU's clock table: one step below the clock run while the average exceeds the limit, one
step up while it is 2% below. The GPU runs at the lower of the set clock and the cap.
`LimiterState` is the memory one GPU carries from run to run.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class LimiterState:
    """The limiter's memory on one GPU: the averaged power and the clock it allows."""

    avg_power_w: float
    cap_mhz: float
    since_tick_s: float = 0.0


class PowerLimiter:
    """Board power limit on power averaged over ``tau_s`` (exponential average), acting
    every ``tau_s / 5``: one table step down (from the clock it runs) while the average
    exceeds the limit, the cap one step up while it is 2% below. The clock run is the
    lower of the set clock and the cap, so a higher set clock applies at once unless the
    cap holds it back."""

    HYSTERESIS = 0.02
    TICKS_PER_TAU = 5
    TICK_SLACK = 1e-9
    """Relative: a tick due within this share of a tick fires now (no sliver of an
    interval left before it)."""

    def __init__(self, limit_w: float, tau_s: float, table_mhz: Sequence[float]) -> None:
        self.limit_w = limit_w
        self.tau_s = tau_s
        self.tick_s = tau_s / self.TICKS_PER_TAU
        self.table = list(table_mhz)  # ascending

    def clock(self, state: LimiterState, f_set: float) -> float:
        return min(f_set, state.cap_mhz)

    def until_tick(self, state: LimiterState) -> float:
        return max(self.tick_s - state.since_tick_s, 0.0)

    def advance(self, state: LimiterState, power_w: float, dt: float, f_set: float) -> None:
        """``dt`` seconds at ``power_w`` (ending at or before the next tick)."""
        a = math.exp(-dt / self.tau_s)
        state.avg_power_w = power_w + (state.avg_power_w - power_w) * a
        state.since_tick_s += dt
        if state.since_tick_s >= self.tick_s * (1 - self.TICK_SLACK):
            self.tick(state, f_set)

    def tick(self, state: LimiterState, f_set: float) -> None:
        """A control tick: the cap moves by the averaged power."""
        state.since_tick_s = 0.0
        if state.avg_power_w > self.limit_w:
            # down one step from the clock it runs
            i = bisect_right(self.table, self.clock(state, f_set)) - 1
            state.cap_mhz = self.table[max(i - 1, 0)]
        elif state.avg_power_w < self.limit_w * (1 - self.HYSTERESIS):
            # the cap follows power alone: a higher set clock applies at once when
            # power allows, as a clock lock does
            i = bisect_right(self.table, state.cap_mhz) - 1
            state.cap_mhz = self.table[min(i + 1, len(self.table) - 1)]
