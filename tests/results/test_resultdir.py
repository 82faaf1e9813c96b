"""The result directory: swapped in whole, stamped with the run, refusing stale plans."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from kareus.core.atomic import mark
from kareus.errors import KareusError
from kareus.job.sources import build_job
from kareus.profiling.executors import ExecutorSpec
from kareus.results.resultdir import MARKER, ResultDir
from kareus.search import SearchConfig
from kareus.store import Journal, job_id
from kareus.workflows.optimize import OptimizeRequest, optimize
from tests.conftest import run_cli

JOB = build_job("kareus-1", overrides={"num_microbatches": 4,
                                       "search_freqs_mhz": (1410, 1200)})


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    out = tmp_path_factory.mktemp("rd") / "run"
    result = optimize(OptimizeRequest(JOB, str(out), SearchConfig(budget=20, seed=1),
                                      executor=ExecutorSpec(workers=1)))
    return ResultDir(out), result


def _consistent(rd: ResultDir) -> str:
    """Every listed plan readable and of the listed run; no other plan file."""
    doc = rd.read_result()
    listed = rd.plan_ids()
    assert {p.stem for p in rd.plans_dir.glob("*.json")} == listed
    for pid in listed:
        plan, _job = rd.read_plan(pid)
        assert plan.id == pid
    return doc["run_id"]


def test_result_and_plans_carry_the_run_and_the_job(first):
    rd, result = first
    doc = rd.read_result()
    assert doc["run_id"] == result.run_id and doc["job_id"] == job_id(JOB)
    plan = json.loads(rd.plan_file(doc["methods"]["kareus"]["frontier"][0]["plan"])
                      .read_text())
    assert plan["run_id"] == result.run_id and plan["job_id"] == job_id(JOB)
    assert _consistent(rd) == result.run_id


@pytest.mark.parametrize("failing", ["kareus.results.report.frontier_figure",
                                     "kareus.results.timeline.timeline_figure",
                                     "kareus.results.report.markdown_report",
                                     "kareus.core.atomic.exchange_dirs"])
def test_a_crash_while_writing_leaves_the_old_result(first, monkeypatch, failing):
    rd, result = first
    before = _consistent(rd)
    rows = len(Journal(rd.journal).summary())

    def crash(*_args, **_kwargs):
        raise OSError("killed here")

    monkeypatch.setattr(failing, crash)
    with pytest.raises(KareusError, match="cannot write the result"):
        rd.write(dataclasses.replace(result, run_id="crashed"))
    assert _consistent(rd) == before
    assert len(Journal(rd.journal).summary()) == rows  # the journal stays in place
    assert not list(rd.path.parent.glob(f".{rd.path.name}.tmp-*"))  # nothing left beside
    monkeypatch.undo()
    killed = rd.path.parent / f".{rd.path.name}.tmp-killed"  # what a SIGKILL leaves
    (killed / "plans").mkdir(parents=True)
    mark(killed, MARKER)  # made by replace_dir, marked as it is made
    rd.prepare()  # the next run removes it
    assert not list(rd.path.parent.glob(f".{rd.path.name}.tmp-*"))


def test_a_rewrite_replaces_every_plan_and_keeps_the_journal(first):
    rd, result = first
    with Journal(rd.journal) as j:
        n = sum(r["measurements"] for r in j.summary())
    fewer = {m: ps[:1] for m, ps in result.plans.items()}
    rd.write(dataclasses.replace(result, plans=fewer, run_id="second"))
    assert _consistent(rd) == "second"
    assert len(rd.plan_ids()) == len(fewer)
    with Journal(rd.journal) as j:
        assert sum(r["measurements"] for r in j.summary()) == n
    rd.write(result)  # back, for the other tests
    assert _consistent(rd) == result.run_id


def test_stale_and_foreign_plan_files_are_refused(first, tmp_path):
    rd, _result = first
    listed = sorted(rd.plan_ids())[0]
    stale = rd.plan_file("kareus-999")
    stale.write_text(rd.plan_file(listed).read_text())
    try:
        with pytest.raises(KareusError, match="lists no plan 'kareus-999'"):
            rd.read_plan("kareus-999")
        r = run_cli("plan", "export", "--result", str(rd.path), "--plan", "kareus-999",
                    "--out", str(tmp_path / "x.json"))
        assert r.code == 2 and not (tmp_path / "x.json").exists()
    finally:
        stale.unlink()
    doc = json.loads(rd.plan_file(listed).read_text())
    rd.plan_file(listed).write_text(json.dumps({**doc, "run_id": "another"}))
    try:
        with pytest.raises(KareusError, match="another run"):
            rd.read_plan(listed)
    finally:
        rd.plan_file(listed).write_text(json.dumps(doc))


def test_out_of_another_job_is_refused_unless_forced(first):
    rd, _result = first
    other = build_job("kareus-1")
    with pytest.raises(KareusError, match="another job"):
        rd.check_writable(job_id(other))
    rd.check_writable(job_id(other), force=True)
    rd.check_writable(job_id(JOB))
    r = run_cli("optimize", "-p", "kareus-1", "--out", str(rd.path), "--budget", "20")
    assert r.code == 2 and "another job" in r.err and "--force" in r.err


def test_plan_export_never_overwrites_without_force(first, tmp_path):
    rd, _result = first
    pid = sorted(rd.plan_ids())[0]
    out = tmp_path / "plan.json"
    args = ["plan", "export", "--result", str(rd.path), "--plan", pid]
    assert run_cli(*args, "--out", str(out)).code == 0
    out.write_text("mine")
    r = run_cli(*args, "--out", str(out))
    assert r.code == 2 and "exists" in r.err and out.read_text() == "mine"
    assert run_cli(*args, "--out", str(out), "--force").code == 0
    assert json.loads(out.read_text())["id"] == pid
    for own in (rd.result_file, rd.plan_file(pid), rd.report):
        before = own.read_bytes()
        r = run_cli(*args, "--out", str(own), "--force")
        assert r.code == 2 and "result directory" in r.err
        assert own.read_bytes() == before


def test_plan_timelines_pictures_and_headline(first, tmp_path):
    rd, result = first
    for which in ("max-throughput", "min-energy"):
        assert rd.timeline(which).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = rd.report.read_text().splitlines()
    assert report[2].startswith("*Emulator: ")  # where the numbers come from, first
    assert "Against Perseus, Kareus uses " in report[2]
    assert "Iso-time energy" in rd.report.read_text()
    plan = result.plans["kareus"][0]
    instr = [e for e in plan.timeline if e.kind in ("forward", "backward")]
    assert len(instr) == 2 * JOB.pp * JOB.num_microbatches
    assert max(e.start_s + e.time_s for e in plan.timeline) == pytest.approx(plan.time_s)
    last = max(instr, key=lambda e: e.start_s + e.time_s)
    assert last.critical  # what ends the iteration is on the critical path
    sends = [e for e in plan.timeline if e.kind == "send"]
    assert len(sends) == 2 * (JOB.pp - 1) * JOB.num_microbatches
    # the plan file keeps it, and `plan show` draws it
    again, _job = rd.read_plan(plan.id)
    assert again.timeline == plan.timeline
    png = tmp_path / "t.png"
    r = run_cli("plan", "show", "--result", str(rd.path), "--plan", plan.id, "--png",
                str(png), "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert png.read_bytes()[:4] == b"\x89PNG"
    knobbed = sum(len(v) for v in plan.execution.instruction_knobs.values())
    assert sum(row["instructions"] for row in doc["settings"]) == knobbed
    table = run_cli("plan", "show", "--result", str(rd.path), "--plan", plan.id)
    assert table.code == 0 and "Partition settings per clock" in table.out


def test_progress_output_a_person_reads(first):
    rd, _result = first
    r = run_cli("optimize", "-p", "kareus-1", "--microbatches", "4", "--freqs", "1410,1200",
                "--budget", "20", "--seed", "1", "--workers", "1", "--out", str(rd.path))
    assert r.code == 0, r.err
    assert ".py:" not in r.err  # log lines carry no source locations
    for key in ("fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"):  # bars end full, say so
        assert re.search(rf"{key} \(reused 20\).*20/20", r.err), r.err
    listed = run_cli("journal", "--journal", str(rd.journal))
    ident = Journal(rd.journal).identities(job_id(JOB))[0]
    assert ident in listed.out  # never cut, piped or not


def test_an_error_after_progress_output_is_one_line(first, tmp_path):
    rd, _result = first
    # a replay asked for settings its journal lacks: the searches fail after their bars
    r = run_cli("optimize", "-p", "kareus-1", "--microbatches", "4", "--freqs", "1410,1200",
                "--budget", "40", "--seed", "1", "--workers", "1", "--out",
                str(tmp_path / "more"), "--backend", "replay", "--replay-journal",
                str(rd.journal))
    assert "fwd_attn" in r.err  # its progress bar was shown
    assert r.code == 2
    errors = [line for line in r.err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("kareus: error: journal ")
    assert "Traceback" not in r.err


# Nothing of the user's is lost (issue 21) ------------------------------------------------


def _tree(root):
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def test_a_directory_inside_a_result_is_refused(first):
    rd, _result = first
    for inside in (rd.plans_dir, rd.path / "mine", rd.plans_dir / "deeper"):
        with pytest.raises(KareusError, match="inside the result directory"):
            ResultDir(inside).check_writable(job_id(JOB))
        r = run_cli("optimize", "-p", "kareus-1", "--out", str(inside), "--budget", "20")
        assert r.code == 2 and "inside the result directory" in r.err, r.err
        assert not inside.exists() or inside == rd.plans_dir


@pytest.mark.parametrize("foreign", ["notes.txt", "data/x.csv", "plans/mine.json",
                                     "plans/sub/x", "result.json.bak"])
def test_files_kareus_did_not_write_are_refused_and_kept(first, foreign):
    rd, result = first
    path = rd.path / foreign
    parts = Path(foreign).parts
    made = next(rd.path.joinpath(*parts[:i]) for i in range(1, len(parts) + 1)
                if not rd.path.joinpath(*parts[:i]).exists())  # what the test adds
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("mine")
    try:
        with pytest.raises(KareusError, match="did not write"):
            rd.check_writable(job_id(JOB))
        r = run_cli("optimize", "-p", "kareus-1", "--microbatches", "4", "--freqs",
                    "1410,1200", "--budget", "20", "--out", str(rd.path))
        assert r.code == 2 and "did not write" in r.err, r.err
        # one that appears while the run searches stops the write and stays, as the result
        with pytest.raises(KareusError, match="the result was not written"):
            rd.write(dataclasses.replace(result, run_id="during"))
        assert path.read_text() == "mine" and rd.read_result()["run_id"] == result.run_id
    finally:
        shutil.rmtree(made) if made.is_dir() else made.unlink()
    assert _consistent(rd) == result.run_id
    rd.check_writable(job_id(JOB))


def test_only_kareus_s_own_leftovers_are_removed(first):
    rd, _result = first
    beside = rd.path.parent
    theirs = beside / f".{rd.path.name}.tmp-users"  # named like one, not Kareus's
    (theirs / "precious").mkdir(parents=True)
    (theirs / "precious" / "file").write_text("mine")
    linked = beside / f".{rd.path.name}.tmp-link"  # a link to a marked one: not followed
    target = beside / "elsewhere"
    target.mkdir()
    mark(target, MARKER)
    linked.symlink_to(target)
    try:
        rd.prepare()
        assert (theirs / "precious" / "file").read_text() == "mine"
        assert linked.is_symlink() and (target / MARKER).is_file()
    finally:
        for q in (theirs / "precious" / "file", theirs / "precious", theirs):
            q.unlink() if q.is_file() else q.rmdir()
        linked.unlink()
        (target / MARKER).unlink()
        target.rmdir()


def test_a_symlinked_out_is_followed(first, tmp_path):
    _rd, result = first
    target = tmp_path / "disk" / "run"
    target.mkdir(parents=True)
    link = tmp_path / "run"
    link.symlink_to(target)
    via = ResultDir(link)
    via.check_writable(job_id(JOB))
    via.prepare()
    via.write(result)
    via.write(dataclasses.replace(result, run_id="again"))  # the target is swapped
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert ResultDir(target).read_result()["run_id"] == "again" == _consistent(via)
    assert (target / MARKER).is_file()
    assert not list(tmp_path.rglob(".*.tmp-*"))  # no leftover beside the link or the target
    with via.lock(job_id(JOB)):
        assert ResultDir(target).lock_file.is_file()  # the lock is the target's


def test_the_result_owns_its_timelines_lock_and_marker(first, tmp_path):
    rd, _result = first
    for own in (rd.timeline("max-throughput"), rd.timeline("min-energy"), rd.lock_file,
                rd.path / MARKER, rd.journal, rd.result_file, rd.plans_dir / "x.json"):
        assert rd.owns(own), own
    assert not rd.owns(rd.path / "notes.txt") and not rd.owns(tmp_path / "t.png")
    pid = sorted(rd.plan_ids())[0]
    png = rd.timeline("min-energy")
    before = png.read_bytes()
    r = run_cli("plan", "show", "--result", str(rd.path), "--plan", pid, "--png", str(png))
    assert r.code == 2 and png.read_bytes() == before


# What a review found (issue 21) --------------------------------------------------------


def test_a_file_that_appears_just_before_the_swap_is_kept(first, monkeypatch):
    """Between the last check and the swap (a few ms): the user's file is not removed with
    the old result but moved into the new one, where the next run's check names it."""
    import kareus.core.atomic as atomic

    rd, result = first
    real_exchange = atomic.exchange_dirs

    def late_user(a, b):
        (a / "late.txt").write_text("mine")  # a is the result directory, about to swap
        return real_exchange(a, b)

    monkeypatch.setattr(atomic, "exchange_dirs", late_user)
    rd.write(dataclasses.replace(result, run_id="late"))
    monkeypatch.undo()
    try:
        assert (rd.path / "late.txt").read_text() == "mine"
        with pytest.raises(KareusError, match=r"did not write \(late.txt\)"):
            rd.check_writable(job_id(JOB))
    finally:
        (rd.path / "late.txt").unlink()
    rd.write(result)
    assert _consistent(rd) == result.run_id


def test_a_link_named_like_the_journal_is_not_kareus_s(tmp_path):
    data = tmp_path / "data.db"
    data.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.sqlite").symlink_to(data)
    with pytest.raises(KareusError, match="is not a Kareus result directory"):
        ResultDir(out).check_writable(job_id(JOB))
    assert data.read_text() == "precious"


def test_inside_an_import_is_refused_whatever_was_imported(tmp_path):
    imported = tmp_path / "perseus"
    imported.mkdir()
    mark(imported, ".kareus-import")  # as import-perseus marks its output
    with pytest.raises(KareusError, match="inside the import-perseus output"):
        ResultDir(imported / "run").check_writable(job_id(JOB))


def test_a_sibling_s_leftover_is_not_taken_for_one_s_own(tmp_path):
    from kareus.core.atomic import remove_leftovers

    sibling_tmp = tmp_path / ".run.tmp-x.tmp-123"  # what `--out run.tmp-x` leaves
    sibling_tmp.mkdir()
    mark(sibling_tmp, MARKER)
    own = tmp_path / ".run.tmp-456"
    own.mkdir()
    mark(own, MARKER)
    remove_leftovers(tmp_path / "run", MARKER)
    assert sibling_tmp.is_dir() and not own.exists()
