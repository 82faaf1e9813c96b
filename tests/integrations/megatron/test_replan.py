"""Re-planning while training (issue 39): examples/megatron_gpt.py at TP=1 x DP=2 on the CPU
(gloo) with --result, on a tiny 2-layer job a small `kareus optimize` planned.

- a control file written before the run: every rank's clock log has the start plan's
  clocks in iteration 0 and the requested plan's from iteration 1 on; the switch log has
  one line, reason "control file";
- --straggler-slowdown 1.5 on replica 1: replica 0's ranks move to a slower, lower-energy
  plan (reason "pace"), replica 1's stay;
- a run that switches at iteration 1 has, from iteration 1 on, the losses of a run started
  on the new plan (same data, same initialisation);
- `MegatronPlan.use` mid-iteration is refused in one line, and changes nothing;
- a malformed control file is a warning: training goes on.

The expected clocks come from the plans' JSON files, not from the code under test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from kareus.errors import KareusError  # noqa: E402
from kareus.plans.schedule import one_f_one_b  # noqa: E402

from .test_example import EXAMPLE, TINY_JOB  # noqa: E402

ITERATIONS = 3


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> Path:
    """A result of the tiny job at TP=1 on 2 GPUs (2 data-parallel replicas)."""
    d = tmp_path_factory.mktemp("replan")
    job = d / "tiny-dp2.yaml"
    job.write_text((TINY_JOB % (1, 1)).replace("gpus_per_node: 4", "gpus_per_node: 2"))
    done = subprocess.run([sys.executable, "-m", "kareus.cli", "optimize", "--config",
                           str(job), "--budget", "20", "--out", str(d / "run")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return d / "run"


def _plans(result: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text())
            for p in sorted((result / "plans").glob("kareus-*.json"))}


def _clocks(plan: dict) -> list[str]:
    """The plan's clock lines of one iteration of the one stage, in 1F1B order."""
    freqs = {(e["microbatch"], e["direction"]): e["freq_mhz"]
             for e in plan["execution"]["instruction_freqs"]}
    return [f"{d} {m} {freqs[(m, d)]}" for m, d in one_f_one_b(1, 2, 0)]


def _iterations(log: Path) -> list[tuple[str, list[str]]]:
    """Per iteration of a clock log: the plan its marker names and its clock lines."""
    out: list[tuple[str, list[str]]] = []
    for line in log.read_text().splitlines():
        if line.startswith("# iteration "):
            _h, _i, n, _p, plan_id = line.split()
            assert int(n) == len(out)
            out.append((plan_id, []))
        else:
            out[-1][1].append(line)
    return out


def _run(tmp: Path, result: Path, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    clocks = tmp / "clocks"
    done = subprocess.run([sys.executable, str(EXAMPLE), "--tp", "1", "--dp", "2",
                           "--result", str(result), "--clock-log", str(clocks),
                           "--iterations", str(ITERATIONS), *flags],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done, clocks


def _losses(done: subprocess.CompletedProcess) -> list[float]:
    return [float(line.split()[-1]) for line in done.stdout.splitlines()
            if line.startswith("step ")]


def _switches(clocks: Path) -> list[dict]:
    log = clocks / "kareus-megatron-switches.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def controlled(result, tmp_path_factory):
    """The run whose control file, written before it, asks for the least-energy plan."""
    plans = _plans(result)
    start = min(plans.values(), key=lambda p: (p["time_s"], p["energy_j"]))
    wanted = min(plans.values(), key=lambda p: (p["energy_j"], p["time_s"]))
    assert _clocks(start) != _clocks(wanted), "the two plans' clocks tell them apart"
    tmp = tmp_path_factory.mktemp("controlled")
    control = tmp / "control.json"
    control.write_text(json.dumps({"plan": wanted["id"]}))
    done, clocks = _run(tmp, result, "--control-file", str(control))
    return start, wanted, done, clocks


def test_a_control_file_switches_every_rank_at_the_next_iteration(controlled):
    start, wanted, done, clocks = controlled
    for rank in range(2):
        its = _iterations(clocks / f"kareus-megatron-clocks-rank{rank}.log")
        assert its == [(start["id"], _clocks(start))] + [
            (wanted["id"], _clocks(wanted))] * (ITERATIONS - 1)
    [switch] = _switches(clocks)
    assert (switch["iteration"], switch["old"], switch["new"], switch["reason"]) == (
        1, start["id"], wanted["id"], "control file")
    assert (f"iteration 1: replica 0: plan {start['id']} -> {wanted['id']} (control file: "
            in done.stdout)


def test_a_switch_leaves_the_numerics_as_a_run_started_on_the_new_plan(
        controlled, result, tmp_path):
    _start, wanted, done, _clocks_dir = controlled
    fresh, _ = _run(tmp_path, result, "--plan", wanted["id"])
    switched, started = _losses(done), _losses(fresh)
    assert len(switched) == len(started) == ITERATIONS
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(switched[1:], started[1:]))
    assert switched[-1] < switched[0]  # it trains


def test_the_replicas_that_wait_for_a_straggler_move_to_a_slower_lower_energy_plan(
        result, tmp_path):
    plans = _plans(result)
    start = min(plans.values(), key=lambda p: (p["time_s"], p["energy_j"]))
    done, clocks = _run(tmp_path, result, "--straggler-slowdown", "1.5",
                        "--iterations", "6")
    fast = [p for p, _c in _iterations(clocks / "kareus-megatron-clocks-rank0.log")]
    slow = [p for p, _c in _iterations(clocks / "kareus-megatron-clocks-rank1.log")]
    assert slow == [start["id"]] * 6  # the straggler's replica keeps its plan
    assert fast[0] == start["id"] and fast[-1] != start["id"]
    moved = plans[fast[-1]]
    assert moved["time_s"] > start["time_s"] and moved["energy_j"] < start["energy_j"]
    assert moved["time_s"] <= 1.5 * start["time_s"]  # it keeps the straggler's pace
    switches = _switches(clocks)
    assert switches and {s["reason"] for s in switches} == {"pace"}
    assert switches[-1]["new"] == fast[-1]
    assert f"-> {fast[-1]} (pace: " in done.stdout


def test_a_malformed_control_file_does_not_stop_training(result, tmp_path):
    control = tmp_path / "control.json"
    control.write_text("{not json")
    done, clocks = _run(tmp_path, result, "--control-file", str(control))
    assert len(_losses(done)) == ITERATIONS
    assert "control file ignored, training goes on" in done.stderr
    assert _switches(clocks) == []


def test_use_mid_iteration_is_refused_in_one_line(result):
    from kareus.integrations.megatron.plan import MegatronPlan
    from kareus.plans.plan import Plan

    plans = _plans(result)
    start, other = sorted(plans)[0], sorted(plans)[-1]
    mp = MegatronPlan.from_result(result, start, stage=0)
    new = Plan.from_dict(plans[other])
    mp._attached = {0}  # a model chunk without Kareus layers: the hooks alone
    chunk = torch.nn.Linear(1, 1)
    mp._on_forward(0, chunk, ())  # the forward hook: microbatch 0's forward runs
    with pytest.raises(KareusError) as exc:
        mp.use(new)
    assert "\n" not in str(exc.value)
    assert str(exc.value).startswith(f"plan {other} cannot start mid-iteration")
    assert mp.plan.id == start  # nothing changed
    for m, d in one_f_one_b(1, 2, 0)[1:]:
        (mp._on_forward(0, chunk, ()) if d == "forward"
         else mp._on_backward(0, m, [], torch.zeros(1)))
    mp.use(new)  # at the boundary
    assert mp.plan.id == other


def test_a_switcher_whose_sm_counts_have_no_communicator_is_refused_at_start():
    """Under NCCL every SM count of every plan the switcher may choose needs its
    communicator before training (none is created mid-run): a missing one is refused
    when the replanner is made, not at the switch that would need it."""
    from types import SimpleNamespace

    from kareus.errors import SpecError
    from kareus.integrations.megatron.replan import _check_switchable

    def groups(sms):
        if sms != 3:
            raise KeyError(sms)
        return "group"

    layer = SimpleNamespace(kareus_groups_by_sms=groups, kareus_cp_groups_by_sms=None)
    plan = SimpleNamespace(layers=[layer], default_sms=32, plan=SimpleNamespace(id="a"))
    ok = SimpleNamespace(plans={}, sms_used=lambda default: {3})
    _check_switchable(plan, ok)
    short = SimpleNamespace(plans={}, sms_used=lambda default: {3, 7})
    with pytest.raises(SpecError, match=r"no communicator for 7 SMs \(kareus_groups_by_sms\)"):
        _check_switchable(plan, short)
