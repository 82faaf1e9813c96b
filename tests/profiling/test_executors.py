import importlib.util
import json

import pytest

from kareus.backends.emulator.spec import EmulatorSpec
from kareus.errors import KareusError
from kareus.job.sources import build_job
from kareus.profiling.executors import (
    ExecutorSpec,
    journal_lock,
    run_tasks,
)
from kareus.profiling.tasks import make_task
from kareus.search import SearchConfig
from kareus.store import Journal, job_id
from tests.conftest import run_cli

JOB = build_job("kareus-1")
CFG = SearchConfig(budget=30, tolerance=0, seed=2)


def _tasks(journal=None):
    return [make_task(JOB, key, CFG, EmulatorSpec(noise=0.03, seed=2), journal=journal)
            for key in ("fwd_attn", "bwd_mlp")]


def test_process_pool_matches_inline_and_shares_one_journal(tmp_path):
    path = str(tmp_path / "j.sqlite")
    inline = run_tasks(_tasks(), ExecutorSpec(workers=1))
    pooled = run_tasks(_tasks(path), ExecutorSpec(workers=2))
    assert inline == pooled
    with Journal(path) as j:
        counts = {r["partition"]: r["measurements"] for r in j.summary()}
    assert counts == {"fwd_attn": 30, "bwd_mlp": 30}
    # and a second run finds everything in the journal
    again = run_tasks(_tasks(path), ExecutorSpec(workers=2))
    assert all(r.measured_this_run == 0 for r in again)
    assert all(s.reused for r in again for s in r.samples)
    assert ([[(s.knobs, s.measurement) for s in r.samples] for r in again]
            == [[(s.knobs, s.measurement) for s in r.samples] for r in pooled])


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed")
def test_ray_matches_the_local_pool():
    assert (run_tasks(_tasks(), ExecutorSpec("ray"))
            == run_tasks(_tasks(), ExecutorSpec(workers=1)))


def test_search_cli_json_schema():
    r = run_cli("search", "-p", "kareus-1", "--partition", "fwd_mlp", "--budget", "30",
                "--seed", "1", "--noise", "0.03", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    for field in ("schema_version", "partition", "strategy", "seed", "measured_this_run",
                  "samples", "frontier", "hypervolume", "profiling_cost_s"):
        assert field in doc
    assert len(doc["samples"]) == 30 == doc["measured_this_run"]
    assert set(doc["samples"][0]) == {"freq_mhz", "sms", "slot", "time_s", "dynamic_energy_j",
                                      "energy_j", "static_energy_j", "avg_power_w",
                                      "effective_freq_mhz", "reused"}
    assert doc["profiling_cost_s"] >= 30 * 10


def test_search_cli_resumes_from_journal(tmp_path):
    j = str(tmp_path / "j.sqlite")
    base = ["search", "-p", "kareus-1", "--partition", "fwd_mlp", "--journal", j,
            "--tolerance", "0", "--json"]
    assert run_cli(*base, "--budget", "60").json()["measured_this_run"] == 60
    second = run_cli(*base, "--budget", "100").json()
    assert second["measured_this_run"] == 40 and second["reused_from_journal"] == 60
    listing = run_cli("journal", "--journal", j, "--json").json()
    assert listing["entries"][0]["measurements"] == 100
    assert listing["entries"][0]["job_id"] == job_id(JOB)
    table = run_cli("journal", "--journal", j)
    assert table.code == 0 and "fwd_mlp" in table.out


def test_search_table_output():
    r = run_cli("search", "-p", "kareus-1", "--partition", "fwd_attn", "--strategy", "random",
                "--budget", "25")
    assert r.code == 0, r.err
    assert "frontier" in r.out


@pytest.mark.parametrize("extra, message", [
    (["--partition", "fwd_nothing"], "no partition"),
    (["--partition", "fwd_mlp", "--budget", "5"], "smaller than the initial design"),
    (["--partition", "fwd_mlp", "--strategy", "grid"], "unknown strategy"),
    (["--partition", "fwd_mlp", "--executor", "slurm"], "unknown executor"),
    (["--partition", "fwd_mlp", "--prior", "oracle"], "unknown prior"),
    (["--partition", "fwd_mlp", "--initial", "0"], "at least 1 setting"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--workers", "100000000"], "--workers 100000000 is over Kareus's limit of 1,024"),
])
def test_search_bad_arguments(extra, message):
    r = run_cli("search", "-p", "kareus-1", *extra)
    assert r.code == 2, r.err
    assert len(r.err.strip().splitlines()) == 1 and message in r.err


def test_unreadable_journal(tmp_path):
    bad = tmp_path / "j.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    r = run_cli("search", "-p", "kareus-1", "--partition", "fwd_mlp", "--journal", str(bad))
    assert r.code == 2 and "cannot open journal" in r.err
    r = run_cli("journal", "--journal", str(bad))
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1
    r = run_cli("journal", "--journal", str(tmp_path / "missing.sqlite"))
    assert r.code == 2 and "not found" in r.err


def test_json_output_is_only_json():
    r = run_cli("search", "-p", "kareus-1", "--partition", "fwd_mlp", "--budget", "20",
                "--json")
    json.loads(r.out)


def test_unreachable_ray_cluster_is_one_error_and_writes_nothing(tmp_path):
    import time

    out = tmp_path / "never"
    t0 = time.monotonic()
    r = run_cli("optimize", "-p", "kareus-1", "--executor", "ray", "--ray-address",
                "127.0.0.1:1", "--ray-timeout", "2", "--out", str(out))
    assert r.code == 2 and time.monotonic() - t0 < 30
    assert "cannot reach the Ray cluster at 127.0.0.1:1 within 2 s" in r.err
    assert len(r.err.strip().splitlines()) == 1
    assert not out.exists()
    r = run_cli("search", "-p", "kareus-1", "--executor", "ray", "--ray-address", "nonsense")
    assert r.code == 2 and "host:port" in r.err


def test_search_table_says_its_gpu_hours_are_an_estimate():
    """An emulator run shows what profiling would cost, labelled as such (issue 21)."""
    r = run_cli("search", "-p", "kareus-1", "--partition", "fwd_mlp", "--budget", "20")
    assert r.code == 0, r.err
    assert "est. GPU h" in r.out and "an estimate, not time spent here" in " ".join(r.out.split())
    assert "profiling h" not in r.out


@pytest.mark.parametrize("command", ["profile", "search"])
def test_a_journal_reached_through_a_link_has_the_lock_of_its_file(tmp_path, command):
    """Two profiles into one journal under two names: the second is refused (before
    anything is created), as under one name."""
    real = tmp_path / "J.sqlite"
    Journal(real).close()
    alias = tmp_path / "alias.sqlite"
    alias.symlink_to(real)
    args = (["profile", "--backend", "emulator"] if command == "profile"
            else ["search", "--partition", "fwd_attn"])
    with journal_lock(str(real)):
        r = run_cli(*args, "-p", "kareus-1", "--budget", "20", "--journal", str(alias))
    assert r.code == 2, r.err
    assert "in use by another kareus run" in r.err and len(r.err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "J.sqlite", "J.sqlite.lock", "alias.sqlite"]
    with journal_lock(str(alias)), pytest.raises(KareusError, match="in use"):
        journal_lock(str(real))


def test_a_pool_never_starts_more_processes_than_tasks(monkeypatch):
    """A pool starts all of its workers at once (issue 34: --workers was unbounded)."""
    import kareus.profiling.executors as executors

    started = []
    monkeypatch.setattr(executors, "_run_pool",
                        lambda tasks, workers, progress: started.append(workers) or [])
    run_tasks(_tasks(), ExecutorSpec(workers=1000))
    assert started == [len(_tasks())]
