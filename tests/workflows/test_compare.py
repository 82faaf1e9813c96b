"""`kareus compare` over a job that leaves methods out (issue 23): the comparison is
written, with n/a where a method did not run."""

import json

from kareus.job.sources import build_job
from kareus.workflows import compare
from kareus.workflows.compare import METRIC_COLUMNS, run_suite


def test_compare_with_a_job_whose_microbatch_is_not_split(tmp_path, monkeypatch):
    monkeypatch.setitem(compare.SUITES, "tiny", ["kareus-1"])
    monkeypatch.setattr(compare, "build_job", lambda preset: build_job(preset, overrides={
        "micro_batch_size": 1, "num_microbatches": 4, "search_freqs_mhz": (1410, 1200)}))
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
