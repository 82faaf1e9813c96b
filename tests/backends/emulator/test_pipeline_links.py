"""Pipeline sends over the links of the job's node (issue 38): NVLink between stages on one
node, the node's network between nodes, shared by the GPUs that send at once."""

import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.backend import network_share_bytes_s
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.job.sources import build_job
from kareus.plans.methods import baseline_plan
from kareus.workload.workload import Workload

GBIT = 1e9 / 8


@pytest.mark.parametrize("preset, overrides, per_gpu_gbit", [
    ("kareus-1", {}, 50),  # all 8 TP ranks of a stage send at once: 400 Gb/s / 8
    ("kareus-1", {"node": "DGX-A100"}, 200),  # one HDR adapter per GPU (the old default)
    ("llama3.3-70b-64gpu", {}, 400),  # DGX H100: one NDR adapter per GPU
])
def test_each_gpus_share_of_its_nodes_network(preset, overrides, per_gpu_gbit):
    job = build_job(preset, overrides=overrides)
    assert network_share_bytes_s(job) == pytest.approx(per_gpu_gbit * GBIT)


def _sends(job):
    ps = Workload.build(job).partitions
    b = EmulatorBackend(job)
    return [(s.send_activation, b.measure_ops((s.send_activation,), 1410).time_s)
            for s in ps.graph.stages[:-1]]


def test_sends_between_nodes_take_the_network_and_within_a_node_nvlink():
    # TP4, PP4 on 2 p4d nodes: stages 0, 1 | 2, 3; the 4 GPUs of stage 1 send at once, each
    # through its own 100 Gb/s adapter
    job = build_job(overrides=dict(model="llama3.2-3b", tp=4, pp=4, nodes=2,
                                   layers_per_stage=(7, 7, 7, 7), node="p4d.24xlarge"))
    (a, t0), (b, t1), (c, t2) = _sends(job)
    assert not a.crosses_nodes and b.crosses_nodes and not c.crosses_nodes
    assert t1 == pytest.approx(b.bytes_ / (0.9 * 100 * GBIT), rel=0.01)
    assert t0 == pytest.approx(t2) and t0 < t1 / 5


def test_kareus1_sends_share_the_p4d_efa():
    """Each of the 8 microbatches' activations (and gradients) crosses as 8 x 201 MB over
    400 Gb/s: 36 ms per send at 0.9 of the line rate, 4x the time over a DGX A100's 8 HDR
    adapters; the wall-clock iteration grows by what lies on its critical path."""
    results = {}
    for node in ("p4d.24xlarge", "DGX-A100"):
        job = build_job("kareus-1", overrides={"node": node})
        ps = Workload.build(job).partitions
        results[node] = IterationSimulator(ps, EmulatorBackend(job)).run(
            baseline_plan("megatron", job))
    p4d, dgx = results["p4d.24xlarge"], results["DGX-A100"]
    per_send = 201_326_592 / (0.9 * 50 * GBIT)
    for stage in p4d.breakdown():
        assert stage["transfers"]["time_s"] == pytest.approx(8 * per_send, rel=0.01)
    assert p4d.breakdown()[0]["transfers"]["time_s"] == pytest.approx(
        4 * dgx.breakdown()[0]["transfers"]["time_s"], rel=0.01)
    assert p4d.time_s > dgx.time_s + 2 * (per_send - per_send / 4)
