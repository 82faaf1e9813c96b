"""`kareus compare` over a job that leaves methods out (issue 23): the comparison is
written, with n/a where a method did not run. The compare directory is Kareus's (issue 34):
refused before any work where it holds the user's files, its files swapped in whole, the
presets' results (their journals) kept."""

import json
from pathlib import Path

import pytest

from kareus.core.atomic import mark
from kareus.errors import KareusError
from kareus.job.sources import build_job
from kareus.results.resultdir import MARKER
from kareus.store import Journal
from kareus.workflows import compare
from kareus.workflows.compare import METRIC_COLUMNS, run_suite
from kareus.workflows.optimize import OptimizeRun
from tests.conftest import run_cli


def test_compare_with_a_job_whose_microbatch_is_not_split(tmp_path, monkeypatch):
    monkeypatch.setitem(compare.SUITES, "tiny", ["kareus-1"])
    monkeypatch.setattr(compare, "build_job", lambda preset: build_job(preset, overrides={
        "micro_batch_size": 3, "num_microbatches": 4, "search_freqs_mhz": (1410, 1200)}))
    said: list[str] = []
    doc = run_suite("tiny", tmp_path, budget=20, workers=1, log=said.append)
    (c,) = json.loads((tmp_path / "compare.json").read_text())["configs"]
    assert c == doc["configs"][0]
    assert set(c["methods"]) == set(c["metrics"]) == {"megatron", "perseus"}
    assert set(c["left_out"]) == {"nanobatch", "nanobatch_perseus", "kareus",
                                  "kareus_no_freq"}
    assert set(c["metrics"]["perseus"]) == set(METRIC_COLUMNS)
    assert any(line.startswith("kareus-1: left out nanobatch, nanobatch_perseus, kareus")
               for line in said)
    md = (tmp_path / "compare.md").read_text()
    best = next(line for line in md.splitlines() if line.startswith("| Kareus |"))
    assert best.count("n/a") == len(METRIC_COLUMNS)
    assert "| kareus-1 |" in md and "| Megatron-LM |" in md


# The compare directory is Kareus's (issue 34, item 1) ------------------------------------


def _tiny(monkeypatch):
    """A one-preset suite on a small kareus-1: seconds, not the ten presets' minutes."""
    monkeypatch.setitem(compare.SUITES, "tiny", ["kareus-1"])
    monkeypatch.setattr(compare, "build_job", lambda preset: build_job(preset, overrides={
        "num_microbatches": 4, "search_freqs_mhz": (1410, 1200)}))


def _no_work(monkeypatch):
    def run(*_a, **_k):
        raise AssertionError("a refused compare did work")
    monkeypatch.setattr(OptimizeRun, "run", run)


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def _compare(out, *args):
    return run_cli("compare", "--suite", "kareus", "--budget", "20", "--out", str(out), *args)


@pytest.mark.parametrize("mine", ["compare.md", "compare.json", "kareus-1.png", "notes.txt",
                                  "kareus-1/notes.txt"])
def test_a_users_file_in_out_is_refused_before_any_work(tmp_path, monkeypatch, mine):
    _no_work(monkeypatch)
    out = tmp_path / "D"
    (out / mine).parent.mkdir(parents=True)
    (out / mine).write_text("mine")
    before = _tree(tmp_path)
    r = _compare(out)
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r.err
    assert "choose" in r.err or "move them out" in r.err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("out", [".", ""])
def test_out_of_the_current_directory_is_refused(tmp_path, monkeypatch, out):
    _no_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "compare.md").write_text("mine")
    r = _compare(out)
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r.err
    assert _tree(tmp_path) == {"compare.md": b"mine"}


@pytest.mark.parametrize("bad", [("--budget", "0"), ("--workers", "0"), ("--suite", "nope"),
                                 ("--sensitivity-presets", "kareus-1")])
def test_bad_options_are_refused_before_out_is_created(tmp_path, monkeypatch, bad):
    _no_work(monkeypatch)
    r = _compare(tmp_path / "D", *bad)
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r.err
    assert list(tmp_path.iterdir()) == []


def test_the_comparison_is_swapped_in_and_the_journals_are_kept(tmp_path, monkeypatch):
    _tiny(monkeypatch)
    out = tmp_path / "D"
    run_suite("tiny", out, budget=20, workers=1)
    names = {p.name for p in out.iterdir()}
    assert {".kareus-compare", "compare.json", "compare.md", "kareus-1.png",
            "kareus-1"} <= names
    journal = out / "kareus-1" / "journal.sqlite"
    inode, md = journal.stat().st_ino, (out / "compare.md").read_text()
    # a crash while writing the comparison leaves the old one, and the journal
    monkeypatch.setattr(compare, "compare_markdown", lambda doc: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run_suite("tiny", out, budget=20, workers=1)
    assert (out / "compare.md").read_text() == md and journal.stat().st_ino == inode
    assert not [p for p in tmp_path.iterdir() if p.name != "D"]  # no leftover beside
    monkeypatch.undo()
    _tiny(monkeypatch)
    # a rerun replaces the comparison whole; the preset's result keeps its journal
    # (the same file: carried over by a hard link, never copied)
    run_suite("tiny", out, budget=20, workers=1)
    assert journal.stat().st_ino == inode
    assert (out / "kareus-1" / MARKER).is_file()
    assert json.loads((out / "compare.json").read_text())["suite"] == "tiny"


def test_a_file_that_appears_during_the_run_is_kept(tmp_path, monkeypatch):
    _tiny(monkeypatch)
    out = tmp_path / "D"
    run_suite("tiny", out, budget=20, workers=1)
    real_run = OptimizeRun.run

    def run(self, *a, **k):
        result = real_run(self, *a, **k)
        (out / "kareus-1" / "late.txt").write_text("mine")
        return result
    monkeypatch.setattr(OptimizeRun, "run", run)
    with pytest.raises(KareusError, match=r"late\.txt.*the comparison was not written"):
        run_suite("tiny", out, budget=20, workers=1)
    assert (out / "kareus-1" / "late.txt").read_text() == "mine"


def test_a_killed_runs_leftovers_do_not_block_a_rerun(tmp_path, monkeypatch):
    _tiny(monkeypatch)
    out = tmp_path / "D"
    (out / "kareus-1").mkdir(parents=True)  # killed before its first swap: only a journal
    Journal(out / "kareus-1" / "journal.sqlite").close()  # made whole, holding nothing yet
    left = out / ".kareus-1.tmp-abc"  # a preset's temporary result, marked
    left.mkdir()
    mark(left, MARKER)
    run_suite("tiny", out, budget=20, workers=1)
    assert not left.exists() and (out / "compare.md").is_file()


def test_a_users_out_inside_a_compare_directory_is_refused(tmp_path, monkeypatch):
    _tiny(monkeypatch)
    out = tmp_path / "D"
    run_suite("tiny", out, budget=20, workers=1)
    before = _tree(out)
    for inside in (out / "kareus-1", out / "mine"):
        r = run_cli("optimize", "-p", "kareus-1", "--budget", "20", "--out", str(inside))
        assert r.code == 2 and "inside the compare directory" in r.err, r.err
        r = _compare(inside)
        assert r.code == 2 and "inside the compare directory" in r.err, r.err
    assert _tree(out) == before
