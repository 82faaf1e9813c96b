"""The SQLite measurement journal (kareus.store): its on-disk schema, what it stores coming
back unchanged, several processes writing to one file at once, corrupt files and journals
of other schema versions refused in one line, and the first version-1 layout opened."""

import inspect
import json
import multiprocessing as mp
import os
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.journaled import JournaledBackend
from kareus.backends.needs import Need
from kareus.core import Knobs, Measurement
from kareus.job.sources import build_job
from kareus.store import (
    APPLICATION_ID,
    JOURNAL_SCHEMA_VERSION,
    Journal,
    JournalError,
    JournalLike,
    job_id,
)
from tests.conftest import run_cli

M = Measurement(0.5, 100.0, 40.0, 60.0, 200.0, 1400.0)

# (name, declared type, NOT NULL) of every column, in order: the file format a journal
# written by any Kareus of this schema version has.
_MEASURED = [("time_s", "REAL", 1), ("energy_j", "REAL", 1), ("static_energy_j", "REAL", 1),
             ("dynamic_energy_j", "REAL", 1), ("avg_power_w", "REAL", 1),
             ("effective_freq_mhz", "REAL", 1), ("created_at", "REAL", 1)]
COLUMNS = {
    "meta": [("key", "TEXT", 0), ("value", "TEXT", 1)],
    "jobs": [("job_id", "TEXT", 0), ("job_json", "TEXT", 1)],
    "backends": [("identity", "TEXT", 0), ("info_json", "TEXT", 1)],
    "measurements": [("id", "INTEGER", 0), ("job_id", "TEXT", 1), ("partition", "TEXT", 1),
                     ("backend", "TEXT", 1), ("freq_mhz", "INTEGER", 1), ("sms", "INTEGER", 1),
                     ("slot", "TEXT", 1), *_MEASURED],
    "op_measurements": [("id", "INTEGER", 0), ("job_id", "TEXT", 1), ("ops", "TEXT", 1),
                        ("backend", "TEXT", 1), ("freq_mhz", "INTEGER", 1),
                        ("sms", "INTEGER", 1), *_MEASURED],
    "fitted": [("job_id", "TEXT", 1), ("kind", "TEXT", 1), ("key", "TEXT", 1),
               ("backend", "TEXT", 1), ("freq_mhz", "INTEGER", 1), ("sms", "INTEGER", 1),
               ("slot", "TEXT", 1), ("time_rel_error", "REAL", 1),
               ("energy_rel_error", "REAL", 1), ("measured_freqs", "TEXT", 1),
               ("created_at", "REAL", 1)],
    "profile_runs": [("id", "INTEGER", 0), ("job_id", "TEXT", 1), ("backend", "TEXT", 1),
                     ("summary_json", "TEXT", 1), ("created_at", "REAL", 1)],
}
UNIQUE = {"measurements": ("job_id", "partition", "backend", "freq_mhz", "sms", "slot"),
          "op_measurements": ("job_id", "ops", "backend", "freq_mhz", "sms"),
          "fitted": ("job_id", "kind", "key", "backend", "freq_mhz", "sms", "slot")}

# The layout the first journal (schema version 1) had: no backends, no op_measurements.
FIRST_V1_LAYOUT = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE jobs (job_id TEXT PRIMARY KEY, job_json TEXT NOT NULL);
CREATE TABLE measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, partition TEXT NOT NULL,
    backend TEXT NOT NULL, freq_mhz INTEGER NOT NULL, sms INTEGER NOT NULL,
    slot TEXT NOT NULL, time_s REAL NOT NULL, energy_j REAL NOT NULL,
    static_energy_j REAL NOT NULL, dynamic_energy_j REAL NOT NULL, avg_power_w REAL NOT NULL,
    effective_freq_mhz REAL NOT NULL, created_at REAL NOT NULL,
    UNIQUE (job_id, partition, backend, freq_mhz, sms, slot));
INSERT INTO meta VALUES ('schema_version', '1');
"""


def _raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(str(path))


def _tables(path: Path) -> set[str]:
    with _raw(path) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                            "AND name NOT LIKE 'sqlite_%'").fetchall()
    return {r[0] for r in rows}


def _unique_columns(conn: sqlite3.Connection, table: str) -> set[tuple[str, ...]]:
    out = set()
    for _seq, name, unique, *_rest in conn.execute(f"PRAGMA index_list({table})"):
        if unique:
            out.add(tuple(r[2] for r in conn.execute(f"PRAGMA index_info({name})")))
    return out


# Schema ------------------------------------------------------------------------------------

def test_a_new_journal_has_the_schema_and_version_it_declares(tmp_path):
    path = tmp_path / "j.sqlite"
    Journal(path).close()
    Journal(path).close()  # opening again changes nothing
    assert _tables(path) == set(COLUMNS)
    with _raw(path) as conn:
        for table, cols in COLUMNS.items():
            got = [(r[1], r[2], r[3]) for r in conn.execute(f"PRAGMA table_info({table})")]
            assert got == cols, table
        for table, key in UNIQUE.items():
            assert key in _unique_columns(conn, table), table
        assert conn.execute("SELECT key, value FROM meta").fetchall() == [
            ("schema_version", str(JOURNAL_SCHEMA_VERSION))]
        assert JOURNAL_SCHEMA_VERSION == 2
        # WAL is a property of the file: every later connection gets it
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_journal_has_every_method_journal_like_promises():
    """The Ray proxy of kareus.profiling.ray_rank stands in for a Journal through this
    protocol: the same methods with the same parameters."""
    promised = [n for n, v in vars(JournalLike).items()
                if callable(v) and not n.startswith("_")]
    assert {"record", "record_ops", "register_backend", "samples", "partition_samples",
            "op_samples"} <= set(promised)
    for name in promised:
        want = list(inspect.signature(getattr(JournalLike, name)).parameters)
        assert list(inspect.signature(getattr(Journal, name)).parameters) == want, name


def test_job_id_is_the_jobs_content_not_how_it_was_built():
    a = build_job("kareus-1")
    assert job_id(a) == job_id(build_job("kareus-1")) == job_id(a.model_copy())
    assert len(job_id(a)) == 16 and int(job_id(a), 16) >= 0
    assert job_id(build_job("kareus-1", overrides={"num_microbatches": 4})) != job_id(a)
    assert job_id(build_job("kareus-2")) != job_id(a)


def test_cp_comm_type_keeps_allgather_ids_and_separates_p2p_jobs():
    # ids of jobs journaled before the field existed (computed by the code of that time)
    # (on the node they ran on then, at the default training settings: the paper presets
    # name p4d.24xlarge and take the artifact's settings since issue 38)
    old = {"node": "DGX-A100", "training": {}}
    assert job_id(build_job("kareus-1", overrides=old)) == "69d84e5d61d95f4a"
    assert job_id(build_job("kareus-2", overrides=old)) == "f7e5657442fbc6f1"
    # a p2p job's measurements are its own: never reused for the allgather job
    p2p = build_job("kareus-2", overrides={"cp_comm_type": "p2p"})
    assert job_id(p2p) != job_id(build_job("kareus-2"))


# Round trips -------------------------------------------------------------------------------

# "" and "none" are left out: the journal stores the no-overlap slot (None) as the text
# "none" and writes `slot or "none"`, so a slot of either name would come back as None.
_slots = st.one_of(st.none(), st.text(min_size=1, max_size=12).filter(lambda s: s != "none"))
_knobs = st.builds(Knobs, st.integers(0, 10**6), st.integers(0, 10**4), _slots)
_floats = st.floats(allow_nan=False, allow_infinity=False)
_measurements = st.builds(Measurement, *([_floats] * 6))
# a few names recur, so that one partition (or run of ops) holds several settings
_names = st.one_of(st.sampled_from(["fwd_attn", "bwd_mlp"]), st.text(min_size=1, max_size=16))
_partition_rows = st.lists(st.tuples(_names, _knobs, _measurements), max_size=25,
                           unique_by=lambda r: (r[0], r[1]))
_op_rows = st.lists(st.tuples(_names, st.integers(0, 10**6), st.integers(0, 10**4),
                              _measurements), max_size=25, unique_by=lambda r: r[:3])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_partition_rows, ops=_op_rows)
def test_what_is_recorded_comes_back_unchanged_after_reopening(rows, ops):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "j.sqlite"
        with Journal(path) as j:
            for part, knobs, m in rows:
                j.record("job", part, "emu", knobs, m)
                j.record("job", part, "other-backend", knobs, M)
                j.record("other-job", part, "emu", knobs, M)
            for sig, freq, sms, m in ops:
                j.record_ops("job", sig, "emu", freq, sms, m)
                j.record_ops("job", sig, "other-backend", freq, sms, M)
        with Journal(path) as j:  # committed: a new connection reads it all
            assert j.partition_samples("job", "emu") == {(p, k): m for p, k, m in rows}
            assert j.op_samples("job", "emu") == {(s, f, n): m for s, f, n, m in ops}
            for part in {p for p, _k, _m in rows}:
                got = [(s.knobs, s.measurement) for s in j.samples("job", part, "emu")]
                assert got == [(k, m) for p, k, m in rows if p == part]  # in recorded order
            assert j.partition_samples("job", "nosuch") == {}
            assert j.integrity_ok()


def test_the_first_measurement_of_a_setting_stays(tmp_path):
    """A rerun reuses what is journaled: recording a setting again changes nothing."""
    other = Measurement(9.0, 9.0, 9.0, 9.0, 9.0, 9.0)
    with Journal(tmp_path / "j.sqlite") as j:
        for m in (M, other):
            j.record("job", "fwd_attn", "emu", Knobs(1410, 8, None), m)
            j.record_ops("job", "ops", "emu", 1410, 8, m)
            j.register_backend("emu", {"gpu": "A100" if m is M else "H100"})
        assert j.partition_samples("job", "emu") == {("fwd_attn", Knobs(1410, 8, None)): M}
        assert j.op_samples("job", "emu") == {("ops", 1410, 8): M}
        assert j.backend_info("emu") == {"gpu": "A100"}
        assert [s["measurements"] for s in j.summary()] == [1]


def test_a_registered_job_is_listed_with_its_model(tmp_path):
    job = build_job("kareus-1")
    with Journal(tmp_path / "j.sqlite") as j:
        jid = j.register_job(job)
        assert j.register_job(job) == jid == job_id(job)
        j.record(jid, "fwd_attn", "emu", Knobs(1410, 8, "mlp"), M)
        j.record(jid, "fwd_attn", "emu", Knobs(1200, 8, "mlp"), M)
        (row,) = j.summary()
        assert (row["job_id"], row["model"], row["measurements"]) == (
            jid, job.model.name, 2)
        assert j.identities(jid) == ["emu"]


@pytest.mark.xfail(strict=True, reason="INSERT OR IGNORE also ignores the NOT NULL "
                   "violation of a NaN (SQLite stores NaN as NULL): the row is dropped "
                   "without an error")
def test_a_measurement_that_cannot_be_stored_is_an_error_not_dropped(tmp_path):
    nan = Measurement(float("nan"), 1.0, 1.0, 1.0, 1.0, 1.0)
    with Journal(tmp_path / "j.sqlite") as j, pytest.raises(JournalError):
        j.record("job", "fwd_attn", "emu", Knobs(1410, 8, None), nan)


# Several writers ---------------------------------------------------------------------------

WRITERS, OWN, SHARED = 3, 60, 15


def _writer(path: str, w: int, start) -> None:
    """One process: opens the (new) journal when all are ready, then writes its own rows
    and the settings every writer writes, one transaction each."""
    start.wait(timeout=120)
    with Journal(path) as j:
        jid = j.register_job(build_job("kareus-1"))  # the id computed in this interpreter
        mine = Measurement(float(w), 1.0, 1.0, 1.0, 1.0, 1.0)
        for i in range(OWN):
            j.record(jid, f"p{i % 4}", "emu", Knobs(1000 + i, w, None), mine)
            j.record_ops(jid, f"ops-{w}", "emu", 1000 + i, 1, mine)
        for i in range(SHARED):
            j.record(jid, "shared", "emu", Knobs(1000 + i, 99, "s"), mine)


def test_writers_in_several_processes_lose_and_duplicate_nothing(tmp_path):
    path = tmp_path / "j.sqlite"  # not there yet: the writers create it together
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_writer, args=(str(path), w, start)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    jid = job_id(build_job("kareus-1"))
    with Journal(path) as j:
        assert j.integrity_ok()
        got = j.partition_samples(jid, "emu")
        ops = j.op_samples(jid, "emu")
        rows = j.conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
        jobs = j.conn.execute("SELECT job_id FROM jobs").fetchall()
    own = {(f"p{i % 4}", Knobs(1000 + i, w, None)): float(w)
           for w in range(WRITERS) for i in range(OWN)}
    assert {k: m.time_s for k, m in got.items() if k[0] != "shared"} == own
    shared = {k: m for k, m in got.items() if k[0] == "shared"}
    assert set(shared) == {("shared", Knobs(1000 + i, 99, "s")) for i in range(SHARED)}
    assert {m.time_s for m in shared.values()} <= {float(w) for w in range(WRITERS)}
    assert rows == WRITERS * OWN + SHARED  # every row once, none twice
    assert set(ops) == {(f"ops-{w}", 1000 + i, 1) for w in range(WRITERS) for i in range(OWN)}
    assert jobs == [(jid,)]  # every process computed the same job id


# Corrupt files and other versions ------------------------------------------------------------

def _journal_with_rows(path: Path, n: int = 300) -> None:
    with Journal(path) as j:
        for i in range(n):
            j.record("job", f"p{i % 5}", "emu", Knobs(1000 + i, 8, None), M)
        j.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # everything in the main file


def _garbage(path: Path) -> None:
    path.write_bytes(b"not an SQLite database " * 200)


def _header_cut(path: Path) -> None:
    _journal_with_rows(path)
    path.write_bytes(path.read_bytes()[:50])


def _second_half_lost(path: Path) -> None:
    _journal_with_rows(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("spoil", [_garbage, _header_cut, _second_half_lost])
def test_a_corrupt_journal_is_refused_in_one_line_and_left_as_it_was(tmp_path, spoil):
    path = tmp_path / "j.sqlite"
    spoil(path)
    before = path.read_bytes()
    with pytest.raises(JournalError, match=f"^cannot open journal {path}: ") as err:
        Journal(path)
    assert "\n" not in str(err.value)
    assert path.read_bytes() == before  # the evidence is kept
    r = run_cli("journal", "--journal", str(path))
    assert r.code == 2 and "Traceback" not in r.err
    assert r.err.startswith(f"kareus: error: cannot open journal {path}")
    assert len(r.err.strip().splitlines()) == 1


def test_a_directory_is_not_a_journal(tmp_path):
    with pytest.raises(JournalError, match="is a directory"):
        Journal(tmp_path)


@pytest.mark.xfail(strict=True, raises=sqlite3.DatabaseError,
                   reason="damage past the pages an open touches is found only by a read, "
                          "which raises sqlite3.DatabaseError, not JournalError")
def test_damaged_data_pages_are_a_journal_error(tmp_path):
    path = tmp_path / "j.sqlite"
    _journal_with_rows(path, 2000)
    data = bytearray(path.read_bytes())
    for page in range(3 * 4096, len(data), 4096):
        data[page:page + 200] = bytes(range(200))
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError), Journal(path) as j:
        j.partition_samples("job", "emu")


@pytest.mark.parametrize("version", ["3", "0", "one"])
def test_a_journal_of_another_schema_version_is_refused(tmp_path, version):
    """Versions 1 and 2 open (1 is upgraded in place); a newer Kareus's journal, or an
    unknown version, is refused rather than misread. Its content stays."""
    path = tmp_path / "j.sqlite"
    with _raw(path) as conn:
        conn.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                           "CREATE TABLE measurements_v2 (x INTEGER);"
                           "INSERT INTO measurements_v2 VALUES (7);")
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (version,))
    with pytest.raises(JournalError, match=f"journal {path} has an unsupported schema "
                                           f"version$"):
        Journal(path)
    with _raw(path) as conn:
        assert conn.execute("SELECT value FROM meta").fetchall() == [(version,)]
        assert conn.execute("SELECT x FROM measurements_v2").fetchall() == [(7,)]
    r = run_cli("journal", "--journal", str(path))
    assert r.code == 2 and "unsupported schema version" in r.err and "Traceback" not in r.err


def test_the_first_version_1_layout_opens_and_gains_the_later_tables(tmp_path):
    """Journals written before backends and op_measurements existed (same version 1: the
    tables were only added) open, keep their measurements and take the new kinds; opening
    one upgrades it to version 2 (which added fitted numbers and profile costs)."""
    path = tmp_path / "old.sqlite"
    with _raw(path) as conn:
        conn.executescript(FIRST_V1_LAYOUT)
        conn.execute("INSERT INTO measurements (job_id, partition, backend, freq_mhz, sms, "
                     "slot, time_s, energy_j, static_energy_j, dynamic_energy_j, "
                     "avg_power_w, effective_freq_mhz, created_at) VALUES "
                     "('job', 'fwd_attn', 'emu', 1410, 8, 'none', 0.5, 100, 40, 60, 200, "
                     "1400, 0), ('job', 'fwd_attn', 'emu', 1200, 8, 'mlp', 0.5, 100, 40, 60, "
                     "200, 1400, 1)")
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert _tables(path) == {"meta", "jobs", "measurements"}
    with Journal(path) as j:
        assert j.partition_samples("job", "emu") == {("fwd_attn", Knobs(1410, 8, None)): M,
                                                     ("fwd_attn", Knobs(1200, 8, "mlp")): M}
        j.record_ops("job", "ops", "emu", 1410, 8, M)
        j.register_backend("emu", {"gpu": "A100"})
    assert _tables(path) == set(COLUMNS)
    with _raw(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT value FROM meta").fetchall() == [("2",)]
    with Journal(path) as j:
        assert j.op_samples("job", "emu") == {("ops", 1410, 8): M}
        assert j.backend_info("emu") == {"gpu": "A100"}
        assert j.integrity_ok()
    # the journal as it was before the upgrade, beside it
    backup = tmp_path / "old.sqlite.v1-backup"
    assert _tables(backup) == {"meta", "jobs", "measurements"}
    with _raw(backup) as conn:
        assert conn.execute("SELECT value FROM meta").fetchall() == [("1",)]
        assert conn.execute("SELECT COUNT(*) FROM measurements").fetchone() == (2,)


def _v1_journal(path: Path) -> None:
    with _raw(path) as conn:
        conn.executescript(FIRST_V1_LAYOUT)
        conn.execute("INSERT INTO jobs VALUES ('job', '{\"model\": {\"name\": \"m\"}}')")
        conn.execute("INSERT INTO measurements (job_id, partition, backend, freq_mhz, sms, "
                     "slot, time_s, energy_j, static_energy_j, dynamic_energy_j, "
                     "avg_power_w, effective_freq_mhz, created_at) VALUES "
                     "('job', 'fwd_attn', 'emu', 1410, 8, 'none', 0.5, 100, 40, 60, 200, "
                     "1400, 0)")
    conn.close()


def test_a_version_1_journal_is_read_as_it_is_by_a_reader(tmp_path):
    """Listing (or replaying) an old journal changes nothing: no upgrade, no backup."""
    path = tmp_path / "old.sqlite"
    _v1_journal(path)
    before = path.read_bytes()
    r = run_cli("journal", "--journal", str(path), "--json")
    assert r.code == 0, r.err
    assert [(e["job_id"], e["model"], e["measurements"]) for e in r.json()["entries"]] == [
        ("job", "m", 1)]
    with Journal(path, read_only=True) as j:
        assert j.partition_samples("job", "emu") == {("fwd_attn", Knobs(1410, 8, None)): M}
        assert j.op_samples("job", "emu") == {} and j.backend_info("emu") is None
        assert j.fitted("job", "emu") == {} and j.profile_runs("job") == []
        with pytest.raises(sqlite3.DatabaseError):
            j.conn.execute("INSERT INTO meta VALUES ('x', 'y')")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.sqlite"]


# Another application's database, empty files -------------------------------------------------

def _foreign_meta(path: Path) -> None:
    """An application's database with a `meta` table of its own."""
    with _raw(path) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("INSERT INTO meta VALUES ('owner', 'other_app')")
    conn.close()


def _foreign_wal(path: Path) -> None:
    """An application's database in WAL mode, closed cleanly."""
    conn = _raw(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE items (x INTEGER)")
    conn.execute("INSERT INTO items VALUES (1)")
    conn.commit()
    conn.close()


def _foreign_version(path: Path) -> None:
    """Another application that also keeps a schema_version in a `meta` table."""
    with _raw(path) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("INSERT INTO meta VALUES ('schema_version', '2')")
        conn.execute("CREATE TABLE settings (x TEXT)")
    conn.close()


def _foreign_meta_columns(path: Path) -> None:
    """An application whose `meta` table has columns of its own (no key/value)."""
    with _raw(path) as conn:
        conn.execute("CREATE TABLE meta (k TEXT, v TEXT)")
        conn.execute("INSERT INTO meta VALUES ('1', '2')")
    conn.close()


def _empty(path: Path) -> None:
    path.write_bytes(b"")


_READERS = [("journal",), ("profile", "-p", "kareus-1", "--backend", "emulator", "--dry-run"),
            ("optimize", "-p", "kareus-1", "--out", "OUT", "--measurements")]
_WRITERS = [("search", "-p", "kareus-1", "--partition", "fwd_attn", "--budget", "20"),
            ("profile", "-p", "kareus-1", "--backend", "emulator", "--budget", "20")]


@pytest.mark.parametrize("make", [_foreign_meta, _foreign_wal, _foreign_version,
                                  _foreign_meta_columns, _empty])
@pytest.mark.parametrize("command", _READERS + _WRITERS, ids=lambda c: " ".join(c[:2]))
def test_a_file_that_is_no_journal_is_refused_and_left_byte_identical(tmp_path, make,
                                                                       command):
    path = tmp_path / "other_app.sqlite"
    make(path)
    before = path.read_bytes()
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    r = run_cli(*args, *([] if args[-1] == "--measurements" else ["--journal"]), str(path))
    assert r.code == 2, r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert "not a Kareus journal" in r.err
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_app.sqlite"]  # no -wal,
    # -shm, .lock, result directory


@pytest.mark.parametrize("make", [_foreign_meta, _foreign_wal, _foreign_meta_columns, _empty])
def test_opening_what_is_no_journal_to_write_changes_nothing(tmp_path, make):
    path = tmp_path / "other_app.sqlite"
    make(path)
    before = path.read_bytes()
    for read_only in (False, True):
        with pytest.raises(JournalError, match="not a Kareus journal"):
            Journal(path, read_only=read_only)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_app.sqlite"]


def test_a_reader_creates_nothing_beside_a_journal_in_wal_mode(tmp_path):
    path = tmp_path / "j.sqlite"
    with Journal(path) as j:
        j.record("job", "fwd_attn", "emu", Knobs(1410, 8, None), M)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.sqlite"]
    before = path.read_bytes()
    with Journal(path, read_only=True) as j:
        assert j.partition_samples("job", "emu") == {("fwd_attn", Knobs(1410, 8, None)): M}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.sqlite"]
    assert path.read_bytes() == before


def test_a_reader_sees_what_a_running_writer_committed(tmp_path):
    """While a writer holds the journal open its rows are in the -wal file: read too."""
    path = tmp_path / "j.sqlite"
    with Journal(path) as writer:
        writer.record("job", "fwd_attn", "emu", Knobs(1410, 8, None), M)
        assert (tmp_path / "j.sqlite-wal").exists()
        with Journal(path, read_only=True) as j:
            assert j.partition_samples("job", "emu") == {
                ("fwd_attn", Knobs(1410, 8, None)): M}


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes despite chmod")
def test_readers_work_on_a_read_only_directory(tmp_path):
    where = tmp_path / "media"
    where.mkdir()
    path = where / "j.sqlite"
    with Journal(path) as j:
        j.record("job", "fwd_attn", "emu", Knobs(1410, 8, None), M)
    path.chmod(0o444)
    where.chmod(0o555)
    try:
        with Journal(path, read_only=True) as j:
            assert j.partition_samples("job", "emu") == {
                ("fwd_attn", Knobs(1410, 8, None)): M}
        r = run_cli("journal", "--journal", str(path))
        assert r.code == 0, r.err
        assert sorted(p.name for p in where.iterdir()) == ["j.sqlite"]
    finally:
        where.chmod(0o755)
        path.chmod(0o644)


def test_a_new_journal_is_created_whole_where_a_link_leads(tmp_path):
    real = tmp_path / "real.sqlite"
    alias = tmp_path / "alias.sqlite"
    alias.symlink_to(real)  # dangling: the journal is made at its target
    with Journal(alias) as j:
        j.record("job", "fwd_attn", "emu", Knobs(1410, 8, None), M)
    assert alias.is_symlink() and real.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias.sqlite", "real.sqlite"]
    with _raw(real) as conn:
        assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID


@pytest.mark.parametrize("command", _READERS + _WRITERS, ids=lambda c: " ".join(c[:2]))
def test_a_journal_path_too_long_to_exist_is_one_line_before_any_work(tmp_path, command):
    path = tmp_path / ("a" * 300 + ".sqlite")
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    r = run_cli(*args, *([] if args[-1] == "--measurements" else ["--journal"]), str(path))
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1, r.err
    assert list(tmp_path.iterdir()) == []


def _open_fds(path: Path) -> int:
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir()
               if os.path.realpath(fd) == os.path.realpath(path)) if fds.is_dir() else 0


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("version", [None, "3"])
def test_a_refused_journal_is_not_left_open(tmp_path, version):
    path = tmp_path / "j.sqlite"
    if version is None:
        _garbage(path)
    else:
        with _raw(path) as conn:
            conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (version,))
        conn.close()
    assert _open_fds(path) == 0
    with pytest.raises(JournalError):
        Journal(path)
    assert _open_fds(path) == 0
    j = Journal(tmp_path / "ok.sqlite")
    assert _open_fds(tmp_path / "ok.sqlite") == 1  # the count sees an open journal
    j.close()


# Fitted numbers and profile costs (schema version 2) -----------------------------------------

FIT = Measurement(0.25, 30.0, 10.0, 20.0, 120.0, 1200.0)


@pytest.mark.parametrize(("kind", "key", "knobs"), [
    ("partition", "fwd_attn", Knobs(1200, 8, "mlp")),
    ("partition", "bwd_mlp", Knobs(1130, 12, None)),
    ("ops", "embedding#abc123", Knobs(1200, 24, None)),
])
def test_a_fitted_number_is_read_where_measurements_are_and_listed_as_fitted(
        tmp_path, kind, key, knobs):
    path = tmp_path / "j.sqlite"
    with Journal(path) as j:
        j.record_fitted("job", "emu", kind, key, knobs, FIT, 0.004, -0.007,
                        [1410, 1130, 850])
        j.record("job", "fwd_attn", "emu", Knobs(1410, 8, None), M)  # a measured one
    with Journal(path) as j:
        parts, ops = j.partition_samples("job", "emu"), j.op_samples("job", "emu")
        if kind == "partition":
            assert parts[(key, knobs)] == FIT
            assert ops == {}
        else:
            assert ops == {(key, knobs.freq_mhz, knobs.sms): FIT}
            assert set(parts) == {("fwd_attn", Knobs(1410, 8, None))}
        # only the fitted number is listed as fitted, with its fit's held-out errors
        assert j.fitted("job", "emu") == {
            (kind, key, knobs.freq_mhz, knobs.sms, knobs.slot): (0.004, -0.007)}
        assert j.fitted("job", "other-backend") == {}
        assert j.fitted("other-job", "emu") == {}
    with _raw(path) as conn:
        (measured,) = conn.execute("SELECT measured_freqs FROM fitted").fetchone()
    assert json.loads(measured) == [1410, 1130, 850]


def test_a_fitted_number_does_not_replace_a_measurement(tmp_path):
    """The first number of a setting stays, as for measurements."""
    with Journal(tmp_path / "j.sqlite") as j:
        j.record_ops("job", "ops", "emu", 1200, 24, M)
        j.record_fitted("job", "emu", "ops", "ops", Knobs(1200, 24, None), FIT, 0.0, 0.0,
                        [1410])
        assert j.op_samples("job", "emu") == {("ops", 1200, 24): M}


def test_profile_runs_come_back_in_order_per_job(tmp_path):
    first = {"estimate": False, "measurements": 12, "cost_s": 120.0,
             "protocol": {"window_s": 5.0, "cooldown_s": 5.0, "settle_s": 2.0}}
    second = {"estimate": False, "measurements": 0, "cost_s": 0.0, "nested": [1, 2.5, None]}
    path = tmp_path / "j.sqlite"
    with Journal(path) as j:
        assert j.profile_runs("job") == []
        j.record_profile_run("job", "emu", first)
        j.record_profile_run("other-job", "emu", {"measurements": 99})
        j.record_profile_run("job", "nvml:A100", second)
    with Journal(path) as j:
        assert j.profile_runs("job") == [first, second]
        assert j.profile_runs("other-job") == [{"measurements": 99}]


def test_a_fitted_number_stored_through_the_backend_answers_a_later_run(tmp_path):
    job = build_job("kareus-1")
    # needs without what measuring takes: only the journal can answer them
    ops = Need(Knobs(1200, 24, None), ops_key="embedding#abc123")
    part = Need(Knobs(1130, 8, "mlp"), partition="fwd_attn")
    measured = Need(Knobs(1410, 24, None), ops_key="embedding#abc123")
    path = tmp_path / "j.sqlite"
    with Journal(path) as j:
        first = JournaledBackend(EmulatorBackend(job), j, j.register_job(job))
        first.store_fitted(ops, FIT, 0.003, -0.002, (1410, 1130))
        first.store_fitted(part, M, -0.01, 0.02, (1410, 850))
        assert first.answer(ops).measurement == FIT  # at once, in this run too
        identity = first.identity()
        j.record_ops(job_id(job), "embedding#abc123", identity, 1410, 24, M)
    with Journal(path) as j:
        later = JournaledBackend(EmulatorBackend(job), j, job_id(job), record=False)
        assert later.fitted_used == []
        got = later.answer(part)
        assert (got.measurement, got.origin) == (M, "journal")
        assert later.answer(ops).measurement == FIT
        assert later.answer(measured).measurement == M
        assert later.measured == 0
        assert later.fitted_used == [part, ops]  # in order; the measured one is not
        assert later.fitted_error(ops) == (0.003, -0.002)
        assert later.fitted_error(part) == (-0.01, 0.02)
        assert later.fitted_error(measured) is None
        assert j.fitted(job_id(job), identity) == {
            ("ops", "embedding#abc123", 1200, 24, None): (0.003, -0.002),
            ("partition", "fwd_attn", 1130, 8, "mlp"): (-0.01, 0.02)}
