"""p2p CP (Transformer Engine's ring attention): the ring stays inside the attention op."""

import pytest

from kareus.job.sources import build_job
from kareus.job.spec import BYTES_PER_ELEMENT
from kareus.workload.graph import ExecutionGraph
from kareus.workload.layer import cp_communication
from kareus.workload.ops import Collective
from kareus.workload.workload import Workload


def _job(preset="kareus-2", **overrides):
    return build_job(preset, overrides=overrides)


def _ps(job):
    return Workload.build(job).partitions


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("preset", ["kareus-2", "kareus-8"])
def test_p2p_keys_are_the_tp_only_ones_and_no_cp_collective_exists(preset, sp):
    ring = _job(preset, cp_comm_type="p2p", sequence_parallel=sp)
    tp_only = _job(preset, cp=1, seq_length=ring.seq_length // ring.cp,
                   sequence_parallel=sp)
    assert _ps(ring).keys == _ps(tp_only).keys
    if not sp:
        assert _ps(ring).keys == ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"]
    g = ExecutionGraph.from_job(ring)
    groups = {op.group for op in (*g.layer_forward, *g.layer_backward)
              if isinstance(op, Collective)}
    assert "cp" not in groups
    assert all(p.collective.group == "tp" for p in _ps(ring).partitions.values())


def test_allgather_keeps_its_twelve_keys_and_cp_collectives():
    ps = _ps(_job())
    assert len(ps.keys) == 12
    names = [op.name for op in (*ps.graph.layer_forward, *ps.graph.layer_backward)
             if isinstance(op, Collective) and op.group == "cp"]
    assert names == ["kv_ag", "kv_regather", "dkv_rs"]


def _attention(ops):
    return [op for op in ops if not isinstance(op, Collective) and op.kind == "attention"]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_attention_does_all_gather_cps_flops_and_sends_the_ring_by_hand(cp):
    over = {"cp": cp, "tp": 8 // cp, "seq_length": 8192}
    ring = ExecutionGraph.from_job(_job(cp_comm_type="p2p", **over))
    gather = ExecutionGraph.from_job(_job(**over))
    (fwd,), (bwd,) = _attention(ring.layer_forward), _attention(ring.layer_backward)
    assert fwd.name == "core_attn" and bwd.name == "core_attn_bwd"
    assert fwd.flops == pytest.approx(sum(op.flops for op in _attention(gather.layer_forward)))
    assert bwd.flops == pytest.approx(sum(op.flops for op in _attention(gather.layer_backward)))
    # by hand: llama3.2-3b has 8 KV heads of 128; one nanobatch of 4 sequences of
    # 8192 / cp tokens; K and V in bf16
    job = ring.job
    kv_heads = max(1, 8 // job.tp)
    kv = 2 * 4 * (8192 // cp) * kv_heads * 128 * BYTES_PER_ELEMENT
    assert fwd.ring_step_bytes == (kv,) * (cp - 1) + (0.0,)
    # backward: K/V out first, K/V with the dK/dV partial sums, dK/dV home last
    assert bwd.ring_step_bytes == (kv,) + (2 * kv,) * (cp - 2) + (kv,)
    assert len(bwd.ring_step_bytes) == cp


def test_all_gather_and_cp1_attention_carry_no_ring():
    for job in (_job(), _job("kareus-1"), _job("kareus-1", cp_comm_type="p2p")):
        g = ExecutionGraph.from_job(job)
        assert all(not op.ring_step_bytes
                   for op in _attention((*g.layer_forward, *g.layer_backward)))


def test_cp_communication_says_whether_cp_traffic_is_in_the_partitions():
    ring = cp_communication(_job(cp_comm_type="p2p"))
    assert ring is not None
    assert ring["cp_comm_type"] == "p2p" and ring["in_partitions"] is False
    assert "not a Kareus partition" in ring["note"]
    gather = cp_communication(_job())
    assert gather is not None
    assert gather["in_partitions"] is True and gather["cp_comm_type"] == "allgather"
    assert cp_communication(_job("kareus-1")) is None
