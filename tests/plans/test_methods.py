"""The method registry: one record per method, and everything iterates over it."""

import json

import pytest

from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.plans.methods import Method, all_methods, get_method, register, registered
from kareus.profiling.executors import ExecutorSpec
from kareus.search import SearchConfig
from kareus.workflows.optimize import OptimizeRequest, optimize

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
        r = optimize(OptimizeRequest(job, str(tmp_path), SearchConfig(budget=20, seed=0),
                                     executor=ExecutorSpec(workers=1),
                                     methods=("megatron", "perseus", "toy")))
    doc = json.loads((tmp_path / "result.json").read_text())
    assert set(doc["methods"]) == {"megatron", "perseus", "toy"}
    assert "iso_time_energy_reduction" in doc["metrics"]["toy"]
    # sequential execution with planned clocks is Perseus: the toy must match it
    assert r.frontier_points()["toy"] == r.frontier_points()["perseus"]
    assert "Toy method" in (tmp_path / "report.md").read_text()
    assert "Toy method" in Image.open(tmp_path / "frontier.png").text["Description"]


def test_which_methods_split_a_microbatch():
    splits = {m.name: m.splits_microbatch for m in all_methods()}
    assert splits == {"megatron": False, "nanobatch": True, "perseus": False,
                      "nanobatch_perseus": True, "kareus": True, "kareus_no_freq": True}
    assert TOY.splits_microbatch is False


@pytest.mark.parametrize("mbs", [3, 5])
def test_a_microbatch_that_is_not_split_leaves_out_the_methods_that_split_it(mbs):
    from kareus.plans.methods import left_out_line, left_out_reasons, runnable_methods

    job = build_job("kareus-1", overrides={"micro_batch_size": mbs})
    runs, out = runnable_methods(all_methods(), job)
    assert [m.name for m in runs] == ["megatron", "perseus"]
    assert [m.name for m in out] == ["nanobatch", "nanobatch_perseus", "kareus",
                                     "kareus_no_freq"]
    assert left_out_line(out, job) == (
        "left out nanobatch, nanobatch_perseus, kareus, kareus_no_freq: they split each "
        "microbatch into two nanobatches and need an even micro-batch size (a batch split, "
        f"this job has {mbs}) or nanobatch_split: sequence (the default at micro-batch size "
        "1)")
    assert left_out_line(out[:1], job).startswith("left out nanobatch: it splits each")
    assert left_out_line((), job) == ""
    assert set(left_out_reasons(out, job)) == {m.name for m in out}
    assert get_method("megatron").baseline_plan(job).overlap is False
    with pytest.raises(SpecError, match=rf"nanobatch splits each microbatch .* this job has "
                                        rf"{mbs}\) .*; this job runs with megatron, perseus"):
        get_method("nanobatch").baseline_plan(job)
    even = build_job("kareus-1")
    assert runnable_methods(all_methods(), even) == (all_methods(), ())


def test_code_asks_roles_not_names():
    from kareus.plans.methods import ISO_REFERENCE, PROPOSED, THROUGHPUT_BASELINE, by_role

    assert (by_role("throughput_baseline").name, by_role("iso_reference").name,
            by_role("proposed").name) == (THROUGHPUT_BASELINE, ISO_REFERENCE, PROPOSED)
    assert by_role("throughput_baseline").fixed_plan
    with pytest.raises(SpecError, match="role proposed already"):
        register(Method("x2", "X", clocks="max", options=("sequential",), overlap=False,
                        color="#000", marker="o", role="proposed"))
    with pytest.raises(SpecError, match="unknown option source 'nope'"):
        register(Method("x3", "X", clocks="max", options=("nope",), overlap=False,
                        color="#000", marker="o"))
    assert "x3" not in [m.name for m in all_methods()]
