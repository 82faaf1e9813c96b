"""The sequence split (issue 37): a `KareusTransformerLayer` at micro-batch size 1 runs
the runtime's TP schedule (kareus.runtime.overlap_tp, ``LayerPlan.split`` "sequence") on
two nanobatches cut along the sequence (Megatron's hidden states are [s, b, h]: dimension
0), not the batch.

The schedule is the runtime's, shared with `LlamaLayer` (kareus.runtime.pieces: nanobatch
1's attention reads nanobatch 0's kept keys and values; the backward runs nanobatch 1
first). What is Megatron's is the attention core over an earlier nanobatch's keys,
`MegatronSeqOps.attn_partial_kv`: QKV with rotary at this half's positions (its rows of
the [s, 1, 1, d] embedding), nanobatch 0's key and value in front of this half's, and the
core attention with the causal mask shifted by the earlier half's length, then the output
projection. The attention is cut as for context parallelism (`MegatronCutOps`).

The shifted causal mask, by core attention (`MegatronSeqOps.attention`):

- Transformer Engine's (`TEDotProductAttention`, Megatron's TE spec): the mask type
  ``causal_bottom_right`` and no mask of its own. In TE 2.11 "causal" aligns the diagonal
  to the top left of the [sq, skv] score matrix (query i sees keys j <= i) and
  "causal_bottom_right" to the bottom right (j <= i + skv - sq;
  transformer_engine/pytorch/attention/dot_product_attention/utils.py, `get_full_mask`):
  with nanobatch 1's queries the last sq of the skv keys, that is exactly its rows of the
  unsplit layer's causal mask. TE's flash-attention and cuDNN backends run it; an
  explicit ("arbitrary") mask would send TE to its unfused backend (utils.py,
  `get_attention_backend`: "Disabling FlashAttention / FusedAttention for arbitrary
  mask"). A mask the layer is called with is passed on cut to the half's rows, with the
  mask type, as the unsplit layer passes it whole with "causal": TE reads a mask only
  with the padding and arbitrary mask types (`DotProductAttention.forward`'s docstring),
  so its flash and cuDNN backends ignore it in the unsplit layer and in both halves
  alike, and its unfused backend adds it to the causal mask in all three alike
  (`get_full_mask`). Each half computes what TE computes for its rows of the unsplit
  layer, whichever backend TE picks;
- any other (Megatron's local `DotProductAttention`, the CPU core attentions): an
  explicit boolean mask, the shifted causal one together with the layer's own, with
  ``AttnMaskType.arbitrary``. Megatron's local attention ignores the mask type of a call
  and its softmax (`FusedScaleMaskSoftmax`) keeps the one it was built with: causal, whose
  fused kernel asserts as many keys as queries (megatron/core/fusions/fused_softmax.py,
  ``forward_fused_softmax``). For nanobatch 1's call its softmax is switched to the
  arbitrary mask type (`softmax_mask_type`), whose fused kernel takes the explicit mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from kareus.errors import SpecError
from kareus.integrations.megatron.ops import KareusTransformerLayer, MegatronCutOps
from kareus.integrations.megatron.te import is_te_attention
from kareus.job.nanobatch import NANOBATCH_SPLITS
from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import Taps
from kareus.runtime.pieces import Before

SEQ_DIM = 0


def nanobatch_split(layer: Any, batch: int, plan: LayerPlan | None = None) -> str:
    """How ``layer`` splits a microbatch of ``batch`` samples: the plan's split where it
    says "sequence", else the layer's ``kareus_nanobatch_split`` where set (the plan's
    job's), else the batch where it splits evenly and the sequence at micro-batch 1."""
    if plan is not None and plan.split == "sequence":
        return "sequence"
    chosen = getattr(layer, "kareus_nanobatch_split", None)
    if chosen is not None:
        if chosen not in NANOBATCH_SPLITS:
            raise SpecError(f"nanobatch split {chosen!r}: the choices are "
                            f"{', '.join(NANOBATCH_SPLITS)}")
        return str(chosen)
    return "sequence" if batch == 1 else "batch"


@contextlib.contextmanager
def softmax_mask_type(core: Any, kind: AttnMaskType) -> Iterator[None]:
    """Within: ``core``'s softmax (Megatron's local `DotProductAttention`'s
    ``scale_mask_softmax``) applies mask type ``kind``; nothing where ``core`` has none."""
    softmax = getattr(core, "scale_mask_softmax", None)
    if softmax is None or not hasattr(softmax, "attn_mask_type"):
        yield
        return
    built = softmax.attn_mask_type
    softmax.attn_mask_type = kind
    try:
        yield
    finally:
        softmax.attn_mask_type = built


class MegatronSeqOps(MegatronCutOps):
    """`kareus.runtime.pieces.SequenceSplitOps` over a `KareusTransformerLayer`: the
    ops of the whole call (both halves run the per-token pieces with these), whose
    `attn_partial_kv` cuts the rotary embedding and the mask to the half's rows."""

    def __init__(self, layer: KareusTransformerLayer, kwargs: dict[str, Any],
                 batch: int) -> None:
        super().__init__(layer, kwargs, batch)
        for name in ("attention_bias", "padding_mask"):
            if kwargs.get(name) is not None:
                raise SpecError(f"a Kareus plan splitting the sequence cannot run a layer "
                                f"called with {name}; supported: causal self-attention, "
                                f"with or without Megatron's boolean attention mask")

    def _rows(self, start: int, stop: int) -> MegatronSeqOps:
        """These ops with the per-position inputs cut to query rows ``start:stop`` (and
        the mask to the keys they can see, 0:stop)."""
        rows = slice(start, stop)
        kw = dict(self.kwargs)
        emb = kw.get("rotary_pos_emb")
        if emb is not None:  # [s, 1, 1, d]: this half's positions
            kw["rotary_pos_emb"] = (tuple(e[rows] for e in emb) if isinstance(emb, tuple)
                                    else emb[rows])
        mask = kw.get("attention_mask")
        if isinstance(mask, Tensor):  # [b or 1, 1, s, s]
            kw["attention_mask"] = mask[..., rows, :stop]
        return MegatronSeqOps(self.layer, kw, self.batch)

    def attn_partial_kv(self, a: Tensor, past: tuple[Tensor, Tensor] | None,
                        before: Before, taps: Taps) -> tuple[Tensor, Tensor, Tensor]:
        """As `kareus.runtime.pieces.SequenceSplitOps.attn_partial_kv`; the key and value
        returned are this half's after rotary ([s/2, b, heads, d])."""
        offset = 0 if past is None else past[0].shape[SEQ_DIM]
        part = self._rows(offset, offset + a.shape[SEQ_DIM])
        q, k, v = part.qkv_partial(a, before, taps)
        k_all, v_all = ((k, v) if past is None else
                        (torch.cat([past[0], k], SEQ_DIM), torch.cat([past[1], v], SEQ_DIM)))
        out = part.proj_partial(part.attention(q, k_all, v_all, before, taps), before, taps)
        self._attn_bias = part._attn_bias  # the residual's (the same parameter per half)
        return out, k, v

    def attention(self, q: Tensor, k: Tensor, v: Tensor, before: Before, taps: Taps
                  ) -> Tensor:
        """The core attention of this half's queries against ``k``, ``v`` (the earlier
        half's keys in front of this half's): causal with the queries at the end (module
        docstring: Transformer Engine's gets ``causal_bottom_right``, any other an
        explicit mask)."""
        attn = self.layer.self_attention
        core = attn.core_attention
        mask = self.kwargs.get("attention_mask")  # cut to this half's rows (`_rows`)
        kind = attn.attn_mask_type
        offset = k.shape[SEQ_DIM] - q.shape[SEQ_DIM]
        if offset:
            if kind != AttnMaskType.causal:
                raise SpecError(f"a Kareus plan splitting the sequence runs causal "
                                f"attention, not {kind.name}")
            if is_te_attention(core):
                if not core.te_forward_mask_type:  # Megatron's wrapper then drops it
                    raise SpecError("a Kareus plan splitting the sequence needs Transformer "
                                    "Engine 0.12 or later (a mask type per attention call); "
                                    "supported: Transformer Engine 2.x")
                # the bottom-right-aligned causal mask is this half's rows of the unsplit
                # one; TE's fused backends run it (an explicit mask would not)
                kind = AttnMaskType.causal_bottom_right
            else:
                # Megatron's boolean mask (True: masked out), causal shifted by the offset
                shifted = torch.ones(q.shape[SEQ_DIM], k.shape[SEQ_DIM], dtype=torch.bool,
                                     device=q.device).triu(offset + 1)[None, None]
                mask = shifted if mask is None else (mask.bool() | shifted)
                kind = AttnMaskType.arbitrary
        with self.layer._kareus_piece(before, taps), softmax_mask_type(core, kind):
            out: Tensor = core(q, k, v, mask, attn_mask_type=kind, attention_bias=None,
                               packed_seq_params=None)
        return out
