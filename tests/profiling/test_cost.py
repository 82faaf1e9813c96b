"""What a profile costs (kareus.profiling.cost, kareus.profiling.estimate): the expected
clock changes of a batch against a Monte Carlo count; on the emulator, `kareus profile
--dry-run` measures and writes nothing and estimates what the run then records (in the
journal's profile_runs and in its result); --max-hours refuses a profile over it before
anything is created; --every-clock fits nothing; `kareus optimize --measurements` says how
many of its numbers were fitted."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kareus.job.sources import build_job
from kareus.profiling.cost import expected_clock_changes
from kareus.store import Journal, job_id
from tests.conftest import run_cli

# kareus-1 with its 18 default clocks; few microbatches and a small budget keep it quick
JOB = build_job("kareus-1", overrides={"num_microbatches": 4})
ARGS = ("-p", "kareus-1", "--microbatches", "4")
PROFILE = ("profile", *ARGS, "--backend", "emulator", "--budget", "20")


# Expected clock changes ---------------------------------------------------------------------

def _monte_carlo(draws: int, clocks: int, trials: int = 20000) -> float:
    """Distinct clocks among ``draws`` settings drawn uniformly from ``clocks``, averaged."""
    rng = np.random.default_rng(12345)
    picks = np.sort(rng.integers(0, clocks, size=(trials, draws)), axis=1)
    distinct = 1 + np.count_nonzero(np.diff(picks, axis=1), axis=1)
    return float(distinct.mean())


@pytest.mark.parametrize(("draws", "clocks"), [(1, 18), (2, 18), (5, 18), (18, 18),
                                               (40, 18), (200, 18), (3, 2), (10, 3),
                                               (7, 100)])
def test_expected_clock_changes_is_the_mean_count_of_distinct_clocks(draws, clocks):
    got = expected_clock_changes(draws, clocks)
    assert got == pytest.approx(_monte_carlo(draws, clocks), rel=0.02, abs=0.02)


def test_expected_clock_changes_edge_cases():
    assert expected_clock_changes(0, 18) == 0.0
    assert expected_clock_changes(0, 1) == 0.0
    assert expected_clock_changes(1, 1) == 1.0
    assert expected_clock_changes(50, 1) == 1.0  # one clock: one change at most
    assert expected_clock_changes(1, 18) == pytest.approx(1.0)  # one draw, one clock


@given(draws=st.integers(1, 500), clocks=st.integers(1, 200))
def test_expected_clock_changes_lies_between_one_and_the_fewer_of_draws_and_clocks(
        draws, clocks):
    got = expected_clock_changes(draws, clocks)
    assert 1.0 - 1e-9 <= got <= min(draws, clocks) + 1e-9
    assert got <= expected_clock_changes(draws + 1, clocks) + 1e-12  # more draws, no fewer


# The estimate against the run, on the emulator ------------------------------------------------

def _fitted_rows(path) -> int:
    with sqlite3.connect(str(path)) as conn:
        return conn.execute("SELECT COUNT(*) FROM fitted").fetchone()[0]


@pytest.fixture(scope="module")
def estimated_then_profiled(tmp_path_factory):
    """`kareus profile --dry-run --json`, then the profile itself (--json), of JOB."""
    d = tmp_path_factory.mktemp("cost")
    path = d / "j.sqlite"
    dry = run_cli(*PROFILE, "--journal", str(path), "--dry-run", "--json")
    assert dry.code == 0, dry.err
    left_by_dry_run = sorted(p.name for p in d.iterdir())
    estimate = dry.json()
    # a limit above the estimate lets the profile run
    run = run_cli(*PROFILE, "--journal", str(path), "--json",
                  "--max-hours", f"{estimate['node_hours'] * 2:.6f}")
    assert run.code == 0, run.err
    return path, left_by_dry_run, estimate, run.json()


def test_a_dry_run_measures_and_writes_nothing_and_states_the_costs(estimated_then_profiled):
    _path, left, est, _run = estimated_then_profiled
    assert left == []  # no journal, no lock file
    for key in ("schema_version", "wall_s", "gpu_s", "node_hours", "measurements"):
        assert key in est, key
    assert est["estimate"] is True
    assert est["measurements"] == est["partition_settings"] + est["steps_measured"] > 0
    assert est["partition_settings"] <= 4 * 20  # four partitions, a budget of 20 each
    assert est["gpu_s"] == pytest.approx(est["cost_s"] * est["group_gpus"])
    assert est["node_hours"] == pytest.approx(
        est["gpu_s"] / est["gpus_per_node"] / 3600.0)
    pr = est["protocol"]
    # every measurement costs at least its window and its cooldown
    assert est["cost_s"] >= est["measurements"] * (pr["window_s"] + pr["cooldown_s"]) - 1e-6
    assert est["wall_s"] == pytest.approx(est["cost_s"])  # one group, one after another
    assert est["steps_measured"] + est["steps_fitted"] == est["steps_upper_bound"]
    assert 0 < est["steps_measured"] < est["steps_upper_bound"]


def test_the_run_records_what_it_cost_within_the_estimate(estimated_then_profiled):
    path, _left, est, run = estimated_then_profiled
    assert path.is_file()
    with Journal(path) as j:
        runs = j.profile_runs(job_id(JOB))
    assert len(runs) == 1
    recorded = runs[0]
    assert recorded == run["cost"]  # the result's cost is the journal's
    assert recorded["estimate"] is False
    steps = run["steps"]
    assert recorded["partition_settings"] <= est["partition_settings"]
    assert recorded["partition_settings"] == sum(s["measured_this_run"]
                                                 for s in run["searches"])
    assert recorded["steps_measured"] + recorded["steps_fitted"] == steps["needed"] > 0
    assert recorded["steps_fitted"] == steps["fitted"] > 0
    assert recorded["steps_measured"] <= est["steps_upper_bound"]
    assert recorded["steps_fitted"] == _fitted_rows(path)
    # the estimate the run printed is the dry run's: same inputs, same numbers
    assert run["estimate"] == {k: v for k, v in est.items() if k != "journal"}
    assert est["cost_s"] == pytest.approx(recorded["cost_s"], rel=0.15)


def test_max_hours_below_the_estimate_is_refused_before_anything_is_created(
        estimated_then_profiled, tmp_path):
    _path, _left, est, _run = estimated_then_profiled
    path = tmp_path / "j.sqlite"
    r = run_cli(*PROFILE, "--journal", str(path), "--max-hours",
                f"{est['node_hours'] / 2:.6f}")
    assert r.code == 2
    assert "Traceback" not in r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert "estimate" in lines[0] and "--max-hours" in lines[0]
    assert f"{est['node_hours']:.2f} node-hours" in lines[0]
    assert not path.exists()


def test_a_profile_refused_by_max_hours_leaves_no_lock_file(tmp_path):
    where = tmp_path / "fresh"
    where.mkdir()
    r = run_cli(*PROFILE, "--journal", str(where / "j.sqlite"), "--max-hours", "0.000001")
    assert r.code == 2 and "--max-hours" in r.err, r.err
    assert list(where.iterdir()) == []  # no journal, no j.sqlite.lock


@pytest.mark.parametrize("hours", ["0", "-1", "-0.5"])
def test_max_hours_must_be_positive(tmp_path, hours):
    path = tmp_path / "j.sqlite"
    r = run_cli(*PROFILE, "--journal", str(path), f"--max-hours={hours}")
    assert r.code == 2
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert "--max-hours" in r.err
    assert not path.exists()


def test_every_clock_fits_nothing(tmp_path):
    path = tmp_path / "j.sqlite"
    dry = run_cli(*PROFILE, "--journal", str(path), "--every-clock", "--dry-run", "--json")
    assert dry.code == 0, dry.err
    est = dry.json()
    assert est["steps_fitted"] == 0 and est["steps_measured"] == est["steps_upper_bound"] > 0
    r = run_cli(*PROFILE, "--journal", str(path), "--every-clock", "--json")
    assert r.code == 0, r.err
    steps = r.json()["steps"]
    assert steps["fitted"] == 0
    assert steps["measured"] == steps["needed"] == est["steps_upper_bound"]
    assert _fitted_rows(path) == 0
    with Journal(path) as j:
        assert j.fitted(job_id(JOB), r.json()["backend"]) == {}
        (cost,) = j.profile_runs(job_id(JOB))
    assert cost["steps_fitted"] == 0 and cost["steps_measured"] == steps["needed"]


def test_optimize_from_a_fitted_profile_says_how_many_numbers_were_fitted(
        estimated_then_profiled, tmp_path):
    path, _left, _est, _run = estimated_then_profiled
    out = tmp_path / "o"
    r = run_cli("optimize", *ARGS, "--measurements", str(path), "--out", str(out), "--json")
    assert r.code == 0, r.err
    fitted = r.json()["measurements"]["fitted"]
    # composition asks for every number the profile fitted (it fitted what composition
    # needs), and reads each one from the journal
    assert fitted["count"] == _fitted_rows(path) > 0
    with sqlite3.connect(str(path)) as conn:
        worst_t, worst_e = conn.execute(
            "SELECT MAX(ABS(time_rel_error)), MAX(ABS(energy_rel_error)) FROM fitted"
        ).fetchone()
    assert fitted["max_time_rel_error"] == pytest.approx(worst_t)
    assert fitted["max_energy_rel_error"] == pytest.approx(worst_e)
    assert json.loads((out / "result.json").read_text())["measurements"]["fitted"] == fitted
    report = (out / "report.md").read_text()
    assert any(str(fitted["count"]) in line and "fitted" in line
               for line in report.splitlines()), report


# The prior ------------------------------------------------------------------------------------

def test_without_the_prior_the_search_spends_100_settings_and_the_steps_six_clocks(tmp_path):
    """The default profile searches with the emulator prior (`SearchConfig.informed`:
    budget 40, batches of 5) and fits the steps through it (three clocks a step);
    ``--prior none`` is the search and the fits of before: budget 100, six clocks."""
    base = ("profile", *ARGS, "--backend", "emulator", "--journal", str(tmp_path / "j"),
            "--dry-run", "--json")
    informed = run_cli(*base)
    plain = run_cli(*base, "--prior", "none")
    assert informed.code == 0 and plain.code == 0, informed.err + plain.err
    a, b = informed.json(), plain.json()
    assert a["partition_settings"] == 4 * 40 and b["partition_settings"] == 4 * 100
    assert a["steps_upper_bound"] == b["steps_upper_bound"]  # the same steps are needed
    assert a["steps_measured"] < 0.65 * b["steps_measured"]
    given_budget = run_cli(*base, "--budget", "30", "--batch-size", "10")
    assert given_budget.json()["partition_settings"] == 4 * 30


@pytest.mark.parametrize("prior", ["gpu", "nvml", ""])
def test_an_unknown_prior_is_one_line_and_creates_nothing(tmp_path, prior):
    path = tmp_path / "j.sqlite"
    r = run_cli(*PROFILE, "--journal", str(path), "--prior", prior)
    assert r.code == 2
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert "prior" in r.err
    assert not path.exists()


# A real GPU's estimate, without one ---------------------------------------------------------

@pytest.fixture
def no_nvml(monkeypatch):
    """NVML and PyTorch absent, as on a machine without an NVIDIA GPU (whatever this one
    has): opening the device or importing torch fails as they do there."""
    from kareus.backends.nvml import spec as nvml
    from kareus.errors import KareusError

    def absent(*_a, **_k):
        raise KareusError("no NVIDIA GPU found (NVML: NVML Shared Library Not Found)")

    monkeypatch.setattr(nvml.NvmlSpec, "_device", absent)
    monkeypatch.setattr(nvml, "import_torch", absent)


def test_an_nvml_dry_run_needs_no_gpu_and_counts_the_catalogs_clocks(tmp_path, no_nvml):
    """docs/gpu.md's "ask before you start": the estimate is arithmetic over the job and
    the protocol, the run's own numbers, with the job's GPU's clocks from the catalog."""
    path = tmp_path / "j.sqlite"
    nvml = run_cli("profile", *ARGS, "--backend", "nvml", "--allow-clock-changes",
                   "--journal", str(path), "--dry-run", "--json")
    assert nvml.code == 0, nvml.err
    emulated = run_cli(*PROFILE[:-2], "--journal", str(path), "--dry-run", "--json")
    assert emulated.code == 0, emulated.err
    a, b = nvml.json(), emulated.json()
    for k in ("partition_settings", "steps_measured", "steps_upper_bound", "cost_s",
              "clock_changes", "gpu_s"):
        assert a[k] == pytest.approx(b[k]), k
    assert a["clocks_from"] == "catalog:A100-40GB"
    assert a["clocks_mhz"] == list(JOB.freqs_mhz) and len(JOB.freqs_mhz) == 18
    assert not path.exists()  # a dry run creates nothing
    text = run_cli("profile", *ARGS, "--backend", "nvml", "--allow-clock-changes",
                   "--journal", str(path), "--dry-run")
    assert text.code == 0 and "A100-40GB catalog's search clocks" in text.out, text.err
    # the run itself still needs the GPU: one line, exit 2, nothing created
    run = run_cli("profile", *ARGS, "--backend", "nvml", "--allow-clock-changes",
                  "--journal", str(path))
    assert run.code == 2 and "no NVIDIA GPU found" in run.err
    assert len(run.err.strip().splitlines()) == 1 and not path.exists()
    # and the estimate keeps the run's own refusals (several clocks need the permission)
    refused = run_cli("profile", *ARGS, "--backend", "nvml", "--journal", str(path),
                      "--dry-run")
    assert refused.code == 2 and "--allow-clock-changes" in refused.err
