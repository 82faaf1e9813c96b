"""The SQLite journal: every measurement is stored before it is used.

One row per (job, partition key, backend, knobs), or per (job, run of ops, backend, clock,
SMs) for what composition measures outside partitions, committed as soon as it is
measured, in
WAL mode so that a process killed at any moment (SIGKILL included) loses nothing that was
committed, and so that several searches (processes) can write to one journal at once.
A search that finds its settings in the journal reuses them instead of measuring again.

What is taken for a journal and how its file is opened, made and upgraded:
`kareus.store.file`; the tables it holds: `kareus.store.schema`.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kareus.core import Knobs, Measurement
from kareus.core.measurement import FIELDS
from kareus.job.spec import JobSpec
from kareus.store.file import (
    JournalError,
    connect_rw,
    in_use_note,
    journal_exists,
    journal_lock_file,
    open_journal,
    recognise,
)
from kareus.store.schema import APPLICATION_ID, JOURNAL_SCHEMA_VERSION, SCHEMA_SQL, TABLES

__all__ = ["APPLICATION_ID", "JOURNAL_SCHEMA_VERSION", "Journal", "JournalError",
           "JournalLike", "StoredSample", "in_use_note", "job_id", "journal_exists",
           "journal_lock_file", "recognise"]

_MEASUREMENT_COLUMNS = ("time_s, energy_j, static_energy_j, dynamic_energy_j, avg_power_w, "
                        "effective_freq_mhz")

_NONE_SLOT = "none"  # SQL NULLs are never equal, so the no-overlap slot is stored as text


def job_id(job: JobSpec) -> str:
    """The job's stable identity (`JobSpec.id`, kareus.job.identity: computed once, when
    the job is validated); the journal names the job by it."""
    return job.id


@dataclass(frozen=True)
class StoredSample:
    knobs: Knobs
    measurement: Measurement


class JournalLike(Protocol):
    """What measuring code (the search loop, `JournaledBackend`) asks of a journal:
    `Journal`, or a stand-in on a machine that cannot open it (a Ray rank's proxy that
    reads a snapshot and sends its writes to the driver, `kareus.profiling.ray_rank`)."""

    def register_backend(self, identity: str, info: dict[str, object]) -> None: ...

    def record(self, jid: str, partition: str, backend: str, knobs: Knobs, m: Measurement
               ) -> None: ...

    def record_ops(self, jid: str, ops: str, backend: str, freq_mhz: int, sms: int,
                   m: Measurement) -> None: ...

    def samples(self, jid: str, partition: str, backend: str) -> list[StoredSample]: ...

    def partition_samples(self, jid: str, backend: str
                          ) -> dict[tuple[str, Knobs], Measurement]: ...

    def op_samples(self, jid: str, backend: str
                   ) -> dict[tuple[str, int, int], Measurement]: ...

    def record_fitted(self, jid: str, backend: str, kind: str, key: str, knobs: Knobs,
                      m: Measurement, time_rel_error: float, energy_rel_error: float,
                      measured_freqs_mhz: Sequence[int]) -> None: ...

    def fitted(self, jid: str, backend: str) -> dict[tuple[str, str, int, int, str | None],
                                                     tuple[float, float]]: ...


class Journal:
    """A journal opened to write (``read_only=False``: made where nothing is, a version-1
    journal upgraded after a backup beside it) or to read (it must exist; nothing is
    written, so it works on read-only media). Either way the file is recognised as a
    journal (`recognise`) before anything touches it."""

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self.backup: Path | None = None
        """Where a version-1 journal was copied before this open upgraded it."""
        if str(path) == ":memory:":
            self.conn = connect_rw(":memory:")
            self.conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            self.conn.executescript(SCHEMA_SQL)
            self.conn.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)",
                              (str(JOURNAL_SCHEMA_VERSION),))
            self._tables = set(TABLES)
            return
        self.conn, self._tables, self.backup = open_journal(self.path, read_only)

    def _close_quietly(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None:
            conn.close()

    @contextmanager
    def _tx(self) -> Iterator[None]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Writing ------------------------------------------------------------------------------

    def register_job(self, job: JobSpec) -> str:
        return self.register_job_doc(job.id, job.model_dump(mode="json"))

    def register_job_doc(self, jid: str, doc: dict[str, Any]) -> str:
        """`register_job` for a job already serialised (``doc``, its JSON dict) and named
        (``jid``, its `JobSpec.id`): what the search tasks carry."""
        try:
            with self._tx():
                self.conn.execute(
                    "INSERT OR IGNORE INTO jobs(job_id, job_json) VALUES (?, ?)",
                    (jid, json.dumps(doc, sort_keys=True)))
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"cannot write to journal {self.path}: {exc}") from None
        return jid

    def record(self, jid: str, partition: str, backend: str, knobs: Knobs, m: Measurement
               ) -> None:
        """Store one measurement and commit before returning."""
        try:
            with self._tx():
                self.conn.execute(
                    "INSERT OR IGNORE INTO measurements(job_id, partition, backend, freq_mhz, "
                    "sms, slot, time_s, energy_j, static_energy_j, dynamic_energy_j, "
                    "avg_power_w, effective_freq_mhz, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (jid, partition, backend, knobs.freq_mhz, knobs.sms,
                     knobs.slot or _NONE_SLOT, m.time_s, m.energy_j, m.static_energy_j,
                     m.dynamic_energy_j, m.avg_power_w, m.effective_freq_mhz, time.time()))
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"cannot write to journal {self.path}: {exc}") from None

    def register_backend(self, identity: str, info: dict[str, object]) -> None:
        """What a replay needs to know of the backend behind ``identity`` (its GPU, static
        power, default SMs, measurement protocol); the first registration stays."""
        try:
            with self._tx():
                self.conn.execute(
                    "INSERT OR IGNORE INTO backends(identity, info_json) VALUES (?, ?)",
                    (identity, json.dumps(info, sort_keys=True)))
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"cannot write to journal {self.path}: {exc}") from None

    def record_ops(self, jid: str, ops: str, backend: str, freq_mhz: int, sms: int,
                   m: Measurement) -> None:
        """Store one measurement of a run of ops (``ops``: its `ops_signature`)."""
        try:
            with self._tx():
                self.conn.execute(
                    "INSERT OR IGNORE INTO op_measurements(job_id, ops, backend, freq_mhz, sms,"
                    f" {_MEASUREMENT_COLUMNS}, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (jid, ops, backend, freq_mhz, sms, *(getattr(m, f) for f in FIELDS),
                     time.time()))
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"cannot write to journal {self.path}: {exc}") from None

    def record_fitted(self, jid: str, backend: str, kind: str, key: str, knobs: Knobs,
                      m: Measurement, time_rel_error: float, energy_rel_error: float,
                      measured_freqs_mhz: Sequence[int]) -> None:
        """Store a fitted number (``kind``: "partition" or "ops", ``key`` the partition or
        ops signature) where measurements are looked up, and that it was fitted, with the
        fit's held-out errors and the clocks measured for it: one transaction."""
        table, col = (("measurements", "partition") if kind == "partition"
                      else ("op_measurements", "ops"))
        slot_cols, slot_vals = (("slot, ", (knobs.slot or _NONE_SLOT,))
                                if kind == "partition" else ("", ()))
        try:
            with self._tx():
                self.conn.execute(
                    f"INSERT OR IGNORE INTO {table}(job_id, {col}, backend, freq_mhz, sms, "
                    f"{slot_cols}{_MEASUREMENT_COLUMNS}, created_at) VALUES "
                    f"({', '.join('?' * (12 + len(slot_vals)))})",
                    (jid, key, backend, knobs.freq_mhz, knobs.sms, *slot_vals,
                     *(getattr(m, f) for f in FIELDS), time.time()))
                self.conn.execute(
                    "INSERT OR IGNORE INTO fitted(job_id, kind, key, backend, freq_mhz, sms, "
                    "slot, time_rel_error, energy_rel_error, measured_freqs, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (jid, kind, key, backend, knobs.freq_mhz, knobs.sms,
                     knobs.slot or _NONE_SLOT, time_rel_error, energy_rel_error,
                     json.dumps(list(measured_freqs_mhz)), time.time()))
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"cannot write to journal {self.path}: {exc}") from None

    def record_profile_run(self, jid: str, backend: str, summary: dict[str, object]) -> None:
        """What a profile measured and what it cost (`kareus profile`)."""
        try:
            with self._tx():
                self.conn.execute(
                    "INSERT INTO profile_runs(job_id, backend, summary_json, created_at) "
                    "VALUES (?, ?, ?, ?)", (jid, backend, json.dumps(summary, sort_keys=True),
                                            time.time()))
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"cannot write to journal {self.path}: {exc}") from None

    # Reading ------------------------------------------------------------------------------

    def fitted(self, jid: str, backend: str) -> dict[tuple[str, str, int, int, str | None],
                                                     tuple[float, float]]:
        """Every fitted number of the job on the backend: (kind, key, MHz, SMs, slot) ->
        its fit's held-out (time, energy) relative errors."""
        if "fitted" not in self._tables:  # a version-1 journal, read as it is
            return {}
        rows = self.conn.execute(
            "SELECT kind, key, freq_mhz, sms, slot, time_rel_error, energy_rel_error "
            "FROM fitted WHERE job_id = ? AND backend = ?", (jid, backend)).fetchall()
        return {(str(k), str(key), int(f), int(n), None if slot == _NONE_SLOT else str(slot)):
                (float(et), float(ee)) for k, key, f, n, slot, et, ee in rows}

    def profile_runs(self, jid: str) -> list[dict[str, object]]:
        """The profiles recorded for the job, oldest first."""
        if "profile_runs" not in self._tables:
            return []
        rows = self.conn.execute(
            "SELECT summary_json FROM profile_runs WHERE job_id = ? ORDER BY id",
            (jid,)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def backend_info(self, identity: str) -> dict[str, object] | None:
        if "backends" not in self._tables:  # the first version-1 layout, read as it is
            return None
        row = self.conn.execute("SELECT info_json FROM backends WHERE identity = ?",
                                (identity,)).fetchone()
        return json.loads(row[0]) if row else None

    def identities(self, jid: str) -> list[str]:
        """Backends with measurements of the job, most measurements first."""
        rows = self.conn.execute(
            "SELECT backend, COUNT(*) AS n FROM measurements WHERE job_id = ? "
            "GROUP BY backend ORDER BY n DESC, backend", (jid,)).fetchall()
        return [str(r[0]) for r in rows]

    def op_samples(self, jid: str, backend: str
                   ) -> dict[tuple[str, int, int], Measurement]:
        """Every run of ops measured for the job on the backend: (ops, MHz, SMs) -> it."""
        if "op_measurements" not in self._tables:
            return {}
        rows = self.conn.execute(
            f"SELECT ops, freq_mhz, sms, {_MEASUREMENT_COLUMNS} FROM op_measurements "
            "WHERE job_id = ? AND backend = ? ORDER BY id", (jid, backend)).fetchall()
        return {(str(ops), int(f), int(n)): Measurement(*map(float, rest))
                for ops, f, n, *rest in rows}

    def partition_samples(self, jid: str, backend: str
                          ) -> dict[tuple[str, Knobs], Measurement]:
        """Every partition setting measured for the job on the backend."""
        rows = self.conn.execute(
            f"SELECT partition, freq_mhz, sms, slot, {_MEASUREMENT_COLUMNS} FROM measurements "
            "WHERE job_id = ? AND backend = ? ORDER BY id", (jid, backend)).fetchall()
        return {(str(part), Knobs(int(f), int(n), None if slot == _NONE_SLOT else slot)):
                Measurement(*map(float, rest)) for part, f, n, slot, *rest in rows}

    def samples(self, jid: str, partition: str, backend: str) -> list[StoredSample]:
        rows = self.conn.execute(
            "SELECT freq_mhz, sms, slot, time_s, energy_j, static_energy_j, dynamic_energy_j, "
            "avg_power_w, effective_freq_mhz FROM measurements "
            "WHERE job_id = ? AND partition = ? AND backend = ? ORDER BY id",
            (jid, partition, backend)).fetchall()
        return [
            StoredSample(Knobs(int(f), int(n), None if slot == _NONE_SLOT else slot),
                         Measurement(t, e, st, dy, p, fe))
            for f, n, slot, t, e, st, dy, p, fe in rows
        ]

    def summary(self) -> list[dict]:
        rows = self.conn.execute(
            "SELECT m.job_id, j.job_json, m.partition, m.backend, COUNT(*), "
            "MIN(m.created_at), MAX(m.created_at) FROM measurements m "
            "LEFT JOIN jobs j ON j.job_id = m.job_id "
            "GROUP BY m.job_id, m.partition, m.backend ORDER BY m.job_id, m.partition").fetchall()
        out = []
        for jid, job_json, part, backend, count, first, last in rows:
            job = json.loads(job_json) if job_json else {}
            out.append({"job_id": jid, "model": job.get("model", {}).get("name"),
                        "partition": part, "backend": backend, "measurements": count,
                        "first_at": first, "last_at": last})
        return out

    def integrity_ok(self) -> bool:
        return self.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
