"""How a microbatch is split into the two nanobatches Kareus overlaps (docs/workload.md).

``batch``: along the batch, each nanobatch half the sequences (an even micro-batch size).
``sequence``: along the sequence, each nanobatch the first or the second half of every
sequence's tokens (micro-batch size 1, the common case of large models): every op but the
attention core is a batch split's, and the second half's queries also attend to the first
half's keys. A job's default is ``batch`` where its micro-batch size is even, ``sequence``
where it is 1 and the sequence halves (an even length, no CP, no SP), no split
otherwise (an odd size > 1: Megatron-LM and Perseus run the microbatch whole).
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args


class JobSpec(Protocol):
    """What the rules read of a `kareus.job.spec.JobSpec` (which imports this module)."""

    micro_batch_size: int
    seq_length: int
    tp: int
    cp: int
    sequence_parallel: bool

NanobatchSplit = Literal["batch", "sequence"]
NANOBATCH_SPLITS: tuple[str, ...] = get_args(NanobatchSplit)
"""The splits, for checks and messages (the runtime's `LayerPlan`, Megatron's layer)."""


def sequence_split_problem(job: JobSpec) -> str | None:
    """Why the job's sequences cannot be halved into two nanobatches (None: they can)."""
    if job.cp > 1:  # CP's load-balanced chunks already cut the sequence: out of scope
        return f"a sequence split does not run with context parallelism (cp={job.cp}); use cp=1"
    if job.seq_length % 2 != 0:
        return f"a sequence split halves each sequence: seq_length {job.seq_length} is odd"
    if job.sequence_parallel:
        # SP gives each TP rank one contiguous chunk of the sequence, so each half lives on
        # half of the ranks: the halves' all-gathers and reduce-scatters would need another
        # token layout through the whole model (embedding to loss), which Kareus does not run
        return ("a sequence split does not run with sequence parallelism (each half of the "
                "sequence sits on half of the TP ranks); use sequence_parallel false, or an "
                "even micro-batch size")
    return None


def default_split(job: JobSpec) -> NanobatchSplit | None:
    """The split a job gets when it names none: ``batch`` at an even micro-batch size,
    ``sequence`` at 1 where the sequence halves, else None (no nanobatches)."""
    if job.micro_batch_size % 2 == 0:
        return "batch"
    if job.micro_batch_size == 1 and sequence_split_problem(job) is None:
        return "sequence"
    return None


def resolve_split(job: JobSpec, asked: NanobatchSplit | None) -> NanobatchSplit | None:
    """The job's split: ``asked`` checked (ValueError in one line), or the default."""
    if asked is None:
        return default_split(job)
    if asked == "batch" and job.micro_batch_size % 2 != 0:
        raise ValueError(f"a batch split needs an even micro-batch size (this job has "
                         f"{job.micro_batch_size}); split the sequence instead "
                         f"(nanobatch_split: sequence)")
    if asked == "sequence" and (problem := sequence_split_problem(job)) is not None:
        raise ValueError(problem)
    return asked


def requirement(job: JobSpec) -> str:
    """What a job that has no nanobatches would need, for messages."""
    if job.micro_batch_size == 1 and (problem := sequence_split_problem(job)) is not None:
        return f"a sequence split at micro-batch size 1, but {problem}"
    return (f"an even micro-batch size (a batch split, this job has "
            f"{job.micro_batch_size}) or nanobatch_split: sequence (the default at "
            f"micro-batch size 1)")
