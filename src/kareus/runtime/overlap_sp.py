"""The overlapped schedule with sequence parallelism (CP=1), over any layer that offers
its ops without their communication (`SPLayerOps`): the project's `LlamaLayer` in SP mode,
and Megatron-Core's `TransformerLayer` with ``sequence_parallel`` (kareus.integrations.megatron).

Under SP the norms and residuals run on this rank's part of the sequence; the
column-parallel linears take the norm output all-gathered along the sequence (their input
gradient reduce-scattered), and the row-parallel linears' partial sums are
reduce-scattered (their gradient all-gathered). The layer's segments are the norms
(``ln1``, ``ln2``) and the two cores (``attn``, ``mlp``), each closed by one collective;
the partitions pair one nanobatch's segment with the other's previous collective, as
kareus.workload.partition keys them (docs/workload.md):

forward   ln1(0) | ln1(1) + AG(0) fwd_ln1_ag | attn(0) + AG(1) fwd_attn_ag |
          attn(1) + RS(0) fwd_attn_rs | ln2(0) + RS(1) fwd_ln2_rs | ln2(1) + AG(0) fwd_ln2_ag |
          mlp(0) + AG(1) fwd_mlp_ag | mlp(1) + RS(0) fwd_mlp_rs | RS(1) | residuals
backward  ln1'(0) | ln1'(1) + AG(0) bwd_ln1_ag | mlp'(0) + AG(1) bwd_mlp_ag |
          mlp'(1) + RS(0) bwd_mlp_rs | ln2'(0) + RS(1) bwd_ln2_rs | ln2'(1) + AG(0) bwd_ln2_ag |
          attn'(0) + AG(1) bwd_attn_ag | attn'(1) + RS(0) bwd_attn_rs | RS(1) | input norms'

(``ln1`` forward is the MLP residual of the layer below and the input norm; one layer runs
here, so its ``ln1`` segment is its input norm, and backward ``ln1'`` its MLP residual's
backward; the input norms' backward ends the layer.) The last collective of each pass is
exposed: across layers the planner pairs it with the next layer's ``ln1`` (keys
``fwd_ln1_rs``, ``bwd_ln1_rs``; under recompute the backward's with the next layer's
recomputed ``fwd_ln1_rs``), whose SMs it runs on here. Each collective is issued
before the compute op the plan's slot names and waited for at the end of its partition:
in the forward from the ops' ``before(name)`` calls, in the backward from a gradient hook
on the forward tensor whose backward the slot names (a norm slot: at the partition's
start).

A sequence split (micro-batch size 1) is refused: a rank's halves of its part of the
sequence interleave in the gathered sequence, so each nanobatch's causal attention would
need keys of the other (computed later in the schedule).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import Pending, hook_backward_slot, issue_at_end, issue_before
from kareus.runtime.pieces import (
    PIECES,
    Before,
    Grads,
    Nanobatch,
    SPLayerOps,
    no_slot,
    refuse_sequence_split,
    split,
)

AG, RS = "all_gather", "reduce_scatter"


class OverlappedSP(torch.autograd.Function):
    """``OverlappedSP.apply(x, ops, plan, keep_graphs, *params)``: the layer's output on
    this rank's part of the sequence; ``params`` are every parameter the ops use (their
    gradients are returned)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ops: SPLayerOps, plan: LayerPlan, keep_graphs: bool,
                *params: Tensor) -> Tensor:
        refuse_sequence_split(plan, "sequence parallelism",
                              "a rank's halves interleave in the gathered sequence: each "
                              "nanobatch's causal attention needs keys of the other")
        nbs = split(x, ops)
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
        nbs: list[Nanobatch] = ctx.nbs
        ops: SPLayerOps = ctx.ops
        grads = Grads(ctx.params)
        dys = tuple(half.contiguous() for half in dy.chunk(2, dim=ops.batch_dim))
        dx = _backward(nbs, _Collectives(ops, ctx.plan), ctx.plan, grads, dys,
                       ops.batch_dim)
        ctx.nbs = None  # the graphs go with the pass
        return (dx, None, None, None, *grads.sums)


class _Collectives:
    """A partition's all-gather or reduce-scatter along the sequence, on the group for
    the SMs the plan gives it."""

    def __init__(self, ops: SPLayerOps, plan: LayerPlan) -> None:
        self.ops, self.plan = ops, plan

    def __call__(self, kind: str, tensor: Tensor, key: str) -> Pending:
        return Pending(kind, tensor.detach(), self.ops.group, self.plan.sms(key),
                       self.ops.groups_by_sms, dim=self.ops.seq_dim)


def _slot(plan: LayerPlan, key: str, pending: Pending) -> Before:
    launch = plan.launch_op(key)
    return lambda name: issue_before(pending, launch, name)


def _forward(nbs: list[Nanobatch], coll: _Collectives, plan: LayerPlan, dim: int
             ) -> Tensor:
    nb0, nb1 = nbs
    # ln1(0), solo
    c = coll(AG, nb0.attn_norm(no_slot), "fwd_ln1_ag")
    # ln1(1) + AG(0)
    a1 = nb1.attn_norm(_slot(plan, "fwd_ln1_ag", c))
    issue_at_end(c)
    a0 = c.wait()
    c = coll(AG, a1, "fwd_attn_ag")
    # attn(0) + AG(1)
    p0 = nb0.attn_core(a0, _slot(plan, "fwd_attn_ag", c), gathered=True)
    issue_at_end(c)
    a1 = c.wait()
    c = coll(RS, p0, "fwd_attn_rs")
    # attn(1) + RS(0)
    p1 = nb1.attn_core(a1, _slot(plan, "fwd_attn_rs", c), gathered=True)
    issue_at_end(c)
    r0 = c.wait()
    c = coll(RS, p1, "fwd_ln2_rs")
    # ln2(0) + RS(1): the attention residual and the MLP norm
    before = _slot(plan, "fwd_ln2_rs", c)
    nb0.attn_residual(r0, before)
    b0 = nb0.mlp_norm(before)
    issue_at_end(c)
    r1 = c.wait()
    c = coll(AG, b0, "fwd_ln2_ag")
    # ln2(1) + AG(0)
    before = _slot(plan, "fwd_ln2_ag", c)
    nb1.attn_residual(r1, before)
    b1 = nb1.mlp_norm(before)
    issue_at_end(c)
    b0 = c.wait()
    c = coll(AG, b1, "fwd_mlp_ag")
    # mlp(0) + AG(1)
    m0 = nb0.mlp_core(b0, _slot(plan, "fwd_mlp_ag", c), gathered=True)
    issue_at_end(c)
    b1 = c.wait()
    c = coll(RS, m0, "fwd_mlp_rs")
    # mlp(1) + RS(0)
    m1 = nb1.mlp_core(b1, _slot(plan, "fwd_mlp_rs", c), gathered=True)
    issue_at_end(c)
    r2 = c.wait()
    r3 = coll(RS, m1, "fwd_ln1_rs").wait()  # exposed
    return torch.cat([nb0.mlp_residual(r2), nb1.mlp_residual(r3)], dim=dim)


def _backward(nbs: list[Nanobatch], coll: _Collectives, plan: LayerPlan, grads: Grads,
              dys: tuple[Tensor, ...], dim: int) -> Tensor:
    nb0, nb1 = nbs
    for nb in nbs:
        nb.build(PIECES[3:])
    # ln1'(0), solo: the MLP residual's backward -> d(h) and d(reduced MLP output)
    dh0, dm0 = grads(nb0.pieces["mlp_res"], dys[0])
    c = coll(AG, dm0, "bwd_ln1_ag")
    # ln1'(1) + AG(0)
    _start(plan, "bwd_ln1_ag", c)
    dh1, dm1 = grads(nb1.pieces["mlp_res"], dys[1])
    issue_at_end(c)
    dm0 = c.wait()
    c = coll(AG, dm1, "bwd_mlp_ag")
    # mlp'(0) + AG(1)
    db0 = _core_backward(nb0, "mlp", dm0, grads, plan, "bwd_mlp_ag", c)
    dm1 = c.wait()
    c = coll(RS, db0, "bwd_mlp_rs")
    # mlp'(1) + RS(0)
    db1 = _core_backward(nb1, "mlp", dm1, grads, plan, "bwd_mlp_rs", c)
    db0 = c.wait()
    c = coll(RS, db1, "bwd_ln2_rs")
    # ln2'(0) + RS(1): the MLP norm's and the attention residual's backward
    _start(plan, "bwd_ln2_rs", c)
    dx0, dr0 = _ln2_backward(nb0, dh0, db0, grads)
    issue_at_end(c)
    db1 = c.wait()
    c = coll(AG, dr0, "bwd_ln2_ag")
    # ln2'(1) + AG(0)
    _start(plan, "bwd_ln2_ag", c)
    dx1, dr1 = _ln2_backward(nb1, dh1, db1, grads)
    issue_at_end(c)
    dr0 = c.wait()
    c = coll(AG, dr1, "bwd_attn_ag")
    # attn'(0) + AG(1)
    da0 = _core_backward(nb0, "attn", dr0, grads, plan, "bwd_attn_ag", c)
    dr1 = c.wait()
    c = coll(RS, da0, "bwd_attn_rs")
    # attn'(1) + RS(0)
    da1 = _core_backward(nb1, "attn", dr1, grads, plan, "bwd_attn_rs", c)
    da0 = c.wait()
    da1 = coll(RS, da1, plan.layer_end_backward("fwd_ln1_rs", "bwd_ln1_rs")).wait()
    (gx0,), (gx1,) = grads(nb0.pieces["attn_norm"], da0), grads(nb1.pieces["attn_norm"], da1)
    return torch.cat([dx0 + gx0, dx1 + gx1], dim=dim)


def _start(plan: LayerPlan, key: str, pending: Pending) -> None:
    """A norm partition: its slots are at its start (the norm or residual backward)."""
    if plan.launch_op(key) is not None:
        pending.issue()


def _core_backward(nb: Nanobatch, half: str, grad: Tensor, grads: Grads, plan: LayerPlan,
                   key: str, pending: Pending) -> Tensor:
    """A core's backward from the gathered gradient of its output -> the partial gradient
    of its (gathered) input; ``pending`` issued at the slot, or at the end."""
    core = nb.pieces[f"{half}_core"]
    hook_backward_slot(core.taps, plan.launch_op(key), pending)
    da, = grads(core, grad)
    issue_at_end(pending)
    return da


def _ln2_backward(nb: Nanobatch, dh_res: Tensor, db: Tensor, grads: Grads
                  ) -> tuple[Tensor, Tensor]:
    """The MLP norm's backward (from the reduce-scattered ``db``) and the attention
    residual's -> the residual's d(x) and d(reduced attention output)."""
    gh, = grads(nb.pieces["mlp_norm"], db)
    nb.build(PIECES[:3])
    dx, dr = grads(nb.pieces["attn_res"], dh_res + gh)
    return dx, dr
