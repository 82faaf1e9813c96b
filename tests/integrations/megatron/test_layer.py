"""The Kareus layer in Megatron-Core (issue 22), on the CPU over gloo, 2 processes, TP=2,
fp32: its output and every parameter and input gradient equal Megatron's own
`TransformerLayer` from the same initialisation, for plans over every launch slot of every
partition, with no overlap, and under recompute (through torch's reentrant checkpoint, and
through Megatron's own block with full recompute); the tensor-parallel all-reduces all
come from the schedule (Megatron's are off while it runs); a 2-layer GPTModel trains 3 steps
with the plain spec's losses. CPU runs check numerics and wiring, never time or energy.

One spawn computes everything (Megatron takes seconds to import); the tests read its
results.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kareus.core import PartitionSetting  # noqa: E402
from kareus.job.sources import build_job  # noqa: E402
from kareus.runtime.layer_plan import LayerPlan  # noqa: E402
from kareus.workload.workload import Workload  # noqa: E402
from tests.integrations.megatron.ranks import _port, megatron_ranks, spawn_ranks  # noqa: E402,F401

HIDDEN, HEADS, GROUPS, FFN, SEQ, BATCH = 64, 4, 2, 128, 16, 4
JOB = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=HIDDEN, num_layers=2, num_attention_heads=HEADS,
               num_kv_heads=GROUPS, head_dim=HIDDEN // HEADS, ffn_hidden_size=FFN,
               vocab_size=128),
    tp=2, pp=1, micro_batch_size=BATCH, seq_length=SEQ, gpus_per_node=2, nodes=1))
PARTS = Workload.build(JOB).partitions.partitions
MOST_SLOTS = max(len(p.slots) for p in PARTS.values())
PLANS = {"no overlap": {k: PartitionSetting(3, None) for k in PARTS}}
for i in range(MOST_SLOTS):  # every slot of every key, SMs varying
    PLANS[f"slot {i}"] = {k: PartitionSetting(3 * (i + 1), p.slots[min(i, len(p.slots) - 1)]
                                              .name) for k, p in PARTS.items()}


def _config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, ffn_hidden_size=FFN, use_cpu_initialization=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, params_dtype=torch.float32, bf16=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=2, **extra)


def _specs():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from kareus.integrations.megatron.cpu import SDPACoreAttention, with_core_attention
    from kareus.integrations.megatron.spec import kareus_layer_spec

    plain = with_core_attention(get_gpt_layer_local_spec(normalization="RMSNorm"),
                                SDPACoreAttention)
    return plain, kareus_layer_spec(plain)


def _rel(a, b) -> float:
    return float(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())


class _Counter:
    """Counts torch.distributed.all_reduce calls (Megatron's and the schedule's)."""

    def __init__(self) -> None:
        self.n = 0
        self._orig = dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self._orig(*args, **kwargs)


def _layer_run(layer, x, dy, emb, checkpoint=False, mask=None):
    layer.zero_grad()
    xi = x.clone().requires_grad_(True)
    if checkpoint:  # full recompute, as Megatron's block does it (reentrant)
        out = torch.utils.checkpoint.checkpoint(
            lambda h: layer(h, attention_mask=mask, rotary_pos_emb=emb)[0], xi,
            use_reentrant=True, preserve_rng_state=False)
    else:
        out, _ = layer(xi, attention_mask=mask, rotary_pos_emb=emb)
    out.backward(dy)
    return [out.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with megatron_ranks(rank, world, port, out_dir, tp=2, seed=1234) as res:
        from megatron.core.transformer.spec_utils import build_module

        from kareus.integrations.megatron.cpu import rotary_embedding
        from kareus.integrations.megatron.layer import KareusTransformerLayer

        cfg = _config()
        plain_spec, kareus_spec = _specs()
        torch.manual_seed(0)
        plain = build_module(plain_spec, config=cfg, layer_number=1)
        torch.manual_seed(0)
        kareus = build_module(kareus_spec, config=cfg, layer_number=1)
        res["class"] = type(kareus).__name__
        res["same_names"] = ([n for n, _ in plain.named_parameters()]
                             == [n for n, _ in kareus.named_parameters()])
        res["same_params"] = all(torch.equal(a, b) for a, b in
                                 zip(plain.parameters(), kareus.parameters()))
        g = torch.Generator().manual_seed(11)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        emb = rotary_embedding(HIDDEN // HEADS, SEQ)

        counter = _Counter()
        dist.all_reduce = counter
        try:
            ref = _layer_run(plain, x, dy, emb)
            res["all_reduces_plain"] = counter.n
            counter.n = 0
            res["unset_equals_plain"] = max(_rel(a, b) for a, b in
                                            zip(_layer_run(kareus, x, dy, emb), ref))
            res["all_reduces_unset"] = counter.n
            worst = {}
            for name, knobs in PLANS.items():
                kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, knobs))
                counter.n = 0
                got = _layer_run(kareus, x, dy, emb)
                res[f"all_reduces {name}"] = counter.n
                worst[name] = max(_rel(a, b) for a, b in zip(got, ref))
            res["worst"] = worst
            # a mask per sample ([b, 1, s, s], Megatron's: True is masked out), as
            # Megatron-LM's data loader gives: each nanobatch gets its half
            mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None].repeat(
                BATCH, 1, 1, 1)
            mask[-1, :, 4:, :2] = True
            kareus.set_kareus_plan(None)
            ref_mask = _layer_run(plain, x, dy, emb, mask=mask)
            kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, PLANS["slot 1"]))
            res["mask_worst"] = max(_rel(a, b) for a, b in
                                    zip(_layer_run(kareus, x, dy, emb, mask=mask), ref_mask))
            res["mask_changes"] = _rel(ref_mask[0], ref[0]) > 1e-3
        finally:
            dist.all_reduce = counter._orig

        # recompute through torch's reentrant checkpoint: the forward runs twice (no grad,
        # then with grad), the backward uses the second run's graphs: norms run 2 x 2
        calls = []
        kareus.input_layernorm.register_forward_hook(lambda *_: calls.append(1))
        kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, PLANS["slot 1"]))
        ref_ck = _layer_run(plain, x, dy, emb, checkpoint=True)
        calls.clear()
        got = _layer_run(kareus, x, dy, emb, checkpoint=True)
        res["recompute_norm_calls"] = len(calls)
        res["recompute_worst"] = max(_rel(a, b) for a, b in zip(got, ref))
        res["recompute_plain_vs_plain"] = max(_rel(a, b) for a, b in zip(ref_ck, ref))
        res["unsplittable"] = _refusal(lambda: _layer_run(kareus, x[:, :3], dy[:, :3], emb))
        kareus.set_kareus_plan(None)

        res.update(_block_with_megatron_recompute(cfg, plain_spec, kareus_spec, x, dy, emb))
        res.update(_train_gpt(plain_spec, kareus_spec))
        res["refusals"] = _refusals(kareus_spec)
        assert isinstance(kareus, KareusTransformerLayer)


def _refusal(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _block_with_megatron_recompute(cfg, plain_spec, kareus_spec, x, dy, emb, parts=PARTS,
                                   knobs=None, **extra) -> dict:
    """Megatron's own TransformerBlock with recompute_granularity="full" (uniform, one
    layer per chunk). Its CheckpointFunction saves the CUDA RNG state, which a CPU build
    has not: Megatron's two RNG-state helpers are swapped for no-ops here (torch.cuda is
    not touched; the CPU RNG state is still saved and restored)."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    saved = mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    out = {}
    try:
        runs = {}
        for name, spec, recompute in (("plain", plain_spec, False),
                                      ("kareus", kareus_spec, True)):
            c = _config(**extra, **({"recompute_granularity": "full",
                                     "recompute_method": "uniform",
                                     "recompute_num_layers": 1} if recompute else {}))
            torch.manual_seed(1)
            block = TransformerBlock(c, TransformerBlockSubmodules(layer_specs=[spec] * 2),
                                     post_layer_norm=False)
            calls = []
            for layer in block.layers:
                layer.input_layernorm.register_forward_hook(
                    lambda *_, calls=calls: calls.append(1))
                if name == "kareus":
                    layer.set_kareus_plan(LayerPlan.from_partitions(
                        parts, knobs if knobs is not None else PLANS["slot 2"]))
            xi = x.clone().requires_grad_(True)
            y = block(xi, attention_mask=None, rotary_pos_emb=emb)
            y.backward(dy)
            runs[name] = [y.detach(), xi.grad] + [p.grad.clone() for p in block.parameters()]
            out[f"block_norm_calls_{name}"] = len(calls)
        out["block_recompute_worst"] = max(_rel(a, b) for a, b in
                                           zip(runs["kareus"], runs["plain"]))
    finally:
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved
    return out


def _train_gpt(plain_spec, kareus_spec) -> dict:
    """A 2-layer GPTModel, 3 AdamW steps, plain spec against Kareus spec with a plan.
    Learned absolute positions: Megatron's RoPE moves its frequencies to CUDA in GPTModel
    (the layer tests above run RoPE)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    losses = {}
    for name, spec in (("plain", plain_spec), ("kareus", kareus_spec)):
        torch.manual_seed(2)
        model = GPTModel(_config(), spec, vocab_size=128, max_sequence_length=SEQ,
                         position_embedding_type="learned_absolute")
        if name == "kareus":
            for layer in model.decoder.layers:
                layer.set_kareus_plan(LayerPlan.from_partitions(PARTS, PLANS["slot 3"]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, 128, (BATCH, SEQ + 1), generator=g)
        pos = torch.arange(SEQ).expand(BATCH, SEQ)
        got = []
        for _ in range(3):
            opt.zero_grad()
            loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).mean()
            loss.backward()
            opt.step()
            got.append(float(loss))
        losses[name] = got
    return {"losses": losses}


def _refusals(kareus_spec) -> dict:
    """A plan on a layer whose configuration it cannot run. Context parallelism cannot
    even be built on the CPU (its groups need more ranks), so the layer is built plain and
    its configuration then says so."""
    from megatron.core.transformer.spec_utils import build_module

    out = {}
    for what, extra in (("context parallel", {"context_parallel_size": 2}),
                        ("selective recompute", {"recompute_granularity": "selective"})):
        torch.manual_seed(0)
        layer = build_module(kareus_spec, config=_config(), layer_number=1)
        layer.config = copy.copy(layer.config)
        for key, value in extra.items():
            setattr(layer.config, key, value)
        out[what] = _refusal(lambda layer=layer: layer.set_kareus_plan(
            LayerPlan.from_partitions(PARTS, PLANS["slot 0"])))
    # Transformer Engine's fused linears cannot be built on the CPU: a module of another
    # class where Megatron's ColumnParallelLinear should be stands for one
    torch.manual_seed(0)
    layer = build_module(kareus_spec, config=_config(), layer_number=1)

    class TELayerNormColumnParallelLinear(torch.nn.Linear):
        pass

    layer.self_attention.linear_qkv = TELayerNormColumnParallelLinear(HIDDEN, HIDDEN)
    out["transformer engine"] = _refusal(lambda: layer.set_kareus_plan(
        LayerPlan.from_partitions(PARTS, PLANS["slot 0"])))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("megatron"))


def test_the_kareus_spec_builds_megatron_s_own_parameters(results):
    for res in results:
        assert res["class"] == "KareusTransformerLayer"
        assert res["same_names"] and res["same_params"]


def test_without_a_plan_the_layer_is_megatron_s(results):
    for res in results:
        assert res["unset_equals_plain"] == 0.0
        assert res["all_reduces_unset"] == res["all_reduces_plain"] == 4


def test_every_plan_equals_megatron_s_layer(results):
    assert len(PLANS) >= 4  # no overlap, and every slot index
    for rank, res in enumerate(results):
        assert set(res["worst"]) == set(PLANS)
        for name, err in res["worst"].items():
            assert err < 1e-5, (rank, name, err)
            # the schedule's 4 all-reduces per nanobatch, Megatron's own off
            assert res[f"all_reduces {name}"] == 8, (name, res[f"all_reduces {name}"])


def test_a_mask_per_sample_is_cut_with_the_batch(results):
    for res in results:
        assert res["mask_changes"]  # the mask matters to the output
        assert res["mask_worst"] < 1e-5


def test_recompute_equals_and_computes_nothing_twice(results):
    for res in results:
        assert res["recompute_plain_vs_plain"] == 0.0
        assert res["recompute_worst"] < 1e-5
        assert res["recompute_norm_calls"] == 4  # 2 nanobatches x (forward, recompute)


def test_megatron_s_block_with_full_recompute(results):
    for res in results:
        assert res["block_recompute_worst"] < 1e-5
        assert res["block_norm_calls_plain"] == 2  # 2 layers, no recompute
        assert res["block_norm_calls_kareus"] == 8  # 2 layers x 2 nanobatches x 2 passes


def test_a_gpt_model_trains_with_the_plain_losses(results):
    for res in results:
        plain, kareus = res["losses"]["plain"], res["losses"]["kareus"]
        assert plain[-1] < plain[0]
        assert kareus == pytest.approx(plain, rel=1e-5)


def test_unsupported_configurations_are_refused_in_one_line(results):
    for res in results:
        te = res["refusals"].pop("transformer engine")
        assert te.startswith("SpecError: a Kareus plan cannot run on this layer "
                             "(linear_qkv is TELayerNormColumnParallelLinear"), te
        assert "Transformer Engine" in te and "\n" not in te
        # CP with a core attention that gathers nothing: neither Kareus's CP attention nor
        # Transformer Engine's ring
        cp = res["refusals"].pop("context parallel")
        assert cp.startswith("SpecError: a Kareus plan cannot run this CP layer (core "
                             "attention SDPACoreAttention"), cp
        assert "KareusCPCoreAttention" in cp and "\n" not in cp
        for what, msg in res["refusals"].items():
            assert msg.startswith("SpecError: a Kareus plan cannot run with"), (what, msg)
            assert ("supported: tensor parallelism with or without sequence parallelism"
                    in msg)
            assert "\n" not in msg
        assert "even size" in results[0]["unsplittable"]


# Sequence parallelism -------------------------------------------------------------------------

JOB_SP = build_job(overrides=dict(
    model=dict(name="tiny", hidden_size=HIDDEN, num_layers=2, num_attention_heads=HEADS,
               num_kv_heads=GROUPS, head_dim=HIDDEN // HEADS, ffn_hidden_size=FFN,
               vocab_size=128),
    tp=2, pp=1, micro_batch_size=BATCH, seq_length=SEQ, gpus_per_node=2, nodes=1,
    sequence_parallel=True))
PARTS_SP = Workload.build(JOB_SP).partitions.partitions
PLANS_SP = {"no overlap": {k: PartitionSetting(3, None) for k in PARTS_SP}}
for i in range(max(len(p.slots) for p in PARTS_SP.values())):
    PLANS_SP[f"slot {i}"] = {k: PartitionSetting(2 * (i + 1),
                                                 p.slots[min(i, len(p.slots) - 1)].name)
                             for k, p in PARTS_SP.items()}


def _sp_specs():
    """Megatron's local spec with the SP-capable CPU norm (Megatron's WrappedTorchNorm
    refuses sequence parallelism; its FusedLayerNorm needs Apex and CUDA)."""
    from kareus.integrations.megatron.cpu import SequenceParallelNorm, with_norm
    from kareus.integrations.megatron.spec import kareus_layer_spec

    plain = with_norm(_specs()[0], SequenceParallelNorm)
    return plain, kareus_layer_spec(plain)


class _SPCounter:
    """Counts the sequence all-gathers and reduce-scatters: Megatron's (its mappings'
    and its linears', blocking) and the schedule's (torch.distributed, asynchronous)."""

    def __init__(self) -> None:
        from megatron.core.tensor_parallel import layers, mappings

        self.modules = (mappings, layers)
        self.megatron = 0
        self.schedule = 0
        self._saved = [(m.dist_all_gather_func, m.dist_reduce_scatter_func)
                       for m in self.modules]
        self._torch = (dist.all_gather_single, dist.reduce_scatter_single)

    def _megatron(self, fn):
        def call(*a, **k):
            self.megatron += 1
            return fn(*a, **k)
        return call

    def _schedule(self, fn):
        def call(*a, **k):
            self.schedule += bool(k.get("async_op"))
            return fn(*a, **k)
        return call

    def __enter__(self):
        for m, (ag, rs) in zip(self.modules, self._saved):
            m.dist_all_gather_func = self._megatron(ag)
            m.dist_reduce_scatter_func = self._megatron(rs)
        tag, trs = self._torch
        dist.all_gather_single = self._schedule(tag)
        dist.reduce_scatter_single = self._schedule(trs)
        return self

    def __exit__(self, *exc):
        for m, (ag, rs) in zip(self.modules, self._saved):
            m.dist_all_gather_func, m.dist_reduce_scatter_func = ag, rs
        dist.all_gather_single, dist.reduce_scatter_single = self._torch

    def take(self) -> tuple[int, int]:
        got = (self.megatron, self.schedule)
        self.megatron = self.schedule = 0
        return got


def _finalized_norm_grads(layer) -> list:
    """The gradients of the parameters marked sequence_parallel, summed over the TP group
    as Megatron's finalize_model_grads sums them."""
    out = []
    for p in layer.parameters():
        if getattr(p, "sequence_parallel", False):
            g = p.grad.clone()
            dist.all_reduce(g)
            out.append(g)
    return out


def _worker_sp(rank: int, world: int, port: int, out_dir: str) -> None:
    with megatron_ranks(rank, world, port, out_dir, tp=2, seed=1234,
                        cpu_allocation=True) as res:
        from megatron.core.transformer.spec_utils import build_module

        from kareus.integrations.megatron.cpu import rotary_embedding

        cfg = _config(sequence_parallel=True)
        plain_spec, kareus_spec = _sp_specs()
        torch.manual_seed(0)
        plain = build_module(plain_spec, config=cfg, layer_number=1)
        torch.manual_seed(0)
        kareus = build_module(kareus_spec, config=cfg, layer_number=1)
        marked = lambda layer: [n for n, p in layer.named_parameters()  # noqa: E731
                                if getattr(p, "sequence_parallel", False)]
        res["marked"] = (marked(plain), marked(kareus))
        g = torch.Generator().manual_seed(11)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).chunk(2, dim=0)[rank].contiguous()
        dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g).chunk(2, dim=0)[rank].contiguous()
        emb = rotary_embedding(HIDDEN // HEADS, SEQ)
        with _SPCounter() as counter:
            ref = _layer_run(plain, x, dy, emb)
            ref_norms = _finalized_norm_grads(plain)
            res["collectives plain"] = counter.take()
            worst = {}
            for name, knobs in PLANS_SP.items():
                kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS_SP, knobs))
                got = _layer_run(kareus, x, dy, emb)
                res[f"collectives {name}"] = counter.take()
                worst[name] = max(_rel(a, b) for a, b in zip(got, ref))
            worst["finalized norm grads"] = max(
                _rel(a, b) for a, b in zip(_finalized_norm_grads(kareus), ref_norms))
            res["worst"] = worst
            # full recompute (reentrant checkpoint): forward, re-run, backward; the
            # backward uses the re-run's graphs
            ref_ck = _layer_run(plain, x, dy, emb, checkpoint=True)
            counter.take()
            res["recompute_worst"] = max(_rel(a, b) for a, b in zip(
                _layer_run(kareus, x, dy, emb, checkpoint=True), ref_ck))
            res["collectives recompute"] = counter.take()
        kareus.set_kareus_plan(None)
        res["unset_equals_plain"] = max(_rel(a, b) for a, b in
                                        zip(_layer_run(kareus, x, dy, emb), ref))
        res.update(_block_with_megatron_recompute(
            cfg, plain_spec, kareus_spec, x, dy, emb, PARTS_SP, PLANS_SP["slot 1"],
            sequence_parallel=True))


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    return spawn_ranks(_worker_sp, 2, tmp_path_factory.mktemp("megatron_sp"))


def test_sequence_parallel_plans_equal_megatron_s_sp_layer(sp_results):
    """TP=2 with sequence parallelism: for plans over every slot of every SP partition,
    the output and every gradient equal Megatron's own SP layer's, and so do the norm
    gradients Megatron's finalize_model_grads sums; the sequence all-gathers and
    reduce-scatters all come from the schedule (8 per pass, asynchronous), Megatron's
    own are off (10 per layer: forward 2 all-gathers and 2 reduce-scatters; backward
    the all-gathers of the two output gradients and of the two inputs again for the
    weight gradients, and 2 reduce-scatters)."""
    assert len(PLANS_SP) >= 4
    for rank, res in enumerate(sp_results):
        assert res["collectives plain"] == (10, 0)
        assert set(res["worst"]) == {*PLANS_SP, "finalized norm grads"}
        for name, err in res["worst"].items():
            assert err < 1e-5, (rank, name, err)
        for name in PLANS_SP:
            assert res[f"collectives {name}"] == (0, 16), name


def test_sequence_parallel_norms_are_marked_as_megatron_marks_them(sp_results):
    for res in sp_results:
        plain, kareus = res["marked"]
        assert plain == kareus == ["input_layernorm.weight", "pre_mlp_layernorm.weight"]


def test_sequence_parallel_full_recompute_communicates_nothing_a_third_time(sp_results):
    for res in sp_results:
        assert res["recompute_worst"] < 1e-5
        # the forward (no grad) and its re-run: 8 each; the backward: 8
        assert res["collectives recompute"] == (0, 24)


def test_sequence_parallel_in_megatron_s_block_with_full_recompute(sp_results):
    for res in sp_results:
        assert res["block_recompute_worst"] < 1e-5
        assert res["block_norm_calls_kareus"] == 8  # 2 layers x 2 nanobatches x 2 passes


def test_sequence_parallel_without_a_plan_is_megatron_s(sp_results):
    for res in sp_results:
        assert res["unset_equals_plain"] == 0.0
