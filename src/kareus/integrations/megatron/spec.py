"""Turning a user's Megatron-Core layer spec into a Kareus one.

Two ways, both keeping every submodule and parameter Megatron would build (the parameters,
their names, their sharding and their checkpoints are Megatron's own; docs/megatron.md):

- `kareus_layer_spec(spec)`: a spec the caller built (Megatron-Core users, who know their
  config where they build the model) with `KareusTransformerLayer` as its module;
- `layer_spec`: for Megatron-LM's ``--spec MODULE NAME``, which imports ``NAME`` from
  ``MODULE`` as it is (megatron.core.transformer.spec_utils.import_module) before any
  configuration is at hand. Its layer, `KareusConfiguredLayer`, asks Megatron's own spec
  function for its submodules when it is built, from the `TransformerConfig` it receives:
  the function and the arguments Megatron-LM's model builder (``gpt_builders.py``) passes
  it without ``--spec`` (`megatron_layer_spec`). So ``--qk-layernorm``, ``--normalization``,
  ``--transformer-impl``, ``--multi-latent-attention`` ... build what Megatron builds; the
  flags the modules read themselves (bias, gated linear units, activation, rotary
  settings) come with the config. A configuration Megatron-LM does not build from a single
  layer spec (mixture of experts, experimental attention, heterogeneous layers,
  multi-token prediction) is refused in one line naming the flag.

    --spec kareus.integrations.megatron.spec layer_spec
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from kareus.errors import SpecError
from kareus.integrations.megatron.cp_attention import KareusCPCoreAttention
from kareus.integrations.megatron.cpu import with_core_attention
from kareus.integrations.megatron.layer import KareusTransformerLayer

_NOT_ONE_SPEC = (
    ("num_moe_experts", "--num-experts (mixture of experts)"),
    ("experimental_attention_variant", "--experimental-attention-variant"),
    ("linear_attention_freq", "--linear-attention-freq"),
    ("heterogeneous_block_specs", "--heterogeneous-layers-config-path"),
    ("mtp_num_layers", "--mtp-num-layers (multi-token prediction)"),
)
"""Configurations Megatron-LM builds from a block spec (a spec per layer) or with extra
blocks, not from the one layer spec ``--spec`` gives: the field, and its flag."""


def megatron_layer_spec(config: Any) -> ModuleSpec:
    """The layer spec Megatron-LM builds for ``config`` without ``--spec``: Megatron-Core's
    own spec function for ``config.transformer_impl``, with the arguments Megatron-LM's
    builder takes from the same flags the config holds; with context parallelism, the local
    spec's core attention is `KareusCPCoreAttention` (Megatron's local `DotProductAttention`
    refuses CP; no parameters, so the checkpoint is the same). One line naming the flag for a
    configuration no single layer spec describes, or Transformer Engine's spec where
    Transformer Engine does not import."""
    for field, flag in _NOT_ONE_SPEC:
        if getattr(config, field, None):
            raise SpecError(f"the Kareus layer spec cannot build {flag}: Megatron-LM builds "
                            f"it from a spec per layer, not from --spec's one layer spec; "
                            f"build the model with kareus_layer_spec on Megatron's own "
                            f"specs (docs/megatron.md)")
    impl = getattr(config, "transformer_impl", "transformer_engine")
    common: dict[str, Any] = {
        "qk_layernorm": bool(config.qk_layernorm),
        "multi_latent_attention": bool(config.multi_latent_attention),
        "qk_l2_norm": bool(config.qk_l2_norm),
    }
    kitchen = {"use_kitchen": bool(config.use_kitchen),
               "use_kitchen_attention": bool(config.use_kitchen_attention),
               "kitchen_attention_backend": config.kitchen_attention_backend}
    if impl == "local":
        spec = get_gpt_layer_local_spec(
            moe_use_legacy_grouped_gemm=config.moe_use_legacy_grouped_gemm,
            normalization=config.normalization, **common, **kitchen)
        if (getattr(config, "context_parallel_size", 1) or 1) > 1:
            # Megatron's local DotProductAttention refuses context parallelism
            return with_core_attention(spec, KareusCPCoreAttention)
        return spec
    if impl in ("transformer_engine", "inference_optimized"):
        if not gpt_layer_specs.HAVE_TE:
            raise SpecError(f"transformer_impl={impl!r} needs Transformer Engine, which does "
                            f"not import here; use --transformer-impl local")
        if impl == "inference_optimized":
            return gpt_layer_specs.get_gpt_layer_with_inference_spec(**common)
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            moe_use_legacy_grouped_gemm=config.moe_use_legacy_grouped_gemm,
            use_te_activation_func=bool(config.use_te_activation_func), **common, **kitchen)
    raise SpecError(f"the Kareus layer spec knows no transformer_impl={impl!r}; it builds "
                    f"'local', 'transformer_engine' and 'inference_optimized'")


class KareusConfiguredLayer(KareusTransformerLayer):
    """`KareusTransformerLayer` whose submodules are Megatron's own spec's for the config
    it is built with (`megatron_layer_spec`), when its spec gives none (``layer_spec``).
    ``kareus_expect``: config fields a named spec fixes (``local_rmsnorm_layer_spec``):
    ``transformer_impl`` is taken from it, any other must agree with the config."""

    def __init__(self, config: Any, submodules: Any = None, *args: Any,
                 kareus_expect: tuple[tuple[str, Any], ...] = (), **kwargs: Any) -> None:
        if submodules is None:
            expect = dict(kareus_expect)
            for field, value in expect.items():
                if field != "transformer_impl" and getattr(config, field, None) != value:
                    raise SpecError(f"this Kareus spec builds {field}={value!r} layers but the "
                                    f"model's {field} is {getattr(config, field, None)!r}; "
                                    f"use --spec kareus.integrations.megatron.spec layer_spec")
            derived = config
            if "transformer_impl" in expect:  # a copy: the model's own config is untouched
                derived = copy.copy(config)
                derived.transformer_impl = expect["transformer_impl"]
            spec = megatron_layer_spec(derived)
            if spec.module is not TransformerLayer:
                raise SpecError(f"Megatron's spec for this config builds "
                                f"{getattr(spec.module, '__name__', spec.module)}, not its "
                                f"TransformerLayer; the Kareus layer replaces only the latter")
            submodules = spec.submodules
            kwargs = {**spec.params, **kwargs}
        super().__init__(config, submodules, *args, **kwargs)


def kareus_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a GPT layer spec of Megatron's `TransformerLayer`, e.g.
    `get_gpt_layer_local_spec()` or the Transformer Engine spec) with
    `KareusTransformerLayer` as its module; everything else is ``spec``'s own."""
    module = spec.module
    if isinstance(module, tuple):  # (module path, class name): Megatron imports it lazily
        from megatron.core.transformer.spec_utils import import_module

        module = import_module(module)
    if not (isinstance(module, type) and issubclass(module, TransformerLayer)):
        raise SpecError(f"kareus_layer_spec takes a spec of Megatron's TransformerLayer, "
                        f"not of {getattr(module, '__name__', module)!r}")
    if module is not TransformerLayer and not issubclass(module, KareusTransformerLayer):
        raise SpecError(f"kareus_layer_spec takes a spec of Megatron's own TransformerLayer; "
                        f"{module.__name__} subclasses it with a forward of its own, which "
                        f"the Kareus layer would replace")
    if module is KareusConfiguredLayer:
        return spec
    return dataclasses.replace(spec, module=KareusTransformerLayer)


def get_gpt_layer_kareus_local_spec(**kwargs: Any) -> ModuleSpec:
    """`kareus_layer_spec` of `get_gpt_layer_local_spec(**kwargs)`."""
    return kareus_layer_spec(get_gpt_layer_local_spec(**kwargs))


layer_spec = ModuleSpec(module=KareusConfiguredLayer)
"""For ``--spec kareus.integrations.megatron.spec layer_spec``: the layer Megatron-LM
would build from the model's flags (`megatron_layer_spec`), as a Kareus layer."""
local_layer_spec = ModuleSpec(
    module=KareusConfiguredLayer,
    params={"kareus_expect": (("transformer_impl", "local"), ("normalization", "LayerNorm"))})
"""Megatron's local GPT layer (LayerNorm) from the model's other flags, as a Kareus layer;
kept for command lines written before `layer_spec`."""
local_rmsnorm_layer_spec = ModuleSpec(
    module=KareusConfiguredLayer,
    params={"kareus_expect": (("transformer_impl", "local"), ("normalization", "RMSNorm"))})
"""Megatron's local GPT layer with RMSNorm (Llama, Qwen) from the model's other flags, as a
Kareus layer; kept for command lines written before `layer_spec`."""
