"""The one way to open a measuring backend: a backend kind opened for a workload, journal
first (`JournaledBackend`), under a `JournalPolicy` that says how the journal and the
backend meet.

Every consumer (a search task, a profile, a Ray rank, optimize's composition, an
estimate's dry run, a replay) asks here instead of wrapping backends itself, so what
"record", "read only", "rank 0's numbers" and "fill what is missing" mean is decided in one
place: a new policy is a new value, not a flag threaded through each caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from kareus.backends.agreed import Agree, AgreedBackend
from kareus.backends.base import Backend
from kareus.backends.journaled import JournaledBackend
from kareus.backends.registry import BackendSpec, CollectiveFactory
from kareus.job.spec import JobSpec
from kareus.store import Journal, JournalLike, job_id
from kareus.workload.workload import Workload


@dataclass(frozen=True)
class JournalPolicy:
    """How a journal and the backend behind it meet."""

    record: bool = True
    """What is measured is committed to the journal before it is returned. False: the
    journal is read, never written (a dry run, a replay, the ranks other than 0)."""
    agree: Agree | None = None
    """Every answer is rank 0's (`AgreedBackend`): the ranks of a TP/CP group measure in
    lockstep and must decide on the same numbers."""
    fill: Backend | None = None
    """What the journal lacks comes from this backend (a cost model the user opted in to,
    ``--fill-missing``), is never journaled, and is listed in ``filled``."""

    @classmethod
    def rank(cls, rank: int, agree: Agree) -> JournalPolicy:
        """A rank of a group measured together: rank 0 records, every rank decides on rank
        0's numbers."""
        return cls(record=rank == 0, agree=agree)


RECORD = JournalPolicy()
READ_ONLY = JournalPolicy(record=False)


class Group(Protocol):
    """What opening a backend for a group profiled together takes (a torchrun or Ray
    rank's process group, kareus.gpu.distributed.TorchrunGroup)."""

    @property
    def collectives(self) -> CollectiveFactory | None: ...

    def agree(self, value: Any) -> Any: ...


def journal_first(inner: Backend, journal: JournalLike | None, job: JobSpec | str,
                  policy: JournalPolicy = RECORD) -> JournaledBackend:
    """``inner`` through ``journal`` under ``policy`` (``job``: the job, registered in the
    journal where the policy records, or its id). ``journal=None``: a journal in memory,
    kept for the wrapper's life (a search that needs no file journal)."""
    store: JournalLike = Journal(":memory:") if journal is None else journal
    if isinstance(job, str):
        jid = job
    elif isinstance(store, Journal) and policy.record:
        jid = store.register_job(job)
    else:
        jid = job_id(job)
    be = AgreedBackend(inner, policy.agree) if policy.agree is not None else inner
    return JournaledBackend(be, store, jid, record=policy.record, fill=policy.fill)


@contextmanager
def open_measuring(spec: BackendSpec, workload: Workload, journal: JournalLike | str | None,
                   *, group: Group | None = None, policy: JournalPolicy = RECORD,
                   jid: str | None = None) -> Iterator[JournaledBackend]:
    """``spec``'s backend opened for ``workload`` (``group``: the collectives and agreement
    of a group profiled together), journal first through ``journal`` (a path: opened here,
    read only unless the policy records; None: in memory) under ``policy``. ``jid``: the
    job's id, registered already."""
    with ExitStack() as stack:
        if isinstance(journal, str):
            journal = stack.enter_context(Journal(journal, read_only=not policy.record))
        collectives = group.collectives if group is not None else None
        agree = group.agree if group is not None else None
        inner = stack.enter_context(spec.open(workload, collectives, agree))
        yield journal_first(inner, journal, jid or workload.job, policy)
