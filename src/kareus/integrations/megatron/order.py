"""Which instructions a pipeline rank runs inside Megatron-Core, in what order: plain
1F1B (one model chunk per stage) or interleaved 1F1B (Megatron's order: groups of ``pp``
microbatches, every model chunk in turn), read from a plan's timeline and checked against
the order Megatron's schedule runs, so that a plan is never applied to the wrong
instruction; and which jobs a plan can run there at all (`check_job`)."""

from __future__ import annotations

from kareus.core import InstructionId
from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.plans.plan import Plan
from kareus.plans.schedule import one_f_one_b, rank_order

Instruction = tuple[int, str]
"""(microbatch, "forward" | "backward") on this stage."""


def stage_order(plan: Plan, pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """The stage's instructions in the order the plan's timeline runs them (plain 1F1B
    where the plan has no timeline); a timeline that is not a 1F1B order of ``stage`` is
    refused."""
    expected = one_f_one_b(pp, microbatches, stage)
    bars = sorted((e for e in plan.timeline
                   if e.stage == stage and e.kind in ("forward", "backward")),
                  key=lambda e: (e.start_s, e.kind != "backward"))
    if not bars:
        return expected
    order = [(e.microbatch, e.kind) for e in bars]
    if sorted(order) != sorted(expected):
        raise SpecError(f"plan {plan.id}'s timeline of stage {stage} does not hold the "
                        f"{len(expected)} instructions of {microbatches} microbatches")
    return order


def rank_instructions(plan: Plan, job: JobSpec, rank: int) -> list[InstructionId]:
    """Pipeline rank ``rank``'s instructions, (virtual stage, microbatch, direction), in
    the order of the plan's timeline. Plain 1F1B: `stage_order`. Interleaved 1F1B: the
    timeline must run exactly Megatron's interleaved order (`rank_order`: Megatron's
    schedule table, groups of ``pp`` microbatches, every chunk in turn), which is the only
    order Megatron's schedule runs; a plan whose timeline has another is refused here, not
    halfway through a step."""
    pp, microbatches, vp = job.pp, job.num_microbatches, job.virtual_pipeline
    if vp == 1:
        return [(rank, m, d) for m, d in stage_order(plan, pp, microbatches, rank)]
    expected = rank_order(pp, microbatches, rank, vp)
    position = {iid: i for i, iid in enumerate(expected)}
    bars = [e for e in plan.timeline
            if e.stage % pp == rank and e.kind in ("forward", "backward")]
    if not bars:
        return expected
    # equal starts (instructions of no duration) are taken in Megatron's order
    bars.sort(key=lambda e: (e.start_s, position.get((e.stage, e.microbatch, e.kind),
                                                     len(expected))))
    order = [(e.stage, e.microbatch, e.kind) for e in bars]
    if sorted(order) != sorted(expected):
        raise SpecError(f"plan {plan.id}'s timeline of pipeline rank {rank} does not hold "
                        f"the {len(expected)} instructions of {microbatches} microbatches "
                        f"on {vp} model chunks (virtual stages "
                        f"{', '.join(str(c * pp + rank) for c in range(vp))})")
    if order != expected:
        i = next(i for i, (a, b) in enumerate(zip(order, expected, strict=True)) if a != b)
        raise SpecError(f"plan {plan.id}'s timeline of pipeline rank {rank} is not "
                        f"Megatron's interleaved 1F1B order: its instruction {i + 1} is "
                        f"{describe(order[i], pp)}, Megatron runs {describe(expected[i], pp)}")
    return order


def describe(iid: InstructionId, pp: int) -> str:
    """An instruction in words, for refusals."""
    stage, microbatch, direction = iid
    return (f"the {direction} of microbatch {microbatch} on model chunk {stage // pp} "
            f"(virtual stage {stage})")


def check_job(job: JobSpec) -> None:
    """What a plan can run inside Megatron-Core: TP with or without sequence parallelism,
    or TP with context parallelism (kareus.integrations.megatron.layer.SUPPORTED), on plain
    or interleaved 1F1B."""
    if job.cp > 1 and job.sequence_parallel:
        raise SpecError("the plan's job uses context parallelism with sequence parallelism, "
                        "which the Kareus layer for Megatron-Core does not run; supported: "
                        "tensor parallelism with or without sequence parallelism, or with "
                        "context parallelism (without sequence parallelism), plain or "
                        "interleaved 1F1B")
