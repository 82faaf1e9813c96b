"""What a journal holds: its tables (SQL), its schema version, and what marks a file
as one (the SQLite application id; older journals: their tables and ``meta`` row)."""

JOURNAL_SCHEMA_VERSION = 2
"""2 added which numbers were fitted rather than measured (`fitted`) and what each profile
cost (`profile_runs`); a version-1 journal is upgraded in place by a command that writes to
it, after a copy of it is written beside it (`NAME.v1-backup`; both tables start empty:
every number in it was measured), and read as it is by one that only reads. Version-1 code
refuses a version-2 journal, which would take its fitted numbers for measurements."""

APPLICATION_ID = 0x4B617265
"""The SQLite header's application id of a journal ("Kare"): what says a file is one.
Journals made before it was set are recognised by their tables and ``meta`` row."""

SCHEMA_SQL = """
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
TABLES = ("meta", "jobs", "measurements", "backends", "op_measurements", "fitted",
           "profile_runs")
V1_TABLES = ("meta", "jobs", "measurements")
"""What the first version-1 journals held (later ones also backends and op_measurements)."""
SQLITE_MAGIC = b"SQLite format 3\x00"
