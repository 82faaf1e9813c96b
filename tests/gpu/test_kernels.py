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
