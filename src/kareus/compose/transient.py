"""What an instruction costs beyond its steady state after its rank waited (issue 24).

Composition charges an instruction its steady-state measurement: repeated back to back,
the power limiter settled. In the pipeline a rank waits between instructions (sends, a
slower neighbour, bubbles); a power-limited instruction then starts above its throttled
clock, runs faster and costs more dynamic energy. Each option that is power-limited gets a
`Transient`: the difference (time, dynamic energy) between its run after a wait and its
steady run, both measured by the backend as one `TransientRun` need each (journal first),
at waits on a geometric grid (`WAIT_GRID_STEPS`, in WAIT_STEP_S, up to WAIT_HORIZON_S) and
interpolated linearly between them: the limiter recovers exponentially during a wait, so
the difference changes fastest for short waits, and ten waits per option cost a twentieth
of the measurements of a uniform 0.5 ms grid (3,968 on the 1,024-GPU job). An option whose
steady run holds its set clock is never throttled, so a wait changes nothing: its
difference is zero and nothing more is measured.
"""

from __future__ import annotations

from collections.abc import Callable

from kareus.backends.needs import Need, TransientRun
from kareus.core import Measurement

WAIT_STEP_S = 0.5e-3
"""Waits are measured on this grid: the limiter acts once per tick (2 ms at tau 10 ms), so
half a millisecond resolves the tick a wait ends in."""
WAIT_HORIZON_S = 0.1
"""Waits longer than this count as this long: the averaged power has then decayed over ten
time constants (tau 10 ms) and the cap has climbed 50 table steps, as good as an idle GPU.
A rank's first instruction (nothing before it this iteration) is charged this wait."""

WAIT_GRID_STEPS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 200)
"""The measured waits, in WAIT_STEP_S: 0 to 100 ms, doubling."""

Answer = Callable[[Need], Measurement | None]
"""A need's measurement, or None where the backend cannot measure transients."""


class Transient:
    """One instruction option's extra (time, dynamic energy) after a wait."""

    def __init__(self, answer: Answer, stage: int, direction: str, freq_mhz: int, sms: int,
                 sequential: bool, settings: tuple) -> None:
        self._answer = answer
        self._run = (stage, direction, sequential, settings)
        self._freq_mhz = freq_mhz
        self._sms = sms
        self._delta: dict[int, tuple[float, float]] = {}
        self._steady: Measurement | None = None
        self._throttled: bool | None = None

    def _measure(self, steps: int) -> Measurement | None:
        stage, direction, sequential, settings = self._run
        run = TransientRun(stage, direction, steps * WAIT_STEP_S, sequential, settings)
        return self._answer(Need.of_transient(run, self._freq_mhz, self._sms))

    @property
    def throttled(self) -> bool:
        """Whether the option's steady run is held below its set clock (measured once;
        False where the backend cannot measure transients)."""
        if self._throttled is None:
            self._steady = self._measure(0)
            # the time-weighted clock equals the set clock but for float rounding when the
            # limiter never acted
            self._throttled = bool(self._steady is not None and self._steady.effective_freq_mhz
                                   < self._freq_mhz * (1 - 1e-9))
        return self._throttled

    def delta(self, wait_s: float) -> tuple[float, float]:
        """(time, dynamic energy) beyond the steady run after ``wait_s`` idle, interpolated
        between the two measured waits around it."""
        if not self.throttled:
            return 0.0, 0.0
        x = min(max(wait_s, 0.0), WAIT_HORIZON_S) / WAIT_STEP_S
        hi = next(i for i, g in enumerate(WAIT_GRID_STEPS) if g >= x)
        if WAIT_GRID_STEPS[hi] == x or hi == 0:
            return self._measured(WAIT_GRID_STEPS[hi])
        a, b = WAIT_GRID_STEPS[hi - 1], WAIT_GRID_STEPS[hi]
        (ta, ea), (tb, eb) = self._measured(a), self._measured(b)
        w = (x - a) / (b - a)
        return ta + w * (tb - ta), ea + w * (eb - ea)

    def _measured(self, steps: int) -> tuple[float, float]:
        hit = self._delta.get(steps)
        if hit is None:
            after, steady = self._measure(steps), self._steady
            assert steady is not None
            hit = (0.0, 0.0) if after is None else (
                after.time_s - steady.time_s, after.dynamic_energy_j - steady.dynamic_energy_j)
            self._delta[steps] = hit
        return hit
