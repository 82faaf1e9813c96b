"""The replay kind: measurements made elsewhere (a cluster, another run), served from a
journal. It never measures: its backend is the one journal-first wrapper
(kareus.backends.journaled) over a `JournalOnly` description of the backend that measured,
so every answer comes from the journal and a replay's accounting says 0 measured. What the
journal does not hold is one clear error naming it, or, with an explicit ``fill`` backend
(``--fill-missing emulator``), that backend's number, listed in ``filled`` and never
journaled.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kareus.backends.base import Backend
from kareus.backends.journaled import JournaledBackend, JournalOnly
from kareus.backends.measuring import JournalPolicy, journal_first
from kareus.backends.options import option
from kareus.backends.registry import Agree, BackendSpec, Capabilities, CollectiveFactory
from kareus.errors import KareusError, SpecError
from kareus.job.spec import JobSpec
from kareus.store import Journal, job_id, journal_exists
from kareus.workload.workload import Workload


@dataclass(frozen=True)
class ReplaySpec(BackendSpec):
    kind: ClassVar[str] = "replay"
    summary: ClassVar[str] = "a journal's measurements"
    capabilities: ClassVar[Capabilities] = Capabilities()
    replay_journal: str | None = option(None, flag="--replay-journal", help="Replay: the "
                                       "journal whose measurements are served.")
    """The journal whose measurements are served."""
    replay_identity: str | None = option(None, flag="--replay-identity", help="Replay: "
                                        "which backend's measurements, when the journal "
                                        "holds several.")
    """Which backend's measurements (needed when the journal holds several)."""
    compose_only: bool = False
    """Compose plans from the journal alone: no search asks for anything
    (``optimize --measurements``). Otherwise searches and composition ask as on any
    backend, and the journal answers (a replay measures nothing)."""

    def check(self, job: JobSpec, here: bool = True) -> None:
        super().check(job, here)
        if not self.replay_journal:
            raise SpecError("the replay backend needs --replay-journal JOURNAL")
        if not journal_exists(self.replay_journal):
            raise SpecError(f"journal not found: {self.replay_journal}")

    def journal_source(self) -> tuple[str, str | None] | None:
        if not self.compose_only:
            return None
        if self.replay_journal is None:
            raise SpecError("the replay backend needs --replay-journal JOURNAL")
        return self.replay_journal, self.replay_identity

    def open(self, workload: Workload, collectives: CollectiveFactory | None = None,
             agree: Agree | None = None) -> AbstractContextManager[Backend]:
        return self._open(workload)

    @contextmanager
    def _open(self, workload: Workload) -> Iterator[Backend]:
        if self.replay_journal is None:
            raise SpecError("the replay backend needs --replay-journal JOURNAL")
        yield open_replay(self.replay_journal, workload.job, self.replay_identity)


def open_replay(path: str | Path, job: JobSpec, identity: str | None = None,
                fill: Backend | None = None) -> JournaledBackend:
    """``job``'s measurements in the journal at ``path`` by backend ``identity`` (the only
    one there if None), as a backend that measures nothing."""
    where = Path(path)
    jid = job_id(job)
    with Journal(where, read_only=True) as j:  # read, never written
        identity = _choose_identity(j, where, jid, identity)
        info = j.backend_info(identity)
        if info is None:
            raise KareusError(f"journal {where} does not describe backend {identity!r}; "
                              f"backends with measurements of this job: "
                              f"{', '.join(j.identities(jid)) or 'none'}")
        if info.get("gpu") != job.gpu_spec.name:
            raise KareusError(f"journal {where}: backend {identity} measured a "
                              f"{info.get('gpu')}, the job runs on {job.gpu_spec.name}")
        # the journal's rows are read now; the connection is not kept
        return journal_first(JournalOnly(identity, info, job.gpu_spec, str(where)), j, jid,
                             JournalPolicy(record=False, fill=fill))


def _choose_identity(j: Journal, path: Path, jid: str, identity: str | None) -> str:
    if identity is not None:
        return identity
    found = j.identities(jid)
    if len(found) != 1:
        raise KareusError(
            f"journal {path} holds {'no' if not found else 'several backends'}"
            f" measurements of this job{': ' + ', '.join(found) if found else ''}"
            f"{'; choose one with --replay-identity' if found else ''}")
    return found[0]
