"""The memory model: published jobs fit, an impossible one is refused with its numbers, and
the model's pieces match public figures."""

import pytest

from kareus.errors import SpecError
from kareus.job.presets import JOB_PRESETS
from kareus.job.sources import build_job
from kareus.workload.graph import ExecutionGraph
from kareus.workload.memory import stage_memory
from kareus.workload.workload import Workload
from tests.conftest import run_cli


@pytest.mark.parametrize("preset", list(JOB_PRESETS))
def test_the_published_jobs_fit(preset):
    job = build_job(preset)
    worst = max(m.total_bytes for m in stage_memory(ExecutionGraph.from_job(job)))
    assert worst < job.gpu_spec.memory_bytes
    Workload.build(job)  # not refused


def test_a_job_that_cannot_fit_is_refused_with_its_numbers():
    with pytest.raises(SpecError, match=r"does not fit: stage 0 needs [\d,.]+ GiB"):
        Workload.build(build_job("kareus-1", overrides={"seq_length": 1048576}))
    r = run_cli("simulate", "-p", "kareus-1", "--seq", "1048576")
    assert r.code == 2 and "activations" in r.err and "A100-40GB has 40.0 GiB" in r.err
    assert len(r.err.strip().splitlines()) == 1


@pytest.mark.parametrize("model, published_gb", [("llama3.1-8b", 16.06), ("llama3.3-70b", 141.1)])
def test_bf16_weights_match_the_published_checkpoint_sizes(model, published_gb):
    # the public bf16 safetensors of Llama 3.1 8B (8.03 B parameters) and Llama 3.3 70B
    # (70.6 B): the parameter count behind the weights, gradients and optimizer terms
    job = build_job(overrides={"model": model, "tp": 1, "pp": 1, "gpus_per_node": 1,
                               "nodes": 1, "gpu": "H200"})
    (m,) = stage_memory(ExecutionGraph.from_job(job))
    assert m.weights_bytes / 1e9 == pytest.approx(published_gb, rel=0.01)


@pytest.mark.parametrize("dp, per_param", [(1, 18.0), (8, 7.5)])
def test_optimizer_bytes_follow_megatrons_distributed_optimizer_table(dp, per_param):
    # Megatron-LM: bf16 parameters, fp32 gradients: 6 + 12/d bytes per parameter with the
    # distributed optimizer (18 without: d = 1)
    job = build_job(overrides={"model": "llama3.1-8b", "tp": 8, "pp": 1, "dp": dp,
                               "gpus_per_node": 8, "nodes": dp})
    (m,) = stage_memory(ExecutionGraph.from_job(job))
    params = m.weights_bytes / 2
    per = (m.weights_bytes + m.gradients_bytes + m.optimizer_bytes) / params
    assert per == pytest.approx(per_param)


def test_recompute_keeps_only_layer_inputs():
    on = stage_memory(ExecutionGraph.from_job(build_job("kareus-1")))
    off = stage_memory(ExecutionGraph.from_job(build_job("kareus-1",
                                                         overrides={"recompute": False})))
    assert off[0].activations_bytes > 5 * on[0].activations_bytes
