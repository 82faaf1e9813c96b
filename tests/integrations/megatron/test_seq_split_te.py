"""The sequence split on Megatron's Transformer Engine spec (issue 37), on the CPU over gloo,
2 processes, TP=2, fp32, micro-batch size 1, with the TE stand-ins (te_standin.py: TE's
linears, and its `DotProductAttention` with TE 2.11's mask types; TE does not import
without CUDA). With a plan of the micro-batch-1 job (its per-nanobatch attention keys), the
Kareus layer's output and every parameter and input gradient equal the same stand-in
layer's unsplit forward and backward, for plans over every slot with the SMs differing by
nanobatch, with and without full recompute (torch's reentrant checkpoint; Megatron's block
with full recompute). Nanobatch 1's TE attention gets ``causal_bottom_right`` and no mask
(an explicit mask would send TE to its unfused backend); a mask the layer is called with
is passed on cut to the half's rows, and each half then computes what the unsplit layer
computes, whether TE ignores that mask (its flash and cuDNN backends) or adds it to the
causal one (its unfused backend). Nothing here runs TE's kernels, NCCL or a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from kareus.core import PartitionSetting  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.runtime.layer_plan import LayerPlan  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402
from tests.integrations.megatron.ranks import megatron_ranks, spawn_ranks  # noqa: E402
from tests.integrations.megatron.te_standin import te_attention  # noqa: E402
from tests.integrations.megatron.test_layer import (  # noqa: E402
    FFN,
    GROUPS,
    HEADS,
    HIDDEN,
    SEQ,
    _block_with_megatron_recompute,
    _Counter,
    _layer_run,
    _refusal,
    _rel,
)
from tests.integrations.megatron.test_te import FLAGS, _config  # noqa: E402

JOB = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=HIDDEN, num_layers=2, num_attention_heads=HEADS,
               num_kv_heads=GROUPS, head_dim=HIDDEN // HEADS, ffn_hidden_size=FFN,
               vocab_size=128),
    tp=2, pp=1, micro_batch_size=1, seq_length=SEQ, gpus_per_node=2, nodes=1))
PARTS = Workload.build(JOB).partitions.partitions
PLANS = {"no overlap": {k: PartitionSetting(3, None) for k in PARTS}}
for _i in range(max(len(p.slots) for p in PARTS.values())):  # every slot, SMs by nanobatch
    PLANS[f"slot {_i}"] = {k: PartitionSetting(3 * (_i + 1) + 2 * k.endswith("nb1"),
                                               p.slots[min(_i, len(p.slots) - 1)].name)
                           for k, p in PARTS.items()}


def _record(calls: list):
    """A forward pre-hook on the core attention: (query rows, key rows, mask type, mask)."""
    def hook(module, args, kwargs):
        mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
        calls.append((args[0].shape[0], args[1].shape[0], kwargs.get("attn_mask_type"),
                      None if mask is None else mask.clone()))
    return hook


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with megatron_ranks(rank, world, port, out_dir, tp=2, seed=1234) as res:
        from megatron.core.transformer.spec_utils import build_module

        from kareus.integrations.megatron.cpu import rotary_embedding
        from kareus.integrations.megatron.spec import kareus_layer_spec
        from tests.integrations.megatron.te_standin import TEDotProductAttention, te_spec

        plain_spec = te_spec(TEDotProductAttention)
        kareus_spec = kareus_layer_spec(plain_spec)
        g = torch.Generator().manual_seed(11)
        x = torch.randn(SEQ, 1, HIDDEN, generator=g)
        dy = torch.randn(SEQ, 1, HIDDEN, generator=g)
        emb = rotary_embedding(HIDDEN // HEADS, SEQ)
        for name, flags in FLAGS.items():
            cfg = _config(**flags)
            torch.manual_seed(0)
            plain = build_module(plain_spec, config=cfg, layer_number=1)
            torch.manual_seed(0)
            kareus = build_module(kareus_spec, config=cfg, layer_number=1)
            calls: list = []
            kareus.self_attention.core_attention.register_forward_pre_hook(
                _record(calls), with_kwargs=True)
            counter = _Counter()
            dist.all_reduce = counter
            out: dict = {}
            try:
                ref = _layer_run(plain, x, dy, emb)
                worst, counts = {}, {}
                for plan_name, knobs in PLANS.items():
                    kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, knobs))
                    counter.n = 0
                    calls.clear()
                    got = _layer_run(kareus, x, dy, emb)
                    counts[plan_name] = counter.n
                    worst[plan_name] = max(_rel(a, b) for a, b in zip(got, ref))
                    out[f"calls {plan_name}"] = [(*c[:3], c[3] is None) for c in calls]
            finally:
                dist.all_reduce = counter._orig
            out["worst"], out["all_reduces"] = worst, counts
            # full recompute through torch's reentrant checkpoint
            ref_ck = _layer_run(plain, x, dy, emb, checkpoint=True)
            out["recompute_worst"] = {}
            for plan_name in ("slot 1", "slot 4"):
                kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, PLANS[plan_name]))
                out["recompute_worst"][plan_name] = max(
                    _rel(a, b) for a, b in
                    zip(_layer_run(kareus, x, dy, emb, checkpoint=True), ref_ck))
            if name == "llama":
                out.update(_with_a_mask(plain, kareus, calls, x, dy, emb, ref))
                core = kareus.self_attention.core_attention
                core.te_forward_mask_type = False
                out["old_te"] = _refusal(lambda k=kareus: _layer_run(k, x, dy, emb))
                core.te_forward_mask_type = True
            kareus.set_kareus_plan(None)
            res[name] = out
        # Megatron's block with full recompute (test_layer's config: the llama flags)
        res.update(_block_with_megatron_recompute(
            None, plain_spec, kareus_spec, x, dy, emb, parts=PARTS, knobs=PLANS["slot 2"],
            bias_dropout_fusion=False))


def _with_a_mask(plain, kareus, calls, x, dy, emb, ref) -> dict:
    """Megatron's boolean mask ([1, 1, s, s], True: masked out), causal plus more, under
    both of TE's readings of a mask given with a causal type."""
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    mask[..., SEQ - 3:, 1:4] = True
    out: dict = {"mask": mask}
    kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, PLANS["slot 2"]))
    for reading in ("ignored", "added"):
        for layer in (plain, kareus):
            layer.self_attention.core_attention.mask_with_causal = reading
        ref_mask = _layer_run(plain, x, dy, emb, mask=mask)
        calls.clear()
        got = _layer_run(kareus, x, dy, emb, mask=mask)
        out[f"mask_worst {reading}"] = max(_rel(a, b) for a, b in zip(got, ref_mask))
        out[f"mask_changes {reading}"] = _rel(ref_mask[0], ref[0]) > 1e-3
        out[f"mask_calls {reading}"] = calls[:2]
    for layer in (plain, kareus):
        layer.self_attention.core_attention.mask_with_causal = "ignored"
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("megatron_seq_te"))


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_every_plan_at_micro_batch_1_equals_the_unsplit_te_layer(results, flags):
    assert len(PLANS) >= 4 and {"fwd_attn_nb1", "bwd_attn_nb1"} <= set(PARTS)
    for rank, res in enumerate(results):
        got = res[flags]
        assert set(got["worst"]) == set(PLANS)
        for plan, err in got["worst"].items():
            assert err < 1e-5, (rank, flags, plan, err)
            # the schedule's 4 per nanobatch and pass, one for the fused norms' weights
            assert got["all_reduces"][plan] == 9, (plan, got["all_reduces"][plan])
        for plan, err in got["recompute_worst"].items():
            assert err < 1e-5, (rank, flags, plan, err)


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_nanobatch_1_s_te_attention_is_bottom_right_causal_without_a_mask(results, flags):
    """Nanobatch 0: its 8 queries against its 8 keys, "causal" as the unsplit layer's;
    nanobatch 1: its 8 queries against all 16 keys, ``causal_bottom_right`` and no mask
    tensor (TE's fused backends run it; an "arbitrary" mask would not)."""
    half = SEQ // 2
    for res in results:
        for plan in PLANS:
            assert res[flags][f"calls {plan}"] == [
                (half, half, AttnMaskType.causal, True),
                (half, SEQ, AttnMaskType.causal_bottom_right, True)], plan


def test_full_recompute_through_megatron_s_block_equals_the_unsplit_te_block(results):
    for res in results:
        assert res["block_recompute_worst"] < 1e-5
        # the identity norm pieces (the TE spec fuses the norms into QKV and FC1): 2 layers
        # x 2 nanobatches x 2 passes (the forward, and its re-run in the backward)
        assert res["block_norm_calls_kareus"] == 8


@pytest.mark.parametrize("reading", ["ignored", "added"])
def test_a_mask_reaches_each_half_as_the_unsplit_te_layer_passes_it(results, reading):
    """The layer's mask, cut to the half's rows, with the half's causal type (not folded
    into an arbitrary mask): whether TE ignores it (flash, cuDNN) or adds it (unfused),
    each half computes its rows of the unsplit layer."""
    half = SEQ // 2
    for res in results:
        got, mask = res["llama"], res["llama"]["mask"]
        assert got[f"mask_worst {reading}"] < 1e-5, (reading, got[f"mask_worst {reading}"])
        assert got[f"mask_changes {reading}"] == (reading == "added")
        (q0, k0, kind0, m0), (q1, k1, kind1, m1) = got[f"mask_calls {reading}"]
        assert (q0, k0, kind0) == (half, half, AttnMaskType.causal)
        assert (q1, k1, kind1) == (half, SEQ, AttnMaskType.causal_bottom_right)
        assert torch.equal(m0, mask[..., :half, :half])
        assert torch.equal(m1, mask[..., half:, :])


def test_transformer_engine_without_a_mask_type_per_call_is_refused_in_one_line(results):
    for res in results:
        msg = res["llama"]["old_te"]
        assert msg.startswith("SpecError: a Kareus plan splitting the sequence needs "
                              "Transformer Engine 0.12 or later"), msg
        assert "\n" not in msg


# The stand-in's mask types (TE 2.11's get_full_mask) ------------------------------------


def _qkv(sq: int, skv: int):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(sq, 2, 4, 8, generator=g), torch.randn(skv, 2, 2, 8, generator=g),
            torch.randn(skv, 2, 2, 8, generator=g))


def test_te_causal_is_top_left_and_causal_bottom_right_is_the_unsplit_rows():
    """With fewer queries than keys TE's "causal" aligns the diagonal to the top left (the
    queries see the first keys) and "causal_bottom_right" to the bottom right: the last
    rows of the square causal attention."""
    q, k, v = _qkv(16, 16)
    full = te_attention(q, k, v, None, AttnMaskType.causal)
    last = te_attention(q[8:], k, v, None, AttnMaskType.causal_bottom_right)
    assert _rel(last, full[8:]) < 1e-6
    top_left = te_attention(q[8:], k, v, None, AttnMaskType.causal)
    assert _rel(top_left, te_attention(q[8:], k[:8], v[:8], None, AttnMaskType.causal)) < 1e-6
    assert _rel(top_left, full[8:]) > 1e-2
    # square: the two alignments agree; no_mask sees every key
    assert torch.equal(full, te_attention(q, k, v, None, AttnMaskType.causal_bottom_right))
    assert _rel(te_attention(q, k, v, None, AttnMaskType.no_mask), full) > 1e-2


def test_te_reads_a_mask_only_with_arbitrary_unless_its_unfused_backend_adds_it():
    q, k, v = _qkv(8, 16)
    mask = torch.zeros(1, 1, 8, 16, dtype=torch.bool)
    mask[..., :, 10:12] = True
    plain = te_attention(q, k, v, None, AttnMaskType.causal_bottom_right)
    assert torch.equal(te_attention(q, k, v, mask, AttnMaskType.causal_bottom_right), plain)
    added = te_attention(q, k, v, mask, AttnMaskType.causal_bottom_right,
                         mask_with_causal="added")
    shifted = torch.ones(8, 16, dtype=torch.bool).triu(9)[None, None]
    assert _rel(added, te_attention(q, k, v, mask | shifted, AttnMaskType.arbitrary)) < 1e-6
    assert _rel(plain, te_attention(q, k, v, shifted, AttnMaskType.arbitrary)) < 1e-6


@pytest.mark.parametrize("kind", [AttnMaskType.padding, AttnMaskType.padding_causal])
def test_te_mask_types_the_stand_in_does_not_implement_are_refused(kind):
    q, k, v = _qkv(8, 8)
    with pytest.raises(ValueError, match="not " + kind.name):
        te_attention(q, k, v, torch.zeros(2, 1, 1, 8, dtype=torch.bool), kind)
    with pytest.raises(ValueError, match="needs an attention mask"):
        te_attention(q, k, v, None, AttnMaskType.arbitrary)
