"""A `KareusTransformerLayer`'s ops as the overlapped schedules run them, for one call of
the layer (its attention mask, rotary embedding, ...): `MegatronLayerOps` for the TP and
SP schedules (kareus.runtime.overlap_tp, kareus.runtime.overlap_sp), `MegatronCPOps` for
the CP schedule (kareus.runtime.overlap_cp_ops).

The TP and SP schedules run each half of the layer through its own modules' forward code
(the whole ``self_attention``, the whole ``mlp``). The CP schedule cuts the attention
where CP communicates, between the QKV projection (with rotary) and the core attention,
so it cannot run Megatron's `SelfAttention.forward` as one call. `MegatronCPOps` runs
that forward's training path in two parts, with Megatron's own modules and functions:
`get_query_key_value_tensors` (the fused QKV, its split and the q/k norms) and
`apply_rotary_pos_emb`, as `Attention.forward` calls them; then the core attention (on
the key and value the schedule gathered: `KareusCPCoreAttention.kv_gathered`) and
`linear_proj`. What that forward does beyond this (inference, packed sequences, output
gates, the fused QKV-rotary kernel, activation offloading) is refused in one line
(`check_cp_attention`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from torch import Tensor

from kareus.errors import SpecError
from kareus.runtime.overlap import GroupsBySms, Taps
from kareus.runtime.pieces import Before


class KareusTransformerLayer(Protocol):
    """What the ops use of `kareus.integrations.megatron.layer.KareusTransformerLayer`
    (which builds them: a protocol here, not an import back into the layer): its Kareus
    state, and Megatron's submodules and settings by their names."""

    kareus_groups_by_sms: GroupsBySms | None
    kareus_cp_groups_by_sms: GroupsBySms | None
    _kareus_te: Any
    training: bool

    def _kareus_piece(self, before: Before, taps: Taps
                      ) -> contextlib.AbstractContextManager[None]: ...

    def __getattr__(self, name: str) -> Any:
        """Megatron's submodules (``self_attention``, ``mlp``, the norms, the bias-dropout-
        adds) and settings (``config``, ``hidden_dropout``)."""
        ...


class MegatronLayerOps:
    """`kareus.runtime.pieces.SPLayerOps` (and so `TPLayerOps`) over a
    `KareusTransformerLayer`'s own modules, for one call of the layer (its attention
    mask, rotary embedding, ...)."""

    batch_dim = 1
    seq_dim = 0
    PER_SAMPLE = ("attention_mask", "attention_bias", "padding_mask")
    """Arguments that may hold one entry per sample along their first dimension ([b, 1,
    s, s] masks, [b, s] padding): cut to the nanobatch's half (one of size 1 is shared)."""

    def __init__(self, layer: KareusTransformerLayer, kwargs: dict[str, Any],
                 batch: int) -> None:
        self.layer = layer
        self.group = layer.self_attention.linear_qkv.tp_group
        self.groups_by_sms = layer.kareus_groups_by_sms
        self.kwargs = kwargs
        self.batch = batch
        self._attn_bias: Tensor | None = None
        self._mlp_bias: Tensor | None = None
        # KAREUS-TE: the fused norms' weights, whose gradients a piece leaves partial
        self.partial_grad_params = (layer._kareus_te.partial_grad_params
                                    if layer._kareus_te is not None else [])

    def nanobatch(self, index: int) -> MegatronLayerOps:
        kw = dict(self.kwargs)
        for name in self.PER_SAMPLE:
            v = kw.get(name)
            if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == self.batch > 1:
                kw[name] = v.chunk(2, dim=0)[index]
        return MegatronLayerOps(self.layer, kw, self.batch // 2)

    def attn_norm(self, x: Tensor) -> Tensor:
        return self.layer.input_layernorm(x)

    def attn_partial(self, a: Tensor, before: Before, taps: Taps) -> Tensor:
        kw = self.kwargs
        with self.layer._kareus_piece(before, taps):
            out, self._attn_bias = self.layer.self_attention(
                a, attention_mask=kw.get("attention_mask"),
                rotary_pos_emb=kw.get("rotary_pos_emb"),
                attention_bias=kw.get("attention_bias"))
        return out

    def attn_residual(self, x: Tensor, reduced: Tensor) -> Tensor:
        return self._bias_dropout_add(self.layer.self_attn_bda, reduced, self._attn_bias, x)

    def _bias_dropout_add(self, bda_of: Any, reduced: Tensor, bias: Tensor | None,
                          residual: Tensor) -> Tensor:
        """residual + dropout(reduced + bias), by the layer's own bda submodule."""
        layer = self.layer
        bda = bda_of(layer.training, layer.config.bias_dropout_fusion)
        with layer.bias_dropout_add_exec_handler():
            return bda((reduced, bias), residual, layer.hidden_dropout)

    def mlp_norm(self, h: Tensor) -> Tensor:
        return self.layer.pre_mlp_layernorm(h)

    def mlp_partial(self, bn: Tensor, before: Before, taps: Taps) -> Tensor:
        extra = ({"padding_mask": self.kwargs["padding_mask"]}
                 if self.kwargs.get("padding_mask") is not None else {})
        with self.layer._kareus_piece(before, taps):
            out, self._mlp_bias = self.layer.mlp(bn, **extra)
        return out

    def mlp_residual(self, h: Tensor, reduced: Tensor) -> Tensor:
        return self._bias_dropout_add(self.layer.mlp_bda, reduced, self._mlp_bias, h)


CP_SUPPORTED = ("context parallelism: all-gather CP (Megatron-LM's --cp-comm-type "
                "allgather) with Kareus's CP core attention (KareusCPCoreAttention), its "
                "collectives as Kareus partitions, without sequence parallelism; or "
                "Transformer Engine's ring CP (p2p) left whole inside its attention")


def cp_size(layer: KareusTransformerLayer) -> int:
    return int(getattr(layer.config, "context_parallel_size", 1) or 1)


def runs_cp_partitions(layer: KareusTransformerLayer) -> bool:
    """Whether ``layer`` runs Kareus's CP partitions (`MegatronCPOps`): CP > 1 with a core
    attention whose key and value the schedule can gather (`KareusCPCoreAttention`). A
    core attention that does its CP communication inside (Transformer Engine's ring) is
    one compute op to the plan: the layer then runs the TP schedule."""
    core = getattr(layer.self_attention, "core_attention", None)
    return cp_size(layer) > 1 and hasattr(core, "kv_gathered")


def cut_attention_problems(layer: KareusTransformerLayer) -> list[str]:
    """What `MegatronCutOps`'s attention, cut between QKV with rotary and the core
    attention, does not reproduce of ``layer``'s (one entry each): it runs self-attention
    with Megatron's fused QKV, its split, the q/k norms and rotary, nothing else."""
    attn, cfg = layer.self_attention, layer.config
    problems = []
    if getattr(attn, "attention_type", "self") != "self":
        problems.append(f"{attn.attention_type} attention")
    for field, what in (("attention_output_gate", "attention output gates"),
                        ("fused_single_qkv_rope", "the fused QKV-rotary kernel"),
                        ("fine_grained_activation_offloading", "activation offloading"),
                        ("multi_latent_attention", "multi-latent attention"),
                        ("no_rope_freq", "per-layer no-RoPE")):
        if getattr(cfg, field, None):
            problems.append(what)
    return problems


def check_cp_attention(layer: KareusTransformerLayer, te_attention: bool) -> None:
    """One line for a CP layer (CP > 1) a plan cannot run. ``te_attention``: the layer
    runs Transformer Engine's modules (whose core attention may keep its ring CP)."""
    attn, cfg = layer.self_attention, layer.config
    core = getattr(attn, "core_attention", None)
    problems = []
    if not runs_cp_partitions(layer):
        # the CP communication the core attention was built with (Megatron gives
        # Transformer Engine's attention its layer's entry of config.cp_comm_type); a core
        # attention without one communicates nothing: it would attend to this rank's part
        # of the sequence only
        kind = getattr(core, "cp_comm_type", None)
        if not (te_attention and kind == "p2p"):
            problems.append(f"core attention {type(core).__name__} with cp_comm_type "
                            f"{kind!r}")
        if problems:
            raise SpecError(f"a Kareus plan cannot run this CP layer "
                            f"({'; '.join(problems)}); supported: {CP_SUPPORTED}")
        return
    if getattr(cfg, "sequence_parallel", False):
        problems.append("sequence parallelism")
    problems += cut_attention_problems(layer)
    if problems:
        raise SpecError(f"a Kareus CP plan cannot run this layer ({'; '.join(problems)}); "
                        f"supported: {CP_SUPPORTED}")


class MegatronCutOps(MegatronLayerOps):
    """`MegatronLayerOps` with the attention cut in three where its core attention reads
    keys and values from elsewhere: `qkv_partial` (the fused QKV, its split, the q/k norms
    and rotary), the core attention (each user's own: `MegatronCPOps.attention` on the
    CP-gathered key and value, the sequence split's on the earlier nanobatch's too,
    kareus.integrations.megatron.seq_split) and `proj_partial`."""

    def qkv_partial(self, a: Tensor, before: Before, taps: Taps
                    ) -> tuple[Tensor, Tensor, Tensor]:
        attn = self.layer.self_attention
        with self.layer._kareus_piece(before, taps):
            q, k, v = attn.get_query_key_value_tensors(a, None, split_qkv=True)
            emb = self.kwargs.get("rotary_pos_emb")
            if emb is not None:
                q_emb, k_emb = emb if isinstance(emb, tuple) else (emb, emb)
                q = self._rotary(q, q_emb)
                k = self._rotary(k, k_emb)
        taps["rope"] = (q, k)
        return q, k, v

    def _rotary(self, t: Tensor, emb: Tensor | None) -> Tensor:
        """Megatron's rotary embedding as `Attention.forward` applies it (bshd: no
        sequence lengths; its YaRN scale where the config has one)."""
        if emb is None:
            return t
        from megatron.core.transformer.attention import (
            _yarn_get_concentration_factor_from_config,
        )

        attn = self.layer.self_attention
        return apply_rotary_pos_emb(t, emb, config=attn.config, cu_seqlens=None,
                                    mscale=_yarn_get_concentration_factor_from_config(
                                        attn.config),
                                    cp_group=attn.pg_collection.cp)

    def proj_partial(self, o: Tensor, before: Before, taps: Taps) -> Tensor:
        with self.layer._kareus_piece(before, taps):
            out, self._attn_bias = self.layer.self_attention.linear_proj(o)
        return out


class MegatronCPOps(MegatronCutOps):
    """`kareus.runtime.overlap_cp_ops.CPLayerOps` over a `KareusTransformerLayer`'s own
    modules, for one call of the layer."""

    def __init__(self, layer: KareusTransformerLayer, kwargs: dict[str, Any],
                 batch: int) -> None:
        super().__init__(layer, kwargs, batch)
        self.cp_group = layer.self_attention.core_attention.cp_group
        self.cp_groups_by_sms = layer.kareus_cp_groups_by_sms

    def nanobatch(self, index: int) -> MegatronCPOps:
        half = super().nanobatch(index)
        return MegatronCPOps(self.layer, half.kwargs, half.batch)

    def attention(self, q: Tensor, k_full: Tensor, v_full: Tensor, before: Before,
                  taps: Taps) -> Tensor:
        attn = self.layer.self_attention
        core = attn.core_attention
        with self.layer._kareus_piece(before, taps), core.kv_gathered():
            out: Tensor = core(q, k_full, v_full, self.kwargs.get("attention_mask"),
                               attn_mask_type=attn.attn_mask_type,
                               attention_bias=self.kwargs.get("attention_bias"),
                               packed_seq_params=None)
        return out
