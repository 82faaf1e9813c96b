"""A job whose microbatch is not split into nanobatches (an odd micro-batch size, issue
23): no partitions, and the Megatron-LM execution of the whole microbatch that the
Megatron-LM and Perseus baselines run."""

import pytest

from kareus.core import DIRECTIONS
from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.workload.partition import PartitionSet
from kareus.workload.workload import Workload

SMALL = {"num_microbatches": 4, "training": {}}  # the default training settings


def _ps(**overrides) -> PartitionSet:
    return Workload.build(build_job("kareus-1", overrides={**SMALL, **overrides})).partitions


def _ops_flops(steps) -> float:
    return sum(op.flops for s in steps for op in s.ops)


def sequential_microbatch_flops(ps: PartitionSet, stage: int) -> float:
    """One microbatch's forward and backward on ``stage`` as Megatron-LM runs it."""
    total = 0.0
    for d in DIRECTIONS:
        pre, layers, post = ps.sequential_steps(stage, d)
        total += (_ops_flops(pre) + layers * _ops_flops(ps.sequential_layer[d])
                  + _ops_flops(post))
    return total


@pytest.mark.parametrize("mbs, why", [
    (3, r"even micro-batch size \(a batch split, this job has 3\) or nanobatch_split: "
        r"sequence"),
    (1, r"sequence split at micro-batch size 1, but .* seq_length 4095 is odd")])
def test_an_odd_micro_batch_has_no_partitions_but_megatrons_steps(mbs, why):
    ps = _ps(micro_batch_size=mbs, **({"seq_length": 4095} if mbs == 1 else {}))
    assert ps.partitions == {} and ps.keys == []
    for stage in range(ps.job.pp):
        for d in DIRECTIONS:
            layout = ps.layouts[(stage, d)]
            pre, layers, post = ps.sequential_steps(stage, d)
            assert layers == ps.graph.stages[stage].num_layers
            # the layout is Megatron-LM's execution: nothing overlapped, nothing searched
            assert layout.steps == (*pre, *ps.sequential_layer[d] * layers, *post)
            assert not layout.partition_counts()
            assert all(s.kind in ("op", "overlap") for s in layout.steps)
            assert all(op.flops > 0 for s in layout.steps for op in s.ops
                       if not op.is_collective and op.kind != "memory")
    with pytest.raises(SpecError, match="no partitions.*" + why):
        ps["fwd_attn"]


def test_sequential_flops_scale_with_the_micro_batch_size():
    """The sequential layer is built at the job's own micro-batch size: one sequence is a
    third of three, half of two (every op is linear in the sequences)."""
    one, two, three = (_ps(micro_batch_size=m) for m in (1, 2, 3))
    for stage in range(2):
        f1 = sequential_microbatch_flops(one, stage)
        assert f1 > 0
        assert sequential_microbatch_flops(two, stage) == pytest.approx(2 * f1, rel=1e-9)
        assert sequential_microbatch_flops(three, stage) == pytest.approx(3 * f1, rel=1e-9)


def test_sequential_flops_of_an_even_micro_batch_match_the_graph():
    """Independent of the nanobatch graph: at MBS 2, Megatron-LM's whole microbatch does
    the work of the graph's two nanobatches."""
    ps = _ps(micro_batch_size=2)
    for stage in ps.graph.stages:
        assert sequential_microbatch_flops(ps, stage.index) == pytest.approx(
            ps.graph.stage_microbatch_flops(stage), rel=1e-9)


def test_graph_flops_of_an_unsplit_micro_batch():
    ps = _ps(micro_batch_size=1)
    for stage in ps.graph.stages:
        assert ps.graph.stage_microbatch_flops(stage) == pytest.approx(
            sequential_microbatch_flops(ps, stage.index), rel=1e-9)
