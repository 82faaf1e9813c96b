"""`JobSpec.node` (issue 38): the node type a job ran on, its one-line refusals, and the
ids of jobs that name none."""

import hashlib
import json

import pytest

from kareus.errors import SpecError
from kareus.job.presets import JOB_PRESETS
from kareus.job.sources import build_job
from kareus.store import job_id


@pytest.mark.parametrize("preset", [f"kareus-{i}" for i in range(1, 11)])
def test_paper_presets_run_on_p4d(preset):
    job = build_job(preset)
    assert job.node == "p4d.24xlarge" and job.node_spec.nics == 4
    assert "(p4d.24xlarge)" in job.describe()


def test_a_job_naming_no_node_runs_on_its_gpus_default_and_keeps_its_id():
    job = build_job("llama3.3-70b-64gpu")
    assert job.node is None and job.node_spec.name == "DGX-H100"
    # the id of the job before the field existed: its dump hashed without it
    doc = {k: v for k, v in job.model_dump(mode="json").items()
           if k not in ("virtual_pipeline", "cp_comm_type", "nanobatch_split", "node",
                        "training")}
    assert job_id(job) == hashlib.sha256(json.dumps(doc, sort_keys=True).encode()
                                         ).hexdigest()[:16]


def test_naming_the_default_node_is_the_same_job():
    plain = build_job("llama3.3-70b-64gpu")
    named = build_job("llama3.3-70b-64gpu", overrides={"node": "dgx-h100"})
    assert named == plain and job_id(named) == job_id(plain)
    # the paper's node is another job: its pipeline sends cost what the EFA gives
    assert job_id(build_job("kareus-1")) != job_id(
        build_job("kareus-1", overrides={"node": "DGX-A100"}))


@pytest.mark.parametrize("overrides, message", [
    ({"node": "p5.48xlarge"}, "unknown node type 'p5.48xlarge'; available: DGX-A100"),
    ({"node": "p4d.24xlarge", "gpu": "H100-SXM"},
     "node type p4d.24xlarge holds A100-40GB, not H100-SXM"),
    ({"gpus_per_node": 16, "nodes": 1}, "node type p4d.24xlarge has 8 GPUs, not "
                                        "gpus_per_node=16"),
])
def test_a_node_that_cannot_hold_the_job_is_refused_in_one_line(overrides, message):
    with pytest.raises(SpecError, match=message) as err:
        build_job("kareus-1", overrides=overrides)
    assert "\n" not in str(err.value)


def test_cli_refuses_an_unknown_node_in_one_line(cli):
    r = cli("graph", "-p", "kareus-1", "--node", "nosuch")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1
    assert "unknown node type 'nosuch'" in r.err
    ok = cli("graph", "-p", "kareus-1", "--node", "dgx-a100", "--json")
    assert ok.code == 0, ok.err


def test_only_the_paper_presets_name_a_node():
    named = {name for name, fields in JOB_PRESETS.items() if "node" in fields}
    assert named == {f"kareus-{i}" for i in range(1, 11)}


def test_kareus_gpus_lists_the_node_types(cli):
    r = cli("gpus", "--json")
    assert r.code == 0, r.err
    nodes = {n["name"]: n for n in r.json()["nodes"]}
    assert nodes["p4d.24xlarge"]["nics"] == 4 and nodes["p4d.24xlarge"]["nic_bytes_s"] == 12.5e9


def test_another_gpu_on_a_preset_takes_that_gpu_s_default_node():
    """kareus-1 names the paper's p4d.24xlarge; asking for an H100 drops it for the
    H100's default node, unless a node is named too (then that one is checked)."""
    job = build_job("kareus-1", overrides={"gpu": "H100-SXM"})
    assert job.node is None and job.node_spec.name == "DGX-H100"
    assert build_job("kareus-1").node == "p4d.24xlarge"
    with pytest.raises(SpecError, match="holds A100-40GB, not H100-SXM"):
        build_job("kareus-1", overrides={"gpu": "H100-SXM", "node": "p4d.24xlarge"})


def test_the_preset_s_own_gpu_keeps_its_node():
    """Naming the GPU a preset already has (by any alias) changes nothing: the same job."""
    for gpu in ("A100-40GB", "a100"):
        job = build_job("kareus-1", overrides={"gpu": gpu})
        assert job.node == "p4d.24xlarge"
        assert job_id(job) == job_id(build_job("kareus-1"))
