"""`kareus profile --executor ray` on a local Ray: each partition's TP group (2 ranks, the
fake GPU's CPU kernels, gloo) is a unit of work, the driver journals what rank 0 sends,
and a unit whose rank dies is retried without measuring again what it journaled."""

import importlib.util
import json

import pytest

if importlib.util.find_spec("ray") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("needs ray and torch", allow_module_level=True)

from kareus.backends.nvml import FakeGpuSpec
from kareus.core import MeasurementProtocol
from kareus.errors import KareusError
from kareus.job.sources import build_job
from kareus.job.spec import validate_job
from kareus.profiling.profile import COMPOSITION
from kareus.profiling.ray_driver import DIE_ENV, profile_ray
from kareus.ray_support import import_ray
from kareus.search import SearchConfig
from kareus.store import Journal, job_id
from kareus.workload.workload import Workload
from tests.conftest import run_cli

JOB = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4,
               num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=97),
    tp=2, pp=1, micro_batch_size=4, seq_length=32, num_microbatches=2, gpus_per_node=2,
    nodes=1, search_freqs_mhz=(1410, 1200)))
BACKEND = FakeGpuSpec(allow_clock_changes=True,
                      protocol=MeasurementProtocol(0.01, 0.0, 0.0))
IDENTITY = f"fakegpu:{JOB.gpu_spec.name}"
CONFIG = SearchConfig(budget=8, initial=4, batch_size=4, seed=0)


@pytest.fixture(scope="module")
def ray_session():
    ray = import_ray()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def profiled(ray_session, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ray") / "j.sqlite")
    seen: list[tuple[str, int, int]] = []
    # with the emulator prior, opened on each rank (the search's and the steps' fits')
    result = profile_ray(JOB, path, BACKEND, CONFIG, prior="emulator",
                         progress=lambda k, d, n: seen.append((k, d, n)))
    return path, result, seen


def _journaled(path: str, key: str) -> dict:
    with Journal(path) as j:
        return {s.knobs: s.measurement for s in j.samples(job_id(JOB), key, IDENTITY)}


def test_every_partition_and_composition_step_is_journaled(profiled):
    path, result, seen = profiled
    ps = Workload.build(JOB).partitions
    assert ps[ps.keys[0]].collective.group_size == 2
    assert [r.partition for r in result.searches] == ps.keys
    for r in result.searches:
        assert r.measured_this_run == len(r.samples) == CONFIG.budget
        journaled = _journaled(path, r.partition)
        assert all(journaled[s.knobs] == s.measurement for s in r.samples)
    assert result.steps is not None and result.steps.needed > 0
    assert result.steps.measured + result.steps.fitted == result.steps.needed
    with Journal(path) as j:
        assert j.identities(job_id(JOB)) == [IDENTITY]
        ops = j.op_samples(job_id(JOB), IDENTITY)
        settings = j.partition_samples(job_id(JOB), IDENTITY)
    # composition's numbers: runs of ops, and settings the searches did not take
    searched = len(ps.keys) * CONFIG.budget
    # (the runs of ops include the wait transients the composition measured)
    assert (len(ops) + len(settings) - searched
            == result.steps.needed + result.steps.transients)
    assert {f for _sig, f, _sms in ops} == {1410, 1200}
    assert {k for k, _, _ in seen} == {*ps.keys, COMPOSITION}
    assert seen[-1] == (COMPOSITION, result.steps.needed, result.steps.needed)


def test_a_second_run_measures_nothing(profiled):
    path, first, _ = profiled
    again = profile_ray(JOB, path, BACKEND, CONFIG, prior="emulator")  # the same path
    assert [r.measured_this_run for r in again.searches] == [0] * len(first.searches)
    assert [r.samples for r in again.searches] == [
        [type(s)(s.knobs, s.measurement, reused=True) for s in r.samples]
        for r in first.searches]
    assert again.steps is not None and again.steps.needed == again.steps.measured == 0


def test_a_unit_whose_rank_dies_is_retried_without_measuring_again(
        ray_session, tmp_path, monkeypatch):
    path = str(tmp_path / "j.sqlite")
    monkeypatch.setenv(DIE_ENV, "fwd_mlp:1:3")  # rank 1 exits at its 4th measurement
    with pytest.raises(KareusError, match="fwd_mlp failed 1 times"):
        profile_ray(JOB, path, BACKEND, CONFIG, keys=["fwd_mlp"], composition=False,
                    retries=0)
    assert len(_journaled(path, "fwd_mlp")) == 3  # what rank 0 recorded before the death is kept
    # first attempt: 3 more measurements, then the death; the retry measures the rest
    result = profile_ray(JOB, path, BACKEND, CONFIG, keys=["fwd_mlp"], composition=False)
    search = result.searches[0]
    assert len(search.samples) == CONFIG.budget
    assert search.reused_from_journal == 6
    assert search.measured_this_run == CONFIG.budget - 6
    journaled = _journaled(path, "fwd_mlp")
    assert len(journaled) == CONFIG.budget
    assert all(journaled[s.knobs] == s.measurement for s in search.samples)


def test_a_group_no_node_can_host_fails_after_its_retries(ray_session, tmp_path):
    doc = JOB.model_dump(mode="json")
    doc.update(tp=8, gpus_per_node=8)
    doc["model"].update(num_attention_heads=8, num_kv_heads=8, head_dim=8)
    wide = validate_job(doc)  # TP=8: 8 ranks, and the local Ray has 4 CPUs
    with pytest.raises(KareusError, match=r"fwd_mlp failed 2 times; last: no node hosted 8"):
        profile_ray(wide, str(tmp_path / "j.sqlite"), BACKEND, CONFIG, keys=["fwd_mlp"],
                    retries=1, placement_timeout_s=0.5)


def test_the_cli_dispatches_to_ray(ray_session, tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(JOB.model_dump(mode="json")))
    args = ("profile", "--config", str(job_file), "--backend", "fakegpu",
            "--allow-clock-changes", "--executor", "ray", "--partition", "fwd_mlp",
            "--partitions-only", "--budget", "20", "--window", "0.01", "--cooldown", "0",
            "--settle", "0", "--journal", str(tmp_path / "j.sqlite"))
    bad = run_cli(*args, "--ray-retries", "-1")
    assert bad.code == 2 and "--ray-retries" in bad.err
    assert len(bad.err.strip().splitlines()) == 1
    r = run_cli(*args, "--json")
    assert r.code == 0, r.err
    (search,) = r.json()["searches"]
    assert search["partition"] == "fwd_mlp" and search["measured_this_run"] == 20
    assert len(_journaled(str(tmp_path / "j.sqlite"), "fwd_mlp")) == 20
