"""Processes a command starts die with it: SIGKILL or SIGTERM of `kareus` leaves no worker
behind (checked by session, not by name), and SIGTERM exits 143 with one line. The
helpers (`session_pids`, `gone_within`) serve tests/test_signals.py too."""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (zombies excluded)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(stat.parent.name))
    return out


def _start_search(journal: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kareus.cli", "search", "-p", "kareus-1", "--budget", "600",
           "--tolerance", "0", "--batch-size", "5", "--workers", "2", "--noise", "0.03",
           "--journal", str(journal), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.2)
        if not journal.exists():  # connecting would create it empty: not a journal
            continue
        try:
            with sqlite3.connect(f"file:{journal}?mode=ro", uri=True) as c:
                if c.execute("SELECT COUNT(DISTINCT partition) FROM measurements"
                             ).fetchone()[0] >= 2:
                    break
        except sqlite3.DatabaseError:
            pass
    assert len(session_pids(proc.pid)) >= 3, "the parent and its two workers are running"
    return proc


def gone_within(sid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not session_pids(sid):
            return True
        time.sleep(0.1)
    return not session_pids(sid)


def test_sigkill_of_the_parent_leaves_no_worker(tmp_path):
    proc = _start_search(tmp_path / "j.sqlite")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert gone_within(proc.pid, 2.0), session_pids(proc.pid)
    with sqlite3.connect(tmp_path / "j.sqlite") as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_sigterm_stops_the_workers_with_one_line(tmp_path):
    proc = _start_search(tmp_path / "j.sqlite")
    os.kill(proc.pid, signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert err.strip().splitlines()[-1] == "kareus: terminated"
    assert len(err.strip().splitlines()) == 1, err
    assert gone_within(proc.pid, 2.0), session_pids(proc.pid)
