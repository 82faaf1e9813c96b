"""The overlapped schedule with tensor parallelism only (CP=1), over any layer that offers
its ops without their communication (`TPLayerOps`): the project's `LlamaLayer`, and
Megatron-Core's `TransformerLayer` (kareus.integrations.megatron).

Two nanobatches; forward nb0.attn | nb1.attn + AR(nb0) | nb0.mlp + AR(nb1) | nb1.mlp +
AR(nb0) | AR(nb1); backward nb0.mlp' | nb1.mlp' + AR(dnb0) | nb0.attn' + AR(dnb1) |
nb1.attn' + AR(dnb0) | AR(dnb1) | input-norm backward (docs/workload.md). Each all-reduce
is issued before the compute op the plan's slot names and waited for at the end of its
partition: in the forward from the ops' ``before(name)`` calls, in the backward from a
gradient hook on the forward tensor whose backward the slot names.

The layer runs as the six pieces of kareus.runtime.pieces per nanobatch, differentiated
piece by piece in the schedule's order; ``keep_graphs`` says whether their graphs are kept
from the forward or rebuilt in the backward (see there).

With a sequence split (``plan.split`` "sequence", micro-batch size 1) nanobatch 0 is the
first half of the tokens and 1 the second, whose attention reads 0's kept keys and values;
the backward runs the nanobatches the other way round (its gradients of 0's keys and
values must reach 0's QKV backward): nb1.mlp' | nb0.mlp' + AR(dnb1) | nb1.attn' + AR(dnb0)
| nb0.attn' + AR(dnb1) | AR(dnb0): the same keys and slots.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import (
    BACKWARD_TAPS,
    Pending,
    hook_backward_slot,
    issue_at_end,
    issue_before,
)
from kareus.runtime.pieces import (
    PIECES,
    Before,
    Grads,
    Nanobatch,
    TPLayerOps,
    backward_order,
    no_slot,
    split,
    split_dim,
)
from kareus.runtime.primitives import world_size

__all__ = ["Before", "OverlappedTP", "TPLayerOps", "input_norm_backward", "mlp_backward",
           "no_slot", "sum_partial_grads"]

class OverlappedTP(torch.autograd.Function):
    """``OverlappedTP.apply(x, ops, plan, keep_graphs, *params)``: the layer's output;
    ``params`` are every parameter the ops use (their gradients are returned)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ops: TPLayerOps, plan: LayerPlan, keep_graphs: bool,
                *params: Tensor) -> Tensor:
        dim = split_dim(ops, plan.split)
        nbs = split(x, ops, plan.split)
        collective = _Collectives(ops, plan)
        with torch.enable_grad() if keep_graphs else torch.no_grad():
            y = _forward(nbs, collective, plan, dim)
        if not keep_graphs:
            for nb in nbs:
                nb.drop()
        ctx.nbs, ctx.ops, ctx.plan, ctx.dim = nbs, ops, plan, dim
        ctx.params = params
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        nbs: list[Nanobatch] = ctx.nbs
        grads = Grads(ctx.params)
        dys = [half.contiguous() for half in dy.chunk(2, dim=ctx.dim)]
        order = backward_order(ctx.plan)
        dxs = _backward([nbs[i] for i in order], _Collectives(ctx.ops, ctx.plan), ctx.plan,
                        grads, tuple(dys[i] for i in order))
        dx = torch.cat([dxs[order.index(i)] for i in (0, 1)], dim=ctx.dim)
        sum_partial_grads(ctx.ops, grads)
        ctx.nbs = None  # the graphs go with the pass
        return (dx, None, None, None, *grads.sums)


def sum_partial_grads(ops: TPLayerOps, grads: Grads) -> None:
    """Sums over the TP group the parameter gradients the pieces leave partial: the ops'
    ``partial_grad_params`` (none by default), the weights of a norm fused into a
    column-parallel linear (Transformer Engine's `LayerNormLinear`), whose backward gets this
    rank's part of the input gradient once the linear's all-reduce is out. One all-reduce of
    them all, per layer backward."""
    partial = {id(p) for p in getattr(ops, "partial_grad_params", ())}
    found = [(i, s) for i, (p, s) in enumerate(zip(grads.params, grads.sums))
             if id(p) in partial and s is not None]
    if not found or world_size(ops.group) <= 1:
        return
    flat = torch.cat([s.reshape(-1) for _, s in found])
    dist.all_reduce(flat, group=ops.group)
    offset = 0
    for i, s in found:
        grads.sums[i] = flat[offset:offset + s.numel()].view_as(s)
        offset += s.numel()


class _Collectives:
    """The all-reduce of a partition, on the group for the SMs the plan gives it."""

    def __init__(self, ops: TPLayerOps, plan: LayerPlan) -> None:
        self.ops, self.plan = ops, plan

    def __call__(self, tensor: Tensor, key: str, nanobatch: int) -> Pending:
        """``key``'s collective of the partition whose compute is ``nanobatch``'s (its
        per-nanobatch key where the plan has one)."""
        key = self.plan.key(key, nanobatch)
        # reduced in place, as Megatron's row-parallel linears do: where the tensor is a
        # kept graph's output, its value is not used by that graph's backward (a linear
        # saves its input, not its output; were it saved, autograd's version check would
        # refuse the backward rather than compute a wrong gradient)
        return Pending("all_reduce", tensor.detach(), self.ops.group, self.plan.sms(key),
                       self.ops.groups_by_sms)


def _slot(pending: Pending | None, launch_op: str | None) -> Before:
    return lambda name: issue_before(pending, launch_op, name)


def _forward(nbs: list[Nanobatch], collective: _Collectives, plan: LayerPlan, dim: int
             ) -> Tensor:
    # each collective's key (and slot) is its partition's: that of the compute it overlaps
    # (the planner's per-nanobatch keys name the computing nanobatch). The layer's last
    # collective overlaps the next layer's first compute in the planner's graph (nb0's
    # attention); one layer cannot reach that, so it runs exposed at that partition's SMs
    nb0, nb1 = nbs
    attn1 = plan.key("fwd_attn", nb1.index)
    mlp0, mlp1 = plan.key("fwd_mlp", nb0.index), plan.key("fwd_mlp", nb1.index)
    # P0: nb0.attn (solo)
    c0 = collective(nb0.attention(no_slot), attn1, nb1.index)
    # P1: nb1.attn + AR(nb0.attn)
    p1 = nb1.attention(_slot(c0, plan.launch_op(attn1)))
    issue_at_end(c0)
    r0 = c0.wait()
    c1 = collective(p1, mlp0, nb0.index)
    # P2: nb0.mlp + AR(nb1.attn)
    before = _slot(c1, plan.launch_op(mlp0))
    nb0.attn_residual(r0, before)
    m0 = nb0.mlp(before)
    issue_at_end(c1)
    r1 = c1.wait()
    c2 = collective(m0, mlp1, nb1.index)
    # P3: nb1.mlp + AR(nb0.mlp)
    before = _slot(c2, plan.launch_op(mlp1))
    nb1.attn_residual(r1, before)
    m1 = nb1.mlp(before)
    issue_at_end(c2)
    r2 = c2.wait()
    r3 = collective(m1, plan.key("fwd_attn", nb0.index), nb0.index).wait()  # exposed
    return torch.cat([nb0.mlp_residual(r2), nb1.mlp_residual(r3)], dim=dim)


def _backward(nbs: list[Nanobatch], collective: _Collectives, plan: LayerPlan,
              grads: Grads, dys: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """The input gradients of ``nbs`` (nb0, nb1 here: in the backward's order)."""
    nb0, nb1 = nbs
    mlp1 = plan.key("bwd_mlp", nb1.index)
    attn0, attn1 = plan.key("bwd_attn", nb0.index), plan.key("bwd_attn", nb1.index)
    # B0: nb0.mlp' (solo)
    db0, dh0 = mlp_backward(nb0, dys[0], grads, None, None)
    c0 = collective(db0, mlp1, nb1.index)
    # B1: nb1.mlp' + AR(db0)
    db1, dh1 = mlp_backward(nb1, dys[1], grads, c0, plan.launch_op(mlp1))
    issue_at_end(c0)
    db0_full = c0.wait()
    c1 = collective(db1, attn0, nb0.index)
    # B2: nb0.attn' + AR(db1)
    dx0, da0 = _attn_backward(nb0, dh0, db0_full, grads, c1, plan.launch_op(attn0))
    issue_at_end(c1)
    db1_full = c1.wait()
    c2 = collective(da0, attn1, nb1.index)
    # B3: nb1.attn' + AR(da0)
    dx1, da1 = _attn_backward(nb1, dh1, db1_full, grads, c2, plan.launch_op(attn1))
    issue_at_end(c2)
    da0_full = c2.wait()
    # exposed: the planner overlaps it with the next layer's first compute (nb0's
    # recomputed attention, or without recompute its MLP backward)
    end = plan.layer_end_backward(plan.key("fwd_attn", 0), plan.key("bwd_mlp", nb0.index))
    da1_full = collective(da1, end, nb0.index).wait()
    return (input_norm_backward(nb0, dx0, da0_full, grads),
            input_norm_backward(nb1, dx1, da1_full, grads))


def mlp_backward(nb: Nanobatch, dy: Tensor, grads: Grads, pending: Pending | None,
                  launch: str | None) -> tuple[Tensor, Tensor]:
    """nbX.mlp': the MLP residual and core backward -> partial d(MLP norm output) and the
    residual's d(h)."""
    nb.build(PIECES[3:])
    core = nb.pieces["mlp_core"]
    hook_backward_slot(core.taps, launch, pending)
    dh, dm = grads(nb.pieces["mlp_res"], dy)
    db, = grads(core, dm)
    return db, dh


def _attn_backward(nb: Nanobatch, dh_res: Tensor, db_full: Tensor, grads: Grads,
                   pending: Pending | None, launch: str | None) -> tuple[Tensor, Tensor]:
    """nbX.attn': the MLP norm backward, the attention residual and core backward -> the
    residual's d(x) and partial d(attention norm output)."""
    if pending is not None and launch is not None and launch not in BACKWARD_TAPS:
        pending.issue()  # a norm or residual slot (pre_mlp_norm_bwd): the partition's start
    gh, = grads(nb.pieces["mlp_norm"], db_full)
    nb.build(PIECES[:3])
    core = nb.pieces["attn_core"]
    hook_backward_slot(core.taps, launch if launch in BACKWARD_TAPS else None, pending)
    dx, dr = grads(nb.pieces["attn_res"], dh_res + gh)
    return dx, nb.attn_core_backward(grads, dr)


def input_norm_backward(nb: Nanobatch, dx_res: Tensor, da_full: Tensor, grads: Grads
                         ) -> Tensor:
    gx, = grads(nb.pieces["attn_norm"], da_full)
    return dx_res + gx
