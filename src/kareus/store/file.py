"""The journal as a file: what is taken for one (`recognise`, before anything is
written), how it is opened to read (creating nothing, on read-only media too) or to
write (made whole where nothing is, a version-1 journal upgraded after a backup beside
it), and its lock file (the resolved file's: one journal under several names has one
lock)."""

from __future__ import annotations

import os
import secrets
import sqlite3
import stat
import time
import urllib.parse
from contextlib import suppress
from pathlib import Path
from typing import Any

from kareus.core.lock import held_by, lock_file
from kareus.errors import KareusError
from kareus.store.schema import (
    APPLICATION_ID,
    JOURNAL_SCHEMA_VERSION,
    SCHEMA_SQL,
    SQLITE_MAGIC,
    TABLES,
    V1_TABLES,
)


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


def connect_rw(where: str) -> sqlite3.Connection:
    conn = sqlite3.connect(where, timeout=30.0, isolation_level=None)
    # WAL + NORMAL: a committed row survives the process being killed (not a power cut);
    # writers from other processes wait up to 30 s for the lock
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


def connect_ro(path: Path) -> sqlite3.Connection:
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
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
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
    needed = V1_TABLES if version == "1" else TABLES
    if app_id != APPLICATION_ID and not set(needed) <= tables:
        raise JournalError(f"{path} is not a Kareus journal (another application's "
                           f"database?); it was left as it is")
    return int(version), tables


def recognise(path: str | Path) -> int:
    """The schema version of the journal at ``path``, read without writing anything; a
    JournalError where nothing is there, or it is no journal (an empty file, another
    application's database), or of a version this code cannot read."""
    conn = connect_ro(Path(path))
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
            conn.executescript(SCHEMA_SQL)
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
    src = connect_ro(target)
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


def open_journal(path: Path, read_only: bool
                 ) -> tuple[sqlite3.Connection, set[str], Path | None]:
    """The connection to the journal at ``path``, its tables, and where a version-1 journal
    was copied before this open upgraded it (None: it was not). Read only: it must exist
    and nothing is written. To write: made where nothing is (where a link leads), a
    version-1 journal upgraded after a backup beside it. Either way the file is recognised
    as a journal (`recognise`) before anything touches it."""
    if read_only:
        reader = connect_ro(path)
        try:
            return reader, _recognised(reader, path)[1], None
        except BaseException:
            reader.close()
            raise
    # written through the resolved path: a link's target, made where it leads
    target = Path(os.path.realpath(path))
    if _stat(path) is None:
        _create(path, target)
    version = recognise(path)
    backup = _backup(path, target, version) if version != JOURNAL_SCHEMA_VERSION else None
    conn: sqlite3.Connection | None = None
    try:
        conn = connect_rw(str(target))
        c = conn
        # WAL: a committed row survives the process being killed (not a power cut) and
        # several processes write at once. Switching to it needs the database to itself
        # and does not wait on the busy handler: retried (a no-op on a journal in WAL
        # already, which every journal this code made is)
        _retry_locked(lambda: c.execute("PRAGMA journal_mode=WAL"))
        if version != JOURNAL_SCHEMA_VERSION:
            # version 1 lacks only tables the schema script creates; once, atomically
            _retry_locked(lambda: c.executescript(
                f"BEGIN IMMEDIATE; PRAGMA application_id = {APPLICATION_ID};"
                f"{SCHEMA_SQL} UPDATE meta SET value = '{JOURNAL_SCHEMA_VERSION}' "
                f"WHERE key = 'schema_version' AND value = '1'; COMMIT;"))
        version, tables = _recognised(conn, path)
    except sqlite3.DatabaseError as exc:
        if conn is not None:
            conn.close()
        raise JournalError(f"cannot open journal {path}: {exc}") from None
    except BaseException:
        if conn is not None:
            conn.close()
        raise
    if version != JOURNAL_SCHEMA_VERSION:
        c.close()
        raise JournalError(f"journal {path} has an unsupported schema version")
    return c, tables, backup
