"""The ops the training settings add to the execution graph (kareus.workload.training_ops),
against hand counts of Megatron-Core's kernels."""

import pytest

from kareus.job.sources import build_job
from kareus.workload.graph import ExecutionGraph
from kareus.workload.ops import ComputeOp
from kareus.workload.partition import blocking_steps, build_partitions

# kareus-1: TP8, one nanobatch = 4 sequences x 4096 tokens, hidden 3072, FFN 8192 / 8
TOKENS, H, FFN, HEADS, KV, D = 4 * 4096, 3072, 1024, 3, 1, 128


def _graph(**training):
    return ExecutionGraph.from_job(build_job("kareus-1", overrides={"training": training}))


def _ops(ops):
    return {op.name: op for op in ops if isinstance(op, ComputeOp)}


def test_defaults_add_nothing():
    g = _graph()
    names = [op.name for op in (*g.layer_forward, *g.layer_backward)]
    assert not [n for n in names if "dropout" in n or "grad_acc" in n]


def test_fused_dropout_writes_the_mask_in_the_residual_adds_kernel():
    g = _graph(hidden_dropout=0.1)
    fwd = [op.name for op in g.layer_forward]
    # the mask's byte per element in the add's kernel: right after it, no launch of its own
    assert fwd[fwd.index("residual_attn") + 1] == "dropout_attn"
    assert fwd[fwd.index("residual_mlp") + 1] == "dropout_mlp"
    f, b = _ops(g.layer_forward), _ops(g.layer_backward)
    for block in ("attn", "mlp"):
        op = f[f"dropout_{block}"]
        assert op.fused and not op.opens_slot and op.breakdown == "dropout"
        assert op.bytes_ == TOKENS * H * 1
        # backward: gradient (2) and mask (1) read, gradient written (2)
        assert b[f"dropout_{block}_bwd"].bytes_ == TOKENS * H * 5
        assert not b[f"dropout_{block}_bwd"].fused
    # the residual add itself is unchanged
    assert f["residual_attn"] == _ops(_graph().layer_forward)["residual_attn"]


def test_unfused_dropout_is_a_kernel_before_the_add():
    g = _graph(hidden_dropout=0.1, bias_dropout_fusion=False)
    fwd = [op.name for op in g.layer_forward]
    assert fwd[fwd.index("residual_attn") - 1] == "dropout_attn"
    op = _ops(g.layer_forward)["dropout_attn"]
    assert not op.fused and op.bytes_ == TOKENS * H * 5  # x read, output and mask written


def test_embedding_dropout_on_the_first_stage():
    g = _graph(hidden_dropout=0.1)
    first, last = g.stages[0], g.stages[-1]
    tokens = 8 * 4096  # one microbatch
    drop = _ops(first.forward_pre)["embedding_dropout"]
    assert drop.bytes_ == tokens * H * 5
    assert "embedding_dropout_bwd" in _ops(first.backward_post)
    assert "embedding_dropout" not in _ops(last.forward_pre)


WEIGHTS = {"qkv": (HEADS + 2 * KV) * D * H, "out_proj": H * HEADS * D,
           "fc1": 2 * FFN * H, "fc2": H * FFN}


def test_unfused_gradient_accumulation_adds_one_kernel_per_linear():
    g = _graph(gradient_accumulation_fusion=False)
    names = [op.name for op in g.layer_backward]
    for name in WEIGHTS:
        assert names[names.index(f"{name}_wgrad") + 1] == f"{name}_grad_acc"
        assert _ops(g.layer_backward)[f"{name}_grad_acc"].breakdown == "grad_accumulation"
    # outside the layers the microbatch is whole: one add to the main gradient
    head = _ops(g.stages[-1].backward_pre)["lm_head_grad_acc"]
    assert head.bytes_ == 10 * H * (128256 // 8)


def test_a_whole_microbatch_adds_its_weight_gradient_once():
    # Megatron-LM's layer (the whole microbatch): the DDP hook's main_grad.add_, bf16
    # gradient read (2), fp32 main gradient read and written (4 + 4)
    ps = build_partitions(_graph(gradient_accumulation_fusion=False))
    b = _ops(o for s in ps.sequential_layer["backward"] for o in s.ops)
    for name, n in WEIGHTS.items():
        assert b[f"{name}_grad_acc"].bytes_ == 10 * n


def test_split_microbatch_sums_its_nanobatches_then_adds_once():
    # Kareus's executor: the two nanobatches' bf16 gradients summed (2 + 2 read, 2
    # written), the sum added to the main gradient once (10): 16 bytes and two kernels
    # per weight, not two main-gradient adds (20)
    g = _graph(gradient_accumulation_fusion=False)
    for name, n in WEIGHTS.items():
        per_microbatch = [_ops(g.nanobatch_layer(nb)[1])[f"{name}_grad_acc"]
                          for nb in (0, 1)]
        assert sum(op.bytes_ for op in per_microbatch) == 16 * n
        assert sum(op.flops for op in per_microbatch) == 2 * n
    # both nanobatches keep one op list: the same partition keys as with fusion
    fused = build_partitions(_graph())
    assert build_partitions(g).keys == fused.keys


def test_megatron_adds_to_the_main_gradient_after_the_input_gradient_collective():
    # Megatron-Core's linear backward waits for its input-gradient all-reduce before it
    # returns (tensor_parallel/layers.py, handle.wait()); the DDP hook's add runs after
    g = _graph(gradient_accumulation_fusion=False)
    steps = blocking_steps(list(g.layer_backward), "backward")
    overlaps = [i for i, s in enumerate(steps) if s.kind == "overlap"]
    assert [[o.name for o in steps[i].ops] for i in overlaps] == [
        ["fc1_wgrad", "fc1_grad_ar"], ["qkv_wgrad", "qkv_grad_ar"]]
    assert [[o.name for o in steps[i].unit.compute_ops] for i in overlaps] == [
        ["fc1_wgrad"], ["qkv_wgrad"]]
    for i, name in zip(overlaps, ("fc1", "qkv"), strict=True):
        assert steps[i + 1].ops[0].name == f"{name}_grad_acc"
    # a row-parallel linear's has no collective to wait for: right after its GEMM
    run = [o.name for s in steps for o in s.ops]
    assert run[run.index("fc2_wgrad") + 1] == "fc2_grad_acc"


def test_the_forward_without_gradients_keeps_no_mask():
    # full recompute: the forward instruction runs under torch.no_grad
    # (CheckpointFunction.forward); the fused bias-dropout-add keeps no mask there, the
    # recomputed forward inside the backward does
    ps = build_partitions(_graph(hidden_dropout=0.1))
    fwd = [o.name for s in ps.sequential_layer["forward"] for o in s.ops]
    bwd = [o.name for s in ps.sequential_layer["backward"] for o in s.ops]
    assert "residual_attn" in fwd and "dropout_attn" not in fwd and "dropout_mlp" not in fwd
    assert {"dropout_attn", "dropout_mlp", "dropout_attn_bwd"} <= set(bwd)


@pytest.mark.parametrize("training, recompute, per_element", [
    # no recompute: the forward keeps the mask for its backward (1 byte in the add's kernel)
    ({"hidden_dropout": 0.1}, False, 1),
    # unfused: torch's eager dropout kernel writes its mask in any grad mode (x read,
    # output and mask written)
    ({"hidden_dropout": 0.1, "bias_dropout_fusion": False}, True, 5),
])
def test_the_mask_is_written_where_the_forward_keeps_or_cannot_skip_it(training, recompute,
                                                                        per_element):
    job = build_job("kareus-1", overrides={"training": training, "recompute": recompute})
    ps = build_partitions(ExecutionGraph.from_job(job))
    fwd = _ops(o for s in ps.sequential_layer["forward"] for o in s.ops)
    assert fwd["dropout_attn"].bytes_ == per_element * 2 * TOKENS * H  # the whole microbatch


def test_unfused_rope_and_swiglu_are_megatrons_kernels():
    g = _graph(apply_rope_fusion=False, bias_activation_fusion=False)
    f = _ops(g.layer_forward)
    q, k = TOKENS * HEADS * D, TOKENS * KV * D
    rope = [op for op in g.layer_forward if op.name.startswith("rope_")]
    assert len(rope) == 12  # six kernels for q, six for k
    # 12 element reads and writes per element of q and k (fused: 2)
    assert sum(op.bytes_ for op in rope) == 12 * 2 * (q + k)
    assert f["silu"].bytes_ == 2 * 2 * TOKENS * FFN
    assert f["swiglu_mul"].bytes_ == 3 * 2 * TOKENS * FFN
    b = _ops(g.layer_backward)
    assert {f"{op.name}_bwd" for op in rope} <= set(b)
    assert "silu_bwd" in b and "swiglu_mul_bwd" in b


@pytest.mark.parametrize("training, per_logit", [
    ({}, (38, 14)),
    ({"cross_entropy_loss_fusion": True}, (22, 6)),
    ({"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"}, (6, 4)),
])
def test_cross_entropy_by_implementation(training, per_logit):
    last = _graph(**training).stages[-1]
    logits = 8 * 4096 * (128256 // 8)
    fwd, bwd = _ops(last.forward_post)["cross_entropy"], _ops(last.backward_pre)[
        "cross_entropy_bwd"]
    assert (fwd.bytes_, bwd.bytes_) == (per_logit[0] * logits, per_logit[1] * logits)
