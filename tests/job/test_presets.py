"""The micro-batch-1 presets (issue 37): NVIDIA's public dgxc-benchmarking Llama 3.1 rows
(docs/anchors.md §8) with TP in place of CP, split along the sequence, through optimize."""

import json

import pytest

from kareus.job.presets import JOB_PRESETS
from kareus.job.sources import build_job
from kareus.workflows.compare import SUITES
from kareus.workload.workload import Workload
from tests.conftest import run_cli

# the public rows: GPUs, global batch, micro-batch, sequence, TP, PP, CP, VP, GA
ROWS = {
    "llama3.1-8b-h100-mbs1": dict(gpus=8, gbs=128, mbs=1, seq=8192, tp=1, pp=1, cp=2, vp=1,
                                  ga=32, model="llama3.1-8b"),
    "llama3.3-70b-h100-mbs1": dict(gpus=64, gbs=128, mbs=1, seq=8192, tp=4, pp=4, cp=2, vp=5,
                                   ga=64, model="llama3.3-70b"),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_each_is_its_public_row_with_tp_in_place_of_cp(name):
    row, job = ROWS[name], build_job(name)
    assert job.model.name == row["model"] and job.gpu == "H100-SXM"
    assert job.num_gpus == row["gpus"]
    assert (job.micro_batch_size, job.seq_length) == (row["mbs"], row["seq"])
    # the row's CP folded into TP (the sequence split refuses CP); the rest kept
    assert (job.cp, job.tp) == (1, row["tp"] * row["cp"])
    assert (job.pp, job.virtual_pipeline, job.num_microbatches) == (row["pp"], row["vp"],
                                                                    row["ga"])
    assert job.micro_batch_size * job.num_microbatches * job.dp == row["gbs"]
    assert job.tp * job.pp * job.dp == row["gpus"]


@pytest.mark.parametrize("name", list(ROWS))
def test_each_splits_the_sequence_into_per_nanobatch_partitions(name):
    job = build_job(name)
    assert job.nanobatch_split == "sequence"
    ps = Workload.build(job).partitions  # fits in memory, builds
    assert ps.keys == ["fwd_attn_nb0", "fwd_attn_nb1", "fwd_mlp", "bwd_mlp", "bwd_attn_nb0",
                       "bwd_attn_nb1"]
    for d in ("fwd", "bwd"):
        p0, p1 = ps[f"{d}_attn_nb0"], ps[f"{d}_attn_nb1"]
        assert (p0.nanobatch, p1.nanobatch) == (0, 1)
        # the second half's attention also reads the first half's keys
        assert p1.compute_flops > p0.compute_flops
        # the same tokens: the same TP all-reduce
        assert (p0.collective.kind, p0.collective.bytes_) == (p1.collective.kind,
                                                              p1.collective.bytes_)
        assert p0.collective.group_size == job.tp


def test_the_mbs1_suite_is_these_presets():
    assert SUITES["mbs1"] == list(ROWS)
    assert all(p in JOB_PRESETS for p in SUITES["mbs1"])


def test_optimize_of_the_8b_preset_gives_a_kareus_frontier(tmp_path):
    out = tmp_path / "r"  # 2 microbatches and 2 clocks: seconds, not the preset's 15 s
    r = run_cli("optimize", "-p", "llama3.1-8b-h100-mbs1", "--microbatches", "2", "--freqs",
                "1980,1500", "--budget", "20", "--workers", "1", "--out", str(out))
    assert r.code == 0, r.err
    doc = json.loads((out / "result.json").read_text())
    assert doc["job"]["nanobatch_split"] == "sequence" and not doc["left_out"]
    assert all(doc["methods"][m]["frontier"] for m in (
        "megatron", "nanobatch", "perseus", "nanobatch_perseus", "kareus", "kareus_no_freq"))
    assert doc["metrics"]["kareus"]["max_throughput_time_reduction_vs_megatron"] > 0
