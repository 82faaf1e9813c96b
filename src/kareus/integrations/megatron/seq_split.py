"""The sequence split (issue 37): a `KareusTransformerLayer` at micro-batch size 1 runs
the TP overlapped schedule on two nanobatches cut along the sequence (Megatron's hidden
states are [s, b, h]: dimension 0), not the batch.

Every row of the norms, linears, activation and residuals is independent, so each
nanobatch runs them on its own half; only the core attention is not. Its causal query
rows of nanobatch 1 (positions s/2 .. s-1) see nanobatch 0's keys and values as well as
their own: nanobatch 0's key and value, kept from its forward (`_SeqNanobatch.qkv_out`),
are concatenated in front of nanobatch 1's, and the core attention runs with the causal
mask shifted by s/2 (an explicit boolean mask: `MegatronSeqOps.attention`). Rotary: each
nanobatch takes its half of the [s, 1, 1, d] embedding, so nanobatch 1's positions start
at s/2. The attention is cut as for context parallelism (`MegatronCutOps`: QKV with
rotary, the core attention, the output projection), one piece each.

The schedule uses the TP partition keys and slots (kareus.runtime.overlap_tp), forward as
there; the backward runs nanobatch 1 first, because its core attention's backward gives
the gradient of nanobatch 0's key and value, which must be added before nanobatch 0's QKV
backward:

forward   attn(0) | attn(1) + AR(0) fwd_attn | mlp(0) + AR(1) fwd_mlp |
          mlp(1) + AR(0) fwd_mlp | AR(1)
backward  mlp'(1) | mlp'(0) + AR(1) bwd_mlp | attn'(1) + AR(0) bwd_attn |
          attn'(0) + AR(1) bwd_attn | AR(0) | input norms'

``keep_graphs`` as in kareus.runtime.pieces: kept from the forward (Megatron's full
recompute re-runs the forward with grad; nothing is computed a third time), or rebuilt in
the backward from the saved piece inputs (nanobatch 0's key and value among them).

Where it lives: this is a runtime-level schedule over CP-style ops (`qkv_partial`,
`attention` taking keys longer than its queries, `proj_partial`), written here while the
runtime changes in parallel; after merging it belongs next to overlap_tp in
kareus.runtime, shared with `LlamaLayer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from kareus.errors import SpecError
from kareus.integrations.megatron.ops import KareusTransformerLayer, MegatronCutOps
from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import (
    BACKWARD_TAPS,
    Pending,
    Taps,
    hook_backward_slot,
    issue_at_end,
    issue_before,
)
from kareus.runtime.overlap_tp import input_norm_backward, mlp_backward, sum_partial_grads
from kareus.runtime.pieces import PIECES, Before, Grads, Nanobatch, Piece, leaf, no_slot

SEQ_DIM = 0
QKV = tuple[Tensor, Tensor, Tensor]
SPLITS = ("batch", "sequence")


def nanobatch_split(layer: Any, batch: int) -> str:
    """How ``layer`` splits a microbatch of ``batch`` samples: its
    ``kareus_nanobatch_split`` where set (the plan's job's), else the batch where it
    splits evenly and the sequence at micro-batch size 1."""
    chosen = getattr(layer, "kareus_nanobatch_split", None)
    if chosen is not None:
        if chosen not in SPLITS:
            raise SpecError(f"nanobatch split {chosen!r}: the choices are "
                            f"{', '.join(SPLITS)}")
        return str(chosen)
    return "sequence" if batch == 1 else "batch"


class MegatronSeqOps(MegatronCutOps):
    """The ops of a `KareusTransformerLayer` for a sequence split: ``nanobatch(i)`` is the
    ops of sequence half ``i`` (its rotary embedding and mask rows), whose `attention`
    takes keys and values longer than its queries (the earlier half's in front)."""

    batch_dim = SEQ_DIM  # the dimension split into nanobatches (and joined again)

    def __init__(self, layer: KareusTransformerLayer, kwargs: dict[str, Any], batch: int,
                 seq: int = 0, index: int | None = None) -> None:
        super().__init__(layer, kwargs, batch)
        self.seq, self.index = seq, index
        if kwargs.get("attention_bias") is not None:
            raise SpecError("a Kareus plan splitting the sequence cannot run a layer called "
                            "with attention_bias; supported: causal self-attention, with "
                            "or without Megatron's boolean attention mask")

    def nanobatch(self, index: int) -> MegatronSeqOps:
        half = self.seq // 2
        rows = slice(index * half, (index + 1) * half)
        kw = dict(self.kwargs)
        emb = kw.get("rotary_pos_emb")
        if emb is not None:  # [s, 1, 1, d]: this half's positions
            kw["rotary_pos_emb"] = (tuple(e[rows] for e in emb) if isinstance(emb, tuple)
                                    else emb[rows])
        mask = kw.get("attention_mask")
        if isinstance(mask, Tensor):  # [b or 1, 1, s, s]: this half's query rows, the keys
            kw["attention_mask"] = mask[..., rows, :(index + 1) * half]  # it can see
        pad = kw.get("padding_mask")
        if isinstance(pad, Tensor) and pad.dim() > 1:  # [b, s]
            kw["padding_mask"] = pad[:, rows]
        return MegatronSeqOps(self.layer, kw, self.batch, half, index)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, before: Before, taps: Taps
                  ) -> Tensor:
        """The core attention of this half's queries against ``k``, ``v`` (the earlier
        half's keys in front of this half's): causal with the queries at the end."""
        attn = self.layer.self_attention
        mask = self.kwargs.get("attention_mask")
        kind = attn.attn_mask_type
        offset = k.shape[0] - q.shape[0]
        if offset:
            if kind != AttnMaskType.causal:
                raise SpecError(f"a Kareus plan splitting the sequence runs causal "
                                f"attention, not {kind.name}")
            # Megatron's boolean mask (True: masked out), causal shifted by the offset
            shifted = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool,
                                 device=q.device).triu(offset + 1)[None, None]
            mask = shifted if mask is None else (mask.bool() | shifted)
            kind = AttnMaskType.arbitrary
        with self.layer._kareus_piece(before, taps):
            out: Tensor = attn.core_attention(q, k, v, mask, attn_mask_type=kind,
                                              attention_bias=None, packed_seq_params=None)
        return out


class _SeqNanobatch(Nanobatch):
    """One sequence half's pieces: the attention half as norm, ``qkv`` (norm output ->
    query, key, value), ``core`` (query, key, value, and the earlier half's key and value
    -> attention output), ``proj`` and the residual; the MLP half as `Nanobatch`'s."""

    ops: MegatronSeqOps

    def __init__(self, ops: MegatronSeqOps, x: Tensor, prior: _SeqNanobatch | None
                 ) -> None:
        super().__init__(ops, x)
        self.prior = prior
        """The earlier half, whose key and value this one's attention reads."""
        self.qkv_out: QKV | None = None
        """This half's query, key and value (detached; kept for the later half)."""

    def attention(self, before: Before) -> Tensor:
        a_in = leaf(self.attn_norm(before))
        taps: Taps = {}
        q, k, v = self.ops.qkv_partial(a_in, before, taps)
        self.pieces["qkv"] = Piece([a_in], (q, k, v), taps)
        self.qkv_out = (q.detach(), k.detach(), v.detach())
        inputs = [leaf(t) for t in self.qkv_out]
        q_in, k_in, v_in = inputs
        if self.prior is not None:
            assert self.prior.qkv_out is not None
            k0, v0 = leaf(self.prior.qkv_out[1]), leaf(self.prior.qkv_out[2])
            inputs += [k0, v0]
            k_in, v_in = torch.cat([k0, k_in], SEQ_DIM), torch.cat([v0, v_in], SEQ_DIM)
        taps = {}
        o = self.ops.attention(q_in, k_in, v_in, before, taps)
        taps.pop("rope", None)  # the rotary slot is the qkv piece's
        self.pieces["core"] = Piece(inputs, o, taps)
        o_in = leaf(o)
        taps = {}
        out = self.ops.proj_partial(o_in, before, taps)
        self.pieces["proj"] = Piece([o_in], out, taps)
        return out

    def build(self, names: Sequence[str]) -> None:
        """As `Nanobatch.build`; the attention half's pieces are the norm, ``qkv``,
        ``core``, ``proj`` and the residual, rebuilt from the saved input (and the earlier
        half's saved key and value)."""
        if names[0] != "attn_norm":
            super().build(names)
            return
        if all(n in self.pieces for n in ("attn_norm", "qkv", "core", "proj", "attn_res")):
            return
        with torch.enable_grad():
            self.attention(no_slot)
            self.attn_residual(self.reduced["attn"], no_slot)


class OverlappedSeqTP(torch.autograd.Function):
    """``OverlappedSeqTP.apply(x, ops, plan, keep_graphs, *params)``: the layer's output
    for ``x`` [s, b, h] split along the sequence; ``params`` are every parameter the ops
    use (their gradients are returned)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ops: MegatronSeqOps, plan: LayerPlan,
                keep_graphs: bool, *params: Tensor) -> Tensor:
        s = x.shape[SEQ_DIM]
        if s < 2 or s % 2:
            raise SpecError(f"a Kareus plan splitting the sequence into two nanobatches "
                            f"needs an even sequence length, not {s}")
        if ops.seq != s:
            raise ValueError(f"ops for a sequence of {ops.seq}, not {s}")
        x0, x1 = (half.contiguous() for half in x.detach().chunk(2, dim=SEQ_DIM))
        nb0 = _SeqNanobatch(ops.nanobatch(0), x0, None)
        nb1 = _SeqNanobatch(ops.nanobatch(1), x1, nb0)
        with torch.enable_grad() if keep_graphs else torch.no_grad():
            y = _forward([nb0, nb1], _Collectives(ops, plan), plan)
        if not keep_graphs:
            for nb in (nb0, nb1):
                nb.drop()
        ctx.nbs, ctx.ops, ctx.plan, ctx.params = [nb0, nb1], ops, plan, params
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        grads = Grads(ctx.params)
        dys = tuple(half.contiguous() for half in dy.chunk(2, dim=SEQ_DIM))
        dx = _backward(ctx.nbs, _Collectives(ctx.ops, ctx.plan), ctx.plan, grads, dys)
        sum_partial_grads(ctx.ops, grads)
        ctx.nbs = None  # the graphs go with the pass
        return (dx, None, None, None, *grads.sums)


class _Collectives:
    """A partition's all-reduce (in place, as overlap_tp's), on the group for the SMs the
    plan gives it."""

    def __init__(self, ops: MegatronSeqOps, plan: LayerPlan) -> None:
        self.ops, self.plan = ops, plan

    def __call__(self, tensor: Tensor, key: str) -> Pending:
        return Pending("all_reduce", tensor.detach(), self.ops.group, self.plan.sms(key),
                       self.ops.groups_by_sms)


def _slot(pending: Pending, launch_op: str | None) -> Before:
    return lambda name: issue_before(pending, launch_op, name)


def _forward(nbs: list[_SeqNanobatch], collective: _Collectives, plan: LayerPlan
             ) -> Tensor:
    nb0, nb1 = nbs
    attn_op, mlp_op = plan.launch_op("fwd_attn"), plan.launch_op("fwd_mlp")
    c0 = collective(nb0.attention(no_slot), "fwd_attn")               # attn(0), solo
    p1 = nb1.attention(_slot(c0, attn_op))
    issue_at_end(c0)
    r0 = c0.wait()
    c1 = collective(p1, "fwd_mlp")
    before = _slot(c1, mlp_op)
    nb0.attn_residual(r0, before)
    m0 = nb0.mlp(before)
    issue_at_end(c1)
    r1 = c1.wait()
    c2 = collective(m0, "fwd_mlp")
    before = _slot(c2, mlp_op)
    nb1.attn_residual(r1, before)
    m1 = nb1.mlp(before)
    issue_at_end(c2)
    r2 = c2.wait()
    r3 = collective(m1, "fwd_mlp").wait()                               # exposed
    return torch.cat([nb0.mlp_residual(r2), nb1.mlp_residual(r3)], dim=SEQ_DIM)


def _backward(nbs: list[_SeqNanobatch], collective: _Collectives, plan: LayerPlan,
              grads: Grads, dys: tuple[Tensor, ...]) -> Tensor:
    nb0, nb1 = nbs
    mlp_launch, attn_launch = plan.launch_op("bwd_mlp"), plan.launch_op("bwd_attn")
    db1, dh1 = mlp_backward(nb1, dys[1], grads, None, None)           # mlp'(1), solo
    c0 = collective(db1, "bwd_mlp")
    db0, dh0 = mlp_backward(nb0, dys[0], grads, c0, mlp_launch)
    issue_at_end(c0)
    db1_full = c0.wait()
    c1 = collective(db0, "bwd_attn")
    dx1, da1, dkv0 = _attn_backward(nb1, dh1, db1_full, grads, c1, attn_launch, None)
    issue_at_end(c1)
    db0_full = c1.wait()
    c2 = collective(da1, "bwd_attn")
    dx0, da0, _ = _attn_backward(nb0, dh0, db0_full, grads, c2, attn_launch, dkv0)
    issue_at_end(c2)
    da1_full = c2.wait()
    da0_full = collective(da0, "bwd_attn").wait()                       # exposed
    return torch.cat([input_norm_backward(nb0, dx0, da0_full, grads),
                      input_norm_backward(nb1, dx1, da1_full, grads)], dim=SEQ_DIM)


def _attn_backward(nb: _SeqNanobatch, dh_res: Tensor, db_full: Tensor, grads: Grads,
                   pending: Pending, launch: str | None,
                   dkv_later: list[Tensor] | None
                   ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """attn'(X): the MLP norm backward, the attention residual, output projection, core
    attention and QKV backward -> the residual's d(x), partial d(attention norm output),
    and d(key), d(value) of the earlier half (from this half's attention; empty for
    nanobatch 0). ``dkv_later``: what the later half's attention gave this half's key and
    value, added before its QKV backward."""
    if launch is not None and launch not in BACKWARD_TAPS:
        pending.issue()  # a norm or residual slot: the partition's start
    gh, = grads(nb.pieces["mlp_norm"], db_full)
    nb.build(PIECES[:3])
    tapped = launch if launch in BACKWARD_TAPS else None
    for name in ("proj", "core", "qkv"):
        hook_backward_slot(nb.pieces[name].taps, tapped, pending)
    dx, dr = grads(nb.pieces["attn_res"], dh_res + gh)
    do, = grads(nb.pieces["proj"], dr)
    dq, dk, dv, *dkv_prior = grads(nb.pieces["core"], do)
    if dkv_later is not None:
        dk, dv = dk + dkv_later[0], dv + dkv_later[1]
    da, = grads(nb.pieces["qkv"], (dq, dk, dv))
    return dx, da, dkv_prior
