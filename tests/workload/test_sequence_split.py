"""A sequence split's nanobatches and partitions (issue 37): each nanobatch is half of
every sequence; only the attention core differs, the second half seeing the first half's
keys too; its backward runs nanobatch 1 first."""

import pytest

from kareus.core import DIRECTIONS
from kareus.job.presets import MODEL_PRESETS
from kareus.job.spec import validate_job
from kareus.workload.layer import backward_ops, forward_ops
from kareus.workload.ops import ComputeOp
from kareus.workload.workload import Workload
from tests.workload.test_unsplit import sequential_microbatch_flops

SEQ = 8192
JOB = dict(model=MODEL_PRESETS["llama3.1-8b"], tp=4, pp=2, micro_batch_size=1,
           seq_length=SEQ, gpu="H100-SXM", nodes=1, num_microbatches=4)


def _job(**overrides):
    return validate_job({**JOB, **overrides})


def _ops(ops):
    return {op.name: op for op in ops if isinstance(op, ComputeOp)}


def test_each_nanobatch_is_half_the_sequence_and_only_attention_differs():
    job = _job()
    f0, f1 = forward_ops(job, nanobatch=0), forward_ops(job, nanobatch=1)
    b0, b1 = backward_ops(job, f0, nanobatch=0), backward_ops(job, f1, nanobatch=1)
    assert _ops(f0)["qkv"].gemm_shapes == ((SEQ // 2, (8 + 2 * 2) * 128, 4096),)
    assert [op.name for op in f0] == [op.name for op in f1]
    differ = {a.name for a, b in zip([*f0, *b0], [*f1, *b1], strict=True) if a != b}
    assert differ == {"core_attn", "core_attn_bwd"}


def test_attention_flops_by_hand():
    """Per local head: QK^T and PV are 2 x 2 q k d FLOPs over the blocks computed. The
    first half is a causal square (half of q x q), the second a full q x q block and a
    causal square: three times the first; together the unsplit causal attention."""
    job = _job()
    q, d, heads = SEQ // 2, 128, 32 // 4
    first = 4 * q * q * d * heads / 2
    second = 4 * q * q * d * heads + first
    a0 = _ops(forward_ops(job, nanobatch=0))["core_attn"]
    a1 = _ops(forward_ops(job, nanobatch=1))["core_attn"]
    assert (a0.flops, a1.flops) == (first, second) and a1.flops == 3 * a0.flops
    assert (a0.attn_keys, a0.attn_causal, a1.attn_keys, a1.attn_causal) == (q, True, SEQ, False)
    whole = _ops(forward_ops(job, sequences=1))["core_attn"]
    assert a0.flops + a1.flops == whole.flops == 4 * SEQ * SEQ * d * heads / 2
    g0 = _ops(backward_ops(job, nanobatch=0))["core_attn_bwd"]
    g1 = _ops(backward_ops(job, nanobatch=1))["core_attn_bwd"]
    assert g1.flops == pytest.approx(3 * g0.flops)


@pytest.mark.parametrize("recompute", [True, False])
def test_the_graph_does_the_whole_microbatchs_work(recompute):
    ps = Workload.build(_job(recompute=recompute)).partitions
    for stage in ps.graph.stages:
        assert ps.graph.stage_microbatch_flops(stage) == pytest.approx(
            sequential_microbatch_flops(ps, stage.index), rel=1e-12)
    # and every layout, partitions included, does it too
    for stage in ps.graph.stages:
        total = sum(op.flops for d in DIRECTIONS for s in ps.layouts[(stage.index, d)].steps
                    for op in s.ops)
        assert total == pytest.approx(ps.graph.stage_microbatch_flops(stage), rel=1e-12)


def test_partitions_differ_by_nanobatch_where_attention_does():
    ps = Workload.build(_job()).partitions
    assert ps.keys == ["fwd_attn_nb0", "fwd_attn_nb1", "fwd_mlp", "bwd_mlp", "bwd_attn_nb0",
                       "bwd_attn_nb1"]
    nb = {k: p.nanobatch for k, p in ps.partitions.items()}
    assert nb == {"fwd_attn_nb0": 0, "fwd_attn_nb1": 1, "fwd_mlp": None, "bwd_mlp": None,
                  "bwd_attn_nb0": 0, "bwd_attn_nb1": 1}
    for d in ("fwd", "bwd"):
        p0, p1 = ps[f"{d}_attn_nb0"], ps[f"{d}_attn_nb1"]
        assert p1.compute_flops > p0.compute_flops
        c0, c1 = p0.collective, p1.collective  # the same all-reduce size: same tokens
        assert (c0.kind, c0.bytes_) == (c1.kind, c1.bytes_)
        assert p0.to_dict()["nanobatch"] == 0 and "nanobatch" not in ps["fwd_mlp"].to_dict()
    # 16 layers a stage: the first attention of a forward instruction is solo (nanobatch 0)
    assert ps["fwd_attn_nb0"].count_forward == (15, 15)
    assert ps["fwd_attn_nb1"].count_forward == (16, 16)


def test_the_backward_runs_nanobatch_1_first():
    """Without recompute one layer's backward is mlp'(1) solo, mlp'(0) + AR(1),
    attn'(1) + AR(0), attn'(0) + AR(1), then the next layer's; the forward is nanobatch 0
    first (nanobatch 1's attention reads nanobatch 0's keys)."""
    ps = Workload.build(_job(recompute=False)).partitions
    bwd = ps.layouts[(1, "backward")].steps
    kinds = [s.kind for s in bwd]
    first = kinds.index("solo")
    keys = [s.key for s in bwd[first + 1:first + 8]]
    assert keys == ["bwd_mlp", "bwd_attn_nb1", "bwd_attn_nb0",
                    "bwd_mlp", "bwd_mlp", "bwd_attn_nb1", "bwd_attn_nb0"]
    # each partition's collective is the other nanobatch's: attn'(1) hides nanobatch 0's
    # FC1 input-gradient all-reduce, attn'(0) nanobatch 1's
    ops = {s.key: s.ops for s in bwd if s.key}
    assert ops["bwd_attn_nb1"][-1].name == "fc1_grad_ar"
    fwd = ps.layouts[(0, "forward")].steps
    keys = [s.key for s in fwd if s.kind == "partition"][:5]
    assert keys == ["fwd_attn_nb1", "fwd_mlp", "fwd_mlp", "fwd_attn_nb0", "fwd_attn_nb1"]


def test_a_batch_split_is_unchanged():
    ps = Workload.build(_job(micro_batch_size=2)).partitions
    assert ps.keys == ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"]
    assert all(p.nanobatch is None for p in ps.partitions.values())


def test_sequence_parallel_has_no_sequence_split():
    """SP puts each half of the sequence on half of the TP ranks, so an SP job at
    micro-batch size 1 has no nanobatches (Megatron-LM and Perseus run it whole)."""
    ps = Workload.build(_job(sequence_parallel=True)).partitions
    assert ps.keys == []
    assert "sequence parallelism" in ps.none_reason


def test_partitions_command_says_the_split(cli):
    r = cli("partitions", "--model", "llama3.1-8b", "--tp", "4", "--pp", "2", "--mbs", "1",
            "--seq", "8192", "--gpu", "H100-SXM", "--nodes", "1")
    assert r.code == 0, r.err
    assert "Sequence split: each nanobatch is one half of every sequence (4096 tokens)" in r.out
    assert "fwd_attn_nb0, fwd_attn_nb1, bwd_attn_nb0, bwd_attn_nb1" in r.out
    assert "mbs 1 (sequence split)" in r.out


def test_graph_command_shows_both_halves(cli):
    r = cli("graph", "--model", "llama3.1-8b", "--tp", "4", "--pp", "2", "--mbs", "1",
            "--seq", "8192", "--gpu", "H100-SXM", "--nodes", "1", "--json")
    assert r.code == 0, r.err
    layer = r.json()["layer"]
    a0, a1 = (next(op for op in ops if op["name"] == "core_attn")
              for ops in (layer["forward"], layer["nanobatch_1"]["forward"]))
    assert a1["flops"] == 3 * a0["flops"] and a1["attn_keys"] == 2 * a0["attn_keys"]
