"""LayerPlan: what the overlapped layer takes of a plan. No torch needed."""

from kareus.core import LAUNCH_FIRST, PartitionSetting
from kareus.job.sources import build_job
from kareus.plans.execution import ExecutionPlan
from kareus.runtime.layer_plan import LayerPlan, layer_plan_for
from kareus.workload.workload import Workload

JOB = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4,
               num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=100),
    tp=2, pp=1, micro_batch_size=2, seq_length=32, gpus_per_node=2, nodes=1))
PARTS = Workload.build(JOB).partitions.partitions


def _op(key: str, slot: str) -> str:
    p = PARTS[key]
    return p.compute_ops[next(s.op_index for s in p.slots if s.name == slot)].name


def test_from_partitions_maps_slots_to_ops_and_resolves_launch_first():
    slot = PARTS["fwd_mlp"].slots[1].name
    plan = LayerPlan.from_partitions(PARTS, {
        "fwd_mlp": PartitionSetting(9, slot),
        "fwd_attn": PartitionSetting(6, LAUNCH_FIRST),
        "bwd_mlp": PartitionSetting(3, None)})
    assert plan.launch_op("fwd_mlp") == _op("fwd_mlp", slot) and plan.sms("fwd_mlp") == 9
    first = PARTS["fwd_attn"].slots[0].name
    assert plan.settings["fwd_attn"] == PartitionSetting(6, first)
    assert plan.launch_op("fwd_attn") == _op("fwd_attn", first)
    assert plan.launch_op("bwd_mlp") is None and plan.sms("bwd_mlp") == 3
    # a key without a setting: no overlap, no SM-specific group
    assert plan.launch_op("bwd_attn") is None and plan.sms("bwd_attn") == 0


def test_from_plan_takes_the_instructions_settings_at_its_clock():
    mlp_slots = [s.name for s in PARTS["fwd_mlp"].slots]
    ex = ExecutionPlan(
        "p", overlap=True, default_freq_mhz=1410, default_slot=LAUNCH_FIRST,
        instruction_freqs={(0, 1, "forward"): 1200},
        knobs={"fwd_mlp": PartitionSetting(9, mlp_slots[1]),
               "bwd_mlp": PartitionSetting(3, None)},
        knobs_by_freq={("fwd_mlp", 1200): PartitionSetting(12, mlp_slots[2])},
        instruction_knobs={(0, 0, "forward"): {"bwd_mlp": PartitionSetting(5, LAUNCH_FIRST)}})

    first = LayerPlan.from_plan(ex, PARTS)  # microbatch 0's forward, at 1410 MHz
    assert set(first.settings) == set(PARTS)
    assert first.settings["fwd_mlp"] == PartitionSetting(9, mlp_slots[1])
    assert first.settings["bwd_mlp"] == PartitionSetting(5, PARTS["bwd_mlp"].slots[0].name)
    # keys the plan leaves alone: its default slot (launch first) and the default SMs
    assert first.settings["fwd_attn"] == PartitionSetting(32,
                                                          PARTS["fwd_attn"].slots[0].name)

    second = LayerPlan.from_plan(ex, PARTS, (0, 1, "forward"), default_sms=16)  # 1200 MHz
    assert second.settings["fwd_mlp"] == PartitionSetting(12, mlp_slots[2])
    assert second.launch_op("fwd_mlp") == _op("fwd_mlp", mlp_slots[2])
    assert second.settings["bwd_mlp"] == PartitionSetting(3, None)
    assert second.sms("fwd_attn") == 16


def test_a_plan_without_overlap_slots_launches_nothing_early():
    ex = ExecutionPlan("seq", overlap=True, default_freq_mhz=1410, default_sms=8)
    plan = LayerPlan.from_plan(ex, PARTS)
    assert all(plan.launch_op(k) is None and plan.sms(k) == 8 for k in PARTS)


def test_sequential_instructions_run_the_plain_layer():
    ex = ExecutionPlan("p", overlap=True, default_freq_mhz=1410, default_slot=LAUNCH_FIRST,
                       sequential=frozenset({(0, 1, "backward")}))
    assert layer_plan_for(ex, PARTS, (0, 1, "backward")) is None
    assert layer_plan_for(ex, PARTS, (0, 0, "backward")) == LayerPlan.from_plan(
        ex, PARTS, (0, 0, "backward"))
    megatron = ExecutionPlan("m", overlap=False, default_freq_mhz=1410)
    assert layer_plan_for(megatron, PARTS, (0, 0, "forward")) is None


def test_the_split_travels_with_the_plan_and_an_unknown_one_is_one_line():
    import pytest

    from kareus.errors import SpecError

    ex = ExecutionPlan("s", overlap=True, default_freq_mhz=1410, default_slot=LAUNCH_FIRST)
    assert LayerPlan.from_plan(ex, PARTS).split == "batch"
    seq = layer_plan_for(ex, PARTS, (0, 0, "backward"), split="sequence")
    assert seq is not None and seq.split == "sequence"
    # the same settings as the batch split's: only the nanobatches differ
    assert seq.settings == LayerPlan.from_plan(ex, PARTS, (0, 0, "backward")).settings
    with pytest.raises(SpecError, match="nanobatch split 'rows': expected one of batch, "
                                        "sequence"):
        LayerPlan.from_plan(ex, PARTS, split="rows")


def test_a_key_resolves_to_the_planner_s_per_nanobatch_key_where_the_plan_has_one():
    """A sequence split's attention partitions are keyed per computing nanobatch
    (``fwd_attn_nb1``); the schedule asks by the plain key and the nanobatch."""
    seq_job = build_job(overrides={**JOB.model_dump(), "micro_batch_size": 1,
                                   "nanobatch_split": None})
    parts = Workload.build(seq_job).partitions.partitions
    assert {"fwd_attn_nb1", "bwd_attn_nb0", "bwd_attn_nb1"} <= set(parts)
    plan = LayerPlan.from_partitions(parts, {
        "fwd_attn_nb1": PartitionSetting(5, None), "bwd_attn_nb0": PartitionSetting(6, None),
        "bwd_attn_nb1": PartitionSetting(7, None), "fwd_mlp": PartitionSetting(8, None)},
        split="sequence")
    assert plan.key("fwd_attn", 1) == "fwd_attn_nb1"
    assert plan.sms(plan.key("bwd_attn", 0)) == 6 and plan.sms(plan.key("bwd_attn", 1)) == 7
    # a key the planner does not split by nanobatch, and a batch split's plan: the plain key
    assert plan.key("fwd_mlp", 0) == plan.key("fwd_mlp", 1) == "fwd_mlp"
    batch = LayerPlan.from_partitions(PARTS, {"fwd_attn": PartitionSetting(4, None)})
    assert batch.key("fwd_attn", 1) == "fwd_attn" and batch.sms(batch.key("fwd_attn", 1)) == 4


def test_a_layer_s_last_backward_collective_goes_where_the_planner_pairs_it():
    """Without recompute the planner pairs a layer's last backward all-reduce with the next
    layer's first backward partition; under recompute with its recomputed forward's
    first, whose key the backward instructions then hold (read from the partitions)."""
    for recompute, want in ((False, "bwd_mlp"), (True, "fwd_attn")):
        job = build_job(overrides={**JOB.model_dump(mode="json"), "recompute": recompute})
        parts = Workload.build(job).partitions.partitions
        plan = LayerPlan.from_partitions(parts, {})
        assert plan.recompute is recompute
        assert plan.layer_end_backward("fwd_attn", "bwd_mlp") == want
