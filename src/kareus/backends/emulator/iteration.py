"""Whole-iteration simulation: a 1F1B pipeline of instructions, each one continuous run.

The ground truth that validates composed plans, so it does not add up partition
measurements: every instruction runs as one continuous two-stream timeline over all its
steps (outside ops, the solo first segment, every layer's partitions with the plan's knobs
at the instruction's clock and their collectives on the side stream, the exposed last
collective); with ``overlap=False`` (Megatron-LM) the microbatch is not split and every
collective blocks the compute stream. Each pipeline rank's GPU carries its power limiter's state
(kareus.backends.emulator.timeline) from step to step, through the waits between
instructions and across the clock changes between them. Composition instead adds up
steady-state measurements of each partition taken alone: where the limiter's memory spans
partitions (a GEMM-heavy partition beside light ones is throttled less than alone), the
two differ, and that difference is what the validation reports.

Ranks follow the 1F1B order (warm-up forwards,
steady one-forward-one-backward, cool-down backwards; interleaved 1F1B with
``virtual_pipeline > 1``, a rank then running several virtual stages, its model chunks); a
forward waits for the previous stage's forward of the same microbatch plus the activation
transfer, a backward for the next stage's backward plus the gradient transfer. After its
last backward a rank runs the data-parallel gradient sync. A GPU that waits draws static
power.

The host issues each rank's kernels (host.py). Megatron-Core synchronises the device after
each batched P2P exchange, but not every pair of consecutive instructions has one between
them (`kareus.plans.schedule.host_syncs`: a steady forward then backward on the last stage,
a steady backward then forward on the first, a steady step's forward then backward with
interleaving; every pair without a pipeline): there the host's lag carries from one
instruction into the next; elsewhere, and at the iteration's first (the optimizer's
gradient norm is read on the host), the instruction starts from an empty queue. With
``timed_windows`` (Megatron's timers around every forward and backward, as the reference's
profiling runs had them, docs/anchors.md §5) every instruction starts from an empty queue.

Iteration time is the slowest rank's; energy is summed over all GPUs of the job:
sum of dynamic energies (every GPU of a stage does the same work) + GPUs x time x static.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.emulator.host import HostPlan
from kareus.backends.emulator.iteration_result import IterationResult, StageReport
from kareus.backends.emulator.limiter import LimiterState
from kareus.backends.emulator.timeline import KERNEL_CLASSES, RunResult
from kareus.core import ZERO, Knobs, Measurement
from kareus.plans.execution import ExecutionPlan
from kareus.plans.schedule import host_syncs, rank_order, schedule
from kareus.workload.partition import PartitionSet, Step


class IterationSimulator:
    def __init__(self, partitions: PartitionSet, backend: EmulatorBackend) -> None:
        self.ps = partitions
        self.job = partitions.job
        self.backend = backend
        self._instr: dict = {}
        self._runs: dict = {}
        self._instructions: dict = {}
        self._plans_of_steps: dict = {}
        self.host_lag_s = 0.0
        """The host's lag at the end of the last `_continuous` instruction (host.py)."""

    # One instruction ----------------------------------------------------------------------

    def instruction(self, plan: ExecutionPlan, stage: int, direction: str, freq_mhz: int,
                    microbatch: int | None = None) -> Measurement:
        """One instruction's cost; ``microbatch`` selects per-instruction knobs, if any."""
        if plan.runs_sequential(stage, direction, microbatch):
            key: tuple = ("seq", stage, direction, freq_mhz)
            compute = lambda: self._sequential(stage, direction, freq_mhz)  # noqa: E731
        else:
            iid = None if microbatch is None else (stage, microbatch, direction)
            knobs = self._knobs(plan, stage, direction, freq_mhz, iid)
            key = ("ovl", stage, direction, freq_mhz, knobs, plan.default_sms)
            compute = lambda: self._overlapped(stage, direction, freq_mhz, knobs,  # noqa: E731
                                               plan.default_sms)
        hit = self._instr.get(key)
        if hit is None:
            hit = self._instr[key] = compute()
        return hit

    def _knobs(self, plan, stage, direction, freq_mhz, iid) -> tuple:
        keys = self.ps.layouts[(stage, direction)].partition_counts()
        out = []
        for k in sorted(keys):
            c = plan.choice(k, freq_mhz, self.backend.default_sms, iid)
            out.append((k, c.sms, self.ps[k].resolve_slot(c.slot)))
        return tuple(out)

    def _overlapped(self, stage: int, direction: str, freq_mhz: int, knobs: tuple,
                    default_sms: int | None) -> Measurement:
        b = self.backend
        chosen = {k: (sms, slot) for k, sms, slot in knobs}
        total = ZERO
        for step in self.ps.layouts[(stage, direction)].steps:
            if step.kind == "partition":
                assert step.key is not None
                sms, slot = chosen[step.key]
                total = total + b.predict(self.ps[step.key], Knobs(freq_mhz, sms, slot))
            else:
                total = total + self._fixed(step, freq_mhz, default_sms)
        return total

    def _fixed(self, step: Step, freq_mhz: int, sms: int | None = None) -> Measurement:
        """Ops back to back; or a weight gradient GEMM beside its input-gradient collective,
        which is launched with the GEMM (Megatron-Core's allreduce_dgrad)."""
        b = self.backend
        if step.kind == "overlap":
            assert step.unit is not None
            unit = step.unit
            return b.predict(unit, Knobs(freq_mhz, sms or b.default_sms, unit.slots[0].name))
        return b.predict_ops(step.ops, freq_mhz, sms)

    def _sequential(self, stage: int, direction: str, freq_mhz: int) -> Measurement:
        """Megatron-LM: the whole microbatch, collectives blocking but for the input-gradient
        all-reduce beside the weight gradient GEMM, NCCL's default channels."""
        pre, layers, post = self.ps.sequential_steps(stage, direction)
        total = [ZERO, ZERO, ZERO]
        for i, steps in enumerate((pre, self.ps.sequential_layer[direction], post)):
            for step in steps:
                total[i] = total[i] + self._fixed(step, freq_mhz)
        return total[0] + total[1].scaled(layers) + total[2]

    # Continuous instructions ----------------------------------------------------------------

    def _continuous(self, plan: ExecutionPlan, iid: tuple[int, int, str], freq_mhz: int,
                    state: LimiterState, classes: list[float] | None = None,
                    host_lag_s: float = 0.0) -> Measurement:
        """Instruction ``iid`` as one timeline from ``state`` (updated to its end state);
        its time and energy per kernel class are added to ``classes``. ``host_lag_s``: the
        host's lag at its start (0: from an empty queue); the lag at its end is left in
        `host_lag_s`."""
        stage, microbatch, direction = iid
        if plan.runs_sequential(stage, direction, microbatch):
            config: tuple = ("seq", stage, direction)
        else:
            config = ("ovl", stage, direction,
                      self._knobs(plan, stage, direction, freq_mhz, iid), plan.default_sms)
        # a whole instruction from the same (snapped) state is the same run of steps: the
        # first step would snap the state the same way, and each step is a function of it
        self._snap(state)
        runs = self._step_runs(config, freq_mhz)
        # a host ahead by more than the instruction's whole issue time never holds it up
        issue_s = sum(sum(hp.issue_s) for _, _, hp in runs)
        host_key = None if host_lag_s <= -issue_s else host_lag_s
        key = (config, freq_mhz, state.avg_power_w, state.cap_mhz, state.since_tick_s,
               host_key)
        hit = self._instructions.get(key)
        if hit is None:
            t = e = f_s = 0.0
            tally = [0.0] * 2 * len(KERNEL_CLASSES)  # time, then energy, per class
            lag = host_lag_s
            for step_key, run, host in runs:
                r, lag = self._step(step_key, run, freq_mhz, state, host, lag)
                t, e, f_s = t + r.time_s, e + r.energy_j, f_s + r.freq_time_mhz_s
                for i, v in enumerate(r.classes):
                    tally[i] += v
            hit = self._instructions[key] = (
                t, e, f_s, tuple(tally), (state.avg_power_w, state.cap_mhz, state.since_tick_s),
                lag - host_lag_s)
        t, e, f_s, tallied, end, drift = hit
        state.avg_power_w, state.cap_mhz, state.since_tick_s = end
        self.host_lag_s = host_lag_s + drift
        if classes is not None:
            for i, v in enumerate(tallied):
                classes[i] += v
        # the clock run, time-weighted: below the set clock where the limiter held it back
        # (kareus.backends.emulator.transient tells power-limited instructions by it)
        return Measurement.from_time_energy(t, e, self.backend.static_power_w,
                                            f_s / t if t > 0 else float(freq_mhz))

    def _snap(self, state: LimiterState) -> None:
        """Average power to 0.5 W, the control tick's phase to a tenth of a tick."""
        lim = self.backend.timeline.limiter
        if lim is not None:
            state.avg_power_w = round(state.avg_power_w * 2) / 2
            tenths = min(round(state.since_tick_s / lim.tick_s * 10), 9)
            state.since_tick_s = tenths * lim.tick_s / 10

    def _step(self, step_key: tuple, run: Callable[..., RunResult], f: int,
              state: LimiterState, host: HostPlan, host_lag_s: float
              ) -> tuple[RunResult, float]:
        """One step from ``state``, updating it, and the host's lag after it. The state is
        snapped at step boundaries (average power to 0.5 W, the control tick's phase to a
        tenth of a tick), so that the same step from nearly the same state is simulated
        once: a layer's partitions repeat layer after layer from states that converge (and
        a host far enough ahead is the same host to them)."""
        self._snap(state)
        host_key = None if host.hidden(host_lag_s) else host_lag_s
        key = (step_key, f, state.avg_power_w, state.cap_mhz, state.since_tick_s, host_key)
        hit = self._runs.get(key)
        if hit is None:
            st = LimiterState(state.avg_power_w, state.cap_mhz, state.since_tick_s)
            hit = self._runs[key] = (run(state=st, host_lag_s=host_lag_s), st)
        r, end = hit
        state.avg_power_w, state.cap_mhz, state.since_tick_s = (
            end.avg_power_w, end.cap_mhz, end.since_tick_s)
        lag = host_lag_s + host.drift_s if host_key is None else r.host_lag_s
        assert lag is not None
        return r, lag

    def _step_runs(self, config: tuple, f: int
                   ) -> list[tuple[tuple, Callable[..., RunResult], HostPlan]]:
        """The instruction's steps as (identity, timeline run taking the state and the
        host's lag, the host's view of it), in order."""
        cached = self._plans_of_steps.get((config, f))
        if cached is not None:
            return cached
        tl, b = self.backend.timeline, self.backend
        if config[0] == "seq":
            _, stage, direction = config
            pre, layers, post = self.ps.sequential_steps(stage, direction)
            steps = [*pre, *list(self.ps.sequential_layer[direction]) * layers, *post]
            sms = b.default_sms
        else:
            _, stage, direction, knobs, default_sms = config
            steps = list(self.ps.layouts[(stage, direction)].steps)
            sms = default_sms or b.default_sms
            chosen = {k: (n, slot) for k, n, slot in knobs}
        runs: list[tuple[tuple, Callable[..., RunResult], HostPlan]] = []
        for step in steps:
            if step.kind == "partition":
                assert step.key is not None
                p = self.ps[step.key]
                n, slot = chosen[step.key]
                runs.append((("p", p.key, n, slot), partial(
                    tl.run, p.compute_ops, f, side=p.collective, side_sms=n,
                    launch_index=p.launch_index(slot)), tl.host_plan(p.compute_ops, f, 32)))
            elif step.kind == "overlap":
                assert step.unit is not None
                u = step.unit
                runs.append((("u", u.key, sms), partial(
                    tl.run, u.compute_ops, f, side=u.collective, side_sms=sms,
                    launch_index=u.launch_index(u.slots[0].name)),
                    tl.host_plan(u.compute_ops, f, 32)))
            else:
                runs.append((("o", id(step.ops), sms), partial(
                    tl.run, step.ops, f, blocking_sms=sms), tl.host_plan(step.ops, f, sms)))
        self._plans_of_steps[(config, f)] = runs
        return runs

    # The pipeline ---------------------------------------------------------------------------

    def run(self, plan: ExecutionPlan, with_instructions: bool = False,
            timed_windows: bool = False) -> IterationResult:
        """The whole iteration; one `StageReport` per pipeline rank (with interleaved 1F1B
        a rank runs the instructions, transfers and end-of-iteration work of its chunks,
        virtual stages rank, rank + pp, ...: one GPU, one limiter state).
        ``timed_windows``: as a run with Megatron's forward-compute and backward-compute
        timers enabled (megatron/core/timers.py: ``Timer.start`` and ``stop`` call
        ``torch.cuda.synchronize()``), the reference's profiling runs: every instruction
        starts from an empty queue, its time measured from that sync (the host's issue
        time before its first kernel included) to the sync after its last kernel."""
        job, b = self.job, self.backend
        pp, mbs, vp = job.pp, job.num_microbatches, job.virtual_pipeline
        stages = self.ps.graph.stages  # per virtual stage
        # Transfers between stages: both ends wait for each (kareus.plans.schedule); their (small)
        # dynamic energy is counted once, on the sender.
        sends = {s.index: {t.name: b.predict_ops((t,), plan.default_freq_mhz)
                           for t in s.transfers} for s in stages}
        ends = [b.predict_ops(g.iteration_end, plan.default_freq_mhz) if g.iteration_end else ZERO
                for g in stages]
        costs: dict = {}
        reports = [StageReport(r) for r in range(pp)]
        states = [b.timeline.idle_state() for _ in range(pp)]
        free_at = [0.0] * pp
        host_lag = [0.0] * pp
        synced = {iid: s or timed_windows for r in range(pp)
                  for iid, s in zip(rank_order(pp, mbs, r, vp), host_syncs(pp, mbs, r, vp),
                                    strict=True)}

        def duration_at(iid, start: float) -> float:
            s, m, d = iid
            r, f = s % pp, plan.freq(s, m, d)
            b.timeline.rest(states[r], start - free_at[r], f)
            # after a sync the host starts with the GPU; else it kept issuing while the GPU
            # was between instructions (host_syncs)
            lag = 0.0 if synced[iid] else host_lag[r] - (start - free_at[r])
            costs[iid] = self._continuous(plan, iid, f, states[r], reports[r].classes, lag)
            host_lag[r] = self.host_lag_s
            free_at[r] = start + costs[iid].time_s
            return costs[iid].time_s

        def send(s: int, name: str) -> float:
            m = sends[s].get(name)
            return m.time_s if m is not None else 0.0

        timing = schedule(pp, mbs, lambda iid: 0.0,
                          [send(s, "send_activation") for s in range(len(stages))],
                          [send(s, "send_grad") for s in range(len(stages))],
                          [e.time_s for e in ends], duration_at=duration_at, vp=vp)
        for r in range(pp):
            rep = reports[r]
            for s, m, d in rank_order(pp, mbs, r, vp):
                cost = costs[(s, m, d)]
                rep.busy_s += cost.time_s
                rep.dynamic_energy_j += cost.dynamic_energy_j
                if with_instructions:
                    rep.instructions.append({
                        "stage": s, "microbatch": m, "direction": d,
                        "freq_mhz": plan.freq(s, m, d), "start_s": timing.start[(s, m, d)],
                        "time_s": cost.time_s, "dynamic_energy_j": cost.dynamic_energy_j})
            for s in range(r, len(stages), pp):  # the rank's chunks
                for sent in sends[s].values():
                    rep.dynamic_energy_j += sent.dynamic_energy_j * mbs
                    rep.transfers_s += sent.time_s * mbs
                    rep.transfers_j += sent.energy_j * mbs
                rep.busy_s += ends[s].time_s
                rep.dynamic_energy_j += ends[s].dynamic_energy_j
                rep.iteration_end_s += ends[s].time_s
                rep.iteration_end_j += ends[s].energy_j
            rep.end_s = timing.stage_end[r]
        time_s = timing.iteration_s
        gpus_per_rank = job.num_gpus // pp
        dynamic = gpus_per_rank * sum(r.dynamic_energy_j for r in reports)
        static = job.num_gpus * time_s * b.static_power_w
        return IterationResult(plan.name, time_s, dynamic + static, static, dynamic,
                               job.num_gpus, reports, timed_windows)
