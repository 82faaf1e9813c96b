"""`--runtime megatron` (issue 22): the fakegpu backend measures partitions with
Megatron-Core's own modules through the Kareus layer's executor, launching the collective
where the slot says; journaled under its own identity. On the CPU in a spawned process
(Megatron's parallel state is per process); time and energy on the CPU mean nothing, the
wiring does."""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

from kareus.core import Knobs, MeasurementProtocol  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402

JOB = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4,
               num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=128),
    tp=2, pp=1, micro_batch_size=4, seq_length=16, num_microbatches=2, gpus_per_node=2,
    nodes=1, search_freqs_mhz=(1410,)))


JOB_SP = build_job(overrides={**JOB.model_dump(), "sequence_parallel": True})


def _run_every_slot(job, res: dict) -> None:
    """Every partition of ``job`` at every slot, twice: per (key, slot) the events (the
    collective's launches with the number of ops announced before them; the parameters'
    gradients) and the ops announced."""
    from kareus.integrations.megatron.profiling import MegatronRuntime

    rt = MegatronRuntime(job, "cpu")
    for key, part in Workload.build(job).partitions.partitions.items():
        for slot in [s.name for s in part.slots] + [None]:
            events: list = []
            box: list = []  # the runner, once built: where its ops stand at the launch

            def collective(events=events, box=box):
                events.append(("COLL", len(getattr(box[0], "ops_run", []))))

            runner = rt.runner(part, slot, collective)
            box.append(runner)
            if key.startswith("bwd"):
                hooks = [p.register_hook(lambda g, n=n, events=events: events.append(n))
                         for n, p in rt.layer.named_parameters()]
            for _ in range(2):
                runner.run()
            runner.synchronize()
            if key.startswith("bwd"):
                for h in hooks:
                    h.remove()
            res[(key, slot)] = (events, list(getattr(runner, "ops_run", [])))


def _worker(_rank: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    from kareus.backends.nvml import FakeGpuSpec
    from kareus.integrations.megatron.profiling import MegatronRuntime

    wl = Workload.build(JOB)
    rt = MegatronRuntime(JOB, "cpu")
    res: dict = {"params": sum(p.numel() for p in rt.layer.parameters())}
    _run_every_slot(JOB, res)
    res["sp"] = {}
    _run_every_slot(JOB_SP, res["sp"])
    spec = FakeGpuSpec(runtime="megatron",
                       protocol=MeasurementProtocol(window_s=0.01, cooldown_s=0.0,
                                                    settle_s=0.0))
    spec.check(JOB)
    with spec.open(wl) as backend:
        res["identity"] = backend.identity()
        part = wl.partitions.partitions["fwd_attn"]
        m = backend.measure(part, Knobs(1410, 6, part.slots[1].name))
        res["measured"] = (m.time_s, m.energy_j)
    wl_sp = Workload.build(JOB_SP)
    with spec.open(wl_sp) as backend:
        res["sp measured"] = {}
        for key in ("fwd_ln1_ag", "fwd_attn_rs", "bwd_mlp_ag", "bwd_ln2_rs"):
            part = wl_sp.partitions.partitions[key]
            m = backend.measure(part, Knobs(1410, 4, part.slots[0].name))
            res["sp measured"][key] = (m.time_s, m.energy_j)
    with FakeGpuSpec().open(wl) as backend:
        res["kernels identity"] = backend.identity()
    torch.save(res, os.path.join(out_dir, "res.pt"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron-runtime")
    mp.spawn(_worker, args=(str(out),), nprocs=1, join=True)
    return torch.load(out / "res.pt", weights_only=False)


@pytest.mark.parametrize("job", [JOB, JOB_SP], ids=["tp", "sp"])
def test_forward_partitions_launch_before_the_slot_s_op(measured, job):
    parts = Workload.build(job).partitions.partitions
    measured = measured["sp"] if job.sequence_parallel else measured
    for key in [k for k in parts if k.startswith("fwd")]:
        names = [o.name for o in parts[key].compute_ops]
        for slot in [s.name for s in parts[key].slots] + [None]:
            events, ops_run = measured[(key, slot)]
            assert ops_run[:len(names)] == names  # the pieces announce the partition's ops
            colls = [i for e, i in events if e == "COLL"]
            assert len(colls) == 2  # once per run
            at = colls[0]
            if slot is None:
                assert at == len(names)  # after the last op
            else:
                op = parts[key].compute_ops[parts[key].launch_index(slot)].name
                assert ops_run[at - 1] == op, (key, slot, ops_run, at)


@pytest.mark.parametrize("job", [JOB, JOB_SP], ids=["tp", "sp"])
def test_backward_partitions_launch_once_where_the_slot_says(measured, job):
    parts = Workload.build(job).partitions.partitions
    measured = measured["sp"] if job.sequence_parallel else measured
    for key in [k for k in parts if k.startswith("bwd")]:
        for slot in [s.name for s in parts[key].slots] + [None]:
            events, _ = measured[(key, slot)]
            run = events[:len(events) // 2]  # the first of the two runs
            where = [i for i, e in enumerate(run) if isinstance(e, tuple)]
            grads = [i for i, e in enumerate(run) if not isinstance(e, tuple)]
            assert len(where) == 1 and grads, (key, slot, run)
            op = (parts[key].compute_ops[parts[key].launch_index(slot)].name
                  if slot is not None else None)
            if slot is None:
                assert where[0] > max(grads)  # after the partition's compute
            elif op.endswith("_norm_bwd"):
                assert where[0] < min(grads)  # at the start
            else:  # a gradient hook, inside the partition's backward
                # (the partition's first op, as fc2_dgrad of TP's bwd_mlp: at once)
                first = parts[key].launch_index(slot) == 0
                assert min(grads) < where[0] < max(grads) or first, (key, slot)


def test_the_megatron_runtime_is_journaled_apart(measured):
    assert measured["identity"] == "fakegpu:A100-40GB:runtime=megatron"
    assert measured["kernels identity"] == "fakegpu:A100-40GB"
    time_s, energy_j = measured["measured"]
    assert time_s > 0 and energy_j > 0
    # a rank's shapes: QKV 64 -> (2 + 2) x 16, proj 32 -> 64, FC1 64 -> 2 x 64, FC2 64 -> 64
    assert measured["params"] == 64 * 64 + 32 * 64 + 64 * 128 + 64 * 64 + 2 * 64


def test_an_unknown_or_unsupported_runtime_is_one_line():
    from kareus.errors import SpecError
    from kareus.gpu.runtimes import check_runtime

    with pytest.raises(SpecError, match="unknown runtime 'tvm'; available: kernels, megatron"):
        check_runtime("tvm", JOB)
    cp = build_job(overrides={**JOB.model_dump(), "cp": 2, "gpus_per_node": 4})
    with pytest.raises(SpecError, match="context parallelism"):
        check_runtime("megatron", cp)
    check_runtime("megatron", JOB_SP)  # sequence parallelism is measured


def test_sequence_parallel_partitions_are_measured_with_megatron_s_modules(measured):
    """The SP keys (8 forward, 8 backward) each run through Megatron's modules; the
    norm partitions on a rank's part of the sequence announce just their two ops."""
    sp = measured["sp"]
    keys = {k for k, _slot in sp}
    assert keys == set(Workload.build(JOB_SP).partitions.partitions)
    # two runs each
    assert sp[("fwd_ln1_ag", None)][1] == ["residual_mlp", "input_norm"] * 2
    assert sp[("fwd_ln2_rs", None)][1] == ["residual_attn", "pre_mlp_norm"] * 2
    assert sp[("fwd_mlp_rs", None)][1] == ["fc1", "swiglu", "fc2"] * 2
    for key, (time_s, energy_j) in measured["sp measured"].items():
        assert time_s > 0 and energy_j > 0, key
