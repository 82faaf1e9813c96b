"""p2p CP: Transformer Engine's ring attention inside one op (docs/workload.md, "CP
communication"). Each ring step takes the longer of its share of the attention and its
transfer to the next CP rank."""

from dataclasses import replace

import pytest

from kareus.backends.emulator import EmulatorBackend
from kareus.backends.emulator.params import default_params
from kareus.backends.emulator.physics import GPUPhysics
from kareus.core import Knobs
from kareus.job.hardware import get_gpu
from kareus.job.sources import build_job
from kareus.workload.graph import ExecutionGraph
from kareus.workload.ops import Collective
from kareus.workload.partition import build_partitions

A100 = get_gpu("A100-40GB")
F = 1410


def _ring_ops(**overrides):
    job = build_job("kareus-2", overrides={"cp_comm_type": "p2p", **overrides})
    g = ExecutionGraph.from_job(job)
    return [op for op in (*g.layer_forward, *g.layer_backward)
            if not isinstance(op, Collective) and op.ring_step_bytes]


def _duration(op, **params) -> float:
    ph = GPUPhysics(A100, replace(default_params(A100), **params))
    return ph.compute_rate(op, F, ph.n_sm, ph.hbm_bw).duration_s


@pytest.mark.parametrize("direction", [0, 1])
def test_ring_time_lies_between_compute_and_compute_plus_transfer(direction):
    op = _ring_ops(seq_length=4096)[direction]
    compute = _duration(replace(op, ring_step_bytes=()))
    ph = GPUPhysics(A100, default_params(A100))
    transfer = sum(ph.p.p2p_latency_s + b / ph.intra_link for b in op.ring_step_bytes if b)
    ring = _duration(op)
    assert compute <= ring <= compute + transfer


@pytest.mark.parametrize("direction", [0, 1])
def test_a_fast_link_hides_the_ring_entirely(direction):
    op = _ring_ops()[direction]
    fast = {"coll_link_busbw_bytes_s": 1e18, "p2p_latency_s": 0.0}
    assert _duration(op, **fast) == pytest.approx(_duration(replace(op, ring_step_bytes=()),
                                                           **fast))


def test_a_slow_link_by_hand():
    # CP2 forward: two steps of equal work t/2; the first sends the rank's K/V while it
    # computes, the second sends nothing. A link that needs 3 x t/2 for the K/V makes the
    # op 3 t/2 + t/2 = 2 t; backward (K/V, then dK/dV): 3 t/2 + 3 t/2 = 3 t.
    fwd, bwd = _ring_ops()
    for op, factor in ((fwd, 2.0), (bwd, 3.0)):
        t = _duration(replace(op, ring_step_bytes=()))
        kv = op.ring_step_bytes[0]
        link = kv / (3 * t / 2)  # bytes/s: the K/V takes 3 x t/2
        slow = {"coll_link_busbw_bytes_s": link, "p2p_latency_s": 0.0}
        assert _duration(replace(op, ring_step_bytes=()), **slow) == pytest.approx(t)
        assert _duration(op, **slow) == pytest.approx(factor * t, rel=1e-9)


def test_waiting_on_the_ring_draws_less_sm_power_and_some_link_power():
    fwd, _ = _ring_ops()
    ph = GPUPhysics(A100, replace(default_params(A100), coll_link_busbw_bytes_s=1e9))
    alone = ph.compute_rate(replace(fwd, ring_step_bytes=()), F, ph.n_sm, ph.hbm_bw)
    ring = ph.compute_rate(fwd, F, ph.n_sm, ph.hbm_bw)
    assert ring.duration_s > alone.duration_s
    assert ring.sm_power_w < alone.sm_power_w and ring.link_power_w > 0
    assert alone.link_power_w == 0


def test_the_emulator_measures_a_p2p_partition_with_its_ring():
    # on a 1 GB/s link the K/V transfer (8 MiB) is far longer than the attention: the
    # partition takes at least that transfer more than the same partition without a ring
    job = build_job("kareus-2", overrides={"cp_comm_type": "p2p"})
    part = build_partitions(ExecutionGraph.from_job(job))["fwd_attn"]
    plain = replace(part, compute_ops=tuple(replace(op, ring_step_bytes=())
                                            for op in part.compute_ops))
    params = replace(default_params(A100), coll_link_busbw_bytes_s=1e9)
    be = EmulatorBackend(job, params=params)
    knobs = Knobs(F, 12, None)
    (attn,) = [op for op in part.compute_ops if op.ring_step_bytes]
    transfer = attn.ring_step_bytes[0] / 1e9
    with_ring, without = be.measure(part, knobs), be.measure(plain, knobs)
    assert with_ring.time_s - without.time_s > 0.9 * transfer
    assert with_ring.energy_j > without.energy_j
