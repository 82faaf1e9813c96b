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
