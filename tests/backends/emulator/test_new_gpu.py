"""A new GPU is one catalog entry: the emulator asks it for its architecture and
features (`GPUSpec.arch`, shared memory, FlashAttention runs), never for its name."""

import dataclasses
import json

import pytest

from kareus.gpu.check import catalog_gpu
from kareus.job.hardware import GPUS, get_gpu
from tests.conftest import run_cli


@pytest.mark.parametrize("like", ["H200", "A100-40GB", "A40"])
def test_a_made_up_gpu_runs_through_the_emulator_as_its_twin(like):
    twin = get_gpu(like)
    made_up = dataclasses.replace(twin, name="Z9000", device_names=(r"z9000",))
    with GPUS.registered(made_up):
        got = run_cli("simulate", "-p", "kareus-1", "--gpu", "z9000", "--json")
        # kareus-1 names its node (p4d); another GPU runs on its default node
        want = run_cli("simulate", "-p", "kareus-1", "--gpu", like, "--node",
                       twin.default_node, "--json")
        assert catalog_gpu("NVIDIA Z9000") == ("Z9000", None)
    assert got.code == 0 and want.code == 0, got.err + want.err
    g, w = json.loads(got.out), json.loads(want.out)
    assert g["job"]["gpu"] == "Z9000"
    # the same constants under another name: the same numbers
    assert g["time_s"] == pytest.approx(w["time_s"])
    assert g["energy_j"] == pytest.approx(w["energy_j"])
    assert "Z9000" not in GPUS


def test_an_architecture_the_emulator_does_not_know_is_one_line():
    odd = dataclasses.replace(get_gpu("H200"), name="Z1", arch="sm1000")
    with GPUS.registered(odd):
        r = run_cli("simulate", "-p", "kareus-1", "--gpu", "Z1")
    assert r.code == 2 and "no emulator parameters for Z1 (sm1000)" in r.err
