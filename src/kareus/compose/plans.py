"""From the options a pipeline solve picked to an ExecutionPlan."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from kareus.compose.instruction import InstructionOption
from kareus.compose.pipeline import PipelineCosts, PipelinePoint, charged_costs
from kareus.core import LAUNCH_FIRST, InstructionId, PartitionSetting
from kareus.plans.execution import ExecutionPlan
from kareus.plans.plan import TimelineEntry
from kareus.plans.schedule import latest_finish, schedule, sends_after


def to_execution_plan(name: str, picks: Mapping[InstructionId, InstructionOption],
                      f_max: int, overlap: bool) -> ExecutionPlan:
    """An ExecutionPlan that runs each instruction with its chosen option."""
    freqs: dict[InstructionId, int] = {}
    settings: dict[InstructionId, dict[str, PartitionSetting]] = {}
    sequential: set[InstructionId] = set()
    for iid, opt in picks.items():
        freqs[iid] = opt.freq_mhz
        if opt.sequential:
            sequential.add(iid)
        elif opt.settings:
            settings[iid] = opt.setting_dict()
    return ExecutionPlan(name, overlap=overlap, default_freq_mhz=f_max,
                         instruction_freqs=freqs, instruction_knobs=settings,
                         default_slot=LAUNCH_FIRST if overlap else None,
                         sequential=frozenset(sequential) if overlap else frozenset())


def timeline(point: PipelinePoint, costs: PipelineCosts, f_max: int
             ) -> list[TimelineEntry]:
    """The point's 1F1B schedule as bars: every instruction with its clock and whether it
    is critical (no float), every transfer after the instruction that sends it, and each
    stage's end-of-iteration work (data-parallel sync, optimizer step: kind "end",
    microbatch -1, at ``f_max``, critical on the rank that ends last). With interleaved
    1F1B every bar's stage is a virtual stage (its rank: stage % pp), and a rank's chunks'
    end-of-iteration bars follow each other after its last instruction. Durations are
    those the point was evaluated with (wait transients included), and so are the
    instructions' dynamic energies (one GPU of the stage); a stage's transfer and
    end-of-iteration dynamic energy (`PipelineCosts.fixed_dynamic_j`) is shared among its
    send and end bars in proportion to their durations (their split is not measured)."""
    charged = charged_costs(point, costs)

    def duration(iid: InstructionId) -> float:
        return charged[iid][0]

    pp, mbs, vp = costs.pp, costs.microbatches, costs.vp
    acts, grads = list(costs.send_activation_s), list(costs.send_grad_s)
    t = schedule(pp, mbs, duration, acts, grads, list(costs.end_s), vp=vp)
    late = latest_finish(pp, mbs, t, duration, acts, grads, costs.end_s, vp=vp)
    tol = 1e-9 * t.iteration_s
    out = []
    for (s, m, d), start in sorted(t.start.items(), key=lambda x: (x[0][0], x[1])):
        crit = bool(late[(s, m, d)] - t.finish[(s, m, d)] <= tol)  # not a numpy bool
        f = point.picks[(s, m, d)].freq_mhz
        out.append(TimelineEntry(s, m, d, start, duration((s, m, d)), f, crit,
                                 charged[(s, m, d)][1]))
        send = sends_after(s, d, costs.stages, acts, grads)
        if send > 0:
            out.append(TimelineEntry(s, m, "send", t.finish[(s, m, d)], send, f, crit))
    for rank in range(pp):
        chunks = range(rank, costs.stages, pp)
        at = t.stage_end[rank] - sum(costs.end_s[s] for s in chunks)
        crit = bool(t.stage_end[rank] >= t.iteration_s - tol)
        for s in chunks:
            if costs.end_s[s] > 0:
                out.append(TimelineEntry(s, -1, "end", at, costs.end_s[s], f_max, crit))
                at += costs.end_s[s]
    return _with_fixed_energy(out, costs.fixed_dynamic_j)


def _with_fixed_energy(entries: list[TimelineEntry], fixed_dynamic_j: Sequence[float]
                       ) -> list[TimelineEntry]:
    """Each stage's fixed dynamic energy over its send and end bars, by duration."""
    busy = [0.0] * len(fixed_dynamic_j)
    for e in entries:
        if e.kind in ("send", "end"):
            busy[e.stage] += e.time_s
    return [replace(e, dynamic_energy_j=fixed_dynamic_j[e.stage] * e.time_s / busy[e.stage])
            if e.kind in ("send", "end") and busy[e.stage] > 0 else e for e in entries]
