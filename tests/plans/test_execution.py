import json

import pytest

from kareus.core import PartitionSetting
from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.plans.execution import ExecutionPlan
from kareus.plans.methods import baseline_plan


def test_plan_round_trips_through_json():
    plan = ExecutionPlan(
        "p", overlap=True, default_freq_mhz=1410,
        instruction_freqs={(0, 1, "forward"): 1200},
        knobs={"fwd_attn": PartitionSetting(12, "linear_0")},
        knobs_by_freq={("fwd_mlp", 900): PartitionSetting(6, None)})
    again = ExecutionPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert again.freq(0, 1, "forward") == 1200 and again.freq(1, 0, "backward") == 1410
    assert again.choice("fwd_mlp", 900, 32) == PartitionSetting(6, None)
    assert again.choice("fwd_mlp", 1410, 32) == PartitionSetting(32, None)


@pytest.mark.parametrize("doc", [{}, {"schema_version": 99}, {"schema_version": 1},
                                 {"schema_version": 1, "name": "x", "overlap": True,
                                  "default_freq_mhz": "fast"}])
def test_corrupt_plans_are_spec_errors(doc):
    with pytest.raises(SpecError):
        ExecutionPlan.from_dict(doc)


def test_baselines():
    job = build_job("kareus-1")
    assert baseline_plan("megatron", job).overlap is False
    nb = baseline_plan("nanobatch", job)
    assert nb.overlap and nb.default_slot == "first" and nb.default_freq_mhz == 1410
    with pytest.raises(SpecError, match="unknown method"):
        baseline_plan("perseus-ultra", job)
