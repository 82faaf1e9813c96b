"""The Kareus CP core attention for Megatron-Core (issue 36, item 1), fp32 on the CPU:

- `cp_causal_attention` over every CP rank's load-balanced queries, against the keys and
  values as the all-gather concatenates them, reassembled, is causal attention on the whole
  sequence, and so are its gradients (hypothesis over CP sizes, chunk lengths, grouped-query
  heads, batch);
- `KareusCPCoreAttention` at CP=2 over gloo (2 processes): output and the gradients of this
  rank's query, key and value equal `SDPACoreAttention` on the full sequence cut the same
  way, gathering K/V itself, and inside ``kv_gathered()`` with K/V gathered outside (where it
  gathers nothing itself);
- what it cannot run is refused in one line (SpecError); at CP=1 it is `SDPACoreAttention`.

CPU runs check numerics and wiring, never time or energy.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kareus.errors import SpecError  # noqa: E402
from kareus.integrations.megatron.cp_attention import (  # noqa: E402
    KareusCPCoreAttention,
    cp_causal_attention,
    load_balanced,
)
from tests.integrations.megatron.ranks import megatron_ranks, spawn_ranks  # noqa: E402

SEQ, BATCH, HEADS, GROUPS, D = 8, 2, 4, 2, 8


def _rel(a, b) -> float:
    return float(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())


def _full_attention(q, k, v, scale=None):
    """Causal attention on the whole sequence: [s, b, h, d] x [s, b, g, d] -> [s, b, h·d]."""
    s, b, h, d = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                         v.permute(1, 2, 0, 3), is_causal=True, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def _gathered(t, cp):
    """What all_gather_into_tensor over the CP ranks' load-balanced parts gives."""
    return torch.cat([load_balanced(t, cp, r) for r in range(cp)])


def _leaves(g, *shapes):
    return [torch.randn(*s, generator=g).requires_grad_(True) for s in shapes]


def test_load_balanced_cuts_as_megatron_lm_does():
    seq = torch.arange(8)
    assert load_balanced(seq, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced(seq, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced(seq, 1, 0) is seq
    x = torch.arange(24).reshape(2, 12)
    assert load_balanced(x, 3, 1, dim=1).tolist() == [[2, 3, 8, 9], [14, 15, 20, 21]]


@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 4), chunk=st.integers(1, 5), rest=st.integers(1, 3),
       dim=st.integers(0, 2))
def test_load_balanced_parts_reassemble_the_sequence(cp, chunk, rest, dim):
    shape = [rest, rest + 1, rest + 2]
    shape[dim] = 2 * cp * chunk
    t = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    parts = [load_balanced(t, cp, r, dim) for r in range(cp)]
    assert all(p.shape[dim] == 2 * chunk for p in parts)
    # every position exactly once
    assert sorted(torch.cat(parts, dim).flatten().tolist()) == t.flatten().tolist()
    # and back: rank r's halves are chunks r and 2cp-1-r
    chunks = [None] * (2 * cp)
    for r, p in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = p.chunk(2, dim)
    assert torch.equal(torch.cat(chunks, dim), t)


def test_load_balanced_refuses_a_sequence_it_cannot_cut():
    with pytest.raises(SpecError, match="divisible by 4, not 6"):
        load_balanced(torch.zeros(6), 2, 0)


@settings(max_examples=40, deadline=None)
@given(cp=st.sampled_from([1, 2, 3, 4]), chunk=st.integers(1, 4), batch=st.integers(1, 2),
       groups=st.integers(1, 3), per_group=st.integers(1, 3), d=st.sampled_from([4, 8]),
       scale=st.sampled_from([None, 0.25]), seed=st.integers(0, 2**16))
def test_cp_attention_over_the_ranks_is_causal_attention_on_the_sequence(
        cp, chunk, batch, groups, per_group, d, scale, seed):
    s, heads = 2 * cp * chunk, groups * per_group
    g = torch.Generator().manual_seed(seed)
    q, k, v = _leaves(g, (s, batch, heads, d), (s, batch, groups, d), (s, batch, groups, d))
    dy = torch.randn(s, batch, heads * d, generator=g)
    ref = _full_attention(q, k, v, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dy)

    kk, vv = _gathered(k, cp), _gathered(v, cp)
    outs = [cp_causal_attention(load_balanced(q, cp, r), kk, vv, cp, r, scale)
            for r in range(cp)]
    for r, out in enumerate(outs):
        assert out.shape == (2 * chunk, batch, heads * d)
        assert _rel(out, load_balanced(ref, cp, r)) < 1e-5, r
    # each rank's output gradient is its part of the whole sequence's
    loss = sum((out * load_balanced(dy, cp, r)).sum() for r, out in enumerate(outs))
    grads = torch.autograd.grad(loss, (q, k, v))
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < 1e-5


def test_a_query_chunk_sees_nothing_after_itself():
    """Rank 0 at CP=2 holds chunks 0 and 3: changing chunk 3's keys and values changes only
    chunk 3's queries; changing chunk 1's (rank 1's first) changes only chunk 3's too."""
    cp, c = 2, 2
    g = torch.Generator().manual_seed(3)
    q, k, v = (t.detach() for t in _leaves(g, (8, 1, 2, 4), (8, 1, 2, 4), (8, 1, 2, 4)))
    base = cp_causal_attention(load_balanced(q, cp, 0), _gathered(k, cp), _gathered(v, cp),
                               cp, 0)
    for chunk in (1, 3):
        k2, v2 = k.clone(), v.clone()
        k2[chunk * c:(chunk + 1) * c] += 1.0
        v2[chunk * c:(chunk + 1) * c] += 1.0
        out = cp_causal_attention(load_balanced(q, cp, 0), _gathered(k2, cp),
                                  _gathered(v2, cp), cp, 0)
        assert torch.equal(out[:c], base[:c])  # chunk 0 sees neither
        assert not torch.equal(out[c:], base[c:])  # chunk 3 sees both


def test_cp_attention_refuses_mismatched_shapes_in_one_line():
    q, kv = torch.zeros(4, 1, 2, 4), torch.zeros(6, 1, 2, 4)
    for fn in (lambda: cp_causal_attention(q, kv, kv, 2, 0),
               lambda: cp_causal_attention(torch.zeros(3, 1, 2, 4), kv, kv, 2, 0),
               lambda: cp_causal_attention(torch.zeros(4, 1, 3, 4), torch.zeros(8, 1, 2, 4),
                                           torch.zeros(8, 1, 2, 4), 2, 0)):
        with pytest.raises(SpecError) as err:
            fn()
        assert "\n" not in str(err.value)


def _config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, use_cpu_initialization=True,
                             attention_dropout=0.0, hidden_dropout=0.0, **extra)


def _causal():
    from megatron.core.transformer.enums import AttnMaskType

    return AttnMaskType.causal


def test_at_cp_1_it_is_sdpa_core_attention():
    """Outside torch.distributed (no CP group): CP size 1, SDPACoreAttention's numbers, mask
    included; no parameters."""
    from kareus.integrations.megatron.cpu import SDPACoreAttention

    cfg = _config()
    ours = KareusCPCoreAttention(cfg, 1, _causal())
    theirs = SDPACoreAttention(cfg, 1, _causal())
    assert (ours.cp, ours.cp_rank, ours.cp_group) == (1, 0, None)
    assert list(ours.parameters()) == [] and ours.state_dict() == {}
    g = torch.Generator().manual_seed(0)
    q, k, v = (t.detach() for t in _leaves(g, (SEQ, BATCH, HEADS, D), (SEQ, BATCH, GROUPS, D),
                                            (SEQ, BATCH, GROUPS, D)))
    mask = torch.rand(BATCH, 1, SEQ, SEQ, generator=g) > 0.7
    mask[..., 0] = False  # every query sees a key
    assert torch.equal(ours(q, k, v), theirs(q, k, v))
    assert torch.equal(ours(q, k, v, mask), theirs(q, k, v, mask))


@pytest.mark.parametrize("extra, match", [
    ({"attention_dropout": 0.1}, "without attention dropout"),
    ({"window_size": (4, 0)}, "sliding-window"),
    ({"softmax_type": "off-by-one"}, "vanilla softmax"),
])
def test_what_it_cannot_compute_is_refused_at_construction(extra, match):
    cfg = _config()
    for key, value in extra.items():
        setattr(cfg, key, value)
    with pytest.raises(SpecError, match=match) as err:
        KareusCPCoreAttention(cfg, 1, _causal())
    assert "\n" not in str(err.value)


# CP=2 over gloo ------------------------------------------------------------------------------


def _refusal(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _run(module, q, k, v, dq, gather=None):
    """Output and the gradients of this rank's q, k, v; ``gather``: K/V gathered outside."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    if gather is None:
        out = module(q, k, v)
    else:
        with module.kv_gathered():
            out = module(q, gather(k), gather(v))
    out.backward(dq)
    return [out.detach(), q.grad, k.grad, v.grad]


class _Gathers:
    """Counts torch.distributed.all_gather calls (the module's own gathers)."""

    def __init__(self) -> None:
        self.n, self._orig = 0, dist.all_gather

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self._orig(*args, **kwargs)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    # no RNG-tracker seed here: _layer_from_the_spec seeds it before it builds its layers
    with megatron_ranks(rank, world, port, out_dir, cp=world) as res:
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType

        from kareus.integrations.megatron.cpu import SDPACoreAttention
        from kareus.runtime.primitives import GatherSeq

        cp, group = world, parallel_state.get_context_parallel_group()
        cfg = _config(context_parallel_size=cp)
        g = torch.Generator().manual_seed(11)  # the same full sequence on every rank
        q = torch.randn(SEQ, BATCH, HEADS, D, generator=g)
        k, v = (torch.randn(SEQ, BATCH, GROUPS, D, generator=g) for _ in range(2))
        dy = torch.randn(SEQ, BATCH, HEADS * D, generator=g)
        mine = [load_balanced(t, cp, rank) for t in (q, k, v, dy)]
        for scale in (None, 0.3):
            ref_mod = SDPACoreAttention(_config(), 1, AttnMaskType.causal,
                                        softmax_scale=scale)
            ref = [load_balanced(t, cp, rank) for t in _run(ref_mod, q, k, v, dy)]
            for how, pgs in (("parallel state", None),
                             ("pg_collection", ProcessGroupCollection.use_mpu_process_groups(
                                 required_pgs=["tp", "cp"]))):
                mod = KareusCPCoreAttention(cfg, 1, AttnMaskType.causal, softmax_scale=scale,
                                            pg_collection=pgs)
                res[f"{how} {scale} cp"] = (mod.cp, mod.cp_rank)
                counter = _Gathers()
                dist.all_gather = counter
                try:
                    alone = _run(mod, *mine)
                    res[f"{how} {scale} gathers alone"] = counter.n
                    counter.n = 0
                    got = _run(mod, *mine, gather=lambda t: GatherSeq.apply(t, group, 0))
                    res[f"{how} {scale} gathers with outside"] = counter.n
                finally:
                    dist.all_gather = counter._orig
                res[f"{how} {scale} self"] = max(_rel(a, b) for a, b in zip(alone, ref))
                res[f"{how} {scale} kv_gathered"] = max(
                    _rel(a, b) for a, b in zip(got, ref))
                res[f"{how} {scale} flag after"] = mod._kv_gathered

        mod = KareusCPCoreAttention(cfg, 1, AttnMaskType.causal)
        ql, kl, vl = mine[:3]
        mask = torch.zeros(1, 1, SEQ // cp, SEQ, dtype=torch.bool)
        res["refused"] = {
            "mask": _refusal(lambda: mod(ql, kl, vl, mask)),
            "bias": _refusal(lambda: mod(ql, kl, vl, attention_bias=torch.zeros(1))),
            "packed": _refusal(lambda: mod(ql, kl, vl, packed_seq_params=object())),
            "no mask": _refusal(lambda: mod(ql, kl, vl, attn_mask_type=AttnMaskType.no_mask)),
            "padding": _refusal(lambda: KareusCPCoreAttention(cfg, 1, AttnMaskType.padding)),
            "cross": _refusal(lambda: KareusCPCoreAttention(cfg, 1, AttnMaskType.causal,
                                                            attention_type="cross")),
            "config cp 1": _refusal(lambda: KareusCPCoreAttention(_config(), 1,
                                                                  AttnMaskType.causal)),
        }
        res.update(_layer_from_the_spec(rank, group))


def _layer_from_the_spec(rank: int, group) -> dict:
    """``--spec kareus.integrations.megatron.spec layer_spec`` at CP=2, local implementation:
    the layer builds (Megatron's DotProductAttention would refuse) with the Kareus CP core
    attention and Megatron's CP=1 layer's parameters, and (no plan: Megatron's own layer
    code, RoPE on this rank's positions) runs as Megatron's CP=1 layer (core attention:
    `SDPACoreAttention`) on the full sequence: output and input gradient this rank's part of
    its, parameter gradients summed over the CP ranks its."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from kareus.integrations.megatron import spec as kspec
    from kareus.integrations.megatron.cpu import (
        SDPACoreAttention,
        rotary_embedding,
        with_core_attention,
    )

    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    plain = with_core_attention(get_gpt_layer_local_spec(), SDPACoreAttention)
    layers = {}
    for cp, spec in ((1, plain), (2, kspec.layer_spec)):
        torch.manual_seed(0)
        cfg = _config(context_parallel_size=cp, ffn_hidden_size=64, transformer_impl="local")
        layers[cp] = build_module(spec, config=cfg, layer_number=1)
    a, b = layers[1].state_dict(), layers[2].state_dict()
    out = {"spec core attention": type(layers[2].self_attention.core_attention).__name__,
           "spec cp": layers[2].self_attention.core_attention.cp,
           "spec same parameters": list(a) == list(b) and all(
               torch.equal(a[n], b[n]) for n in a if torch.is_tensor(a[n]))}
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, HEADS * D, generator=g)
    dy = torch.randn(SEQ, BATCH, HEADS * D, generator=g)
    emb = rotary_embedding(D, SEQ)
    runs = []
    for cp, xs, dys, embs in ((1, x, dy, emb), (2, *(load_balanced(t, 2, rank)
                                                     for t in (x, dy, emb)))):
        xi = xs.clone().requires_grad_(True)
        y, _ = layers[cp](xi, attention_mask=None, rotary_pos_emb=embs)
        y.backward(dys)
        grads = [p.grad.clone() for p in layers[cp].parameters()]
        if cp > 1:  # each rank's parameter gradients are its positions' part
            for t in grads:
                dist.all_reduce(t, group=group)
        runs.append([y.detach(), xi.grad, *grads])
    ref = [load_balanced(t, 2, rank) for t in runs[0][:2]] + runs[0][2:]
    out["layer worst"] = max(_rel(a, b) for a, b in zip(runs[1], ref))
    out["layer tensors"] = len(ref)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("cp_attention"))


def test_the_module_at_cp_2_equals_full_sequence_attention(results):
    for rank, res in enumerate(results):
        for how in ("parallel state", "pg_collection"):
            for scale in (None, 0.3):
                assert res[f"{how} {scale} cp"] == (2, rank)
                assert res[f"{how} {scale} self"] < 1e-5, (rank, how, scale)


def test_kv_gathered_takes_k_and_v_gathered_outside(results):
    for rank, res in enumerate(results):
        for how in ("parallel state", "pg_collection"):
            for scale in (None, 0.3):
                assert res[f"{how} {scale} kv_gathered"] < 1e-5, (rank, how, scale)
                # K and V: by the module itself, or by the caller and not again inside
                assert res[f"{how} {scale} gathers alone"] == 2
                assert res[f"{how} {scale} gathers with outside"] == 2
                assert res[f"{how} {scale} flag after"] is False


def test_what_cp_attention_cannot_run_is_refused_in_one_line(results):
    refused = results[0]["refused"]
    for what, words in (("mask", "explicit attention mask"), ("bias", "attention bias"),
                        ("packed", "packed sequences"), ("no mask", "not no_mask"),
                        ("padding", "not padding"), ("cross", "not 'cross'"),
                        ("config cp 1", "context_parallel_size is 1 but its CP process "
                                        "group has 2 ranks")):
        assert refused[what].startswith("SpecError: "), (what, refused[what])
        assert words in refused[what], (what, refused[what])
        assert "\n" not in refused[what]


def test_the_spec_builds_a_cp_layer_with_megatron_s_parameters(results):
    for res in results:
        assert res["spec core attention"] == "KareusCPCoreAttention"
        assert res["spec cp"] == 2
        assert res["spec same parameters"]


def test_a_megatron_layer_at_cp_2_equals_megatron_s_cp_1_layer(results):
    for res in results:
        assert res["layer tensors"] > 6
        assert res["layer worst"] < 1e-5
