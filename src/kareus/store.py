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
import os
import secrets
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kareus.core import Knobs, Measurement
from kareus.core.lock import held_by, lock_file
from kareus.core.measurement import FIELDS
from kareus.errors import KareusError
from kareus.job.spec import JobSpec

JOURNAL_SCHEMA_VERSION = 2
"""2 added which numbers were fitted rather than measured (`fitted`) and what each profile
cost (`profile_runs`); a version-1 journal is upgraded in place by a command that writes to
it, after a copy of it is written beside it (`NAME.v1-backup`; both tables start empty:
every number in it was measured), and read as it is by one that only reads. Version-1 code
refuses a version-2 journal, which would take its fitted numbers for measurements."""

APPLICATION_ID = 0x4B617265
"""The SQLite header's application id of a journal ("Kare"): what says a file is one.
Journals made before it was set are recognised by their tables and ``meta`` row."""

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


_TABLES = ("meta", "jobs", "measurements", "backends", "op_measurements", "fitted",
           "profile_runs")
_V1_TABLES = ("meta", "jobs", "measurements")
"""What the first version-1 journals held (later ones also backends and op_measurements)."""
_SQLITE_MAGIC = b"SQLite format 3\x00"


class JournalError(KareusError):
    pass


def journal_lock_file(path: str | Path) -> Path:
    """The lock file of the journal at ``path``: beside the file a link leads to, so that
    one journal reached through several names has one lock."""
    return lock_file(os.path.realpath(path))


def in_use_note(path: str | Path) -> str:
    """"" where no run holds the lock of the journal at ``path``; else a clause saying
    which does, for an error about what the journal lacks."""
    who = held_by(journal_lock_file(path))
    return ("" if who is None else f"; a kareus run ({who}) holds the journal's lock: a "
            f"profile may still be measuring into it (wait for it to end)")


def _stat(path: Path) -> os.stat_result | None:
    """``path``'s file (None: nothing is there); a directory, or a path that cannot be
    looked at (too long a name, no permission), is one line."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise JournalError(f"cannot open journal {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise JournalError(f"journal {path} is a directory")
    return st


def journal_exists(path: str | Path) -> bool:
    """Whether something is at ``path`` (not whether it is a journal: `recognise`); a
    directory or a path that cannot be looked at is a JournalError."""
    return _stat(Path(path)) is not None


def _connect_rw(where: str) -> sqlite3.Connection:
    conn = sqlite3.connect(where, timeout=30.0, isolation_level=None)
    # WAL + NORMAL: a committed row survives the process being killed (not a power cut);
    # writers from other processes wait up to 30 s for the lock
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


def _connect_ro(path: Path) -> sqlite3.Connection:
    """A connection that cannot write ``path``, and creates nothing beside it.

    ``mode=ro`` on a database in WAL mode creates its -wal and -shm files, and leaves them:
    where no -wal file is there, every committed row is in the database file itself, which
    is then read as immutable (no lock, no -shm; a writer starting meanwhile appends to its
    own new -wal and changes the file only at a checkpoint, after many pages or at its
    end). Where a -wal file is (a writer is running, or was killed), it is read through
    it, as ``mode=ro``, with the -shm it has (or makes)."""
    st = _stat(path)
    if st is None:
        raise JournalError(f"journal not found: {path}")
    if st.st_size == 0:
        raise JournalError(f"{path} is empty: not a Kareus journal")
    try:
        with open(path, "rb") as f:
            header = f.read(100)
    except OSError as exc:
        raise JournalError(f"cannot open journal {path}: {exc.strerror or exc}") from None
    if len(header) < 100 or not header.startswith(_SQLITE_MAGIC):
        raise JournalError(f"cannot open journal {path}: file is not a database")
    wal = header[18] == 2 and header[19] == 2
    immutable = wal and _stat(Path(f"{path}-wal")) is None
    uri = (f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
           + ("&immutable=1" if immutable else ""))
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=30.0, isolation_level=None)
    except sqlite3.DatabaseError as exc:
        raise JournalError(f"cannot open journal {path}: {exc}") from None
    try:
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise JournalError(f"cannot open journal {path}: {exc}") from None
    return conn


def _schema_row(conn: sqlite3.Connection, tables: set[str]) -> tuple[Any, ...] | None:
    """The journal's schema-version row; None where there is no ``meta`` table of a
    journal's shape (another application's ``meta`` without key/value columns)."""
    if "meta" not in tables:
        return None
    columns = {str(r[1]) for r in conn.execute("PRAGMA table_info(meta)")}
    if not {"key", "value"} <= columns:
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else tuple(row)


def _recognised(conn: sqlite3.Connection, path: Path) -> tuple[int, set[str]]:
    """The schema version and tables of the journal on ``conn``; a JournalError where the
    database is not one (another application's), or of a version this code cannot read."""
    try:
        app_id = int(conn.execute("PRAGMA application_id").fetchone()[0])
        tables = {str(r[0]) for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        row = _schema_row(conn, tables)
    except sqlite3.DatabaseError as exc:
        raise JournalError(f"cannot open journal {path}: {exc}") from None
    if app_id not in (0, APPLICATION_ID) or row is None:
        raise JournalError(f"{path} is not a Kareus journal (another application's "
                           f"database?); it was left as it is")
    version = str(row[0])
    if version not in ("1", "2"):
        raise JournalError(f"journal {path} has an unsupported schema version")
    needed = _V1_TABLES if version == "1" else _TABLES
    if app_id != APPLICATION_ID and not set(needed) <= tables:
        raise JournalError(f"{path} is not a Kareus journal (another application's "
                           f"database?); it was left as it is")
    return int(version), tables


def recognise(path: str | Path) -> int:
    """The schema version of the journal at ``path``, read without writing anything; a
    JournalError where nothing is there, or it is no journal (an empty file, another
    application's database), or of a version this code cannot read."""
    conn = _connect_ro(Path(path))
    try:
        return _recognised(conn, Path(path))[0]
    finally:
        conn.close()


def _create(path: Path, target: Path) -> None:
    """A new journal at ``target`` (where ``path`` leads), made whole beside it and linked
    into place: no process ever sees it empty or half made. Where another process made one
    first, that one stays."""
    tmp = target.with_name(f".kareus-journal-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)",
                         (str(JOURNAL_SCHEMA_VERSION),))
            conn.execute("PRAGMA journal_mode=WAL")
        finally:
            conn.close()
        try:
            os.link(tmp, target)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: copied, not replacing one
            with open(tmp, "rb") as src, open(target, "xb") as dst:
                dst.write(src.read())
                dst.flush()
                os.fsync(dst.fileno())
    except FileExistsError:
        pass
    except (OSError, sqlite3.DatabaseError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise JournalError(f"cannot create journal {path}: {reason}") from None
    finally:
        for suffix in ("", "-journal", "-wal", "-shm"):
            with suppress(OSError):
                os.unlink(f"{tmp}{suffix}")


def _backup(path: Path, target: Path, version: int) -> Path:
    """A copy of the journal at ``target`` (of schema ``version``), written beside it
    before it is upgraded: ``NAME.v1-backup`` (``-2``, ... where that is taken)."""
    tmp = target.with_name(f".kareus-journal-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    src = _connect_ro(target)
    try:
        dst = sqlite3.connect(str(tmp))
        try:
            src.backup(dst)
        finally:
            dst.close()
        n = 1
        while True:
            dest = target.with_name(f"{target.name}.v{version}-backup"
                                    + (f"-{n}" if n > 1 else ""))
            try:
                os.link(tmp, dest)
                return dest
            except FileExistsError:
                n += 1
    except (OSError, sqlite3.DatabaseError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise JournalError(f"cannot back up journal {path} before upgrading it from "
                           f"version {version}: {reason}; it was left as it is") from None
    finally:
        src.close()
        with suppress(OSError):
            os.unlink(tmp)


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
            self.conn = _connect_rw(":memory:")
            self.conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            self.conn.executescript(_SCHEMA)
            self.conn.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)",
                              (str(JOURNAL_SCHEMA_VERSION),))
            self._tables = set(_TABLES)
            return
        if read_only:
            self.conn = _connect_ro(self.path)
            try:
                version, self._tables = _recognised(self.conn, self.path)
            except BaseException:
                self._close_quietly()
                raise
            return
        # written through the resolved path: a link's target, made where it leads
        target = Path(os.path.realpath(self.path))
        if _stat(self.path) is None:
            _create(self.path, target)
        version = recognise(self.path)
        if version != JOURNAL_SCHEMA_VERSION:
            self.backup = _backup(self.path, target, version)
        try:
            self.conn = _connect_rw(str(target))
            # WAL: a committed row survives the process being killed (not a power cut)
            # and several processes write at once. Switching to it needs the database to
            # itself and does not wait on the busy handler: retried (a no-op on a journal
            # in WAL already, which every journal this code made is)
            _retry_locked(lambda: self.conn.execute("PRAGMA journal_mode=WAL"))
            if version != JOURNAL_SCHEMA_VERSION:
                # version 1 lacks only tables the schema script creates; once, atomically
                _retry_locked(lambda: self.conn.executescript(
                    f"BEGIN IMMEDIATE; PRAGMA application_id = {APPLICATION_ID};"
                    f"{_SCHEMA} UPDATE meta SET value = '{JOURNAL_SCHEMA_VERSION}' "
                    f"WHERE key = 'schema_version' AND value = '1'; COMMIT;"))
            version, self._tables = _recognised(self.conn, self.path)
        except sqlite3.DatabaseError as exc:
            self._close_quietly()
            raise JournalError(f"cannot open journal {self.path}: {exc}") from None
        except BaseException:
            self._close_quietly()
            raise
        if version != JOURNAL_SCHEMA_VERSION:
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
