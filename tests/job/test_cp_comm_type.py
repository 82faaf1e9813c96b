"""The job's CP communication (`JobSpec.cp_comm_type`, Megatron-LM's --cp-comm-type)."""

import json

import pytest
import yaml

from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.job.spec import JobSpec, validate_job


def test_allgather_is_the_default_and_every_preset_keeps_it():
    job = build_job("kareus-2")
    assert job.cp_comm_type == "allgather"
    assert job.cp_partitions and not job.cp_ring
    assert job.describe().split(", ")[2] == "CP2"  # the description is unchanged


def test_p2p_with_cp_is_a_ring_and_says_so():
    job = build_job("kareus-2", overrides={"cp_comm_type": "p2p"})
    assert job.cp_ring and not job.cp_partitions
    assert "CP2 (p2p: ring inside the attention op)" in job.describe()


def test_megatron_cores_spelling_is_the_same_allgather():
    assert build_job("kareus-2", overrides={"cp_comm_type": "all_gather"}) == build_job(
        "kareus-2")


def test_p2p_without_cp_is_normalised_to_allgather():
    # no CP traffic at cp = 1: the same job as the default, one identity
    job = build_job("kareus-1", overrides={"cp_comm_type": "p2p"})
    assert job.cp == 1 and job.cp_comm_type == "allgather"
    assert job == build_job("kareus-1")


@pytest.mark.parametrize("value", ["a2a", "a2a+p2p", "ring", "", 2, "P2P"])
def test_other_values_are_refused_in_one_line_naming_the_two(value):
    with pytest.raises(SpecError) as err:
        build_job("kareus-2", overrides={"cp_comm_type": value})
    msg = str(err.value)
    assert "\n" not in msg and "cp_comm_type" in msg
    assert "'allgather'" in msg and "'p2p'" in msg


@pytest.mark.parametrize("comm", ["allgather", "p2p"])
def test_the_field_round_trips_through_json_and_yaml(comm, tmp_path):
    job = build_job("kareus-2", overrides={"cp_comm_type": comm})
    doc = job.model_dump(mode="json")
    assert doc["cp_comm_type"] == comm
    assert validate_job(json.loads(json.dumps(doc))) == job
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert build_job(None, str(f)) == job
    f.write_text(f"preset: kareus-2\ncp_comm_type: {comm}\n")
    assert build_job(None, str(f)).cp_comm_type == comm


def test_a_job_written_before_the_field_loads_as_allgather():
    doc = build_job("kareus-2").model_dump(mode="json")
    del doc["cp_comm_type"]
    job = JobSpec.model_validate(doc)
    assert job.cp_comm_type == "allgather" and job == build_job("kareus-2")
