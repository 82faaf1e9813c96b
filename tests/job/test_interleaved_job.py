"""Interleaved 1F1B on the job: `virtual_pipeline` (--vp), checked as Megatron-Core 0.16
checks it, and the workload built with pp x V virtual stages."""

import pytest

from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.store import job_id
from kareus.workload.workload import Workload
from tests.conftest import run_cli

VP2 = dict(virtual_pipeline=2, layers_per_stage=(7, 7, 7, 7))


def test_virtual_stages_split_the_layers_and_the_description_shows_vp():
    job = build_job("llama3.3-70b-64gpu", overrides=dict(virtual_pipeline=2))
    assert job.virtual_stages == 16 and job.layers_per_stage == (5,) * 16
    assert "PP8, VP2," in job.describe()
    assert "VP" not in build_job("kareus-1").describe()


@pytest.mark.parametrize("overrides, message", [
    (dict(virtual_pipeline=2, pp=1, tp=8, dp=2), "needs pp >= 2"),
    (dict(VP2, num_microbatches=5), "num_microbatches a multiple of pp"),
    (dict(virtual_pipeline=2), "has 2 entries but pp x virtual_pipeline = 4 "
                               r"\(one per virtual stage\)"),
    (dict(virtual_pipeline=0), "greater than or equal to 1"),
])
def test_invalid_interleaved_jobs_name_the_problem(overrides, message):
    with pytest.raises(SpecError, match=message):
        build_job("kareus-1", overrides=overrides)


def test_uneven_chunks_need_an_explicit_split():
    with pytest.raises(SpecError, match="pp x virtual_pipeline = 6 must divide the 28 layers"):
        build_job(overrides=dict(model="llama3.2-3b", pp=2, virtual_pipeline=3))


def test_the_cli_flag_reaches_the_job_and_bad_values_are_one_line():
    r = run_cli("simulate", "-p", "kareus-1", "--vp", "2", "--microbatches", "5",
                "--layers-per-stage", "7,7,7,7")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1
    assert "multiple of pp" in r.err


def test_job_id_keeps_plain_jobs_ids_and_tells_vp_apart():
    plain = build_job("llama3.3-70b-64gpu")
    interleaved = build_job("llama3.3-70b-64gpu", overrides=dict(virtual_pipeline=2))
    assert interleaved.model_dump()["virtual_pipeline"] == 2
    assert job_id(plain) != job_id(interleaved)
    # a job journaled before the field existed hashed its dump without it (nor the later
    # cp_comm_type, nor the node type or the training settings: a preset at their
    # defaults, as kareus-1 is no longer since it took the artifact's)
    import hashlib
    import json
    doc = {k: v for k, v in plain.model_dump(mode="json").items()
           if k not in ("virtual_pipeline", "cp_comm_type", "nanobatch_split", "node",
                        "training")}
    old = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    assert job_id(plain) == old


def test_the_workload_has_one_stage_per_virtual_stage():
    w = Workload.build(build_job("kareus-1", overrides=VP2))
    stages = w.graph.stages
    assert [s.num_layers for s in stages] == [7, 7, 7, 7]
    # the embedding on virtual stage 0 only, the LM head on the last only
    names = [{o.name for o in (*s.forward_pre, *s.forward_post)} for s in stages]
    assert "embedding" in names[0] and not any("embedding" in n for n in names[1:])
    assert "lm_head" in names[3] and not any("lm_head" in n for n in names[:3])
    # transfers between consecutive virtual stages, as between stages
    assert [s.send_activation is not None for s in stages] == [True, True, True, False]
    assert [s.send_grad is not None for s in stages] == [False, True, True, True]
    assert {k[0] for k in w.partitions.layouts} == {0, 1, 2, 3}
    assert all(len(p.count_forward) == 4 for p in w.partitions.partitions.values())
    # memory per pipeline rank: rank 0 holds chunks 0 and 2 (the embedding)
    assert [m.stage for m in w.memory] == [0, 1]
    assert w.memory[0].weights_bytes == pytest.approx(2.0 * (stages[0].params
                                                              + stages[2].params))
    assert w.memory[1].logits_bytes > 0 and w.memory[0].logits_bytes == 0


def test_interleaving_holds_more_activations_on_the_first_rank():
    # Megatron's warm-up on rank 0: 2 (pp - 1) + (V - 1) pp = 4 chunk forwards, plus one;
    # each a chunk of 7 layers = 35 layers' inputs, against 1F1B's 2 microbatches x 14
    plain = Workload.build(build_job("kareus-1", overrides=dict(
        layers_per_stage=(14, 14))))
    inter = Workload.build(build_job("kareus-1", overrides=VP2))
    job = inter.job
    layer_input = 2 * job.local_seq_length * job.micro_batch_size * job.model.hidden_size
    extra = inter.memory[0].activations_bytes - plain.memory[0].activations_bytes
    assert extra == pytest.approx((35 - 28) * layer_input)
