"""`kareus optimize --vp 2` end to end: every plan covers every (virtual stage,
microbatch, direction) instruction, is validated by the whole-iteration simulation, and
exports as JSON (Zeus's scheduler cannot run chunks: refused in one line)."""

import json

import pytest

from kareus.core import DIRECTIONS
from kareus.results.resultdir import ResultDir
from tests.conftest import run_cli

STAGES, MICROBATCHES = 4, 4


@pytest.fixture(scope="module")
def rd(tmp_path_factory):
    out = tmp_path_factory.mktemp("vp2") / "result"
    r = run_cli("optimize", "-p", "kareus-1", "--vp", "2", "--layers-per-stage", "7,7,7,7",
                "--microbatches", str(MICROBATCHES), "--freqs", "1410,1200", "--budget", "20",
                "--workers", "1", "--out", str(out))
    assert r.code == 0, r.err
    return ResultDir(out)


def test_every_plan_covers_every_virtual_stage_instruction(rd):
    want = {(s, m, d) for s in range(STAGES) for m in range(MICROBATCHES) for d in DIRECTIONS}
    ids = rd.plan_ids()
    assert ids
    for pid in ids:
        plan, job = rd.read_plan(pid)
        assert job["virtual_pipeline"] == 2
        assert set(plan.execution.instruction_freqs) == want, pid
        bars = {(e.stage, e.microbatch, e.kind) for e in plan.timeline
                if e.kind in DIRECTIONS}
        assert bars == want, pid


def test_the_result_is_validated_and_carries_vp(rd):
    doc = json.loads(rd.result_file.read_text())
    assert doc["job"]["virtual_pipeline"] == 2
    assert 0 < doc["validation_max_rel_error"] < 0.05
    assert "VP2" in rd.report.read_text()


def test_plan_show_png_and_export(rd, tmp_path):
    pid = sorted(rd.plan_ids())[0]
    png = tmp_path / "t.png"
    r = run_cli("plan", "show", "--result", str(rd.path), "--plan", pid, "--png", str(png))
    assert r.code == 0, r.err
    assert png.read_bytes().startswith(b"\x89PNG")
    r = run_cli("plan", "export", "--result", str(rd.path), "--plan", pid, "--format", "zeus",
                "--out", str(tmp_path / "z.py"))
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and "--format json" in r.err
    r = run_cli("plan", "export", "--result", str(rd.path), "--plan", pid, "--format", "json",
                "--out", str(tmp_path / "p.json"))
    assert r.code == 0, r.err
    assert json.loads((tmp_path / "p.json").read_text())["job"]["virtual_pipeline"] == 2
