"""kareus import-perseus: Zeus's per-instruction profile format, strict validation, and the
1F1B frontier checked against a hand-computed pipeline."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kareus.core.atomic import mark
from kareus.job.perseus_profile import read_profile
from kareus.plans.plan import Plan
from kareus.results.resultdir import MARKER as RESULT_MARKER
from kareus.workflows.perseus import ImportDir
from tests.conftest import run_cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "perseus-profile.csv"
HEADER = "rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy"
FREQS = (1410, 1200, 1005)
# Both stages alike: (time s, energy J) per frequency; slower clocks save energy.
KNOWN = {"forward": {1410: (0.1, 30.0), 1200: (0.11, 25.5), 1005: (0.13, 22.5)},
         "backward": {1410: (0.2, 60.0), 1200: (0.22, 51.0), 1005: (0.26, 45.0)}}
STATIC_W = 50.0
MBS = 3


def _rows(pp: int = 2, tp: int = 1) -> list[str]:
    """Zeus's CSV rows (InstructionProfilingResult.to_csv's column order)."""
    return [f"{s * tp + t},0,{s},{t},{s},{d},{f},{KNOWN[d][f][0]},{KNOWN[d][f][1]}"
            for s in range(pp) for t in range(tp) for d in KNOWN for f in FREQS]


def _write(path: Path, rows: list[str], header: str = HEADER) -> Path:
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def _import(tmp_path: Path, src: Path, *extra: str):
    return run_cli("import-perseus", str(src), "--out", str(tmp_path / "out"),
                   "--microbatches", str(MBS), *extra, "--json")


def test_reads_the_example():
    prof = read_profile(EXAMPLE)
    assert (prof.pp, prof.gpus_per_stage, prof.fmt) == (2, 1, "csv")
    assert prof.freqs_mhz == (1410, 1305, 1200, 1095, 990)
    assert prof.time_s[(1, "backward", 1410)] == pytest.approx(0.0937)


def test_ranks_of_a_stage_give_the_slowest_time_and_mean_energy(tmp_path):
    rows = _rows(tp=2)
    rows[0] = rows[0].replace(",0.1,30.0", ",0.12,34.0")  # rank 0, forward, 1410 MHz
    prof = read_profile(_write(tmp_path / "p.csv", rows))
    assert prof.gpus_per_stage == 2
    assert prof.time_s[(0, "forward", 1410)] == pytest.approx(0.12)
    assert prof.energy_j[(0, "forward", 1410)] == pytest.approx(32.0)


def test_zeus_own_writers_are_read_alike(tmp_path):
    pytest.importorskip("aiofiles")
    pytest.importorskip("pandas")
    common = pytest.importorskip("zeus.optimizer.pipeline_frequency.common")
    res = [common.OfflineProfilingResult(
        rank=s, dp_rank=0, pp_rank=s, tp_rank=0,
        **{f"{d}_{what}": {f: KNOWN[d][f][i] for f in FREQS}
           for d in KNOWN for i, what in enumerate(("time", "energy"))})
        for s in range(2)]
    doc = common.InstructionProfilingResult(__root__=res)
    doc.to_csv(str(tmp_path / "zeus.csv"))
    (tmp_path / "zeus.json").write_text(doc.json())
    a, b = read_profile(tmp_path / "zeus.csv"), read_profile(tmp_path / "zeus.json")
    assert (a.fmt, b.fmt) == ("csv", "json")
    assert a.time_s == b.time_s and a.energy_j == b.energy_j and a.freqs_mhz == b.freqs_mhz


def _bad(rows: list[str], old: str, new: str) -> list[str]:
    return [r.replace(old, new, 1) if i == 3 else r for i, r in enumerate(rows)]


@pytest.mark.parametrize("header, edit, message", [
    (HEADER.replace(",energy", ""), None, "row 1: missing column(s) energy"),
    (HEADER + ",power", None, "row 1: unknown column(s) power"),
    (HEADER, lambda r: _bad(r, ",0.2,60.0", ",0,60.0"), "row 5: time must be positive"),
    (HEADER, lambda r: _bad(r, ",0.2,60.0", ",0.2,-1"), "row 5: energy must be positive"),
    (HEADER, lambda r: _bad(r, ",0.2,60.0", ",fast,60.0"), "row 5: time 'fast' is not a"),
    (HEADER, lambda r: _bad(r, "backward", "recompute"), "row 5: instruction 'recompute'"),
    (HEADER, lambda r: [x for x in r if not x.startswith("1,0,1,0,1,backward")],
     "stage 1 (rank 1) has no backward rows"),
    (HEADER, lambda r: _bad(r, ",1410,", ",1305,"), "inconsistent frequencies"),
    (HEADER, lambda r: [*r, r[0]], "row 14: duplicates row 2"),
    (HEADER, lambda r: [x.replace(",1,0,1,", ",2,0,2,") for x in r],
     "stage 1 has no rows"),
    (HEADER, lambda r: [*r[:3], "1,2"], "row 5: 2 fields, the header has 9"),
])
def test_bad_profiles_fail_in_one_line(tmp_path, header, edit, message):
    rows = _rows()
    src = _write(tmp_path / "bad.csv", edit(rows) if edit else rows, header)
    r = _import(tmp_path, src, "--static-power-w", "50")
    assert r.code == 2, r.out
    assert r.err.count("\n") == 1 and str(src) in r.err and message in r.err, r.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    ((), "give --static-power-w W or --gpu NAME"),
    (("--gpu", "nosuch"), "unknown GPU 'nosuch'"),
    (("--static-power-w", "50", "--microbatches", "0"), "--microbatches must be at least 1"),
    (("--static-power-w", "500"), "less than the static power 500 W alone"),
])
def test_bad_options_fail_in_one_line(tmp_path, args, message):
    r = _import(tmp_path, _write(tmp_path / "p.csv", _rows()), *args)
    assert r.code == 2 and r.err.count("\n") == 1 and message in r.err, r.err


@pytest.mark.parametrize("pp, microbatches, bound", [(2, 257, 256), (8, 65, 64)])
def test_too_many_microbatches_fail_in_one_line(tmp_path, pp, microbatches, bound):
    """At most 1024 pipeline instructions (stages x microbatches x 2), checked before
    anything is solved (tests/test_signals.py: a million, in a process)."""
    src = _write(tmp_path / "p.csv", _rows(pp=pp))
    r = run_cli("import-perseus", str(src), "--out", str(tmp_path / "out"), "--microbatches",
                str(microbatches), "--static-power-w", "50", "--json")
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    assert (f"--microbatches {microbatches} is too many: {pp} stages x {microbatches} "
            f"microbatches x 2 is {2 * pp * microbatches} pipeline instructions") in r.err
    assert f"at most {bound} microbatches for {pp} stages; docs/perseus.md" in r.err
    assert not (tmp_path / "out").exists()


def test_clocks_are_checked_against_the_gpu(tmp_path):
    src = _write(tmp_path / "p.csv", [r.replace(",1005,", ",1000,") for r in _rows()])
    r = _import(tmp_path, src, "--gpu", "a100")
    assert r.code == 2 and "1000 MHz is not a supported clock" in r.err and str(src) in r.err


def test_json_entries_are_validated(tmp_path):
    src = tmp_path / "p.json"
    src.write_text(json.dumps([{"rank": 0, "pp_rank": 0, "forward_time": {}}]))
    r = _import(tmp_path, src, "--static-power-w", "50")
    assert r.code == 2 and "entry 0: missing key(s) dp_rank, tp_rank" in r.err, r.err


def test_round_trip_matches_the_hand_computed_pipeline(tmp_path):
    src = _write(tmp_path / "p.csv", _rows())
    r = _import(tmp_path, src, "--static-power-w", str(STATIC_W))
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["schema_version"] == 1 and doc["source"] == str(src)
    assert doc["p2p_time_s"] == 0 and "assumed 0" in doc["p2p_source"]
    front = doc["frontier"]
    fast = next(p for p in front if p["plan"] == doc["fastest"])
    low = next(p for p in front if p["plan"] == doc["least_energy"])
    # 1F1B, 2 stages, 3 microbatches, F = 1 and B = 2 units at 1410 MHz (1 unit = 0.1 s):
    # stage 0: F0 0-1, F1 1-2, B0 4-6, F2 6-7, B1 7-9, B2 10-12
    # stage 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7, F2 7-8, B2 8-10   -> 12 units
    assert fast["time_s"] == pytest.approx(1.2)
    all_max_j = 2 * MBS * (30 - STATIC_W * 0.1 + 60 - STATIC_W * 0.2) + 2 * 1.2 * STATIC_W
    assert fast["energy_j"] <= all_max_j + 1e-9  # slack of stage 0 runs slower
    # at 1005 MHz every instruction is 1.3x as long; each step up a clock costs more
    # dynamic energy than the static energy it could save, so all-1005 is the least
    t_min = 1.3 * 1.2
    dyn_min = 2 * MBS * (22.5 - STATIC_W * 0.13 + 45 - STATIC_W * 0.26)
    assert (low["time_s"], low["energy_j"]) == pytest.approx(
        (t_min, dyn_min + 2 * t_min * STATIC_W))
    assert low["freqs_mhz"] == [1005]
    out = tmp_path / "out"
    zeus = ast.literal_eval((out / fast["zeus_file"]).read_text())
    assert zeus[1] == [(d, 1410) for d in ("forward", "backward") * MBS]  # all critical
    plan = Plan.from_dict(json.loads((out / fast["plan_file"]).read_text()))
    assert (plan.id, plan.time_s) == (fast["plan"], fast["time_s"])
    for p in front:
        assert (out / p["plan_file"]).is_file() and (out / p["zeus_file"]).is_file()
    assert json.loads((out / "summary.json").read_text())["frontier"] == front


def test_out_is_refused_unless_empty_or_forced(tmp_path):
    src = _write(tmp_path / "p.csv", _rows())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    r = _import(tmp_path, src, "--static-power-w", "50")
    assert r.code == 2 and "not empty" in r.err
    # --force never replaces a directory that is not an earlier import's output
    r = _import(tmp_path, src, "--static-power-w", "50", "--force")
    assert r.code == 2 and "is not a Kareus import-perseus output" in r.err
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"
    (tmp_path / "out" / "keep.txt").unlink()
    assert _import(tmp_path, src, "--static-power-w", "50").code == 0
    r = _import(tmp_path, src, "--static-power-w", "50")
    assert r.code == 2 and "earlier import-perseus output" in r.err and "--force" in r.err
    r = _import(tmp_path, src, "--static-power-w", "50", "--force")
    assert r.code == 0, r.err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".kareus-import", ".kareus-import.lock", "plans", "summary.json", "zeus"]
    assert not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("failing", ["kareus.core.atomic.exchange_dirs",
                                     "kareus.workflows.perseus.export_plan"])
def test_a_failed_rewrite_leaves_the_earlier_import(tmp_path, monkeypatch, failing):
    src = _write(tmp_path / "p.csv", _rows())
    out = tmp_path / "out"
    assert _import(tmp_path, src, "--static-power-w", "50").code == 0

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*")
                if p.is_file()}

    before = files()

    def crash(*_args, **_kwargs):
        raise OSError("killed here")

    monkeypatch.setattr(failing, crash)
    r = _import(tmp_path, src, "--static-power-w", "60", "--force")
    assert r.code == 2 and f"cannot write the plans to {out}: killed here" in r.err, r.err
    assert files() == before
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_table_and_zeus_loader(tmp_path):
    r = run_cli("import-perseus", str(EXAMPLE), "--out", str(tmp_path / "out"),
                "--microbatches", "4", "--gpu", "A100")
    assert r.code == 0, r.err
    assert "fastest" in r.out and "least energy" in r.out and "P2P transfers 0 s" in r.out
    assert "solving the 1F1B frontier of 2 stages x 4 microbatches" in r.err
    pytest.importorskip("aiofiles")
    scheduler = pytest.importorskip("zeus.optimizer.pipeline_frequency.server.scheduler")
    common = pytest.importorskip("zeus.optimizer.pipeline_frequency.common")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    path = tmp_path / "out" / summary["frontier"][0]["zeus_file"]
    job = common.JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    ranks = [common.RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0,
                             available_frequencies=list(range(1410, 209, -15)))
             for r in range(2)]
    settings = common.PFOServerSettings(scheduler="PointSolution",
                                        scheduler_args={"solution_path": str(path)})
    sched = scheduler.PointSolution(job, ranks, settings, solution_path=str(path))
    served = {s.rank: [tuple(x) for x in s.frequencies] for s in sched.next_schedule()}
    assert served == dict(enumerate(ast.literal_eval(path.read_text())))


# The output directory holds only what Kareus writes (issue 21, item 1) ------------------


def _kareus(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kareus.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("out", [".", "", "..", "ABS"])
def test_out_of_the_current_directory_or_above_is_refused_as_a_process(tmp_path, out):
    """As it failed: a real process in a directory holding the user's files; the current
    directory (given as ``.``, empty, its parent or its absolute path) is never swapped."""
    home = tmp_path / "work"
    (home / "precious").mkdir(parents=True)
    (home / "precious" / "file").write_text("mine")
    src = _write(home / "p.csv", _rows())
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    given = str(home) if out == "ABS" else out
    r = _kareus("import-perseus", "p.csv", "--out", given, "--microbatches", "3",
                "--static-power-w", "50", "--force", cwd=home)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("kareus: error: --out"), r.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (home / "precious" / "file").read_text() == "mine" and src.is_file()


def test_out_inside_a_result_or_an_import_is_refused(tmp_path):
    src = _write(tmp_path / "p.csv", _rows())
    assert _import(tmp_path, src, "--static-power-w", "50").code == 0
    for inside in (tmp_path / "out" / "plans", tmp_path / "out" / "sub"):
        r = run_cli("import-perseus", str(src), "--out", str(inside), "--microbatches",
                    "3", "--static-power-w", "50", "--force")
        assert r.code == 2 and "inside the import-perseus output" in r.err, r.err
    assert not (tmp_path / "out" / "sub").exists()
    result = tmp_path / "run"
    result.mkdir()
    mark(result, RESULT_MARKER)
    r = run_cli("import-perseus", str(src), "--out", str(result / "perseus"),
                "--microbatches", "3", "--static-power-w", "50")
    assert r.code == 2 and "inside the result directory" in r.err, r.err
    assert not (result / "perseus").exists()


@pytest.mark.parametrize("foreign", ["notes.txt", "plans/mine.txt", "zeus/sub/x"])
def test_an_earlier_import_holding_user_files_is_not_replaced(tmp_path, foreign):
    src = _write(tmp_path / "p.csv", _rows())
    assert _import(tmp_path, src, "--static-power-w", "50").code == 0
    path = tmp_path / "out" / foreign
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("mine")
    r = _import(tmp_path, src, "--static-power-w", "60", "--force")
    assert r.code == 2 and "did not write" in r.err, r.err
    assert path.read_text() == "mine"
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["static_power_w"] == 50


def test_a_second_import_on_the_same_out_is_refused_naming_the_first(tmp_path):
    src = _write(tmp_path / "p.csv", _rows())
    out_dir = ImportDir(tmp_path / "out")
    with out_dir.lock():
        r = _import(tmp_path, src, "--static-power-w", "50")
        assert r.code == 2 and f"in use by another kareus run (pid {os.getpid()})" in r.err
        assert not (tmp_path / "out" / "summary.json").exists()
    assert _import(tmp_path, src, "--static-power-w", "50").code == 0  # released


def test_a_symlinked_out_gets_the_plans_in_its_target(tmp_path):
    src = _write(tmp_path / "p.csv", _rows())
    target = tmp_path / "disk" / "out"
    target.mkdir(parents=True)
    (tmp_path / "out").symlink_to(target)
    assert _import(tmp_path, src, "--static-power-w", "50").code == 0
    assert _import(tmp_path, src, "--static-power-w", "60", "--force").code == 0
    assert (tmp_path / "out").is_symlink()
    assert json.loads((target / "summary.json").read_text())["static_power_w"] == 60
    assert not list(tmp_path.rglob(".*.tmp-*"))


@pytest.mark.parametrize("depth", [100, 100_000])
def test_a_profile_nested_too_deep_is_one_line(tmp_path, depth):
    """Issue 34: a RecursionError traceback at 100,000 levels."""
    src = tmp_path / "deep.json"
    src.write_text("[" * depth + "]" * depth)
    r = _import(tmp_path, src, "--static-power-w", "50")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r.err
    assert "nested deeper than 64 levels" in r.err
    assert not (tmp_path / "out").exists()
