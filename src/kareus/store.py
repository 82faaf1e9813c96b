"""The SQLite journal: every measurement is stored before it is used.

One row per (job, partition key, backend, knobs), or per (job, run of ops, backend, clock,
SMs) for what composition measures outside partitions, committed as soon as it is
measured, in
WAL mode so that a process killed at any moment (SIGKILL included) loses nothing that was
committed, and so that several searches (processes) can write to one journal at once.
A search that finds its settings in the journal reuses them instead of measuring again.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kareus.core import Knobs, Measurement
from kareus.core.measurement import FIELDS
from kareus.errors import KareusError
from kareus.job.spec import JobSpec

JOURNAL_SCHEMA_VERSION = 2
"""2 added which numbers were fitted rather than measured (`fitted`) and what each profile
cost (`profile_runs`); a version-1 journal is upgraded in place when opened (both tables
start empty: every number in it was measured). Version-1 code refuses a version-2 journal,
which would take its fitted numbers for measurements."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, job_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    partition TEXT NOT NULL,
    backend TEXT NOT NULL,
    freq_mhz INTEGER NOT NULL,
    sms INTEGER NOT NULL,
    slot TEXT NOT NULL,
    time_s REAL NOT NULL,
    energy_j REAL NOT NULL,
    static_energy_j REAL NOT NULL,
    dynamic_energy_j REAL NOT NULL,
    avg_power_w REAL NOT NULL,
    effective_freq_mhz REAL NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (job_id, partition, backend, freq_mhz, sms, slot)
);
CREATE TABLE IF NOT EXISTS backends (identity TEXT PRIMARY KEY, info_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS op_measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    ops TEXT NOT NULL,
    backend TEXT NOT NULL,
    freq_mhz INTEGER NOT NULL,
    sms INTEGER NOT NULL,
    time_s REAL NOT NULL,
    energy_j REAL NOT NULL,
    static_energy_j REAL NOT NULL,
    dynamic_energy_j REAL NOT NULL,
    avg_power_w REAL NOT NULL,
    effective_freq_mhz REAL NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (job_id, ops, backend, freq_mhz, sms)
);
CREATE TABLE IF NOT EXISTS fitted (
    job_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    backend TEXT NOT NULL,
    freq_mhz INTEGER NOT NULL,
    sms INTEGER NOT NULL,
    slot TEXT NOT NULL,
    time_rel_error REAL NOT NULL,
    energy_rel_error REAL NOT NULL,
    measured_freqs TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (job_id, kind, key, backend, freq_mhz, sms, slot)
);
CREATE TABLE IF NOT EXISTS profile_runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    backend TEXT NOT NULL,
    summary_json TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""
_MEASUREMENT_COLUMNS = ("time_s, energy_j, static_energy_j, dynamic_energy_j, avg_power_w, "
                        "effective_freq_mhz")

_NONE_SLOT = "none"  # SQL NULLs are never equal, so the no-overlap slot is stored as text


class JournalError(KareusError):
    pass


def _retry_locked(fn, seconds: float = 30.0):
    """Run ``fn``, retrying while SQLite says the database is locked."""
    deadline = time.monotonic() + seconds
    delay = 0.005
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(0.2, delay * 2)


def job_id(job: JobSpec) -> str:
    """A stable identity of the job: hash of its canonical JSON (without
    ``virtual_pipeline`` when it is 1, so that jobs journaled before the field existed
    keep their id)."""
    doc = job.model_dump(mode="json")
    if doc.get("virtual_pipeline") == 1:
        del doc["virtual_pipeline"]
    text = json.dumps(doc, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StoredSample:
    knobs: Knobs
    measurement: Measurement


class JournalLike(Protocol):
    """What measuring code (the search loop, `JournaledBackend`) asks of a journal:
    `Journal`, or a stand-in on a machine that cannot open it (a Ray rank's proxy that
    reads a snapshot and sends its writes to the driver, `kareus.workflows.profile_ray`)."""

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
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise JournalError(f"journal {self.path} is a directory")
        try:
            self.conn = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None)
            # Switching to WAL needs the database to itself and does not wait on the busy
            # handler: several processes opening a new journal at once retry it.
            _retry_locked(lambda: self.conn.execute("PRAGMA journal_mode=WAL"))
            # WAL + NORMAL: a committed row survives the process being killed (not a power
            # cut); writers from other processes wait up to 30 s for the lock.
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute("PRAGMA busy_timeout=30000")
            # idempotent; each statement commits itself
            _retry_locked(lambda: self.conn.executescript(_SCHEMA))
            _retry_locked(lambda: self.conn.execute(
                "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                (str(JOURNAL_SCHEMA_VERSION),)))
            # version 1 lacks only the tables the schema script just created
            _retry_locked(lambda: self.conn.execute(
                "UPDATE meta SET value = ? WHERE key = 'schema_version' AND value = '1'",
                (str(JOURNAL_SCHEMA_VERSION),)))
            version = self.conn.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            self._close_quietly()
            raise JournalError(f"cannot open journal {self.path}: {exc}") from None
        if version is None or str(version[0]) != str(JOURNAL_SCHEMA_VERSION):
            self._close_quietly()
            raise JournalError(f"journal {self.path} has an unsupported schema version")

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
        jid = job_id(job)
        try:
            with self._tx():
                self.conn.execute(
                    "INSERT OR IGNORE INTO jobs(job_id, job_json) VALUES (?, ?)",
                    (jid, json.dumps(job.model_dump(mode="json"), sort_keys=True)))
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
        rows = self.conn.execute(
            "SELECT kind, key, freq_mhz, sms, slot, time_rel_error, energy_rel_error "
            "FROM fitted WHERE job_id = ? AND backend = ?", (jid, backend)).fetchall()
        return {(str(k), str(key), int(f), int(n), None if slot == _NONE_SLOT else str(slot)):
                (float(et), float(ee)) for k, key, f, n, slot, et, ee in rows}

    def profile_runs(self, jid: str) -> list[dict[str, object]]:
        """The profiles recorded for the job, oldest first."""
        rows = self.conn.execute(
            "SELECT summary_json FROM profile_runs WHERE job_id = ? ORDER BY id",
            (jid,)).fetchall()
        return [json.loads(r[0]) for r in rows]


    def backend_info(self, identity: str) -> dict[str, object] | None:
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
