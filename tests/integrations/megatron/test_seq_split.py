"""The sequence split in Megatron-Core (issue 37), on the CPU over gloo, 2 processes, TP=2,
fp32: a `KareusTransformerLayer` at micro-batch size 1 splits the sequence into two
nanobatches, nanobatch 1's attention reading nanobatch 0's kept key and value; its output
and every parameter and input gradient equal Megatron's own unsplit layer's for plans over
every slot of the TP keys (SMs varying), with no overlap and with mixed slots, with and
without full recompute (torch's reentrant checkpoint; Megatron's block with full
recompute; the schedule's own rebuild, ``keep_graphs`` False), with an explicit attention
mask, and at micro-batch 2 when the split is chosen. The plans use the TP partitions of
the same job at micro-batch 2 (the same slots; the planner's per-nanobatch keys of the
micro-batch-1 job fall back to them; tests/integrations/megatron/test_example.py and
test_seq_split_te.py run those keys). CPU runs check numerics and wiring, never time or
energy.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402

from kareus.core import PartitionSetting  # noqa: E402
from kareus.runtime.layer_plan import LayerPlan  # noqa: E402
from tests.integrations.megatron.ranks import megatron_ranks, spawn_ranks  # noqa: E402
from tests.integrations.megatron.test_layer import (  # noqa: E402
    HEADS,
    HIDDEN,
    PARTS,
    PLANS,
    SEQ,
    _block_with_megatron_recompute,
    _config,
    _Counter,
    _layer_run,
    _refusal,
    _rel,
    _specs,
)

SEQ_PLANS = dict(PLANS)
SEQ_PLANS["mixed"] = {k: PartitionSetting(5 if k.startswith("fwd") else 9,
                                          p.slots[-1 if k.startswith("fwd") else 0].name)
                      for k, p in PARTS.items()}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with megatron_ranks(rank, world, port, out_dir, tp=2, seed=1234) as res:
        from megatron.core.transformer.spec_utils import build_module

        from kareus.integrations.megatron.cpu import rotary_embedding
        from kareus.integrations.megatron.seq_split import MegatronSeqOps
        from kareus.runtime.overlap_tp import OverlappedTP

        cfg = _config()
        plain_spec, kareus_spec = _specs()
        torch.manual_seed(0)
        plain = build_module(plain_spec, config=cfg, layer_number=1)
        torch.manual_seed(0)
        kareus = build_module(kareus_spec, config=cfg, layer_number=1)
        g = torch.Generator().manual_seed(11)
        x = torch.randn(SEQ, 2, HIDDEN, generator=g)
        dy = torch.randn(SEQ, 2, HIDDEN, generator=g)
        x1, dy1 = x[:, :1].contiguous(), dy[:, :1].contiguous()
        emb = rotary_embedding(HIDDEN // HEADS, SEQ)
        qkv_calls = []
        kareus.self_attention.linear_qkv.register_forward_hook(
            lambda *_: qkv_calls.append(1))

        counter = _Counter()
        dist.all_reduce = counter
        try:
            ref = _layer_run(plain, x1, dy1, emb)
            worst = {}
            for name, knobs in SEQ_PLANS.items():
                kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, knobs))
                counter.n = 0
                qkv_calls.clear()
                got = _layer_run(kareus, x1, dy1, emb)
                res[f"all_reduces {name}"] = counter.n
                res[f"qkv_calls {name}"] = len(qkv_calls)
                worst[name] = max(_rel(a, b) for a, b in zip(got, ref))
            res["worst"] = worst
        finally:
            dist.all_reduce = counter._orig

        # the split matters: nanobatch 1 without nanobatch 0's keys would differ
        res["halves_differ"] = _rel(plain(x1[SEQ // 2:], rotary_pos_emb=emb[SEQ // 2:])[0],
                                    ref[0][SEQ // 2:]) > 1e-3

        # full recompute through torch's reentrant checkpoint, two plans
        ref_ck = _layer_run(plain, x1, dy1, emb, checkpoint=True)
        res["recompute_worst"] = {}
        for name in ("slot 1", "mixed"):
            kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, SEQ_PLANS[name]))
            res["recompute_worst"][name] = max(
                _rel(a, b) for a, b in zip(_layer_run(kareus, x1, dy1, emb, checkpoint=True),
                                           ref_ck))

        # the schedule's own rebuild (keep_graphs False: LlamaLayer's recompute mode)
        kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, SEQ_PLANS["slot 3"]))
        kareus.zero_grad()
        xi = x1.clone().requires_grad_(True)
        params = [p for p in kareus.parameters() if p.requires_grad]
        out = OverlappedTP.apply(
            xi, MegatronSeqOps(kareus, {"rotary_pos_emb": emb}, 1),
            dataclasses.replace(kareus.kareus_plan, split="sequence"), False, *params)
        out.backward(dy1)
        got = [out.detach(), xi.grad] + [p.grad.clone() for p in kareus.parameters()]
        res["rebuild_worst"] = max(_rel(a, b) for a, b in zip(got, ref))

        # Megatron's boolean mask ([1, 1, s, s], True: masked out), causal plus more
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
        mask[..., SEQ - 3:, 1:4] = True
        ref_mask = _layer_run(plain, x1, dy1, emb, mask=mask)
        kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, SEQ_PLANS["slot 2"]))
        res["mask_worst"] = max(_rel(a, b) for a, b in
                                zip(_layer_run(kareus, x1, dy1, emb, mask=mask), ref_mask))
        res["mask_changes"] = _rel(ref_mask[0], ref[0]) > 1e-3

        # micro-batch 2 with the sequence split chosen (the job's nanobatch_split)
        ref2 = _layer_run(plain, x, dy, emb)
        kareus.kareus_nanobatch_split = "sequence"
        res["batch2_worst"] = max(_rel(a, b) for a, b in
                                  zip(_layer_run(kareus, x, dy, emb), ref2))
        kareus.kareus_nanobatch_split = None

        res["odd"] = _refusal(lambda: _layer_run(kareus, x1[:SEQ - 1], dy1[:SEQ - 1],
                                                 emb[:SEQ - 1]))
        res["refusals"] = _refusals(kareus_spec, x1, dy1, emb)
        kareus.set_kareus_plan(None)
        res.update(_block_with_megatron_recompute(cfg, plain_spec, kareus_spec, x1, dy1, emb))


def _refusals(kareus_spec, x, dy, emb) -> dict:
    """The sequence split with context or sequence parallelism: one line each (neither can
    be built at TP=2 on 2 CPU ranks with a split that applies, so a TP layer is told it
    has them)."""
    from megatron.core.transformer.spec_utils import build_module

    out = {}
    for what in ("context parallel", "sequence parallel"):
        torch.manual_seed(0)
        layer = build_module(kareus_spec, config=_config(), layer_number=1)
        layer.set_kareus_plan(LayerPlan.from_partitions(PARTS, SEQ_PLANS["slot 0"]))
        if what == "context parallel":
            layer.config = copy.copy(layer.config)
            layer.config.context_parallel_size = 2
        else:
            layer.self_attention.linear_qkv.sequence_parallel = True
        out[what] = _refusal(lambda layer=layer: _layer_run(layer, x, dy, emb))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("megatron_seq"))


def test_every_plan_at_micro_batch_1_equals_megatron_s_unsplit_layer(results):
    assert len(SEQ_PLANS) >= 5  # no overlap, every slot index, mixed
    for rank, res in enumerate(results):
        assert res["halves_differ"]
        assert set(res["worst"]) == set(SEQ_PLANS)
        for name, err in res["worst"].items():
            assert err < 1e-5, (rank, name, err)
            # the schedule's 4 all-reduces per nanobatch and pass, Megatron's own off
            assert res[f"all_reduces {name}"] == 8, name
            # nanobatch 0's key and value are kept, not computed again for nanobatch 1
            assert res[f"qkv_calls {name}"] == 2, name


def test_full_recompute_equals_the_unsplit_layer(results):
    for res in results:
        for name, err in res["recompute_worst"].items():
            assert err < 1e-5, (name, err)
        assert res["rebuild_worst"] < 1e-5
        assert res["block_recompute_worst"] < 1e-5
        assert res["block_norm_calls_kareus"] == 8  # 2 layers x 2 nanobatches x 2 passes


def test_an_attention_mask_is_cut_per_nanobatch(results):
    for res in results:
        assert res["mask_changes"]
        assert res["mask_worst"] < 1e-5


def test_the_sequence_split_when_the_job_chooses_it_at_micro_batch_2(results):
    for res in results:
        assert res["batch2_worst"] < 1e-5


def test_what_the_sequence_split_cannot_run_is_refused_in_one_line(results):
    for res in results:
        assert res["odd"] == ("SpecError: the partitioned overlap splits the sequence "
                              "(dimension 0) into two nanobatches: it needs an even size, "
                              f"not {SEQ - 1}")
        for what, msg in res["refusals"].items():
            assert msg.startswith("SpecError: a Kareus plan cannot split the sequence into "
                                  "nanobatches with "), (what, msg)
            assert what.split()[0] in msg and "\n" not in msg


def test_attention_the_cut_does_not_reproduce_is_refused_in_one_line():
    """The sequence split runs Megatron's attention cut in three (`MegatronCutOps`): an
    output gate or per-layer no-RoPE would otherwise run a different layer silently."""
    from types import SimpleNamespace

    from kareus.errors import SpecError
    from kareus.integrations.megatron.layer import KareusTransformerLayer

    def layer(**cfg):
        attention = SimpleNamespace(attention_type="self",
                                    linear_qkv=SimpleNamespace(sequence_parallel=False))
        return SimpleNamespace(config=SimpleNamespace(context_parallel_size=1, **cfg),
                               self_attention=attention)

    KareusTransformerLayer._check_sequence_split(layer())  # plain TP: runs
    for cfg, what in (({"attention_output_gate": True}, "attention output gates"),
                      ({"no_rope_freq": [1, 1]}, "per-layer no-RoPE")):
        with pytest.raises(SpecError) as err:
            KareusTransformerLayer._check_sequence_split(layer(**cfg))
        assert what in str(err.value) and "\n" not in str(err.value)


def test_megatron_s_softmax_takes_the_shifted_mask_for_nanobatch_1():
    """Megatron's local attention keeps the softmax's built mask type (causal), whose fused
    kernel asserts as many keys as queries; for nanobatch 1 it is switched to arbitrary (and
    back), and the softmax then gives the unsplit causal softmax's last rows. The fused
    kernel itself needs CUDA: here the softmax's torch path."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from kareus.integrations.megatron.seq_split import softmax_mask_type

    softmax = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False,
                                    attention_mask_func, True, None)
    core = type("Core", (), {"scale_mask_softmax": softmax})()
    scores = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    whole = softmax(scores, torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None])
    shifted = torch.ones(4, 8, dtype=torch.bool).triu(5)[None, None]
    with softmax_mask_type(core, AttnMaskType.arbitrary):
        assert softmax.attn_mask_type == AttnMaskType.arbitrary
        half = softmax(scores[:, :, 4:], shifted)
    assert softmax.attn_mask_type == AttnMaskType.causal
    assert torch.allclose(half, whole[:, :, 4:], atol=1e-6)
    with softmax_mask_type(object(), AttnMaskType.arbitrary):  # no softmax of its own
        pass
