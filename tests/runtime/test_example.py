import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import itertools

from kareus.core import PartitionSetting
from kareus.plans.execution import ExecutionPlan
from kareus.plans.plan import Plan

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"


STEPS = 5
LOG_LINE = re.compile(r"(forward|backward) [01] \d+")


def _run(*args, tmp=None):
    env = None if tmp is None else {**os.environ, "TMPDIR": str(tmp)}
    r = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS), *args],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def _losses(r):
    return [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", r.stdout)]


def _clock_logs(r):
    """The two ranks' clock logs the run says it wrote (its first line)."""
    first = r.stdout.splitlines()[0]
    assert first.startswith("clock log (dry run, one file per rank): "), r.stdout
    pattern = first.split(": ", 1)[1]
    assert "<N>" in pattern
    return [Path(pattern.replace("<N>", str(rank))) for rank in (0, 1)]


def test_tiny_training_loss_decreases(tmp_path):
    r = _run(tmp=tmp_path)
    losses = _losses(r)
    assert len(losses) == STEPS
    assert losses[-1] < 0.8 * losses[0]
    assert all(b < a for a, b in itertools.pairwise(losses))
    # by default the clock logs are in a new directory of their own, this run's lines only
    logs = _clock_logs(r)
    assert logs[0].parent.parent == tmp_path and logs[0].parent == logs[1].parent
    assert logs[0].parent.name.startswith("kareus-example-clocks-")
    for log in logs:
        lines = log.read_text().splitlines()
        assert len(lines) == STEPS * 2 * 2  # forward and backward of 2 microbatches a step
        assert all(LOG_LINE.fullmatch(line) for line in lines)


def test_tiny_training_with_a_plan_file(tmp_path):
    ex = ExecutionPlan("kareus-001", overlap=True, default_freq_mhz=1200,
                       knobs={"fwd_attn": PartitionSetting(6, "attn_0"),
                              "fwd_mlp": PartitionSetting(9, "linear_1"),
                              "bwd_mlp": PartitionSetting(3, "activation_0"),
                              "bwd_attn": PartitionSetting(12, "rope_0")})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(Plan("kareus-001", "kareus", 1.0, 1.0, ex).to_dict()))
    logs = tmp_path / "logs"
    logs.mkdir()
    stale = logs / "kareus-example-clocks-rank0.log"
    stale.write_text("forward 0 999\n")  # another run's line: not kept
    r = _run("--plan", str(path), "--clock-log", str(logs))
    losses = _losses(r)
    assert losses[-1] < 0.8 * losses[0]
    assert _clock_logs(r) == [logs / f"kareus-example-clocks-rank{k}.log" for k in (0, 1)]
    for log in _clock_logs(r):
        lines = log.read_text().splitlines()
        assert lines[:2] == ["forward 0 1200", "backward 0 1200"]
        assert len(lines) == STEPS * 2 * 2


def test_a_missing_plan_file_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLE), "--plan", str(tmp_path / "none.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"train_tiny: error: plan not found: {tmp_path / 'none.json'}"]


def test_the_example_re_plans_on_a_control_file_and_a_programmatic_request(tmp_path):
    """--result: the control file (read from iteration 1) and --switch-to at iteration 3
    switch every rank; the clock logs mark each iteration's plan and follow its clocks."""
    job = tmp_path / "job.yaml"
    job.write_text("model: {name: t, hidden_size: 64, num_layers: 2, num_attention_heads: 4,"
                   " num_kv_heads: 2, head_dim: 16, ffn_hidden_size: 128, vocab_size: 97}\n"
                   "tp: 2\npp: 1\nmicro_batch_size: 4\nseq_length: 32\nnum_microbatches: 2\n"
                   "gpu: A40\ngpus_per_node: 2\nnodes: 1\n")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "kareus.cli", "optimize", "--config",
                           str(job), "--budget", "20", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    plans = {p.stem: json.loads(p.read_text()) for p in (out / "plans").glob("kareus-*.json")}
    fastest = min(plans.values(), key=lambda p: (p["time_s"], p["energy_j"]))["id"]
    least = min(plans.values(), key=lambda p: (p["energy_j"], p["time_s"]))["id"]
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"plan": least}))
    logs = tmp_path / "logs"
    r = _run("--result", str(out), "--control-file", str(control), "--switch-to", fastest,
             "--switch-at", "3", "--clock-log", str(logs))
    assert len(_losses(r)) == STEPS
    want = [fastest, least, least, fastest, fastest]
    for rank in (0, 1):
        lines = (logs / f"kareus-example-clocks-rank{rank}.log").read_text().splitlines()
        marks = [line.split()[-1] for line in lines if line.startswith("# iteration ")]
        assert marks == want
        clocks = [line for line in lines if not line.startswith("#")]
        for it, plan_id in enumerate(want):
            freqs = {(e["microbatch"], e["direction"]): e["freq_mhz"]
                     for e in plans[plan_id]["execution"]["instruction_freqs"]}
            assert clocks[4 * it:4 * it + 4] == [f"{d} {m} {freqs[(m, d)]}" for m in (0, 1)
                                                 for d in ("forward", "backward")]
    switches = [json.loads(x) for x in
                (logs / "kareus-example-switches.jsonl").read_text().splitlines()]
    assert [(s["iteration"], s["new"], s["reason"]) for s in switches] == [
        (1, least, "control file"), (3, fastest, "programmatic")]
