import pytest

from kareus.errors import SpecError
from kareus.job.sources import build_job
from kareus.workload.slots import make_slots
from kareus.workload.workload import Workload

# kareus-1 at the default training settings (the layer as Kareus built it before them;
# the artifact's, which the preset now takes, are tested in tests/workload/test_training_ops.py)
DEFAULTS = {"training": {}}


def _ps(preset="kareus-1", **overrides):
    return Workload.build(build_job(preset, overrides={**DEFAULTS, **overrides})).partitions


def test_kareus1_keys_and_all_reduce_bytes():
    ps = _ps()
    assert ps.keys == ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"]
    for p in ps.partitions.values():
        assert p.collective.kind == "all_reduce"
        assert p.collective.bytes_ == 100_663_296
        assert p.sm_choices == tuple(range(3, 31, 3))


def test_kareus2_has_the_twelve_published_keys():
    ps = _ps("kareus-2")
    assert set(ps.keys) == {
        "fwd_qkv_ar", "fwd_qkv_ag", "fwd_ao_ag", "fwd_ao_ar", "fwd_mlp", "bwd_mlp",
        "bwd_o_ar", "bwd_o_ag", "bwd_a_ag", "bwd_a_rs", "bwd_qkv_rs", "bwd_qkv_ar",
    }
    suffix_kind = {"ar": "all_reduce", "ag": "all_gather", "rs": "reduce_scatter"}
    for key, p in ps.partitions.items():
        tail = key.rsplit("_", 1)[-1]
        if tail in suffix_kind:
            assert p.collective.kind == suffix_kind[tail], key
    assert ps["fwd_qkv_ag"].sm_choices == tuple(range(1, 21))
    assert ps["fwd_ao_ar"].sm_choices == tuple(range(3, 31, 3))


def test_forward_partitions_of_a_layer_sum_to_its_forward_flops():
    ps = _ps()
    layer_fwd = sum(op.flops for op in ps.graph.layer_forward)
    assert ps["fwd_attn"].compute_flops + ps["fwd_mlp"].compute_flops == pytest.approx(layer_fwd)


def test_slots_follow_the_published_rule():
    ps = _ps()
    assert [s.name for s in ps["fwd_attn"].slots] == [
        "norm_0", "linear_0", "rope_0", "attn_0", "linear_1"]
    assert [s.name for s in ps["fwd_mlp"].slots] == [
        "norm_0", "linear_0", "activation_0", "linear_1"]
    # residual add + RMSNorm are one slot; the slot starts at the first of them
    assert ps["fwd_attn"].launch_index("norm_0") == 0
    assert ps["fwd_attn"].launch_index("linear_0") == 2
    assert ps["fwd_attn"].launch_index(None) == len(ps["fwd_attn"].compute_ops)
    with pytest.raises(SpecError, match="no slot 'attn_3'"):
        ps["fwd_attn"].launch_index("attn_3")


def test_qwen3_qk_norm_merges_into_the_rope_slot():
    ps = _ps("kareus-5")
    assert [s.name for s in ps["fwd_attn"].slots] == [
        "norm_0", "linear_0", "rope_0", "attn_0", "linear_1"]


def test_counts_per_stage():
    ps = _ps()
    # 15 layers, two nanobatches: 30 attention segments, minus the solo first one
    assert ps["fwd_attn"].count_forward == (29, 25)
    assert ps["fwd_attn"].count_backward == (29, 25)  # the recomputed forward
    assert ps["fwd_mlp"].count_per_stage == (60, 52)
    assert ps["bwd_attn"].count_per_stage == (30, 26)
    assert ps["fwd_attn"].count_per_layer == 4 and ps["bwd_mlp"].count_per_layer == 2


@pytest.mark.parametrize("preset", ["kareus-1", "kareus-2", "kareus-5", "kareus-8"])
@pytest.mark.parametrize("sp", [False, True])
def test_every_segment_runs_once_per_nanobatch(preset, sp):
    ps = _ps(preset, sequence_parallel=sp)
    graph = ps.graph
    n_fwd, n_bwd = len(graph.forward_segments), len(graph.backward_segments)
    for stage in graph.stages:
        for direction in ("forward", "backward"):
            steps = ps.layouts[(stage.index, direction)].steps
            per_layer = n_fwd if direction == "forward" else n_fwd + n_bwd
            computes = [s for s in steps if s.kind in ("solo", "partition")]
            assert len(computes) == 2 * per_layer * stage.num_layers
            assert [s.kind for s in steps].count("solo") == 1
            assert [s.kind for s in steps].count("exposed") == 1
            counts = ps.layouts[(stage.index, direction)].partition_counts()
            for key, p in ps.partitions.items():
                got = p.count_forward if direction == "forward" else p.count_backward
                assert counts.get(key, 0) == got[stage.index]


def test_no_recompute_removes_forward_keys_from_backward():
    ps = _ps(recompute=False, micro_batch_size=2)  # mbs 8 without recompute: 42.6 GiB
    assert ps["fwd_attn"].count_backward == (0, 0)


def test_sequence_parallel_keys_are_documented_shape():
    ps = _ps(sequence_parallel=True)
    assert "fwd_attn_ag" in ps.keys and "fwd_attn_rs" in ps.keys
    both = _ps("kareus-2", sequence_parallel=True)
    assert "fwd_qkv_cpag" in both.keys and "fwd_qkv_tpag" in both.keys


def test_make_slots_numbers_per_class():
    ops = _ps()["bwd_attn"].compute_ops
    assert [s.name for s in make_slots(ops)] == [
        "norm_0", "linear_0", "attn_0", "rope_0", "linear_1"]
