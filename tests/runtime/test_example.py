import json
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


def _losses(*args):
    r = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "5", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", r.stdout)]


def test_tiny_training_loss_decreases():
    losses = _losses()
    assert len(losses) == 5
    assert losses[-1] < 0.8 * losses[0]
    assert all(b < a for a, b in itertools.pairwise(losses))


def test_tiny_training_with_a_plan_file(tmp_path):
    ex = ExecutionPlan("kareus-001", overlap=True, default_freq_mhz=1200,
                       knobs={"fwd_attn": PartitionSetting(6, "attn_0"),
                              "fwd_mlp": PartitionSetting(9, "linear_1"),
                              "bwd_mlp": PartitionSetting(3, "activation_0"),
                              "bwd_attn": PartitionSetting(12, "rope_0")})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(Plan("kareus-001", "kareus", 1.0, 1.0, ex).to_dict()))
    losses = _losses("--plan", str(path))
    assert losses[-1] < 0.8 * losses[0]


def test_a_missing_plan_file_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLE), "--plan", str(tmp_path / "none.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"train_tiny: error: plan not found: {tmp_path / 'none.json'}"]
