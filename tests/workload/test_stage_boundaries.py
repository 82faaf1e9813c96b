"""Which pipeline sends leave the node (issue 38): Megatron's rank order tp-cp-dp-pp puts a
stage's GPUs node by node, so a send crosses only where its stages sit on different nodes."""

from kareus.job.sources import build_job
from kareus.workload.graph import ExecutionGraph


def _crossings(**job):
    g = ExecutionGraph.from_job(build_job(overrides=dict(model="llama3.2-3b", **job)))
    acts = [s.send_activation.crosses_nodes for s in g.stages[:-1]]
    grads = [s.send_grad.crosses_nodes for s in g.stages[1:]]
    assert acts == grads  # the two directions of a boundary use the same link
    return acts


def test_kareus1_stage_fills_a_node_so_its_sends_cross():
    g = ExecutionGraph.from_job(build_job("kareus-1"))
    send = g.stages[0].send_activation
    assert send.crosses_nodes
    # without SP every TP rank sends the whole [s, b, h] activation in bf16: 8 x 4096 x 3072 x 2
    assert send.bytes_ == 8 * 4096 * 3072 * 2 == 201_326_592
    # with SP each rank holds and sends s / tp of it
    sp = ExecutionGraph.from_job(build_job("kareus-1", overrides={"sequence_parallel": True}))
    assert sp.stages[0].send_activation.bytes_ == sp.stages[1].send_grad.bytes_ == 201_326_592 / 8


def test_stages_on_one_node_use_nvlink_and_those_across_the_network():
    # TP4, PP4 on 2 nodes of 8: stages 0, 1 on node 0 and 2, 3 on node 1
    assert _crossings(tp=4, pp=4, nodes=2, layers_per_stage=(7, 7, 7, 7)) == [
        False, True, False]
    # one node: nothing crosses
    assert _crossings(tp=2, pp=4, nodes=1, layers_per_stage=(7, 7, 7, 7)) == [False] * 3
    # TP8 x DP2 fills two nodes per stage: every boundary crosses
    assert _crossings(tp=8, pp=2, dp=2, nodes=4) == [True]


def test_interleaved_chunks_cross_where_their_ranks_do():
    # TP8, PP2, VP2 on 2 nodes: rank 1's chunk sends to rank 0's next chunk over the
    # network too; TP2, PP2, VP2 on 1 node: nothing crosses
    assert _crossings(tp=8, pp=2, virtual_pipeline=2, nodes=2) == [True] * 3
    assert _crossings(tp=2, pp=2, virtual_pipeline=2, nodes=1) == [False] * 3
    # TP2 x PP4, VP2 on 2 nodes of 4 GPUs: pipeline ranks 0, 1 | 2, 3
    assert _crossings(tp=2, pp=4, virtual_pipeline=2, nodes=2, gpus_per_node=4,
                      layers_per_stage=(4, 4, 4, 4, 3, 3, 3, 3)) == [
        False, True, False, True, False, True, False]
