"""Wait transients on the emulator: how an instruction runs after its GPU waited.

A measurement (`Timeline.steady`) is an instruction's steady state: repeated back to back,
the power limiter settled at the clock where the averaged power meets the limit. In a
pipeline a rank waits between instructions (sends, a slower neighbour, warm-up and
cool-down bubbles) at static power: the averaged power decays over tau and the cap climbs
one clock-table step per tick, so the next instruction starts above its throttled clock,
runs faster and costs more dynamic energy until the limiter brings it back down
(tests/backends/emulator/test_iteration_scale.py). A `TransientRun` measures that: the
instruction repeated until the limiter settles, ``wait_s`` idle (`Timeline.rest`), then
one run, simulated as the whole-iteration simulation runs it (`IterationSimulator`'s
continuous instruction). At ``wait_s = 0`` it is the next run of the same loop: the
steady state the transients are compared with.

The state before the wait is the instruction's own settled state, not the pipeline's
(where a forward follows a backward): measured at PP8 and PP16 on the 70B preset, charging
each instruction its transient from its own settled state keeps one-clock plans within
~1.3% of the continuous simulation, as close as starting from the stage's 1F1B cycle
(issue 24), and the measurement needs nothing but the instruction.
"""

from __future__ import annotations

from typing import Any

from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.backends.emulator.limiter import LimiterState
from kareus.backends.needs import TransientRun
from kareus.core import LAUNCH_FIRST, Measurement
from kareus.plans.execution import ExecutionPlan
from kareus.workload.partition import PartitionSet
from kareus.workload.workload import Workload

SETTLE_TAUS = 10.0
"""How long the loop runs before the wait, in limiter time constants: the cap moves one
table step per tick (five per tau), so 10 tau let it walk 50 steps (the whole way from the
highest clock to any throttled one on the tables here) and the average forget its start
(e^-10)."""


def emulator_for(workload: Workload, **options: Any) -> EmulatorBackend:
    """The emulator opened for ``workload`` (``options``: `EmulatorBackend`'s), measuring
    its wait transients."""
    backend = EmulatorBackend(workload=workload, **options)
    backend.transients = TransientRuns(backend, workload.partitions)
    return backend


class TransientRuns:
    """One backend's wait transients of the instructions of ``partitions`` (the simulator
    and settled states cached)."""

    def __init__(self, backend: EmulatorBackend, partitions: PartitionSet) -> None:
        self.backend = backend
        self.partitions = partitions
        self._sim = IterationSimulator(partitions, backend)
        self._settled: dict[tuple, LimiterState] = {}

    def measure(self, run: TransientRun, freq_mhz: int) -> Measurement:
        sim = self._sim
        plan = _plan(run, freq_mhz)
        iid = (run.stage, 0, run.direction)
        key = (run.stage, run.direction, run.sequential, run.settings, freq_mhz)
        settled = self._settled.get(key)
        if settled is None:
            settled = self._settled[key] = self._settle(sim, plan, iid, freq_mhz)
        state = LimiterState(settled.avg_power_w, settled.cap_mhz, settled.since_tick_s)
        self.backend.timeline.rest(state, run.wait_s, freq_mhz)
        return sim._continuous(plan, iid, freq_mhz, state)

    def _settle(self, sim: IterationSimulator, plan: ExecutionPlan,
                iid: tuple[int, int, str], freq_mhz: int) -> LimiterState:
        """The limiter's state at the end of the instruction repeated back to back from an
        idle GPU for SETTLE_TAUS time constants (at least twice)."""
        tl = self.backend.timeline
        state = tl.idle_state()
        horizon_s = SETTLE_TAUS * tl.limiter.tau_s if tl.limiter is not None else 0.0
        elapsed_s, runs = 0.0, 0
        while elapsed_s < horizon_s or runs < 2:
            elapsed_s += sim._continuous(plan, iid, freq_mhz, state).time_s
            runs += 1
        return state


def _plan(run: TransientRun, freq_mhz: int) -> ExecutionPlan:
    """An execution plan that runs the transient's instruction (microbatch 0) as asked."""
    iid = (run.stage, 0, run.direction)
    knobs = {iid: dict(run.settings)} if run.settings else {}
    return ExecutionPlan("transient", overlap=not run.sequential, default_freq_mhz=freq_mhz,
                         instruction_knobs=knobs,
                         default_slot=None if run.sequential else LAUNCH_FIRST)

