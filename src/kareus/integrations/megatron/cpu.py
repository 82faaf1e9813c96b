"""What a Megatron-Core model needs to run on the CPU (tests, the example), without
touching torch.cuda or Megatron's code:

- `SDPACoreAttention`: a core-attention submodule that computes what Megatron's
  `DotProductAttention` computes (softmax(QK^T·scale + causal mask)·V, grouped-query heads
  expanded) with `torch.nn.functional.scaled_dot_product_attention`; Megatron's allocates
  its score buffer with `device=torch.cuda.current_device()`;
- `with_core_attention(spec, cls)`: a layer spec whose core attention is ``cls``;
- `rotary_embedding(config, seq_length)`: the RoPE tensor [s, 1, 1, d] Megatron's
  `RotaryEmbedding.forward` returns, from its public `get_freqs_non_repeated` (its
  `get_emb` moves the frequencies to CUDA);
- sequence parallelism: `SequenceParallelNorm`, torch's LayerNorm/RMSNorm (what Megatron's
  `WrappedTorchNorm` builds, which refuses sequence parallelism) with its parameters marked
  `sequence_parallel` as Megatron's `FusedLayerNorm` (Apex, CUDA) and `TENorm` mark them;
  `with_norm(spec, cls)`; and `allocate_on_cpu()`: Megatron's sequence-parallel all-gather
  and reduce-scatter (tensor_parallel/mappings.py) allocate their outputs on
  ``torch.cuda.current_device()``, which a CPU build of torch has not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor


class SDPACoreAttention(torch.nn.Module):
    """Core attention by `scaled_dot_product_attention`: query [s, b, heads, d], key and
    value [s, b, groups, d] (this rank's) -> [s, b, heads·d]; causal, and/or Megatron's
    boolean mask (True: masked out); no dropout (the tests and the example run without)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", cp_comm_type: str | None = None,
                 softmax_scale: float | None = None, pg_collection: Any = None,
                 **_: Any) -> None:
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        if getattr(config, "attention_dropout", 0.0):
            raise ValueError("SDPACoreAttention runs without attention dropout")

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Tensor | None = None,
                attn_mask_type: AttnMaskType | None = None,
                attention_bias: Tensor | None = None, packed_seq_params: Any = None
                ) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention takes no attention bias or packed sequences")
        s, b, heads, d = query.shape
        groups = key.shape[2]
        if heads != groups:  # a group's query heads are contiguous
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        kind = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = kind == AttnMaskType.causal
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                 scale=self.softmax_scale)
        else:  # Megatron's mask: True where a query must not see a key ([b or 1, 1, s, s])
            allowed = ~attention_mask.bool()
            if causal:
                allowed = allowed & torch.ones(s, key.shape[0], dtype=torch.bool,
                                               device=query.device).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                 scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


def with_core_attention(spec: ModuleSpec, core_attention: type) -> ModuleSpec:
    """``spec`` (a GPT layer spec) whose self-attention uses ``core_attention``."""
    attn = spec.submodules.self_attention
    sub = dataclasses.replace(attn.submodules, core_attention=core_attention)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=dataclasses.replace(attn, submodules=sub)))


class SequenceParallelNorm:
    """``cls(config, hidden_size, eps)``: torch's LayerNorm or RMSNorm as the config says,
    its parameters marked ``sequence_parallel`` with the config (Megatron's
    `finalize_model_grads` sums their gradients over the TP group)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5,
                **_: Any) -> Any:  # a torch norm (a Module), as WrappedTorchNorm's
        kind = getattr(config, "normalization", "LayerNorm")
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(kind)
        if norm_cls is None:
            raise ValueError(f"SequenceParallelNorm runs LayerNorm or RMSNorm, not {kind}")
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        return norm


def with_norm(spec: ModuleSpec, norm: type) -> ModuleSpec:
    """``spec`` (a GPT layer spec) whose two layer norms are ``norm``."""
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm))


def allocate_on_cpu() -> None:
    """On a machine without CUDA: ``torch.cuda.current_device()`` is the CPU, so that
    Megatron's sequence-parallel collectives allocate their outputs there (nothing else
    on such a machine can use a CUDA device anyway). A no-op where CUDA is available."""
    if not torch.cuda.is_available():
        setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # noqa: B010


def rotary_embedding(kv_channels: int, seq_length: int, base: float = 10000.0) -> Tensor:
    """Megatron's rotary embedding for ``seq_length`` positions, on the CPU: [s, 1, 1, d]."""
    rope = RotaryEmbedding(kv_channels=kv_channels, rotary_percent=1.0, rotary_base=base,
                           use_cpu_initialization=True)
    freqs = rope.get_freqs_non_repeated(seq_length)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
