import pytest

from kareus.backends.emulator.iteration_anchors import H100_8B_JOB
from kareus.job.sources import build_job
from kareus.workload.graph import ExecutionGraph, layer_params, mfu, model_flops_per_token
from kareus.workload.ops import Collective

# kareus-1 at the default training settings (the layer as Kareus built it before them;
# the artifact's, which the preset now takes, are tested in tests/workload/test_training_ops.py)
DEFAULTS = {"training": {}}


def _graph(preset="kareus-1", **overrides):
    return ExecutionGraph.from_job(build_job(preset, overrides={**DEFAULTS, **overrides}))


def test_kareus1_forward_flops_per_op():
    g = _graph()
    flops = {op.name: op.flops / 1e9 for op in g.layer_forward}
    expected = {"qkv": 64.4, "out_proj": 38.7, "fc1": 206.2, "fc2": 103.1, "core_attn": 51.5}
    for name, gflop in expected.items():
        assert flops[name] == pytest.approx(gflop, rel=0.005), name
    total = sum(op.flops for op in g.layer_forward) / 1e9
    assert total == pytest.approx(463.9, rel=0.01)


def test_kareus1_all_reduce_size():
    g = _graph()
    ars = [op for op in g.layer_forward if op.is_collective]
    assert [op.kind for op in ars] == ["all_reduce", "all_reduce"]
    assert all(op.bytes_ == 4 * 4096 * 3072 * 2 == 100_663_296 for op in ars)
    assert all(op.group == "tp" and op.group_size == 8 for op in ars)


def test_backward_is_twice_forward_and_attention_two_and_a_half():
    g = _graph()
    fwd = {op.name: op for op in g.layer_forward if not op.is_collective}
    bwd = {op.name: op for op in g.layer_backward if not op.is_collective}
    assert bwd["core_attn_bwd"].flops == pytest.approx(2.5 * fwd["core_attn"].flops)
    for name in ("rope", "swiglu", "input_norm"):
        assert bwd[f"{name}_bwd"].flops == pytest.approx(2 * fwd[name].flops)
    # a backward linear is two kernels, data gradient then weight gradient, one slot
    names = [op.name for op in g.layer_backward]
    for name in ("qkv", "out_proj", "fc1", "fc2"):
        dgrad, wgrad = bwd[f"{name}_dgrad"], bwd[f"{name}_wgrad"]
        assert dgrad.flops + wgrad.flops == pytest.approx(2 * fwd[name].flops)
        assert names.index(f"{name}_wgrad") == names.index(f"{name}_dgrad") + 1
        assert dgrad.opens_slot and not wgrad.opens_slot
    assert bwd["fc1_dgrad"].gemm_shapes == ((16384, 3072, 2048),)
    assert bwd["fc1_wgrad"].gemm_shapes == ((2048, 3072, 16384),)
    # the input-gradient all-reduces follow the column-parallel weight gradients and are
    # the ones Megatron overlaps with them
    overlapped = [op.name for op in g.layer_backward if op.is_collective
                  and op.overlaps_weight_grad]
    assert overlapped == ["fc1_grad_ar", "qkv_grad_ar"]
    for name in overlapped:
        assert names[names.index(name) - 1].endswith("_wgrad")


def test_collectives_per_layer_without_sp():
    g = _graph()
    # two all-reduces forward, two backward (the recomputed forward repeats the forward's)
    assert sum(op.is_collective for op in g.layer_forward) == 2
    assert sum(op.is_collective for op in g.layer_backward) == 2


def test_cp_all_gather_sizes():
    g = _graph("kareus-2")
    ag = next(op for op in g.layer_forward if op.kind == "all_gather")
    # K and V each (s/cp) x b x (kv/tp) x d x 2 bytes per rank, gathered over cp=2
    per_rank = 2 * (4096 // 2) * 4 * (8 // 4) * 128 * 2
    assert ag.group == "cp" and ag.bytes_ == per_rank * 2
    ar = next(op for op in g.layer_forward if op.kind == "all_reduce")
    assert ar.bytes_ == 4 * 2048 * 3072 * 2
    kinds = [(op.kind, op.group) for op in g.layer_backward if op.is_collective]
    assert kinds == [("all_reduce", "tp"), ("all_gather", "cp"), ("reduce_scatter", "cp"),
                     ("all_reduce", "tp")]


def test_sequence_parallel_uses_gather_and_scatter():
    g = _graph(sequence_parallel=True)
    kinds = [op.kind for op in g.layer_forward if op.is_collective]
    assert kinds == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    norm = next(op for op in g.layer_forward if op.name == "input_norm")
    assert norm.flops == pytest.approx(4 * (4 * 4096 // 8) * 3072)


def test_qwen3_has_qk_norm():
    names = [op.name for op in _graph("kareus-5").layer_forward]
    assert names.index("qkv") < names.index("qk_norm") < names.index("rope")


def test_iteration_flops_follow_the_counting_rule():
    g = _graph()
    job = g.job
    fwd_nb = sum(op.flops for op in g.layer_forward)
    bwd_nb = sum((2.5 if op.kind == "attention" else 2.0) * op.flops for op in g.layer_forward)
    per_layer = 2 * (fwd_nb + fwd_nb + bwd_nb)  # two nanobatches: forward, recompute, backward
    for stage, got in zip(g.stages, g.per_gpu_iteration_flops):
        outside = sum(op.flops for ops in (stage.forward_pre, stage.forward_post,
                                           stage.backward_pre, stage.backward_post)
                      for op in ops)
        once = sum(op.flops for op in stage.iteration_end)  # the optimizer step
        expected = job.num_microbatches * (stage.num_layers * per_layer + outside) + once
        assert got == pytest.approx(expected, rel=1e-9)


def test_lm_head_and_embedding_on_the_right_stages():
    g = _graph()
    first, last = g.stages
    assert [op.name for op in first.forward_pre] == ["embedding", "embedding_ar"]
    assert "lm_head" in [op.name for op in last.forward_post]
    head = next(op for op in last.forward_post if op.name == "lm_head")
    assert head.gemm_shapes == ((8 * 4096, 128256 // 8, 3072),)
    # transfers are not ops of either instruction: both ends wait for one transfer
    assert first.forward_post == () and last.forward_pre == ()
    assert first.send_activation is not None and first.send_grad is None
    assert last.send_grad is not None and last.send_activation is None
    assert [t.name for t in first.transfers] == ["send_activation"]


def test_cp_attention_runs_as_two_chunks_per_rank():
    from kareus.job.sources import build_job
    from kareus.workload.graph import ExecutionGraph

    job = build_job("kareus-2")  # CP2 + TP4, seq 4096
    g = ExecutionGraph.from_job(job)
    attn = [op for op in g.layer_forward if op.kind == "attention"]
    assert [op.name for op in attn] == ["core_attn", "core_attn_2"]
    assert attn[0].opens_slot and not attn[1].opens_slot
    # rank 0 holds chunks 0 and 3 of 4 (1024 tokens each): 0.5 and 3.5 blocks of work
    assert attn[1].flops == pytest.approx(7 * attn[0].flops)
    b, heads, d, s = job.nanobatch_size, job.local_heads, job.model.head_dim, 4096
    assert sum(op.flops for op in attn) == pytest.approx(2.0 * b * (s // 2) * s * heads * d)
    bwd = [op.name for op in g.layer_backward if op.kind == "attention"]
    assert bwd == ["core_attn_bwd", "core_attn_2_bwd"]
    one = ExecutionGraph.from_job(build_job("kareus-1", overrides=DEFAULTS))
    assert [op.name for op in one.layer_forward if op.kind == "attention"] == ["core_attn"]


def test_parameter_count_matches_the_model():
    g = _graph()
    job = g.job
    total = sum(s.params for s in g.stages) * job.tp
    # Llama 3.2 3B with untied embeddings: 3.21 B + 0.39 B output head; replicated norms
    # are counted once per TP rank, hence the tolerance
    assert total / 1e9 == pytest.approx(3.61, rel=0.02)
    assert layer_params(job) * job.tp == pytest.approx(100.7e6, rel=0.01)


def test_dp_sync_only_when_weights_are_replicated():
    def colls(stage):
        return [op for op in stage.iteration_end if isinstance(op, Collective)]

    assert all(not colls(s) for s in _graph().stages)
    cp = _graph("kareus-2")
    assert all(op.group_size == 2 for s in cp.stages for op in colls(s))
    dp = _graph(nodes=4)
    assert [op.kind for op in colls(dp.stages[0])] == ["reduce_scatter", "all_gather"]
    rs, ag = colls(dp.stages[0])
    # fp32 gradients reduced, bf16 parameters gathered (Megatron-LM with bf16)
    assert rs.bytes_ == pytest.approx(4 * dp.stages[0].params)
    assert ag.bytes_ == pytest.approx(2 * dp.stages[0].params)


def test_every_stage_steps_its_optimizer_once_per_iteration():
    """Adam's bytes: 38 per parameter shared over the data-parallel group, plus zeroing
    the fp32 gradient buffer (4 per parameter) on every rank."""
    for g, shards in ((_graph(), 1), (_graph(nodes=4), 2)):
        for stage in g.stages:
            (step,) = [op for op in stage.iteration_end if op.name == "optimizer_step"]
            assert step.kind == "memory"
            assert step.bytes_ == pytest.approx(stage.params * (38 / shards + 4))


def test_cross_entropy_moves_megatrons_passes_over_the_logits():
    job = build_job("kareus-1", overrides=DEFAULTS)
    last = _graph().stages[-1]
    logits = job.micro_batch_size * job.seq_length * -(-job.model.vocab_size // job.tp)
    fwd = next(op for op in last.forward_post if op.name == "cross_entropy")
    bwd = next(op for op in last.backward_pre if op.name == "cross_entropy_bwd")
    assert (fwd.bytes_, bwd.bytes_) == (38 * logits, 14 * logits)


def test_mfu_formula_reproduces_the_published_mfus():
    """NVIDIA's formula against numbers it did not produce here: Llama 3.2 3B's 23.50 GFLOP
    per token and kareus-1's 6.16 PFLOP per iteration (docs/anchors.md §8), and the dgxc
    8B run's 59.37% MFU at its published 12.91 s per step."""
    job = build_job("kareus-1", overrides=DEFAULTS)
    assert model_flops_per_token(job) / 1e9 == pytest.approx(23.50, abs=0.005)
    tokens = job.num_microbatches * job.micro_batch_size * job.seq_length
    assert model_flops_per_token(job) * tokens / 1e15 == pytest.approx(6.16, abs=0.005)
    assert mfu(job, 5.1) == pytest.approx(0.242, abs=0.0005)
    h100 = build_job(overrides=H100_8B_JOB)
    assert mfu(h100, 12.91) == pytest.approx(0.5937, rel=0.005)
