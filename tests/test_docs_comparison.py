"""docs/comparison.md's current numbers are the rendering of the committed compare run
(docs/data/comparison.json), and that rendering agrees with `kareus compare`'s own report.
That the committed runs are still what fresh `kareus compare --suite kareus` and `--suite
mbs1` give is `python scripts/comparison_doc.py --check` (minutes: not in the test suite)."""

import importlib.util
import json
from pathlib import Path

import pytest

from kareus.workflows.compare import PAPER, SUITES, compare_markdown

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("comparison_doc",
                                                  ROOT / "scripts" / "comparison_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(script):
    return json.loads(script.DATA.read_text())


def test_the_doc_is_the_rendering_of_the_committed_run(script, data):
    assert data["schema_version"] == script.DATA_SCHEMA
    assert data["suite"] == "kareus" and len(data["configs"]) == 10
    assert data["commit"] and data["command"].startswith("kareus compare --suite kareus")
    block = script.generated_block(script.DOC.read_text())
    assert block == script.render(data), "run: python scripts/comparison_doc.py --render"


def test_the_rendering_agrees_with_compares_own_report(script, data):
    # compare.md's best-over-the-suite rows, from the same metrics, are the doc's rows
    doc = {"suite": data["suite"], "budget": data["budget"], "seed": data["seed"],
           "paper_headline": PAPER, "sensitivity": None,
           "configs": [{"preset": c["preset"], "job": "", "metrics": c["metrics"],
                        "iso_power": []} for c in data["configs"]]}
    report = compare_markdown(doc).splitlines()
    rendered = script.render(data).splitlines()
    start = report.index(next(r for r in report if r.startswith("| best over the suite")))
    best_rows = [r for r in report[start + 2:] if r.startswith("| ")]
    ours = [r for r in best_rows if r.startswith(("| Kareus", "| Nanobatching"))]
    assert len(ours) == 5 and all(r in rendered for r in ours)  # with the paper's row


def test_trim_keeps_each_methods_fastest_and_least_energy_plan(script):
    compare = {"suite": "kareus", "budget": 3, "seed": 1, "noise": 0.0, "configs": [{
        "preset": "kareus-1", "metrics": {},
        "methods": {"perseus": {"frontier": [{"time_s": 2.0, "energy_j": 5.0},
                                             {"time_s": 1.0, "energy_j": 9.0},
                                             {"time_s": 3.0, "energy_j": 4.0}]},
                    "megatron": {"frontier": []}},
        "validation": {"perseus": {"time_max_rel_error": 0.01, "energy_max_rel_error": 0.02},
                       "kareus": {"time_max_rel_error": 0.03, "energy_max_rel_error": 0.0}}}]}
    c = script.trim(compare, "kareus compare", "abc")["configs"][0]
    assert c["fastest"] == {"perseus": (1.0, 9.0)}
    assert c["least_energy"] == {"perseus": (3.0, 4.0)}
    assert c["validation_max_rel_error"] == {"time": 0.03, "energy": 0.02}


def test_the_micro_batch_1_suite_is_in_the_doc(script, data):
    # issue 37: the mbs1 presets' run is kept beside the paper suite's and rendered with it
    run = data["more"]["mbs1"]
    assert run["suite"] == "mbs1" and run["commit"]
    assert run["command"].startswith("kareus compare --suite mbs1")
    assert [c["preset"] for c in run["configs"]] == SUITES["mbs1"]
    block = script.generated_block(script.DOC.read_text())
    assert "### Suite `mbs1`" in block
    for c in run["configs"]:
        kareus = c["metrics"]["kareus"]
        assert all(kareus[k] is not None for k in kareus), c["preset"]
        row = f"| {c['preset']}: Kareus | " + " | ".join(
            script._pct(kareus[k]) for k in script.METRIC_COLUMNS) + " |"
        assert row in block.splitlines()


def test_place_puts_each_suites_run_in_its_own_spot(script, data):
    main = {k: v for k, v in data.items() if k != "more"}
    other = {**data["more"]["mbs1"], "schema_version": script.DATA_SCHEMA, "commit": "new"}
    placed = script.place(data, other)
    assert placed["more"]["mbs1"]["commit"] == "new" and "schema_version" not in placed[
        "more"]["mbs1"]
    assert {k: v for k, v in placed.items() if k != "more"} == main  # the main run kept
    again = script.place(placed, {**main, "commit": "newer"})
    assert again["commit"] == "newer" and again["more"] == placed["more"]
    with pytest.raises(SystemExit, match="no place"):
        script.place(data, {**other, "suite": "elsewhere"})
