import pytest

torch = pytest.importorskip("torch")

from kareus.gpu.kernels import build_kernel, build_kernels, stand_in_collective  # noqa: E402
from kareus.gpu.partition_runner import PartitionRunner  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.workload.layer import LayerShapes  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402

TINY = dict(model=dict(name="tiny", hidden_size=256, num_layers=4, num_attention_heads=4,
                       num_kv_heads=2, head_dim=64, ffn_hidden_size=512, vocab_size=1000),
            tp=2, pp=1, micro_batch_size=2, seq_length=128, gpus_per_node=2, nodes=1)


@pytest.mark.parametrize("preset", ["kareus-1", "kareus-2", "kareus-5"])
def test_kernels_follow_the_partition_at_full_shapes(preset):
    job = build_job(preset)
    for p in Workload.build(job).partitions.partitions.values():
        kernels = build_kernels(p, job, device="meta")  # shapes only, nothing computed
        assert [k.name for k in kernels] == [op.name for op in p.compute_ops]
        for k, op in zip(kernels, p.compute_ops):
            assert k.kind == op.kind
            if op.kind == "gemm":
                want = [s for m, n, kk in op.gemm_shapes for s in ((m, kk), (kk, n))]
                assert list(k.shapes) == want
            if op.kind == "attention":
                q, kk, v = k.shapes
                assert q == (job.nanobatch_size, job.local_heads, job.local_seq_length, 128)
                assert kk == v == (job.nanobatch_size, job.local_kv_heads, job.seq_length, 128)
            k.run()  # shapes compose


def test_kernels_run_on_the_cpu_with_the_collective_at_its_slot():
    job = build_job(overrides=TINY)
    ps = Workload.build(job).partitions
    order = []
    for p in ps.partitions.values():
        kernels = build_kernels(p, job, device="cpu", dtype_name="float32")
        for k in kernels:
            fn = k.run
            k.run = lambda fn=fn, name=k.name: (order.append(name), fn())[1]
        coll = stand_in_collective(p.collective.bytes_)
        runner = PartitionRunner(kernels, lambda coll=coll: (order.append("COLL"), coll()),
                                 p.launch_index(p.slots[1].name))
        order.clear()
        runner.run()
        names = [op.name for op in p.compute_ops]
        at = p.slots[1].op_index
        assert order == [*names[:at], "COLL", *names[at:]]


def test_one_kernel_per_op_outside_partitions():
    """`build_kernel` serves ops outside partitions too (the LM head GEMM, the final
    norm): the same kernel `build_kernels` builds for an op of a partition."""
    job = build_job(overrides=TINY)
    p = Workload.build(job).partitions["fwd_mlp"]
    shapes = LayerShapes(job)
    for op in p.compute_ops:
        k = build_kernel(op, shapes, "cpu", torch.float32)
        assert (k.name, k.kind) == (op.name, op.kind)
        k.run()
    gemm = next(op for op in p.compute_ops if op.kind == "gemm")
    assert build_kernel(gemm, shapes, "meta", torch.bfloat16).shapes == next(
        k.shapes for k in build_kernels(p, job, "meta") if k.name == gemm.name)


SEQ = {**TINY, "micro_batch_size": 1}
"""Micro-batch size 1 (issue 37): a sequence split, two nanobatches of 64 of 128 tokens."""


class _Attentions(torch.overrides.TorchFunctionMode):
    """Records the scaled_dot_product_attention calls made inside it: ``calls`` (query
    shape, key shape, (query, key) pairs computed per sample and head), ``inputs`` (q, k,
    v). A mode, not a patched function: torch's CausalBias dispatches on the function."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []
        self.inputs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            from torch.nn.attention.bias import CausalBias

            q, k, v = args[:3]
            mask, causal = kwargs.get("attn_mask"), kwargs.get("is_causal", False)
            s_q, s_k = q.shape[-2], k.shape[-2]
            if isinstance(mask, CausalBias):
                pairs = int(mask._materialize(q.device).sum())
            elif mask is not None:
                pairs = int(mask.sum())
            else:  # is_causal: SDPA's upper-left alignment
                pairs = int(torch.ones(s_q, s_k).tril().sum()) if causal else s_q * s_k
            self.calls.append((tuple(q.shape), tuple(k.shape), pairs))
            self.inputs.append((q, k, v))
        return func(*args, **kwargs)


def test_a_sequence_split_s_kernels_run_half_the_sequence():
    """At micro-batch size 1 every kernel of a partition runs one sample's half of the
    sequence (64 tokens): GEMMs, norms, residuals; nanobatch 0's attention is its 64
    queries against its 64 keys, causal; nanobatch 1's its 64 queries (the last) against
    all 128 keys, the first 64 in full and its own causally: ~3x the pairs (64·64 + 2080
    against 2080), forward and backward."""
    job = build_job(overrides=SEQ)
    assert job.sequence_split
    parts = Workload.build(job).partitions.partitions
    pairs = {}
    for key, p in parts.items():
        kernels = build_kernels(p, job, device="cpu", dtype_name="float32")
        for k, op in zip(kernels, p.compute_ops):
            if op.kind == "gemm":  # the tokens: rows of a forward or data gradient GEMM,
                # the reduction of a weight gradient
                (m, _n, kk), = op.gemm_shapes
                assert (kk if op.name.endswith("wgrad") else m) == 64, (key, op.name)
            elif op.name in ("residual_mlp", "input_norm", "residual_attn", "pre_mlp_norm"):
                assert k.shapes[0] == (64, 256), (key, op.name)
            elif op.kind == "attention":
                with _Attentions() as seen:
                    k.run()
                (q_shape, k_shape, n), = seen.calls
                nb = int(key[-1])
                assert q_shape == (1, 2, 64, 64)  # one sample, a rank's 2 heads
                assert k_shape == (1, 1, 64 * (nb + 1), 64), key  # its 1 query group
                pairs[key] = n
            k.run()
    causal = 64 * 65 // 2
    assert pairs == {"fwd_attn_nb0": causal, "bwd_attn_nb0": causal,
                     "fwd_attn_nb1": 64 * 64 + causal, "bwd_attn_nb1": 64 * 64 + causal}
    assert 2.9 < pairs["fwd_attn_nb1"] / pairs["fwd_attn_nb0"] < 3


def test_a_sequence_split_s_second_half_attention_is_causal_at_its_positions():
    """Nanobatch 1's attention kernel equals the last 64 rows of a causal attention over
    all 128 tokens (its mask aligned to the lower right, not SDPA's upper-left
    is_causal)."""
    job = build_job(overrides=SEQ)
    op = next(o for o in Workload.build(job).partitions["fwd_attn_nb1"].compute_ops
              if o.kind == "attention")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kernel = build_kernel(op, LayerShapes(job, nanobatch=1), "cpu", torch.float32)
    with _Attentions() as seen:
        got = kernel.run()
    (q, k, v), = seen.inputs
    # the whole sequence's queries (nanobatch 0's arbitrary), causal: the last 64 rows
    whole = torch.cat([torch.randn_like(q), q], dim=-2)
    want = sdpa(whole, k, v, is_causal=True, enable_gqa=True)[..., 64:, :]
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, sdpa(q, k, v, is_causal=True, enable_gqa=True),
                              atol=1e-3)


def test_ops_outside_partitions_run_at_the_shapes_they_were_built_with():
    """`op_shapes`: a partition's op at its nanobatch's shapes; the unsplit layer's (the
    Megatron-LM and Perseus baselines) and the final norm at the whole microbatch's.
    Batch split: the microbatch's 2 samples, not a nanobatch's 1."""
    from kareus.gpu.kernels import op_shapes
    from kareus.workload.layer import forward_ops

    for overrides, nanobatch_tokens in ((TINY, 128), (SEQ, 64)):
        job = build_job(overrides=overrides)
        shapes = op_shapes(job)
        wl = Workload.build(job)
        for p in wl.partitions.partitions.values():
            for op in p.compute_ops:
                assert shapes(op).tokens == nanobatch_tokens, (p.key, op.name)
        whole = [op for op in forward_ops(job, sequences=job.micro_batch_size)
                 if op.name == "residual_mlp"]
        assert shapes(whole[0]).tokens == 2 * nanobatch_tokens
        k = build_kernel(whole[0], shapes(whole[0]), "meta", torch.bfloat16)
        assert k.shapes[0] == (2 * nanobatch_tokens, 256)
        attn = next(op for op in forward_ops(job, sequences=job.micro_batch_size)
                    if op.kind == "attention")
        q, kk, _v = build_kernel(attn, shapes(attn), "meta", torch.bfloat16).shapes
        assert q[0] * q[2] == 2 * nanobatch_tokens and kk[2] == 128
