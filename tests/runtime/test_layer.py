import os
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from kareus.core import PartitionSetting  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.runtime.layer_plan import LayerPlan  # noqa: E402
from kareus.runtime.model import LlamaLayer  # noqa: E402
from kareus.runtime.overlap_tp import OverlappedTP  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402

SHAPE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128)
JOB = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4,
               num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=100),
    tp=2, pp=1, micro_batch_size=2, seq_length=32, gpus_per_node=2, nodes=1))
PARTS = Workload.build(JOB).partitions.partitions

PLANS = {
    "no overlap": {k: PartitionSetting(3, None) for k in PARTS},
    "earliest": {k: PartitionSetting(3, p.slots[0].name) for k, p in PARTS.items()},
    "middle": {k: PartitionSetting(6, p.slots[len(p.slots) // 2].name) for k, p in PARTS.items()},
    "last": {k: PartitionSetting(9, p.slots[-1].name) for k, p in PARTS.items()},
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worst_errors(layer, x, dy, parts, plans):
    """The plain layer's output and gradients, and per plan the largest relative error of
    the overlapped layer's output and gradients against them."""

    def run(plan):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = layer(xi, plan)
        y.backward(dy)
        return [y.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()]

    ref = run(None)
    worst = {}
    for name, knobs in plans.items():
        got = run(LayerPlan.from_partitions(parts, knobs))
        worst[name] = max(float(((a - b).abs().max() / b.abs().max()).item())
                          for a, b in zip(got, ref))
    return ref, worst


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layer = LlamaLayer(**SHAPE, tp_group=dist.group.WORLD, seed=3)
        x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(11))
        dy = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(12))

        _, worst = _worst_errors(layer, x, dy, PARTS, PLANS)
        torch.save(worst, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_overlapped_layer_equals_the_plain_layer_tp2(tmp_path):
    mp.spawn(_worker, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        worst = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(worst) == set(PLANS)
        for name, err in worst.items():
            assert err < 1e-5, (rank, name, err)


def test_single_process_layer_and_plan_mapping():
    layer = LlamaLayer(**SHAPE, seed=1)
    x = torch.randn(2, 16, 64, requires_grad=True)
    plan = LayerPlan.from_partitions(PARTS, PLANS["middle"])
    assert plan.launch_op("fwd_attn") == PARTS["fwd_attn"].compute_ops[
        PARTS["fwd_attn"].slots[len(PARTS["fwd_attn"].slots) // 2].op_index].name
    y_ref = layer(x)
    y = layer(x, plan)
    assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-6)


JOB_CP = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4,
               num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=100),
    tp=1, cp=2, pp=1, micro_batch_size=2, seq_length=32, gpus_per_node=2, nodes=1))
PARTS_CP = Workload.build(JOB_CP).partitions.partitions
PLANS_CP = {
    "no overlap": {k: PartitionSetting(3, None) for k in PARTS_CP},
    "earliest": {k: PartitionSetting(3, p.slots[0].name) for k, p in PARTS_CP.items()},
    "last": {k: PartitionSetting(9, p.slots[-1].name) for k, p in PARTS_CP.items()},
}


def _worker_cp(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layer = LlamaLayer(**SHAPE, tp_group=None, cp_group=dist.group.WORLD, seed=5)
        full_x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(21))
        full_dy = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(22))
        x = full_x.chunk(2, dim=1)[rank].contiguous()  # this rank's half of the sequence
        dy = full_dy.chunk(2, dim=1)[rank].contiguous()

        with _CountingCollectives() as counting:
            ref, worst = _worst_errors(layer, x, dy, PARTS_CP, PLANS_CP)
        # and the CP layer computes what one unsplit layer computes (this rank's half)
        single = LlamaLayer(**SHAPE, seed=5)
        worst["vs one GPU"] = float(((ref[0] - single(full_x).chunk(2, dim=1)[rank]).abs()
                                     .max() / ref[0].abs().max()).item())
        # the schedule Megatron-Core's CP layer runs too (one CP schedule)
        schedule = type(layer(x, LayerPlan.from_partitions(PARTS_CP, PLANS_CP["last"]))
                        .grad_fn).__name__
        torch.save((worst, counting.counts, schedule),
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_overlapped_layer_equals_the_plain_layer_cp2(tmp_path):
    assert {"fwd_qkv_ag", "bwd_a_rs", "bwd_qkv_rs"} <= set(PARTS_CP)
    mp.spawn(_worker_cp, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        worst, counts, schedule = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(worst) == {*PLANS_CP, "vs one GPU"}
        for name, err in worst.items():
            assert err < 1e-5, (rank, name, err)
        assert schedule == "OverlappedCPOpsBackward"
        # per plan the K/V's asynchronous all-gathers (forward 2, backward 2 again) and
        # the dK/dV reduce-scatters (backward 2): the rebuilt pieces gather nothing more
        assert counts == {"all_gather": 4 * len(PLANS_CP), "reduce_scatter": 2 * len(PLANS_CP)}


JOB_SP = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=64, num_layers=2, num_attention_heads=4,
               num_kv_heads=2, head_dim=16, ffn_hidden_size=128, vocab_size=100),
    tp=2, pp=1, micro_batch_size=2, seq_length=32, gpus_per_node=2, nodes=1,
    sequence_parallel=True))
PARTS_SP = Workload.build(JOB_SP).partitions.partitions
PLANS_SP = {
    "no overlap": {k: PartitionSetting(3, None) for k in PARTS_SP},
    "earliest": {k: PartitionSetting(3, p.slots[0].name) for k, p in PARTS_SP.items()},
    "middle": {k: PartitionSetting(6, p.slots[len(p.slots) // 2].name)
               for k, p in PARTS_SP.items()},
    "last": {k: PartitionSetting(9, p.slots[-1].name) for k, p in PARTS_SP.items()},
}


class _CountingCollectives:
    """Counts the asynchronous all-gathers and reduce-scatters the SP schedule issues."""

    def __init__(self) -> None:
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self._ag, self._rs = dist.all_gather_single, dist.reduce_scatter_single

    def __enter__(self):
        def ag(*a, **k):
            self.counts["all_gather"] += bool(k.get("async_op"))
            return self._ag(*a, **k)

        def rs(*a, **k):
            self.counts["reduce_scatter"] += bool(k.get("async_op"))
            return self._rs(*a, **k)

        dist.all_gather_single, dist.reduce_scatter_single = ag, rs
        return self

    def __exit__(self, *exc):
        dist.all_gather_single, dist.reduce_scatter_single = self._ag, self._rs


def _worker_sp(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layer = LlamaLayer(**SHAPE, tp_group=dist.group.WORLD, seed=7, sequence_parallel=True)
        full_x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(31))
        full_dy = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(32))
        x = full_x.chunk(2, dim=1)[rank].contiguous()  # this rank's part of the sequence
        dy = full_dy.chunk(2, dim=1)[rank].contiguous()
        with _CountingCollectives() as counting:
            ref, worst = _worst_errors(layer, x, dy, PARTS_SP, PLANS_SP)
        # the SP layer computes what the TP layer computes (this rank's part of it; the
        # norm weights' gradients are this rank's part of the sum, as in Megatron)
        tp = LlamaLayer(**SHAPE, tp_group=dist.group.WORLD, seed=7)
        xt = full_x.clone().requires_grad_(True)
        yt = tp(xt)
        yt.backward(full_dy)
        mine = lambda t: t.chunk(2, dim=1)[rank]  # noqa: E731
        norms = [p.grad.clone() for p in (layer.norm1, layer.norm2)]
        for n in norms:
            dist.all_reduce(n)
        worst["SP vs TP output"] = float(((ref[0] - mine(yt)).abs().max()
                                          / yt.abs().max()).item())
        worst["SP vs TP input grad"] = float(((ref[1] - mine(xt.grad)).abs().max()
                                              / xt.grad.abs().max()).item())
        worst["SP vs TP norm grads"] = max(
            float(((n - p.grad).abs().max() / p.grad.abs().max()).item())
            for n, p in zip(norms, (tp.norm1, tp.norm2)))
        # 4 plans' forwards and backwards, each 8 partitions' collectives (4 all-gathers,
        # 4 reduce-scatters) per pass, asynchronous
        torch.save((worst, counting.counts), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_overlapped_sp_layer_equals_the_plain_sp_and_tp_layers(tmp_path):
    """Sequence parallelism at TP=2: the overlapped schedule over the SP partitions equals
    the plain SP layer (outputs and every gradient) for plans over their slots, and the
    SP layer equals the TP layer; the schedule's collectives are asynchronous."""
    assert {"fwd_ln1_ag", "fwd_attn_rs", "bwd_mlp_ag", "bwd_attn_rs"} <= set(PARTS_SP)
    mp.spawn(_worker_sp, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        worst, counts = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(worst) == {*PLANS_SP, "SP vs TP output", "SP vs TP input grad",
                              "SP vs TP norm grads"}
        for name, err in worst.items():
            assert err < 1e-5, (rank, name, err)
        passes = 2 * len(PLANS_SP)
        assert counts == {"all_gather": 4 * passes, "reduce_scatter": 4 * passes}


# Micro-batch size 1: the sequence split (issue 37) ------------------------------------------

def _seq_plans():
    """The TP plans over the same keys and slots, splitting the sequence."""
    return {name: LayerPlan.from_partitions(PARTS, knobs, split="sequence")
            for name, knobs in PLANS.items()}


def _count_qkv(layer):
    """Counts the layer's QKV projections (``qkv_partial`` calls), forward and backward."""
    counts = {"forward": 0, "backward": 0}
    phase = ["forward"]
    inner = layer.qkv_partial

    def counting(*a, **k):
        counts[phase[0]] += 1
        return inner(*a, **k)

    layer.qkv_partial = counting
    return counts, phase


def _seq_errors(layer, x, dy):
    """Per plan and graph mode (recompute: keep_graphs False, LlamaLayer's own; kept:
    True), the largest relative error of the sequence-split overlapped layer's output and
    gradients against the unsplit plain layer, and the QKV projections per pass."""
    params = tuple(layer.parameters())

    def run(fn):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        phase[0] = "forward"
        y = fn(xi)
        phase[0] = "backward"
        y.backward(dy)
        return [y.detach(), xi.grad] + [p.grad.clone() for p in params]

    counts, phase = _count_qkv(layer)
    ref = run(layer)
    worst, qkv = {}, {}
    for name, plan in _seq_plans().items():
        for keep in (False, True):
            counts.update(forward=0, backward=0)
            got = run(lambda xi, plan=plan, keep=keep: OverlappedTP.apply(xi, layer, plan,
                                                                          keep, *params))
            worst[name, keep] = max(float(((a - b).abs().max() / b.abs().max()).item())
                                    for a, b in zip(got, ref))
            qkv[name, keep] = dict(counts)
    # LlamaLayer's own entry point runs the same (recompute)
    counts.update(forward=0, backward=0)
    got = run(lambda xi: layer(xi, _seq_plans()["middle"]))
    worst["layer(x, plan)", False] = max(float(((a - b).abs().max() / b.abs().max()).item())
                                         for a, b in zip(got, ref))
    return worst, qkv


def _worker_seq(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layer = LlamaLayer(**SHAPE, tp_group=dist.group.WORLD, seed=13)
        x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(41))
        dy = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(42))
        torch.save(_seq_errors(layer, x, dy), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sequence_split_at_micro_batch_1_equals_the_unsplit_layer_tp2(tmp_path):
    """Micro-batch 1 at TP=2: the overlapped layer splitting the sequence in halves gives
    the unsplit plain layer's output and every gradient, for plans over the slots and SMs,
    with the layer's own recompute and with the forward's graphs kept; nanobatch 1's
    attention reads nanobatch 0's kept keys and values (2 QKV projections a forward, not
    3; the backward's rebuild projects each half once more, the kept graphs none)."""
    mp.spawn(_worker_seq, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        worst, qkv = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(worst) == 2 * len(PLANS) + 1
        for case, err in worst.items():
            assert err < 1e-5, (rank, case, err)
        for (name, keep), n in qkv.items():
            assert n == {"forward": 2, "backward": 0 if keep else 2}, (name, keep, n)


@pytest.mark.parametrize("seq", [2, 6, 16])
def test_sequence_split_single_process(seq):
    """One process, short and odd-halved sequences (a half of 1 or 3 tokens): equal to
    the unsplit layer, recompute and kept graphs."""
    layer = LlamaLayer(**SHAPE, seed=17)
    x = torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(seq))
    dy = torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(seq + 1))
    worst, qkv = _seq_errors(layer, x, dy)
    assert max(worst.values()) < 1e-5, worst
    assert all(n["forward"] == 2 for n in qkv.values())


def test_sequence_split_refusals():
    """One line (SpecError) where a sequence split cannot run, before anything runs."""
    from kareus.errors import SpecError
    from kareus.runtime.overlap_cp_ops import OverlappedCPOps
    from kareus.runtime.overlap_sp import OverlappedSP

    layer = LlamaLayer(**SHAPE, seed=1)
    params = tuple(layer.parameters())
    plan = _seq_plans()["last"]
    x = torch.randn(1, 16, 64, requires_grad=True)
    with pytest.raises(SpecError, match="sequence parallelism runs no sequence split"):
        OverlappedSP.apply(x, layer, plan, False, *params)
    with pytest.raises(SpecError, match="context parallelism runs no sequence split"):
        OverlappedCPOps.apply(x, layer, plan, False, *params)
    with pytest.raises(SpecError, match=r"splits the sequence .* not 15"):
        layer(torch.randn(1, 15, 64), plan)
    with pytest.raises(SpecError, match=r"splits the batch .* not 1$"):
        layer(torch.randn(1, 16, 64), LayerPlan.from_partitions(PARTS, PLANS["last"]))

    class BatchOnly:  # a layer's ops without attn_partial_kv
        batch_dim, seq_dim = 0, 1

    with pytest.raises(SpecError, match="BatchOnly offers no attention core"):
        OverlappedTP.apply(x, BatchOnly(), plan, False)
    with pytest.raises(SpecError, match="nanobatch split 'tokens'"):
        LayerPlan.from_partitions(PARTS, PLANS["last"], split="tokens")


def test_the_planner_s_per_nanobatch_keys_set_the_collectives_of_the_computing_nanobatch(
        monkeypatch):
    """A sequence split's plan keys its attention partitions per nanobatch
    (``fwd_attn_nb1``, ``bwd_attn_nb0``, ``bwd_attn_nb1``): each collective takes the SMs
    of the partition whose compute it overlaps (backward: nanobatch 1 first); the exposed
    ones, which the planner overlaps with the next layer's first compute (nanobatch 0's
    attention forward, its MLP backward), that partition's. A batch split's plan keeps the
    plain keys."""
    from kareus.runtime import overlap_tp

    seen: list[int] = []
    real = overlap_tp.Pending

    def recording(kind, tensor, group, sms=0, groups_by_sms=None):
        seen.append(sms)
        return real(kind, tensor, group, sms, groups_by_sms)

    monkeypatch.setattr(overlap_tp, "Pending", recording)
    layer = LlamaLayer(**SHAPE, seed=3)
    params = tuple(layer.parameters())

    def run(plan, x):
        x = x.requires_grad_(True)
        OverlappedTP.apply(x, layer, plan, True, *params).backward(torch.ones_like(x))

    sms = {"fwd_attn_nb0": 12, "fwd_attn_nb1": 11, "fwd_mlp": 13, "bwd_mlp": 14, "bwd_attn_nb0": 15,
           "bwd_attn_nb1": 16}
    run(LayerPlan({k: PartitionSetting(v, None) for k, v in sms.items()}, split="sequence"),
        torch.randn(1, 8, 64))
    # forward: AR(nb0.attn) | nb1.attn, AR(nb1.attn) | nb0.mlp, AR(nb0.mlp) | nb1.mlp,
    # exposed (the next layer's nb0.attn: fwd_attn_nb0)
    # backward: AR(db1) | nb0.mlp', AR(db0) | nb1.attn', AR(da1) | nb0.attn', exposed
    # (the next layer's mlp': bwd_mlp)
    assert seen == [11, 13, 13, 12, 14, 16, 15, 14]
    seen.clear()
    # under recompute the backward's last one is paired with the next layer's recomputed
    # nb0.attn (fwd_attn_nb0)
    run(LayerPlan({k: PartitionSetting(v, None) for k, v in sms.items()}, split="sequence",
                  recompute=True), torch.randn(1, 8, 64))
    assert seen == [11, 13, 13, 12, 14, 16, 15, 12]
    seen.clear()
    plain = {"fwd_attn": 3, "fwd_mlp": 4, "bwd_mlp": 5, "bwd_attn": 6}
    run(LayerPlan({k: PartitionSetting(v, None) for k, v in plain.items()}),
        torch.randn(2, 8, 64))
    assert seen == [3, 4, 4, 3, 5, 6, 6, 5]
