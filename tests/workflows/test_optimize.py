import json

import pytest

from kareus.job.sources import build_job
from kareus.plans.plan import DEADLINE_TOLERANCE_S
from kareus.profiling.executors import ExecutorSpec
from kareus.search import SearchConfig
from kareus.store import job_id
from kareus.workflows.optimize import OptimizeRequest, optimize
from tests.conftest import run_cli


@pytest.fixture(scope="module", params=["kareus-1", "kareus-2"])
def result(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    job = build_job(request.param)
    return optimize(OptimizeRequest(job, str(out), SearchConfig(budget=30, seed=0),
                                    executor=ExecutorSpec(workers=2))), out


def test_the_validated_plans_match_the_simulation(result):
    r, _ = result
    assert r.validation_max_error < 0.03
    for plans in r.plans.values():
        simulated = [p for p in plans if p.simulated_time_s is not None]
        # a stratified sample: the fastest and the least-energy plan among them
        assert plans[0] in simulated and plans[-1] in simulated
        assert len(simulated) == min(len(plans), 12)
        for p in simulated:
            assert p.simulated_time_s == pytest.approx(p.time_s, rel=0.03)
            assert p.simulated_energy_j == pytest.approx(p.energy_j, rel=0.03)
    assert r.to_dict()["validated_plans"] == {
        "simulated": sum(min(len(ps), 12) for ps in r.plans.values()),
        "of": sum(len(ps) for ps in r.plans.values())}


def test_kareus_is_never_dominated_by_perseus_or_nanobatch_perseus(result):
    r, _ = result
    kareus = [(p.time_s, p.energy_j) for p in r.plans["kareus"]]
    for baseline in ("perseus", "nanobatch_perseus"):
        for p in r.plans[baseline]:
            # some Kareus plan is at least as fast and as frugal (0.1% tolerance)
            assert any(t <= p.time_s * 1.001 and e <= p.energy_j * 1.001 for t, e in kareus), (
                baseline, p.time_s, p.energy_j)


def test_result_files(result):
    r, out = result
    doc = json.loads((out / "result.json").read_text())
    assert doc["schema_version"] == 1 and doc["job"]["tp"] == r.job.tp
    assert set(doc["methods"]) == {"megatron", "nanobatch", "perseus", "nanobatch_perseus",
                                   "kareus", "kareus_no_freq"}
    for m in doc["methods"].values():
        for point in m["frontier"]:
            assert (out / "plans" / f"{point['plan']}.json").exists()
    assert doc["metrics"]["kareus"]["iso_time_energy_reduction"] > 0
    assert (out / "frontier.png").stat().st_size > 10_000
    report = (out / "report.md").read_text()
    assert "kareus plan --result" in report and "frontier.png" in report


def test_plan_cli_on_the_result(result):
    _r, out = result
    fast = run_cli("plan", "--result", str(out), "--max-throughput", "--json").json()
    low = run_cli("plan", "--result", str(out), "--min-energy", "--json").json()
    assert fast["time_s"] <= low["time_s"] and fast["energy_j"] >= low["energy_j"]
    mid = (fast["time_s"] + low["time_s"]) / 2
    d = run_cli("plan", "--result", str(out), "--deadline", str(mid), "--json").json()
    assert d["time_s"] <= mid + DEADLINE_TOLERANCE_S  # a typed deadline's rounding slack
    e = run_cli("plan", "--result", str(out), "--energy-budget", str(fast["energy_j"]),
                "--json").json()
    assert e["energy_j"] <= fast["energy_j"]
    bad = run_cli("plan", "--result", str(out), "--deadline", "0.001")
    assert bad.code == 2 and "no plan meets" in bad.err and "range" in bad.err
    both = run_cli("plan", "--result", str(out), "--min-energy", "--max-throughput")
    assert both.code == 2 and "exactly one" in both.err
    text = run_cli("plan", "--result", str(out), "--min-energy", "--method", "perseus")
    assert text.code == 0 and "perseus" in text.out


def test_optimize_cli_and_rerun_reuses_the_journal(tmp_path):
    out = tmp_path / "run"
    args = ["optimize", "-p", "kareus-1", "--out", str(out), "--budget", "20", "--json"]
    first = run_cli(*args)
    assert first.code == 0, first.err
    again = run_cli(*args).json()
    # an unchanged rerun measures nothing and writes the same result: plan ids and run id
    # included; only what this run did (times, measured / reused) differs
    assert all(r["measured_this_run"] == 0 for r in again["this_run"].values())
    assert all(r["reused_from_journal"] == 20 for r in again["this_run"].values())

    def content(doc):
        return {k: v for k, v in doc.items() if k not in ("timings_s", "this_run")}

    assert content(again) == content(first.json())
    assert json.loads((out / "result.json").read_text())["run_id"] == first.json()["run_id"]
    table = run_cli("optimize", "-p", "kareus-1", "--out", str(out), "--budget", "20")
    assert table.code == 0 and "Kareus" in table.out


def test_optimize_bad_arguments(tmp_path):
    r = run_cli("optimize", "-p", "kareus-1", "--out", str(tmp_path), "--budget", "3")
    assert r.code == 2 and "initial design" in r.err
    a_file = tmp_path / "file"
    a_file.write_text("x")
    r = run_cli("optimize", "-p", "kareus-1", "--out", str(a_file), "--budget", "20")
    assert r.code == 2 and "cannot create" in r.err and len(r.err.strip().splitlines()) == 1


def test_plan_export_cli(result, tmp_path):
    r, out = result
    plan_id = r.plans["kareus"][0].id
    z = tmp_path / "z.py"
    e = run_cli("plan", "export", "--result", str(out), "--plan", plan_id, "--format", "zeus",
                "--out", str(z))
    assert e.code == 0, e.err
    import ast

    schedule = ast.literal_eval("".join(
        line for line in z.read_text().splitlines(keepends=True) if not line.startswith("#")))
    assert len(schedule) == r.job.pp
    assert len(schedule[0]) == 2 * r.job.num_microbatches
    j = tmp_path / "p.json"
    assert run_cli("plan", "export", "--result", str(out), "--plan", plan_id, "--out",
                   str(j)).code == 0
    assert json.loads(j.read_text())["id"] == plan_id
    bad = run_cli("plan", "export", "--result", str(out), "--plan", "../x", "--out", str(j))
    assert bad.code == 2


def test_optimize_at_mbs_1_splits_the_sequence_and_runs_all_six_methods(tmp_path):
    """Issue 37: micro-batch size 1 splits each sequence in two; every method runs, and
    Kareus's frontier comes from the per-nanobatch partitions."""
    out = tmp_path / "r"
    r = run_cli("optimize", "-p", "kareus-1", "--mbs", "1", "--microbatches", "4", "--freqs",
                "1410,1200", "--budget", "20", "--workers", "1", "--out", str(out))
    assert r.code == 0, r.err
    assert "left out" not in r.out
    doc = json.loads((out / "result.json").read_text())
    assert doc["job"]["nanobatch_split"] == "sequence"
    assert set(doc["methods"]) == {"megatron", "nanobatch", "perseus", "nanobatch_perseus",
                                   "kareus", "kareus_no_freq"}
    assert all(doc["methods"][m]["frontier"] for m in doc["methods"])
    assert {"fwd_attn_nb0", "fwd_attn_nb1", "bwd_attn_nb0", "bwd_attn_nb1"} <= {
        s["partition"] for s in doc["searches"]}


UNSPLIT = ("optimize", "-p", "kareus-1", "--mbs", "3", "--microbatches", "4", "--freqs",
           "1410,1200", "--budget", "20", "--workers", "1")
LEFT_OUT = ("left out nanobatch, nanobatch_perseus, kareus, kareus_no_freq: they split each "
            "microbatch into two nanobatches and need an even micro-batch size (a batch split, "
            "this job has 3) or nanobatch_split: sequence (the default at micro-batch size 1)")


def test_optimize_at_mbs_3_runs_megatron_and_perseus_and_says_what_it_left_out(tmp_path):
    """Issue 23: Megatron-LM and Perseus at the job's own micro-batch size; one line names
    the methods that split a microbatch, and the result says n/a where they are missing."""
    out = tmp_path / "r"
    r = run_cli(*UNSPLIT, "--out", str(out))
    assert r.code == 0, r.err
    assert [line for line in r.out.splitlines() if "left out" in line] == [LEFT_OUT]
    doc = json.loads((out / "result.json").read_text())
    assert set(doc["methods"]) == {"megatron", "perseus"} and doc["searches"] == []
    assert set(doc["left_out"]) == {"nanobatch", "nanobatch_perseus", "kareus",
                                    "kareus_no_freq"}
    assert len(doc["methods"]["megatron"]["frontier"]) == 1
    assert len(doc["methods"]["perseus"]["frontier"]) > 1
    assert doc["validation_max_rel_error"] < 0.03
    perseus = doc["metrics"]["perseus"]
    assert perseus["max_throughput_energy_reduction_vs_megatron"] >= 0
    assert "iso_time_energy_reduction" not in perseus  # Perseus is the iso reference
    for m in doc["methods"].values():
        for point in m["frontier"]:
            assert (out / "plans" / f"{point['plan']}.json").exists()
    report = (out / "report.md").read_text()
    assert "Kareus was left out: splitting each microbatch" in report
    assert "No partition was searched" in report and "least-energy Perseus plan" in report
    assert (out / "timeline-min-energy.png").exists() and (out / "frontier.png").exists()
    plan = run_cli("plan", "--result", str(out), "--max-throughput")
    assert plan.code == 2 and "kareus was left out: splitting" in plan.err
    assert run_cli("plan", "--result", str(out), "--min-energy", "--method",
                   "perseus").code == 0
    # --json: stdout is the result alone, the line goes to stderr
    again = run_cli(*UNSPLIT, "--out", str(out), "--json")
    assert again.code == 0 and again.json()["left_out"] == doc["left_out"]
    assert LEFT_OUT in again.err


def test_optimize_refuses_when_no_method_asked_for_can_run(tmp_path):
    from kareus.errors import SpecError
    from kareus.workflows.optimize import OptimizeRequest, prepare_optimize

    job = build_job("kareus-1", overrides={"micro_batch_size": 3})
    with pytest.raises(SpecError, match=r"no method to run: left out kareus: it splits each "
                                        r"microbatch .* this job has 3\)"):
        prepare_optimize(OptimizeRequest(job, str(tmp_path / "r"), SearchConfig(budget=20),
                                         methods=("kareus",)))
    assert not (tmp_path / "r").exists()


def test_optimize_a_p2p_cp_job_end_to_end(tmp_path):
    """p2p CP (Transformer Engine's ring inside the attention op): the TP-only partitions
    are searched, the result keeps the job's cp_comm_type and reads back."""
    out = tmp_path / "r"
    r = run_cli("optimize", "-p", "kareus-2", "--cp-comm-type", "p2p", "--microbatches", "4",
                "--freqs", "1410,1200", "--budget", "20", "--workers", "1", "--out", str(out),
                "--json")
    assert r.code == 0, r.err
    doc = json.loads((out / "result.json").read_text())
    assert doc["job"]["cp_comm_type"] == "p2p" and doc["job"]["cp"] == 2
    assert {s["partition"] for s in doc["searches"]} == {"fwd_attn", "fwd_mlp", "bwd_mlp",
                                                         "bwd_attn"}
    same_allgather = build_job("kareus-2", overrides={"num_microbatches": 4,
                                                      "search_freqs_mhz": (1410, 1200)})
    assert doc["job_id"] != job_id(same_allgather)  # its own journal entries
    shown = run_cli("plan", "--result", str(out), "--min-energy")
    assert shown.code == 0, shown.err
