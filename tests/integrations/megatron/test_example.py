"""examples/megatron_gpt.py end to end, as the issue's "done when" runs it: `kareus optimize`
on the example's job file, a Kareus plan that overlaps exported, then the example at TP=2
on the CPU with --compare-plain and --clock-log: the largest relative errors are below
1e-5 and each rank's clock log holds the plan's clocks in its timeline's 1F1B order. The
same with Megatron's sequence parallelism (examples/megatron_gpt_sp.yaml,
--sequence-parallel), against Megatron's own SP layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "megatron_gpt.py"
JOB = ROOT / "examples" / "megatron_gpt.yaml"
JOB_SP = ROOT / "examples" / "megatron_gpt_sp.yaml"


def _kareus(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kareus.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_the_example_runs_a_plan_kareus_wrote(tmp_path):
    done, _plan_file = _done_when(tmp_path, JOB, [])
    assert "instructions ran the partitioned overlap" in done.stdout


def test_the_example_runs_a_sequence_parallel_plan_kareus_wrote(tmp_path):
    done, plan_file = _done_when(tmp_path, JOB_SP, ["--sequence-parallel"])
    assert '"sequence_parallel": true' in done.stdout
    assert ("instructions ran the sequence-parallel partitions overlapped (all-gathers and "
            "reduce-scatters)") in done.stdout
    assert "  fwd_attn_ag: " in done.stdout and "  fwd_mlp_rs: " in done.stdout
    # the SP plan on a model without sequence parallelism: one line, before any work
    done = subprocess.run([sys.executable, str(EXAMPLE), "--tp", "2", "--plan",
                           str(plan_file)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("megatron_gpt: error: the plan's job has sequence "
                                   "parallelism: add --sequence-parallel")


def _done_when(tmp_path: Path, job: Path, flags: list[str]
               ) -> tuple[subprocess.CompletedProcess, Path]:
    """The issue's "done when" on ``job``: optimize, export a Kareus plan that overlaps,
    run the example with it (``flags``), --compare-plain, --clock-log; checks the errors
    and the clock logs. The example's run and the plan file."""
    out = tmp_path / "run"
    done = _kareus("optimize", "--config", str(job), "--budget", "20", "--out", str(out),
                   "--json")
    assert done.returncode == 0, done.stderr
    plans = [json.loads(p.read_text()) for p in sorted((out / "plans").glob("kareus-*.json"))]
    overlapping = [p for p in plans if len(p["execution"]["sequential"]) <
                   len(p["execution"]["instruction_freqs"])]
    assert overlapping, "the example's job is sized so that some Kareus plan overlaps"
    plan = max(overlapping, key=lambda p: len({e["freq_mhz"] for e in
                                               p["execution"]["instruction_freqs"]}))
    plan_file = tmp_path / "plan.json"
    done = _kareus("plan", "export", "--result", str(out), "--plan", plan["id"], "--format",
                   "json", "--out", str(plan_file))
    assert done.returncode == 0, done.stderr
    clocks = tmp_path / "clocks"
    done = subprocess.run([sys.executable, str(EXAMPLE), "--tp", "2", *flags, "--plan",
                           str(plan_file), "--compare-plain", "--clock-log", str(clocks),
                           "--steps", "1"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["plan"] == plan["id"] and report["ranks"] == 2
    assert report["max_rel_err_loss"] < 1e-5 and report["max_rel_err_grad"] < 1e-5, report
    n = len(plan["execution"]["instruction_freqs"])
    overlapped = n - len(plan["execution"]["sequential"])
    assert f"{overlapped} of {n} instructions ran " in done.stdout
    bars = sorted((e for e in plan["timeline"] if e["kind"] in ("forward", "backward")),
                  key=lambda e: e["start_s"])
    freqs = {(e["microbatch"], e["direction"]): e["freq_mhz"]
             for e in plan["execution"]["instruction_freqs"]}
    want = [f"{e['kind']} {e['microbatch']} {freqs[(e['microbatch'], e['kind'])]}"
            for e in bars]
    for rank in range(2):
        log = clocks / f"kareus-megatron-clocks-rank{rank}.log"
        assert log.read_text().split("\n")[:-1] == want
    return done, plan_file


def test_a_plan_of_another_tp_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), "--tp", "4"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("megatron_gpt: error: --tp 4, but the plan's job has "
                                   "tp 2")
