"""Turning a user's Megatron-Core layer spec into a Kareus one.

`kareus_layer_spec(spec)` keeps every submodule and parameter of ``spec`` and only changes
the layer class to `KareusTransformerLayer`: the parameters, their names, their sharding
and their checkpoints are Megatron's own. The module-level specs are for Megatron-LM's
``--spec MODULE NAME`` option, which imports ``NAME`` from ``MODULE`` as it is
(megatron.core.transformer.spec_utils.import_module), so they are `ModuleSpec` objects,
not functions (docs/megatron.md):

    --spec kareus.integrations.megatron.spec local_layer_spec          # LayerNorm
    --spec kareus.integrations.megatron.spec local_rmsnorm_layer_spec  # RMSNorm (Llama)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from kareus.errors import SpecError
from kareus.integrations.megatron.layer import KareusTransformerLayer


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
    if module is not TransformerLayer and module is not KareusTransformerLayer:
        raise SpecError(f"kareus_layer_spec takes a spec of Megatron's own TransformerLayer; "
                        f"{module.__name__} subclasses it with a forward of its own, which "
                        f"the Kareus layer would replace")
    return dataclasses.replace(spec, module=KareusTransformerLayer)


def get_gpt_layer_kareus_local_spec(**kwargs: Any) -> ModuleSpec:
    """`kareus_layer_spec` of `get_gpt_layer_local_spec(**kwargs)`."""
    return kareus_layer_spec(get_gpt_layer_local_spec(**kwargs))


local_layer_spec = get_gpt_layer_kareus_local_spec()
"""Megatron's local GPT layer (LayerNorm) as a Kareus layer, for ``--spec``."""
local_rmsnorm_layer_spec = get_gpt_layer_kareus_local_spec(normalization="RMSNorm")
"""Megatron's local GPT layer with RMSNorm (Llama, Qwen) as a Kareus layer, for
``--spec``."""
