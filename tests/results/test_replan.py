"""A result directory read for the re-planning savings, and `kareus plan replan-savings`:
its figures from the result's own plans, and bad input refused in one line, exit 2."""

import pytest

from kareus.plans.replan import JobShape
from kareus.results.replan import replan_inputs
from kareus.results.resultdir import ResultDir
from tests.conftest import run_cli


def _savings(result, *args):
    return run_cli("plan", "replan-savings", "--result", str(result), *args)


def test_inputs_are_the_results_plans_and_job(small_result):
    rd = ResultDir(small_result)
    plans, shape = replan_inputs(rd, "kareus", window_s=1.0)
    front = rd.frontier("kareus")
    assert sorted(p.id for p in plans) == sorted(q["plan"] for q in front)
    assert [p.time_s for p in plans] == sorted(p.time_s for p in plans)
    # kareus-1: DP1 of 2 x 8 A100 (85 W static, 60 W idle: the GPU catalog)
    assert shape == JobShape(1, 16, 85.0, 60.0)
    assert all(p.peak_w is not None and p.peak_w > 16 * 85.0 for p in plans)
    # without a window no plan file but the first is read for its peak
    assert all(p.peak_w is None for p in replan_inputs(rd, "kareus")[0])


def test_straggler_json(small_result):
    r = _savings(small_result, "--slowdown", "1.5", "--duration-iterations", "100",
                 "--replicas", "8", "--json")
    assert r.code == 0, r.err
    s = r.json()["straggler"]
    plans = {q["plan"]: q for q in ResultDir(small_result).frontier("kareus")}
    fastest = min(plans.values(), key=lambda q: (q["time_s"], q["energy_j"]))
    assert s["p0"] == fastest["plan"]
    assert s["p1_time_s"] <= 1.5 * s["p0_time_s"]
    assert plans[s["p1"]]["energy_j"] <= fastest["energy_j"]
    assert s["replicas"] == 8 and s["wait_power_w_per_gpu"] == 85.0
    assert 0 <= s["saved_j"] == pytest.approx(s["energy_without_j"] - s["energy_with_j"])


def test_straggler_replicas_default_to_the_jobs_dp(small_result):
    r = _savings(small_result, "--slowdown", "1.5", "--duration-iterations", "10", "--json")
    s = r.json()["straggler"]
    assert s["replicas"] == 1 and s["saved_j"] == 0  # nobody waits for the straggler


def test_cap_schedule_table(small_result):
    rd = ResultDir(small_result)
    plans, _shape = replan_inputs(rd, "kareus", window_s=1.0)
    mid = sorted(p.peak_w for p in plans)[len(plans) // 2] / 1e3
    r = _savings(small_result, "--cap-schedule", f"0:none,10:{mid:.4f},30:none",
                 "--iterations", "50", "--restart-s", "120")
    assert r.code == 0, r.err
    assert "re-planned" in r.out and "restarting (120 s each)" in r.out
    j = _savings(small_result, "--cap-schedule", f"0:none,10:{mid:.4f},30:none",
                 "--iterations", "50", "--restart-s", "120", "--json").json()["cap_schedule"]
    assert j["restart"]["time_s"] == pytest.approx(j["replan"]["time_s"] + 120 * j["switches"])


@pytest.mark.parametrize("args, message", [
    (("--cap-schedule", "0:none,x:4", "--iterations", "50", "--restart-s", "60"),
     "is not ITERATION:KW"),
    (("--cap-schedule", "0:none,10:4", "--iterations", "50"), "--restart-s"),
    (("--cap-schedule", "0:none,10:0.001", "--iterations", "50", "--restart-s", "60"),
     "no plan stays under"),
    (("--slowdown", "1.5", "--duration-iterations", "10", "--plan", "kareus-999"),
     "no plan 'kareus-999'"),
    (("--slowdown", "1.5", "--duration-iterations", "10", "--plan", "megatron-000"),
     "no plan 'megatron-000'"),
    (("--slowdown", "1.5",), "--duration-iterations"),
    (("--slowdown", "0", "--duration-iterations", "10"), "slowdown"),
    (("--slowdown", "1.5", "--duration-iterations", "0"), "duration-iterations"),
    ((), "give a straggler scenario"),
    (("--restart-s", "60",), "--cap-schedule"),
])
def test_bad_input_is_one_line_and_exit_2(small_result, args, message):
    r = _savings(small_result, *args)
    assert r.code == 2, (r.out, r.err)
    assert message in r.err
    assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err


def test_a_missing_result_is_one_line(tmp_path):
    r = _savings(tmp_path / "nothing", "--slowdown", "1.5", "--duration-iterations", "10")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1
