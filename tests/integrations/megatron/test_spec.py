"""The Kareus layer spec builds the model Megatron would have built (issue 35, item 1): a
GPTModel (RoPE, as Llama and Qwen3 have it) built with ``layer_spec`` (what
``--spec kareus.integrations.megatron.spec layer_spec`` hands Megatron-LM) and one built with
Megatron's own spec function called with the same flags, from the same seed, have the same
state-dict keys, shapes and values, and the same module class at every name (but the layer's
own). Flags no single layer spec describes are refused in one line naming them.

One spawned process (gloo, TP=1: building needs Megatron's parallel state) builds all models;
the tests read its results. Building is all this needs: nothing runs on CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.nn.functional as F  # noqa: E402

from tests.integrations.megatron.ranks import megatron_ranks, spawn_ranks  # noqa: E402

COMMON = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
              use_cpu_initialization=True, params_dtype=torch.float32,
              transformer_impl="local")
FLAGS = {
    # Llama: RMSNorm, SwiGLU, no biases, grouped-query attention, RoPE
    "llama": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, num_query_groups=2),
    # Qwen3: Llama's, and --qk-layernorm
    "qwen3": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, num_query_groups=2, qk_layernorm=True),
    # GPT: LayerNorm, biases, GeLU
    "gpt": dict(normalization="LayerNorm", add_bias_linear=True),
}


def _refusal(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _model(cfg, spec):
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(7)
    return GPTModel(cfg, spec, vocab_size=128, max_sequence_length=16,
                    position_embedding_type="rope", rotary_base=1000000)


def _compare(cfg, megatron_spec, kareus_spec) -> dict:
    a, b = _model(cfg, megatron_spec), _model(cfg, kareus_spec)
    sa, sb = a.state_dict(), b.state_dict()
    types_a = {n: type(m).__name__ for n, m in a.named_modules()}
    types_b = {n: type(m).__name__ for n, m in b.named_modules()}
    layers = {n for n, t in types_b.items() if t == "KareusConfiguredLayer"}
    return {
        "keys": list(sa) == list(sb),
        "shapes": all(getattr(sa[k], "shape", None) == getattr(sb[k], "shape", None)
                      for k in sa),
        "values": all(torch.equal(sa[k], sb[k]) for k in sa if torch.is_tensor(sa[k])),
        "types": {n: t for n, t in types_a.items() if n not in layers} ==
                 {n: t for n, t in types_b.items() if n not in layers},
        "layers": len(layers),
        "qk_norm_keys": sorted(k for k in sb if "q_layernorm" in k or "k_layernorm" in k),
        "n_keys": len(sb),
    }


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with megatron_ranks(rank, world, port, out_dir, tp=1, seed=1234) as res:
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import import_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        from kareus.integrations.megatron import spec as kspec

        res["have_te"] = gpt_layer_specs.HAVE_TE
        # what Megatron-LM's --spec MODULE NAME calls
        res["imported"] = (import_module(("kareus.integrations.megatron.spec", "layer_spec"))
                           is kspec.layer_spec)
        for name, flags in FLAGS.items():
            cfg = TransformerConfig(**COMMON, **flags)
            # what Megatron-LM's builder calls without --spec (local implementation)
            own = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm,
                                           normalization=cfg.normalization)
            res[name] = _compare(cfg, own, kspec.layer_spec)
            named = (kspec.local_rmsnorm_layer_spec if cfg.normalization == "RMSNorm"
                     else kspec.local_layer_spec)
            res[f"{name} named"] = _compare(cfg, own, named)
        # the named specs fix the local implementation: a config asking for TE's (Megatron's
        # default) still gets what the name says, with the config's other flags
        cfg = TransformerConfig(**{**COMMON, "transformer_impl": "transformer_engine"},
                                **FLAGS["qwen3"])
        own = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        res["named te config"] = _compare(cfg, own, kspec.local_rmsnorm_layer_spec)
        res["te config unchanged"] = cfg.transformer_impl
        res["refused"] = {
            "moe": _refusal(lambda: _model(TransformerConfig(
                **COMMON, **FLAGS["llama"], num_moe_experts=4), kspec.layer_spec)),
            "mtp": _refusal(lambda: _model(TransformerConfig(
                **COMMON, **FLAGS["llama"], mtp_num_layers=1), kspec.layer_spec)),
            "wrong norm": _refusal(lambda: _model(TransformerConfig(
                **COMMON, **FLAGS["gpt"]), kspec.local_rmsnorm_layer_spec)),
        }
        if not gpt_layer_specs.HAVE_TE:
            res["refused"]["te"] = _refusal(lambda: _model(TransformerConfig(
                **{**COMMON, "transformer_impl": "transformer_engine"}, **FLAGS["llama"]),
                kspec.layer_spec))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, 1, tmp_path_factory.mktemp("spec"))[0]


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_layer_spec_builds_megatron_s_model_from_the_flags(results, name):
    for key in (name, f"{name} named"):
        got = results[key]
        assert got["keys"] and got["shapes"] and got["values"] and got["types"], (key, got)
        assert got["layers"] == 2
        assert got["n_keys"] > 10


def test_megatron_s_import_module_finds_layer_spec(results):
    assert results["imported"]


def test_qk_layernorm_gives_q_and_k_norm_weights(results):
    """The issue's repro: with --qk-layernorm the static spec built IdentityOp q/k norms."""
    want = [f"decoder.layers.{i}.self_attention.{w}_layernorm.weight"
            for i in (0, 1) for w in "kq"]
    assert results["qwen3"]["qk_norm_keys"] == want
    assert results["qwen3 named"]["qk_norm_keys"] == want
    assert results["llama"]["qk_norm_keys"] == []


def test_named_specs_fix_the_local_implementation(results):
    got = results["named te config"]
    assert got["keys"] and got["values"] and got["types"]
    assert results["te config unchanged"] == "transformer_engine"


def test_what_no_layer_spec_describes_is_refused_in_one_line(results):
    refused = results["refused"]
    for what, flag in (("moe", "--num-experts"), ("mtp", "--mtp-num-layers")):
        assert refused[what].startswith(f"SpecError: the Kareus layer spec cannot build "
                                        f"{flag}"), refused[what]
    assert "normalization='RMSNorm'" in refused["wrong norm"]
    assert "'LayerNorm'" in refused["wrong norm"]
    if not results["have_te"]:
        assert refused["te"].startswith("SpecError: transformer_impl='transformer_engine' "
                                        "needs Transformer Engine"), refused["te"]
    for msg in refused.values():
        assert "\n" not in msg


def test_the_local_spec_under_context_parallelism_has_the_kareus_cp_attention():
    """Megatron's local DotProductAttention refuses CP ("only supported by
    TEDotProductAttention"): under CP the local spec's core attention is the Kareus one
    (no parameters: the same checkpoint), everything else Megatron's; without CP, Megatron's.
    (Building a CP layer from it: tests/integrations/megatron/test_cp_attention.py.)"""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus.integrations.megatron.cp_attention import KareusCPCoreAttention
    from kareus.integrations.megatron.spec import megatron_layer_spec

    def attention(spec):
        return spec.submodules.self_attention.submodules

    for cp, want in ((1, DotProductAttention), (2, KareusCPCoreAttention)):
        cfg = TransformerConfig(**COMMON, **FLAGS["llama"], context_parallel_size=cp)
        got = megatron_layer_spec(cfg)
        assert attention(got).core_attention is want
        own = get_gpt_layer_local_spec(normalization="RMSNorm")
        assert attention(got).linear_qkv is attention(own).linear_qkv
        assert got.submodules.mlp == own.submodules.mlp
