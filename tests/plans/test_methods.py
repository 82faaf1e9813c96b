"""The method registry: one record per method, and everything iterates over it."""

import json

import pytest

from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.plans.methods import Method, all_methods, get_method, register, registered
from kareus.search import SearchConfig
from kareus.workflows.executors import ExecutorSpec
from kareus.workflows.optimize import optimize

TOY = Method("toy", "Toy method", clocks="search", options=("sequential",), overlap=False,
             color="#000000", marker="x", aliases=("toy_alias",))


def test_builtin_methods_and_aliases():
    assert [m.name for m in all_methods()][:6] == [
        "megatron", "nanobatch", "perseus", "nanobatch_perseus", "kareus", "kareus_no_freq"]
    assert get_method("kareus_no_sched").name == "nanobatch_perseus"
    assert get_method("kareus").merges == ("perseus", "nanobatch_perseus")
    with pytest.raises(SpecError, match="unknown method 'zeus'"):
        get_method("zeus")


def test_register_refuses_clashes_and_unknown_merges():
    with pytest.raises(SpecError, match="already registered"):
        register(Method("kareus", "again", clocks="max", options=("sequential",),
                        overlap=False, color="#000", marker="o"))
    with pytest.raises(SpecError, match="merges unregistered"):
        register(Method("x", "X", clocks="max", options=("sequential",), overlap=False,
                        color="#000", marker="o", merges=("nope",)))
    with registered(TOY):
        assert get_method("toy_alias") is TOY
    with pytest.raises(SpecError):
        get_method("toy")


def test_fixed_plans():
    job = build_job("kareus-1")
    assert get_method("megatron").baseline_plan(job).overlap is False
    assert get_method("nanobatch").baseline_plan(job, 1200).default_freq_mhz == 1200
    with pytest.raises(SpecError, match="no fixed plan"):
        get_method("kareus").baseline_plan(job)


def test_a_registered_toy_method_reaches_result_report_and_figure(tmp_path):
    from PIL import Image

    job = build_job("kareus-1", overrides={"num_microbatches": 4,
                                           "search_freqs_mhz": (1410, 1200, 1005)})
    with registered(TOY):
        r = optimize(job, str(tmp_path), SearchConfig(budget=20, seed=0),
                     executor=ExecutorSpec(workers=1),
                     methods=("megatron", "perseus", "toy"))
    doc = json.loads((tmp_path / "result.json").read_text())
    assert set(doc["methods"]) == {"megatron", "perseus", "toy"}
    assert "iso_time_energy_reduction" in doc["metrics"]["toy"]
    # sequential execution with planned clocks is Perseus: the toy must match it
    assert r.frontier_points()["toy"] == r.frontier_points()["perseus"]
    assert "Toy method" in (tmp_path / "report.md").read_text()
    assert "Toy method" in Image.open(tmp_path / "frontier.png").text["Description"]
