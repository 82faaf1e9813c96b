"""Nothing of the user's is lost to a result directory or a journal (issue 21): `--out` that
is not Kareus's is refused before any work, one run at a time holds a result directory or
a journal, and a refused command creates nothing. The concurrent runs and `--out .` are
real `kareus` processes, as they failed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kareus.backends.registry import default_spec
from kareus.errors import KareusError
from kareus.job.sources import build_job
from kareus.results.resultdir import ResultDir
from kareus.search import SearchConfig
from kareus.store import Journal, job_id
from kareus.workflows import optimize as optimize_module
from kareus.workflows.optimize import OptimizeRequest, OptimizeRun, prepare_optimize
from kareus.workflows.profile import journal_lock, prepare_profile
from kareus.workload.workload import Workload
from tests.conftest import run_cli

SMALL = ("-p", "kareus-1", "--microbatches", "4", "--freqs", "1410,1200", "--seed", "1",
         "--workers", "1")
OPTIMIZE = ("optimize", *SMALL, "--budget", "20")
LONG = ("optimize", *SMALL, "--budget", "200")  # a run that lasts: it is killed


def _kareus(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kareus.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kareus.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kareus: error: "), stderr
    return lines[0]


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its content (None: a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process and its workers (its own session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _wait_started(proc: subprocess.Popen, lock: Path, fallback: Path) -> None:
    """Until ``proc`` holds ``lock`` (its PID in it), or, without a lock, has started
    writing ``fallback``."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if lock.is_file() and lock.read_text().strip() == str(proc.pid):
            return
        if fallback.exists() and not lock.exists():
            time.sleep(1.0)  # no lock at all: let it get going
            return
        time.sleep(0.05)
    raise AssertionError(f"the first run did not start: {proc.poll()}")


# --out that is not a directory of its own --------------------------------------------


@pytest.mark.parametrize("out", [".", ""])
def test_out_of_the_current_directory_is_refused_and_destroys_nothing(tmp_path, out):
    home = tmp_path / "work"
    (home / "precious").mkdir(parents=True)
    (home / "precious" / "file").write_text("mine")
    (home / "notes.txt").write_text("mine too")
    before = _tree(tmp_path)
    r = _kareus(*OPTIMIZE, "--out", out, cwd=home)
    assert (home / "precious" / "file").read_text() == "mine"
    assert _tree(tmp_path) == before  # nothing moved, removed or created (no journal)
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr)  # at once: no search ran
    assert ("current directory" in line) if out else ("--out is empty" in line)


def test_root_home_current_and_their_ancestors_are_refused(tmp_path, monkeypatch):
    home = tmp_path / "home" / "me"
    (home / "work").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home / "work")
    for out, says in (("/", "root directory"), (str(home), "home directory"),
                      (".", "current directory"), (str(home / "work"), "current directory"),
                      ("../..", "holding the current directory"), ("", "--out is empty")):
        with pytest.raises(KareusError, match=says):
            ResultDir(out).check_writable()
    ResultDir(home / "work" / "run").check_writable()  # a directory of its own is fine


def test_a_directory_that_is_not_a_result_is_refused_and_untouched(tmp_path):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "data.csv").write_text("1,2")
    (mine / "report.md").write_text("my report")  # one of the result's names, not Kareus's
    before = _tree(tmp_path)
    r = run_cli(*OPTIMIZE, "--out", str(mine))
    assert r.code == 2 and "is not a Kareus result directory" in r.err, r.err
    assert _tree(tmp_path) == before
    (mine / "sub" / "data.csv").unlink()
    (mine / "sub").rmdir()
    with pytest.raises(KareusError, match="not a Kareus result"):
        ResultDir(mine).check_writable()  # report.md alone: still not Kareus's


def test_an_empty_directory_or_a_killed_runs_journal_is_fine(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    ResultDir(empty).check_writable("job")
    killed = ResultDir(tmp_path / "killed")
    killed.path.mkdir()
    Journal(killed.journal).close()
    killed.lock_file.write_text("999999999\n")  # the lock file of a run killed long ago
    killed.check_writable("job")
    with killed.lock("job") as held:
        assert held.held and killed.lock_file.read_text().strip() == str(os.getpid())


# One run at a time ---------------------------------------------------------------------


def test_a_second_optimize_on_the_same_out_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "run"
    rd = ResultDir(out)
    first = _start(*LONG, "--out", str(out), "--json")
    try:
        _wait_started(first, rd.lock_file, rd.journal)
        for other in (("--microbatches", "8"), ()):  # another job, then the same job
            r = _kareus(*OPTIMIZE, *other, "--out", str(out), "--json")
            assert r.returncode == 2, r.stderr
            line = _one_error_line(r.stderr)
            assert f"pid {first.pid}" in line and "in use" in line, line
            assert first.poll() is None, "the first run still holds it"
        assert not rd.result_file.exists()  # the second run wrote nothing
    finally:
        _kill(first)
    # the lock of a SIGKILLed run went with it: the next run takes it over
    with rd.lock(job_id(build_job("kareus-1"))) as held:
        assert held.held


def test_a_second_profile_on_the_same_journal_is_refused_naming_the_first(tmp_path):
    journal = tmp_path / "j.sqlite"
    args = ("profile", "-p", "kareus-1", "--microbatches", "4", "--backend", "emulator",
            "--partitions-only", "--journal", str(journal))
    # a search that lasts (an exhaustive profile ends in about 1.5 s, which a loaded
    # machine's start of the second process could outlast): it is killed
    first = _start(*args, "--budget", "200", "--tolerance", "0", "--json")
    lock = journal.with_name(journal.name + ".lock")
    try:
        _wait_started(first, lock, journal)
        r = _kareus(*args, "--strategy", "exhaustive", "--json")
        assert r.returncode == 2, r.stderr
        line = _one_error_line(r.stderr)
        assert f"pid {first.pid}" in line and str(journal) in line, line
        assert first.poll() is None, "the first run still holds it"
    finally:
        _kill(first)


def test_the_result_directory_and_its_journal_share_one_lock(tmp_path):
    rd = ResultDir(tmp_path / "run")
    profile_args = ("profile", *SMALL, "--backend", "emulator", "--journal", str(rd.journal))
    with rd.lock():  # as `kareus optimize --out run` holds it
        r = run_cli(*profile_args)
        assert r.code == 2 and f"pid {os.getpid()}" in r.err, r.err
    with journal_lock(str(rd.journal)):  # as `kareus profile --journal run/journal.sqlite`
        r = run_cli(*OPTIMIZE, "--out", str(rd.path))
        assert r.code == 2 and f"pid {os.getpid()}" in r.err, r.err
    assert sorted(p.name for p in rd.path.iterdir()) == [rd.lock_file.name]


def test_a_search_on_a_journal_being_written_is_refused(tmp_path):
    """`kareus search --journal J` is a writer of J like a profile: one at a time."""
    journal = tmp_path / "j.sqlite"
    args = ("search", *SMALL, "--budget", "20", "--journal", str(journal))
    with journal_lock(str(journal)):  # as `kareus profile --journal j.sqlite` holds it
        r = run_cli(*args)
        assert r.code == 2 and f"pid {os.getpid()}" in r.err and str(journal) in r.err, r.err
        assert not journal.exists()
    r = run_cli(*args, "--partition", "fwd_attn", "--json")
    assert r.code == 0, r.err
    with journal_lock(str(journal)) as held:  # released when the search ended
        assert held.held


def test_ranks_that_only_measure_take_no_lock(tmp_path, monkeypatch):
    job = build_job("kareus-1", overrides={"num_microbatches": 4})
    monkeypatch.setenv("RANK", "1")
    run = prepare_profile(Workload.build(job), str(tmp_path / "j.sqlite"), default_spec(),
                          SearchConfig(budget=20))
    assert run.quiet and run.lock is None and not list(tmp_path.iterdir())
    monkeypatch.setattr(OptimizeRun, "measures_only", property(lambda _self: True))
    monkeypatch.setattr(optimize_module, "check_profile", lambda *_a, **_k: [])
    run2 = prepare_optimize(OptimizeRequest(job, str(tmp_path / "out"), SearchConfig(budget=20)))
    assert run2.lock is None and not list(tmp_path.iterdir())


# A refused command creates nothing -----------------------------------------------------


def test_refused_commands_create_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    before = _tree(tmp_path)
    refused = [
        ("profile", *SMALL, "--backend", "emulator", "--journal", "j.sqlite",
         "--partition", "nosuch"),
        ("profile", *SMALL, "--backend", "emulator", "--journal", "nodir/j.sqlite"),
        ("profile", *SMALL, "--backend", "emulator", "--journal", "afile/j.sqlite"),
        (*OPTIMIZE, "--out", "out", "--budget", "5"),
        (*OPTIMIZE, "--out", "out", "--measurements", "none.sqlite"),
        (*OPTIMIZE, "--out", "out", "--backend", "replay", "--replay-journal", "n.sqlite"),
        (*OPTIMIZE, "--out", "afile"),
        (*OPTIMIZE, "--out", ""),
    ]
    for args in refused:
        r = run_cli(*args)
        assert r.code == 2, (args, r.err)
        assert _tree(tmp_path) == before, args


@pytest.mark.parametrize("name", ["r" * 239, "r" * 255, "r" * 300,
                                  os.fsdecode(b"r\xff"), "d/" * 2100 + "r"])
def test_out_names_that_would_fail_after_the_work_are_refused_first(tmp_path, monkeypatch,
                                                                    name):
    """A last component too long for the temporary name beside it (239-255 bytes passed
    every check and failed after the run), one too long outright, a whole path too long,
    a name that is not UTF-8 (issue 34, items 6 and 8): one line, before any work, for
    every kind of Kareus directory."""
    monkeypatch.chdir(tmp_path)
    for args in ((*OPTIMIZE, "--out", name),
                 ("compare", "--suite", "kareus", "--budget", "20", "--out", name),
                 ("import-perseus", "nosuch", "--microbatches", "4", "--out", name)):
        r = run_cli(*args)
        lines = r.err.strip().splitlines()
        assert r.code == 2 and len(lines) == 1, (args[0], r.err)
        assert "too long" in r.err or "UTF-8" in r.err, r.err
        assert os.listdir(tmp_path) == [], args[0]
