"""The Kareus layer on Megatron's Transformer Engine spec (issue 35, item 3), on the CPU over
gloo, 2 processes, TP=2, fp32, with a stand-in for TE's linears (te_standin.py: TE does not
import without CUDA; the stand-in has exactly the attributes and semantics the adapter
relies on, from TE 2.11's sources). With a plan, the layer's output and every parameter and
input gradient equal the same stand-in layer's own communicating forward and backward, for
every slot; its fused norms' weight gradients are summed (one all-reduce per layer
backward); TE's own all-reduces are off while a piece runs. With sequence parallelism the
same against the stand-in's own SP layer (the fused norms' weight gradients are then each
rank's share, which Megatron's finalize_model_grads sums). What a plan cannot run on TE's
modules is refused in one line. Nothing here says anything about TE's kernels on a GPU
(scripts/gpu_check.py --megatron-te does).
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kareus.runtime.layer_plan import LayerPlan  # noqa: E402
from tests.integrations.megatron.ranks import megatron_ranks, spawn_ranks  # noqa: E402
from tests.integrations.megatron.test_layer import (  # noqa: E402
    BATCH,
    FFN,
    GROUPS,
    HEADS,
    HIDDEN,
    PARTS,
    PARTS_SP,
    PLANS,
    PLANS_SP,
    SEQ,
    _Counter,
    _layer_run,
    _refusal,
    _rel,
)

FLAGS = {
    "llama": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False),
    "gpt": dict(normalization="LayerNorm", add_bias_linear=True),
}


def _config(**flags):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, use_cpu_initialization=True, params_dtype=torch.float32,
        bf16=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=2,
        bias_dropout_fusion=False, **flags)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with megatron_ranks(rank, world, port, out_dir, tp=2, seed=1234) as res:
        from megatron.core.transformer.spec_utils import build_module

        from kareus.integrations.megatron import te
        from kareus.integrations.megatron.cpu import SDPACoreAttention, rotary_embedding
        from kareus.integrations.megatron.spec import kareus_layer_spec
        from tests.integrations.megatron.te_standin import te_spec

        plain_spec = te_spec(SDPACoreAttention)
        kareus_spec = kareus_layer_spec(plain_spec)
        for name, flags in FLAGS.items():
            cfg = _config(**flags)
            torch.manual_seed(0)
            plain = build_module(plain_spec, config=cfg, layer_number=1)
            torch.manual_seed(0)
            kareus = build_module(kareus_spec, config=cfg, layer_number=1)
            g = torch.Generator().manual_seed(11)
            x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
            dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
            emb = rotary_embedding(HIDDEN // HEADS, SEQ)
            counter = _Counter()
            dist.all_reduce = counter
            out: dict = {"names": [n for n, _ in kareus.named_parameters()]}
            try:
                ref = _layer_run(plain, x, dy, emb)
                out["all_reduces_plain"] = counter.n
                counter.n = 0
                out["unset"] = max(_rel(a, b) for a, b in
                                   zip(_layer_run(kareus, x, dy, emb), ref))
                out["all_reduces_unset"] = counter.n
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, PLANS["slot 0"]))
                out["warnings"] = [str(w.message) for w in caught]
                worst, counts = {}, {}
                for plan_name, knobs in PLANS.items():
                    kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS, knobs))
                    counter.n = 0
                    got = _layer_run(kareus, x, dy, emb)
                    counts[plan_name] = counter.n
                    worst[plan_name] = max(_rel(a, b) for a, b in zip(got, ref))
                    modes = [m.parallel_mode for _, m, _ in kareus._kareus_te.linears]
                out["worst"], out["counts"], out["modes_after"] = worst, counts, modes
                # the fused norms' weight gradients: the same on both ranks, Megatron's
                ln = [p.grad.clone() for n, p in kareus.named_parameters()
                      if "layer_norm_" in n]
                gathered = [[torch.empty_like(t) for _ in range(world)] for t in ln]
                for t, parts in zip(ln, gathered):
                    dist.all_gather(parts, t)
                out["ln_same_on_ranks"] = all(torch.equal(p[0], p[1]) for p in gathered)
                out["n_ln"] = len(ln)
                # full recompute through torch's reentrant checkpoint
                counter.n = 0
                out["recompute"] = max(_rel(a, b) for a, b in zip(
                    _layer_run(kareus, x, dy, emb, checkpoint=True), ref))
            finally:
                dist.all_reduce = counter._orig
            kareus.set_kareus_plan(None)
            res[name] = out
        res["refusals"] = _refusals(kareus_spec, build_module, te)


def _refusals(kareus_spec, build_module, te) -> dict:
    out = {}

    def layer():
        torch.manual_seed(0)
        return build_module(kareus_spec, config=_config(**FLAGS["gpt"]), layer_number=1)

    plan = LayerPlan.from_partitions(PARTS, PLANS["slot 0"])
    for what, extra in (("fp8", {"fp8": "e4m3"}), ("tp_comm_overlap", {"tp_comm_overlap": True})):
        lay = layer()
        lay.config = copy.copy(lay.config)
        for key, value in extra.items():
            setattr(lay.config, key, value)
        out[what] = _refusal(lambda lay=lay: lay.set_kareus_plan(plan))
    lay = layer()
    lay.self_attention.linear_proj.apply_bias = True  # skip_bias_add=False
    out["row bias"] = _refusal(lambda: lay.set_kareus_plan(plan))
    lay = layer()
    lay.mlp.linear_fc1.ub_overlap_ag_fprop = True
    out["userbuffers"] = _refusal(lambda: lay.set_kareus_plan(plan))
    lay = layer()
    lay.mlp.linear_fc2.parallel_mode = None  # a TE linear Megatron built without TP comm
    out["mode"] = _refusal(lambda: lay.set_kareus_plan(plan))
    out["not_run_line"] = te.NOT_RUN_ON_GPU
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("megatron_te"))


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_without_a_plan_the_te_layer_is_megatron_s(results, flags):
    for res in results:
        got = res[flags]
        assert got["unset"] == 0.0
        assert got["all_reduces_unset"] == got["all_reduces_plain"] == 4


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_every_plan_equals_the_te_layer(results, flags):
    for rank, res in enumerate(results):
        got = res[flags]
        assert set(got["worst"]) == set(PLANS)
        for plan, err in got["worst"].items():
            assert err < 1e-5, (rank, flags, plan, err)
            # the schedule's 4 per nanobatch, and one for the fused norms' weights
            assert got["counts"][plan] == 9, (plan, got["counts"][plan])
        assert got["modes_after"] == ["column", "row", "column", "row"]  # restored
        assert got["recompute"] < 1e-5


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_fused_norm_weight_gradients_are_summed(results, flags):
    """Without the sum each rank's norm weights would get its own part of the gradient
    (TE's LayerNormLinear runs the norm's backward on the all-reduced gradient)."""
    want = 4 if flags == "gpt" else 2  # weight (and bias for LayerNorm) of QKV and FC1
    for res in results:
        assert res[flags]["n_ln"] == want
        assert res[flags]["ln_same_on_ranks"]
    names = results[0][flags]["names"]
    assert "self_attention.linear_qkv.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)


def test_the_te_path_warns_once_that_it_has_not_run_on_a_gpu(results):
    line = results[0]["refusals"]["not_run_line"]
    assert "not run on a GPU" in line and "--megatron-te" in line and "\n" not in line
    assert results[0]["llama"]["warnings"] == [line]  # the first TE layer with a plan
    assert results[0]["gpt"]["warnings"] == []  # once per process


def test_what_a_plan_cannot_run_on_te_is_refused_in_one_line(results):
    refusals = dict(results[0]["refusals"])
    refusals.pop("not_run_line")
    assert "FP8" in refusals["fp8"]
    assert "TP communication overlap" in refusals["tp_comm_overlap"]
    assert "linear_proj adds its bias after its all-reduce" in refusals["row bias"]
    assert "linear_fc1 uses userbuffers (ub_overlap_ag_fprop)" in refusals["userbuffers"]
    assert "linear_fc2 has parallel_mode=None, not 'row'" in refusals["mode"]
    for what, msg in refusals.items():
        assert msg.startswith("SpecError: a Kareus plan cannot run"), (what, msg)
        assert "\n" not in msg


# Sequence parallelism -------------------------------------------------------------------------


class _Collectives:
    """Counts the sequence all-gathers and reduce-scatters: the stand-in's (blocking, as
    TE's are within a GEMM's call) and the schedule's (asynchronous)."""

    NAMES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_single",
             "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.blocking = self.asynchronous = 0
        self._saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def _wrap(self, fn):
        def call(*a, **k):
            if k.get("async_op"):
                self.asynchronous += 1
            else:
                self.blocking += 1
            return fn(*a, **k)
        return call

    def __enter__(self):
        for n, fn in self._saved.items():
            setattr(dist, n, self._wrap(fn))
        return self

    def __exit__(self, *exc):
        for n, fn in self._saved.items():
            setattr(dist, n, fn)

    def take(self) -> tuple[int, int]:
        got = (self.blocking, self.asynchronous)
        self.blocking = self.asynchronous = 0
        return got


def _sp_compare(layer, got, ref, ref_sums) -> float:
    """The largest relative error of ``got`` (output, input gradient, parameter
    gradients) against ``ref``: parameters marked ``sequence_parallel`` compared after
    the sum over the TP group Megatron's finalize_model_grads does (`ref_sums`); per rank,
    their shares differ (the fused norm sees the whole sequence with a partial gradient
    in one, its shard with the full gradient in the other)."""
    params = list(layer.parameters())
    worst = max(_rel(a, b) for a, b in zip(got[:2], ref[:2]))
    for p, a, b in zip(params, got[2:], ref[2:]):
        if not getattr(p, "sequence_parallel", False):
            worst = max(worst, _rel(a, b))
    return max([worst] + [_rel(a, b) for a, b in zip(_sums(layer, got), ref_sums)])


def _sums(layer, run) -> list:
    """The gradients (of a `_layer_run`) of the parameters marked ``sequence_parallel``,
    summed over the TP group."""
    out = []
    for p, g in zip(layer.parameters(), run[2:]):
        if getattr(p, "sequence_parallel", False):
            g = g.clone()
            dist.all_reduce(g)
            out.append(g)
    return out


def _worker_sp(rank: int, world: int, port: int, out_dir: str) -> None:
    with megatron_ranks(rank, world, port, out_dir, tp=2, seed=1234,
                        cpu_allocation=True) as res:
        from megatron.core.transformer.spec_utils import build_module

        from kareus.integrations.megatron.cpu import SDPACoreAttention, rotary_embedding
        from kareus.integrations.megatron.spec import kareus_layer_spec
        from tests.integrations.megatron.te_standin import te_spec

        plain_spec = te_spec(SDPACoreAttention)
        kareus_spec = kareus_layer_spec(plain_spec)
        for name, flags in FLAGS.items():
            cfg = _config(sequence_parallel=True, **flags)
            torch.manual_seed(0)
            plain = build_module(plain_spec, config=cfg, layer_number=1)
            torch.manual_seed(0)
            kareus = build_module(kareus_spec, config=cfg, layer_number=1)
            g = torch.Generator().manual_seed(11)
            x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).chunk(2, dim=0)[rank].contiguous()
            dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g).chunk(2, dim=0)[rank].contiguous()
            emb = rotary_embedding(HIDDEN // HEADS, SEQ)
            out: dict = {"marked": [n for n, p in kareus.named_parameters()
                                    if getattr(p, "sequence_parallel", False)]}
            with _Collectives() as counter:
                ref = _layer_run(plain, x, dy, emb)
                ref_sums = _sums(plain, ref)
                out["collectives plain"] = counter.take()
                worst, counts = {}, {}
                for plan_name, knobs in PLANS_SP.items():
                    kareus.set_kareus_plan(LayerPlan.from_partitions(PARTS_SP, knobs))
                    got = _layer_run(kareus, x, dy, emb)
                    counts[plan_name] = counter.take()
                    worst[plan_name] = _sp_compare(kareus, got, ref, ref_sums)
                out["worst"], out["counts"] = worst, counts
                out["partial_grad_params"] = len(kareus._kareus_te.partial_grad_params)
                # the fused norms' weight gradients: this rank's share and the full one
                ln = [(n, p.grad.clone()) for n, p in kareus.named_parameters()
                      if "layer_norm_" in n]
                out["ln_share"] = {n: t for n, t in ln}
                full = {}
                for n, t in ln:
                    t = t.clone()
                    dist.all_reduce(t)
                    full[n] = t
                out["ln_full"] = full
                ref_named = dict(zip([n for n, _ in plain.named_parameters()], ref[2:]))
                plain_full = {}
                for n, _ in ln:
                    t = ref_named[n].clone()
                    dist.all_reduce(t)
                    plain_full[n] = t
                out["ln_full_plain"] = plain_full
                # full recompute through torch's reentrant checkpoint: nothing a third time
                ref_ck = _layer_run(plain, x, dy, emb, checkpoint=True)
                counter.take()
                got = _layer_run(kareus, x, dy, emb, checkpoint=True)
                out["recompute"] = _sp_compare(kareus, got, ref_ck, _sums(plain, ref_ck))
                out["collectives recompute"] = counter.take()
            kareus.set_kareus_plan(None)
            out["unset"] = max(_rel(a, b) for a, b in
                               zip(_layer_run(kareus, x, dy, emb), ref))
            res[name] = out


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    return spawn_ranks(_worker_sp, 2, tmp_path_factory.mktemp("megatron_te_sp"))


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_sequence_parallel_plans_equal_the_te_sp_layer(sp_results, flags):
    """TP=2 with sequence parallelism on the TE spec: for plans over every slot of every
    SP partition, with and without full recompute, the output, the input gradient and
    every parameter gradient equal the stand-in's own communicating SP layer's (the
    parameters marked ``sequence_parallel`` after Megatron's sum over the TP group).
    The stand-in's own gathers and scatters are off while a piece runs (the plain layer
    has 10: forward 2 all-gathers and 2 reduce-scatters; backward the columns' input
    all-gathers for their weight gradients and input-gradient reduce-scatters, the rows'
    output-gradient all-gathers); the schedule's are 8 per pass."""
    assert len(PLANS_SP) >= 4
    for rank, res in enumerate(sp_results):
        got = res[flags]
        assert got["collectives plain"] == (10, 0)
        assert set(got["worst"]) == set(PLANS_SP)
        for plan, err in got["worst"].items():
            assert err < 1e-5, (rank, flags, plan, err)
            assert got["counts"][plan] == (0, 16), (plan, got["counts"][plan])
        assert got["recompute"] < 1e-5, (rank, flags, got["recompute"])
        # the forward (no grad) and its re-run: 8 each; the backward: 8
        assert got["collectives recompute"] == (0, 24)
        assert got["unset"] == 0.0


@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_sequence_parallel_fused_norm_weight_gradients_are_shares(sp_results, flags):
    """Under SP each rank's fused-norm weight gradient is its share: the ranks' differ,
    and their sum over the TP group (what Megatron's finalize_model_grads does for the
    parameters TE marks ``sequence_parallel``) is the full gradient. Summing them in the
    layer as well (as without SP, where nothing else sums them) would count them twice."""
    want = {"self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"}
    if flags == "gpt":
        want |= {"self_attention.linear_qkv.layer_norm_bias",
                 "mlp.linear_fc1.layer_norm_bias"}
    r0, r1 = (res[flags] for res in sp_results)
    assert set(r0["ln_share"]) == want
    assert want <= set(r0["marked"])
    assert r0["partial_grad_params"] == 0
    for n in want:
        share0, share1 = r0["ln_share"][n], r1["ln_share"][n]
        assert _rel(share0, share1) > 1e-3, n  # not already summed
        assert _rel(share0 + share1, r0["ln_full_plain"][n]) < 1e-5, n
        assert torch.equal(r0["ln_full"][n], r1["ln_full"][n])
