"""Context-parallel core attention for Megatron-Core, as the Kareus artifact runs CP
(all-gather mode), on any device torch's ``scaled_dot_product_attention`` runs on.

Megatron's local `DotProductAttention` refuses context parallelism ("only supported by
TEDotProductAttention"), and Transformer Engine does not run on a CPU. This is the
``core_attention`` submodule a layer spec swaps in instead (no parameters: checkpoints do not
change):

- each CP rank holds the load-balanced sequence chunks ``r`` and ``2·cp−1−r`` of ``2·cp``
  equal ones (`load_balanced`; Megatron-LM's ``get_batch_on_this_cp_rank`` cuts the batch
  so);
- K and V are all-gathered over the CP group before attention (rank-major, as
  ``all_gather_into_tensor`` concatenates them), dK and dV reduce-scattered back in the
  backward: by the module itself (synchronous), or by an overlapped schedule that gathers
  them at the plan's slot and runs the module inside `KareusCPCoreAttention.kv_gathered`;
- `cp_causal_attention`: each query chunk attends to the key chunks before it fully and to
  its own causally, nothing after (exact per chunk pair), so the numbers are those of CP=1
  causal attention on the full sequence.

At CP size 1 the module is `SDPACoreAttention`, so one spec serves every layer of a model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from kareus.errors import SpecError
from kareus.integrations.megatron.cpu import SDPACoreAttention
from kareus.runtime.primitives import GatherSeq, rank_in, world_size


def load_balanced(t: Tensor, cp: int, cp_rank: int, dim: int = 0) -> Tensor:
    """This CP rank's part of a full sequence as Megatron-LM's get_batch_on_this_cp_rank
    cuts it: the sequence in 2*cp equal chunks, rank r keeps chunks r and 2*cp-1-r,
    concatenated in that order. cp=1: t itself."""
    if cp == 1:
        return t
    if not 0 <= cp_rank < cp:
        raise SpecError(f"CP rank {cp_rank} is not in a CP group of {cp}")
    s = t.shape[dim]
    if s % (2 * cp):
        raise SpecError(f"context parallelism over {cp} ranks needs a sequence length "
                        f"divisible by {2 * cp}, not {s}")
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]), dim=dim)


def _natural_order(t: Tensor, cp: int) -> Tensor:
    """[cp·s_l, ...] as the all-gather concatenates the ranks' load-balanced parts (rank j:
    chunks j, 2cp−1−j) -> the same chunks in sequence order 0 .. 2cp−1."""
    parts = t.unflatten(0, (cp, 2, t.shape[0] // (2 * cp)))
    return torch.cat((parts[:, 0], parts[:, 1].flip(0)), dim=0).flatten(0, 1)


def cp_causal_attention(query: Tensor, key: Tensor, value: Tensor, cp: int, cp_rank: int,
                        scale: float | None = None) -> Tensor:
    """Causal attention of this rank's queries [s_l, b, heads, d] (its load-balanced chunks)
    against the whole sequence's keys and values [cp*s_l, b, groups, d] as
    all_gather_into_tensor concatenates the ranks' load-balanced parts (rank-major: rank 0's
    chunks 0 and 2cp-1, then rank 1's 1 and 2cp-2, ...). Grouped-query heads expanded
    (a group's query heads are contiguous, as Megatron lays them out). Returns
    [s_l, b, heads*d]. Exact causal masking per chunk pair: query chunk c sees key chunks
    0..c-1 fully and its own chunk causally, nothing after. Pure function, differentiable."""
    s_l, b, heads, _ = query.shape
    groups, d = key.shape[2], value.shape[3]  # d: the value's head size (MLA's differs)
    if key.shape[:3] != value.shape[:3] or key.shape[0] != cp * s_l or key.shape[1] != b:
        raise SpecError(f"CP attention over {cp} ranks takes keys and values of "
                        f"{cp * s_l} positions for {s_l} queries (batch {b}), not "
                        f"{tuple(key.shape)} and {tuple(value.shape)}")
    if groups < 1 or heads % groups:
        raise SpecError(f"{heads} query heads do not split into {groups} key/value groups")
    if cp > 1 and s_l % 2:
        raise SpecError(f"a CP rank's sequence holds two equal chunks: {s_l} positions "
                        f"do not split in two")
    if cp > 1:
        key, value = _natural_order(key, cp), _natural_order(value, cp)
    if heads != groups:
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
    if cp == 1:  # the load-balanced part is the whole sequence
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(s_l, b, heads * d)
    c = s_l // 2
    rows = torch.arange(c, device=query.device)[:, None]
    outs = []
    for local, chunk in enumerate((cp_rank, 2 * cp - 1 - cp_rank)):
        seen = (chunk + 1) * c  # the key prefix this chunk can see
        allowed = torch.arange(seen, device=query.device)[None, :] <= chunk * c + rows
        outs.append(F.scaled_dot_product_attention(
            q[:, :, local * c:(local + 1) * c], k[:, :, :seen], v[:, :, :seen],
            attn_mask=allowed, scale=scale))
    out = torch.cat(outs, dim=2)
    return out.permute(2, 0, 1, 3).reshape(s_l, b, heads * d)


def _cp_group(pg_collection: Any) -> Any:
    """The CP group: the collection's, else Megatron's parallel state's (None where it has
    none, or torch.distributed is not up: size 1)."""
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group(check_initialized=False)


class KareusCPCoreAttention(SDPACoreAttention):
    """Megatron core_attention submodule (same constructor signature as
    kareus.integrations.megatron.cpu.SDPACoreAttention / Megatron's DotProductAttention:
    config, layer_number, attn_mask_type, attention_type="self", cp_comm_type=None,
    softmax_scale=None, pg_collection=None, **_). No parameters (checkpoints unchanged).
    forward(query, key, value, attention_mask=None, attn_mask_type=None,
            attention_bias=None, packed_seq_params=None) -> [s_l, b, heads*d]:
    query/key/value are this rank's load-balanced [s_l, b, ., d]; key and value are
    all-gathered over the CP group here (synchronous; autograd: their gradients
    reduce-scattered back) — unless inside `with module.kv_gathered():`, where key and value
    arrive already all-gathered (rank-major, as above) and are used as they are.

    The softmax scale is Megatron's: ``softmax_scale``, else 1/sqrt(kv_channels) (with
    ``apply_query_key_layer_scaling`` Megatron divides the scores by the layer number and
    multiplies them back inside its fp32 softmax: the same numbers)."""

    cp_group: Any
    """The CP process group (None: size 1)."""
    cp: int
    """Its size."""
    cp_rank: int
    """This rank's index in it."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", cp_comm_type: str | None = None,
                 softmax_scale: float | None = None, pg_collection: Any = None,
                 **extra: Any) -> None:
        # the overlapped CP schedule recomputes attention in the backward from K and V
        # gathered again: a dropout mask drawn twice would differ
        if getattr(config, "attention_dropout", 0.0) or extra.get("attention_dropout"):
            raise SpecError("the Kareus CP core attention runs without attention dropout "
                            "(its backward recomputes attention); set attention_dropout=0")
        if getattr(config, "window_size", None) is not None:
            raise SpecError("the Kareus CP core attention computes full causal attention, "
                            "not sliding-window attention (window_size)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise SpecError(f"the Kareus CP core attention computes the vanilla softmax, "
                            f"not softmax_type={config.softmax_type!r}")
        super().__init__(config, layer_number, attn_mask_type, attention_type, cp_comm_type,
                         softmax_scale, pg_collection)
        self.cp_group = _cp_group(pg_collection)
        self.cp = world_size(self.cp_group)
        self.cp_rank = rank_in(self.cp_group)
        configured = getattr(config, "context_parallel_size", 1) or 1
        if configured != self.cp:
            raise SpecError(f"the model's context_parallel_size is {configured} but its "
                            f"CP process group has {self.cp} ranks")
        if self.cp > 1:
            if attention_type != "self":
                raise SpecError(f"the Kareus CP core attention runs self-attention under "
                                f"context parallelism, not {attention_type!r}")
            if attn_mask_type != AttnMaskType.causal:
                raise SpecError(f"the Kareus CP core attention runs causal attention under "
                                f"context parallelism, not {attn_mask_type.name}")
        self._kv_gathered = False

    @contextlib.contextmanager
    def kv_gathered(self) -> Iterator[None]:
        """Inside: forward's key and value are the whole sequence's, already all-gathered
        over the CP group (rank-major), and are used as they are."""
        before, self._kv_gathered = self._kv_gathered, True
        try:
            yield
        finally:
            self._kv_gathered = before

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Tensor | None = None,
                attn_mask_type: AttnMaskType | None = None,
                attention_bias: Tensor | None = None, packed_seq_params: Any = None
                ) -> Tensor:
        if self.cp == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        kind = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if kind != AttnMaskType.causal:
            raise SpecError(f"the Kareus CP core attention runs causal attention under "
                            f"context parallelism, not {kind.name}")
        for given, what in ((attention_mask is not None, "an explicit attention mask "
                             "(Megatron-LM: --no-create-attention-mask-in-dataloader)"),
                            (attention_bias is not None, "an attention bias"),
                            (packed_seq_params is not None, "packed sequences")):
            if given:
                raise SpecError(f"the Kareus CP core attention runs causal self-attention "
                                f"under context parallelism, without {what}")
        if not self._kv_gathered:
            key = GatherSeq.apply(key, self.cp_group, 0)
            value = GatherSeq.apply(value, self.cp_group, 0)
        return cp_causal_attention(query, key, value, self.cp, self.cp_rank,
                                   self.softmax_scale)
