"""The overlapped schedule with context parallelism (all-gather CP) and tensor parallelism,
over any layer that offers its ops without their communication (`CPLayerOps`): the
project's `LlamaLayer` (contiguous sequence chunks; its own full recompute:
``keep_graphs`` False) and Megatron-Core's `TransformerLayer` with Kareus's CP core
attention (kareus.integrations.megatron; load-balanced chunks).

A nanobatch's attention half is cut where CP communicates: the norm, the QKV piece (QKV
projection and rotary: this rank's query, key and value), the core attention on the key
and value all-gathered over the CP group, and the output projection (partial sums, their
all-reduce over the TP group). The segments and partitions are kareus.workload's
(docs/workload.md), each partition one nanobatch's segment with the other's previous
collective:

forward   qkv(0) | qkv(1) + AG(kv0) fwd_qkv_ag | ao(0) + AG(kv1) fwd_ao_ag |
          ao(1) + AR(0) fwd_ao_ar | mlp(0) + AR(1) fwd_mlp | mlp(1) + AR(0) fwd_mlp | AR(1)
backward  mlp'(0) | mlp'(1) + AR(0) bwd_mlp | o'(0) + AR(1) bwd_o_ar |
          o'(1) + AG(kv0) bwd_o_ag | a'(0) + AG(kv1) bwd_a_ag | a'(1) + RS(dkv0) bwd_a_rs |
          qkv'(0) + RS(dkv1) bwd_qkv_rs | qkv'(1) + AR(0) bwd_qkv_ar | AR(1) | input norms'

(``ao``: core attention and output projection; ``o'``: the MLP norm, attention residual
and output projection backward; ``a'``: the core attention's backward; ``qkv'``: rotary
and QKV backward.) As in all-gather CP, a rank keeps only its own key and value: the
gathered ones are not saved by the forward but gathered again for the backward (``o'``,
``a'``), whose core attention is rebuilt from them and the saved query; the key and value
gradients are reduce-scattered back to their owners. The last all-reduce of each pass is
exposed: across layers the planner pairs the forward's with the next layer's first segment
(``fwd_qkv_ar``), whose SMs it runs on here; the backward's with the next layer's
first backward segment (``bwd_mlp``), or under recompute its recomputed ``fwd_qkv_ar``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import (
    BACKWARD_TAPS,
    GroupsBySms,
    Pending,
    Taps,
    hook_backward_slot,
    issue_at_end,
    issue_before,
)
from kareus.runtime.overlap_tp import input_norm_backward, mlp_backward, sum_partial_grads
from kareus.runtime.pieces import (
    PIECES,
    Before,
    Grads,
    Nanobatch,
    Piece,
    TPLayerOps,
    leaf,
    no_slot,
    refuse_sequence_split,
    split,
)
from kareus.runtime.primitives import Group

AG, RS, AR = "all_gather", "reduce_scatter", "all_reduce"
QKV = tuple[Tensor, Tensor, Tensor]


class CPLayerOps(TPLayerOps, Protocol):
    """`TPLayerOps` of a layer with context parallelism: its attention core in three ops
    (`attn_partial` is not used), none of which communicates."""

    cp_group: Group
    """The context-parallel group (the key and value are all-gathered over it)."""
    cp_groups_by_sms: GroupsBySms | None
    """The CP group whose NCCL communicator runs a collective on that many SMs."""
    seq_dim: int
    """The sequence dimension of the query, key and value."""

    def qkv_partial(self, a: Tensor, before: Before, taps: Taps) -> QKV:
        """Norm output -> this rank's query, key and value (rotary applied); calls
        ``before`` with "qkv" and "rope", and fills ``taps`` with "qkv" (the projection's
        output) and "rope" (the rotated query and key)."""
        ...

    def attention(self, q: Tensor, k_full: Tensor, v_full: Tensor, before: Before,
                  taps: Taps) -> Tensor:
        """The core attention of this rank's query against the gathered key and value;
        calls ``before`` with "core_attn" and taps its output as "core_attn"."""
        ...

    def proj_partial(self, o: Tensor, before: Before, taps: Taps) -> Tensor:
        """Attention output -> partial output projection; calls ``before`` with
        "out_proj" and taps its output as "out_proj"."""
        ...


class OverlappedCPOps(torch.autograd.Function):
    """``OverlappedCPOps.apply(x, ops, plan, keep_graphs, *params)``: the layer's output;
    ``params`` are every parameter the ops use (their gradients are returned)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ops: CPLayerOps, plan: LayerPlan, keep_graphs: bool,
                *params: Tensor) -> Tensor:
        refuse_sequence_split(plan, "context parallelism", "not supported with CP")
        nbs = [_CPNanobatch(nb.ops, nb.x) for nb in split(x, ops)]
        with torch.enable_grad() if keep_graphs else torch.no_grad():
            y = _forward(nbs, _Collectives(ops, plan), plan, ops.batch_dim)
        if not keep_graphs:
            for nb in nbs:
                nb.drop()
        ctx.nbs, ctx.ops, ctx.plan = nbs, ops, plan
        ctx.params = params
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        ops: CPLayerOps = ctx.ops
        grads = Grads(ctx.params)
        dys = tuple(half.contiguous() for half in dy.chunk(2, dim=ops.batch_dim))
        dx = _backward(ctx.nbs, _Collectives(ops, ctx.plan), ctx.plan, grads, dys,
                       ops.batch_dim)
        sum_partial_grads(ops, grads)
        ctx.nbs = None  # the graphs go with the pass
        return (dx, None, None, None, *grads.sums)


class _Collectives:
    """A partition's collective: all-reduces over the TP group, the key and value's
    all-gather and their gradients' reduce-scatter over the CP group (along the
    sequence), each on the group for the SMs the plan gives the partition."""

    def __init__(self, ops: CPLayerOps, plan: LayerPlan) -> None:
        self.ops, self.plan = ops, plan

    def __call__(self, kind: str, tensor: Tensor, key: str) -> Pending:
        ops, sms = self.ops, self.plan.sms(key)
        if kind == AR:  # in place, as overlap_tp's (see there)
            return Pending(AR, tensor.detach(), ops.group, sms, ops.groups_by_sms)
        return Pending(kind, tensor.detach(), ops.cp_group, sms, ops.cp_groups_by_sms,
                       dim=ops.seq_dim)


def pair_kv(k: Tensor, v: Tensor) -> Tensor:
    """Key and value as one tensor (one collective for both)."""
    return torch.cat([k, v], dim=-1)


def unpair_kv(kv: Tensor) -> tuple[Tensor, Tensor]:
    """`pair_kv` undone: the key and the value."""
    k, v = kv.chunk(2, dim=-1)
    return k, v


class _CPNanobatch(Nanobatch):
    """A nanobatch's pieces with the attention core cut where CP communicates: ``qkv``
    (a piece: norm output -> query, key, value), the core attention (not kept: rebuilt in
    the backward on the gathered key and value) and ``proj`` (a piece: attention output
    -> partial output projection)."""

    ops: CPLayerOps

    def __init__(self, ops: TPLayerOps, x: Tensor) -> None:
        super().__init__(ops, x)
        self.qkv_out: QKV | None = None
        """This rank's query, key and value (detached)."""
        self.attn_out: Tensor | None = None
        """The core attention's output (the output projection's input)."""

    def qkv(self, before: Before) -> QKV:
        """The attention norm and QKV pieces: this rank's query, key and value."""
        a_in = leaf(self.attn_norm(before))
        taps: Taps = {}
        q, k, v = self.ops.qkv_partial(a_in, before, taps)
        self.pieces["qkv"] = Piece([a_in], (q, k, v), taps)
        self.qkv_out = (q.detach(), k.detach(), v.detach())
        return self.qkv_out

    def ao(self, kv_full: Tensor, before: Before) -> Tensor:
        """The core attention (no graph kept) and the output projection piece."""
        assert self.qkv_out is not None
        with torch.no_grad():
            o = self.ops.attention(self.qkv_out[0], *unpair_kv(kv_full), before, {})
        self.attn_out = o
        return self._proj(o, before)

    def _proj(self, o: Tensor, before: Before) -> Tensor:
        o_in = leaf(o)
        taps: Taps = {}
        out = self.ops.proj_partial(o_in, before, taps)
        self.pieces["proj"] = Piece([o_in], out, taps)
        return out

    def build(self, names: Sequence[str]) -> None:
        """As `Nanobatch.build`; the attention half's pieces are the norm, ``qkv``,
        ``proj`` and the residual (its core attention is rebuilt by ``a'`` itself)."""
        if names[0] != "attn_norm":
            super().build(names)
            return
        if all(n in self.pieces for n in ("attn_norm", "qkv", "proj", "attn_res")):
            return
        assert self.attn_out is not None
        with torch.enable_grad():
            self.qkv(no_slot)
            self._proj(self.attn_out, no_slot)
            self.attn_residual(self.reduced["attn"], no_slot)


def _slot(plan: LayerPlan, key: str, pending: Pending) -> Before:
    launch = plan.launch_op(key)
    return lambda name: issue_before(pending, launch, name)


def _forward(nbs: list[_CPNanobatch], coll: _Collectives, plan: LayerPlan, dim: int
             ) -> Tensor:
    nb0, nb1 = nbs
    _q, k, v = nb0.qkv(no_slot)                                        # qkv(0), solo
    c = coll(AG, pair_kv(k, v), "fwd_qkv_ag")
    _q, k, v = nb1.qkv(_slot(plan, "fwd_qkv_ag", c))
    issue_at_end(c)
    kv0 = c.wait()
    c = coll(AG, pair_kv(k, v), "fwd_ao_ag")
    p0 = nb0.ao(kv0, _slot(plan, "fwd_ao_ag", c))
    issue_at_end(c)
    kv1 = c.wait()
    c = coll(AR, p0, "fwd_ao_ar")
    p1 = nb1.ao(kv1, _slot(plan, "fwd_ao_ar", c))
    issue_at_end(c)
    r0 = c.wait()
    c = coll(AR, p1, "fwd_mlp")
    before = _slot(plan, "fwd_mlp", c)
    nb0.attn_residual(r0, before)
    m0 = nb0.mlp(before)
    issue_at_end(c)
    r1 = c.wait()
    c = coll(AR, m0, "fwd_mlp")
    before = _slot(plan, "fwd_mlp", c)
    nb1.attn_residual(r1, before)
    m1 = nb1.mlp(before)
    issue_at_end(c)
    r2 = c.wait()
    r3 = coll(AR, m1, "fwd_qkv_ar").wait()                             # exposed
    return torch.cat([nb0.mlp_residual(r2), nb1.mlp_residual(r3)], dim=dim)


def _backward(nbs: list[_CPNanobatch], coll: _Collectives, plan: LayerPlan, grads: Grads,
              dys: tuple[Tensor, ...], dim: int) -> Tensor:
    nb0, nb1 = nbs
    launch = plan.launch_op
    db0, dh0 = mlp_backward(nb0, dys[0], grads, None, None)          # mlp'(0), solo
    c = coll(AR, db0, "bwd_mlp")
    db1, dh1 = mlp_backward(nb1, dys[1], grads, c, launch("bwd_mlp"))
    issue_at_end(c)
    db0 = c.wait()
    c = coll(AR, db1, "bwd_o_ar")
    dx0, do0 = _o_backward(nb0, dh0, db0, grads, c, launch("bwd_o_ar"))
    issue_at_end(c)
    db1 = c.wait()
    c = coll(AG, _kv(nb0), "bwd_o_ag")
    dx1, do1 = _o_backward(nb1, dh1, db1, grads, c, launch("bwd_o_ag"))
    issue_at_end(c)
    kv0 = c.wait()
    c = coll(AG, _kv(nb1), "bwd_a_ag")
    dq0, dkv0 = _a_backward(nb0, kv0, do0, c, launch("bwd_a_ag"))
    issue_at_end(c)
    kv1 = c.wait()
    c = coll(RS, dkv0, "bwd_a_rs")
    dq1, dkv1 = _a_backward(nb1, kv1, do1, c, launch("bwd_a_rs"))
    issue_at_end(c)
    dkv0 = c.wait()
    c = coll(RS, dkv1, "bwd_qkv_rs")
    da0 = _qkv_backward(nb0, dq0, dkv0, grads, c, launch("bwd_qkv_rs"))
    issue_at_end(c)
    dkv1 = c.wait()
    c = coll(AR, da0, "bwd_qkv_ar")
    da1 = _qkv_backward(nb1, dq1, dkv1, grads, c, launch("bwd_qkv_ar"))
    issue_at_end(c)
    da0 = c.wait()
    da1 = coll(AR, da1, plan.layer_end_backward("fwd_qkv_ar", "bwd_mlp")).wait()  # exposed
    return torch.cat([input_norm_backward(nb0, dx0, da0, grads),
                      input_norm_backward(nb1, dx1, da1, grads)], dim=dim)


def _kv(nb: _CPNanobatch) -> Tensor:
    assert nb.qkv_out is not None
    return pair_kv(nb.qkv_out[1], nb.qkv_out[2])


def _o_backward(nb: _CPNanobatch, dh_res: Tensor, db_full: Tensor, grads: Grads,
                pending: Pending | None, launch: str | None) -> tuple[Tensor, Tensor]:
    """o': the MLP norm backward, the attention residual and output projection backward
    -> the residual's d(x) and d(attention output)."""
    if pending is not None and launch is not None and launch not in BACKWARD_TAPS:
        pending.issue()  # a norm or residual slot: the partition's start
    gh, = grads(nb.pieces["mlp_norm"], db_full)
    nb.build(PIECES[:3])
    proj = nb.pieces["proj"]
    hook_backward_slot(proj.taps, launch if launch in BACKWARD_TAPS else None, pending)
    dx, dr = grads(nb.pieces["attn_res"], dh_res + gh)
    do, = grads(proj, dr)
    return dx, do


def _a_backward(nb: _CPNanobatch, kv_full: Tensor, do: Tensor, pending: Pending | None,
                launch: str | None) -> tuple[Tensor, Tensor]:
    """a': the core attention rebuilt on the gathered key and value, differentiated ->
    d(query) and d(key, value) of the whole sequence (to be reduce-scattered)."""
    assert nb.qkv_out is not None
    if pending is not None and launch is not None and launch not in BACKWARD_TAPS:
        pending.issue()
    with torch.enable_grad():
        q = leaf(nb.qkv_out[0])
        k, v = (leaf(t) for t in unpair_kv(kv_full))
        taps: Taps = {}
        o = nb.ops.attention(q, k, v, no_slot, taps)
        hook_backward_slot(taps, launch, pending)
        dq, dk, dv = torch.autograd.grad(o, [q, k, v], do)
    return dq, pair_kv(dk, dv)


def _qkv_backward(nb: _CPNanobatch, dq: Tensor, dkv: Tensor, grads: Grads,
                  pending: Pending | None, launch: str | None) -> Tensor:
    """qkv': rotary and QKV backward -> partial d(attention norm output)."""
    piece = nb.pieces["qkv"]
    if pending is not None and launch is not None and launch not in BACKWARD_TAPS:
        pending.issue()
    hook_backward_slot(piece.taps, launch if launch in BACKWARD_TAPS else None, pending)
    dk, dv = unpair_kv(dkv)
    da, = grads(piece, (dq, dk.contiguous(), dv.contiguous()))
    return da
