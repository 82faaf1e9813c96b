"""The overlapped schedule with tensor parallelism only (CP=1), over any layer that offers
its ops without their communication (`TPLayerOps`): the project's `LlamaLayer`, and
Megatron-Core's `TransformerLayer` (kareus.integrations.megatron).

Two nanobatches; forward nb0.attn | nb1.attn + AR(nb0) | nb0.mlp + AR(nb1) | nb1.mlp +
AR(nb0) | AR(nb1); backward nb0.mlp' | nb1.mlp' + AR(dnb0) | nb0.attn' + AR(dnb1) |
nb1.attn' + AR(dnb0) | AR(dnb1) | input-norm backward (docs/workload.md). Each all-reduce
is issued before the compute op the plan's slot names and waited for at the end of its
partition: in the forward from the ops' ``before(name)`` calls, in the backward from a
gradient hook on the forward tensor whose backward the slot names.

A nanobatch's layer is cut into six pieces at the points where a collective sits: the
attention norm, the attention core (QKV to the partial output projection), the attention
residual, and the same three for the MLP. The backward differentiates them piece by piece,
in the schedule's order. Where the pieces' autograd graphs come from is the caller's
choice (``keep_graphs``):
- kept from the forward (run with grad enabled): nothing is computed twice. This is what
  Megatron's full recompute needs: its checkpoint re-runs the layer's forward before the
  backward, and that re-run keeps the graphs;
- rebuilt in the backward from the saved piece inputs (the layer's own full recompute:
  `LlamaLayer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import (
    BACKWARD_TAPS,
    GroupsBySms,
    Pending,
    Taps,
    hook_backward_slot,
    issue_before,
)
from kareus.runtime.primitives import Group, world_size

Before = Callable[[str], None]
"""Called with a compute op's name just before it runs (the forward's slot hook)."""



def no_slot(_name: str) -> None:
    """A `Before` that does nothing (a piece run outside a partition's slot)."""


class TPLayerOps(Protocol):
    """A decoder layer's ops as the TP schedule runs them: none communicates. The two
    cores return this rank's partial sums (row-parallel linears without their
    all-reduce) and take a norm output whose gradient they return partial
    (column-parallel linears without their backward all-reduce)."""

    group: Group
    """The tensor-parallel group."""
    groups_by_sms: GroupsBySms | None
    """The group whose NCCL communicator runs a collective on that many SMs (None: the
    layer's own group for every collective)."""
    batch_dim: int
    """The batch dimension of the layer's input (split into the two nanobatches)."""

    def attn_norm(self, x: Tensor) -> Tensor: ...

    def attn_partial(self, a: Tensor, before: Before, taps: Taps) -> Tensor:
        """Norm output -> partial output projection; calls ``before`` with "qkv", "rope",
        "core_attn", "out_proj" and fills ``taps`` with the tensors of those names."""
        ...

    def attn_residual(self, x: Tensor, reduced: Tensor) -> Tensor: ...

    def mlp_norm(self, h: Tensor) -> Tensor: ...

    def mlp_partial(self, bn: Tensor, before: Before, taps: Taps) -> Tensor:
        """Norm output -> partial FC2 output; calls ``before`` with "fc1", "swiglu",
        "fc2" and fills ``taps`` with the tensors of those names."""
        ...

    def mlp_residual(self, h: Tensor, reduced: Tensor) -> Tensor: ...

    def nanobatch(self, index: int) -> TPLayerOps:
        """The ops of nanobatch ``index`` (0 or 1): inputs given per batch element (an
        attention mask per sample) cut to that half; self where there are none."""
        ...


PIECES = ("attn_norm", "attn_core", "attn_res", "mlp_norm", "mlp_core", "mlp_res")


@dataclass
class _Piece:
    """One piece of one nanobatch: its leaf inputs and output (a graph when built with
    grad enabled) and its tapped intermediates."""

    inputs: list[Tensor]
    output: Tensor
    taps: Taps = field(default_factory=dict)


def _leaf(t: Tensor) -> Tensor:
    return t.detach().requires_grad_(torch.is_grad_enabled())


class _Nanobatch:
    """The six pieces of one nanobatch, built in the forward and, where they were not
    kept, again in the backward from the saved inputs (`build`)."""

    def __init__(self, ops: TPLayerOps, x: Tensor) -> None:
        self.ops, self.x = ops, x
        self.pieces: dict[str, _Piece] = {}
        self.reduced: dict[str, Tensor] = {}
        """The all-reduced core outputs (the residuals' second input)."""

    def attention(self, before: Before) -> Tensor:
        """The attention norm and core: the partial output projection."""
        before("residual_mlp")
        before("input_norm")
        return self._norm_and_core("attn", self.x, self.ops.attn_norm,
                                   self.ops.attn_partial, before)

    def _norm_and_core(self, half: str, x: Tensor, norm: Callable[[Tensor], Tensor],
                       core: Callable[[Tensor, Before, Taps], Tensor], before: Before
                       ) -> Tensor:
        """``half``'s norm piece and core piece (cut between them: the core's input
        gradient is partial and all-reduced before the norm's backward)."""
        x_in = _leaf(x)
        n = norm(x_in)
        self.pieces[f"{half}_norm"] = _Piece([x_in], n)
        n_in = _leaf(n)
        taps: Taps = {}
        out = core(n_in, before, taps)
        self.pieces[f"{half}_core"] = _Piece([n_in], out, taps)
        return out

    def attn_residual(self, reduced: Tensor, before: Before) -> Tensor:
        self.reduced["attn"] = reduced
        before("residual_attn")
        x, r = _leaf(self.x), _leaf(reduced)
        h = self.ops.attn_residual(x, r)
        self.pieces["attn_res"] = _Piece([x, r], h)
        self.h = h.detach()
        return self.h

    def mlp(self, before: Before) -> Tensor:
        """The MLP norm and core: the partial FC2 output."""
        before("pre_mlp_norm")
        return self._norm_and_core("mlp", self.h, self.ops.mlp_norm, self.ops.mlp_partial,
                                   before)

    def mlp_residual(self, reduced: Tensor) -> Tensor:
        self.reduced["mlp"] = reduced
        h, r = _leaf(self.h), _leaf(reduced)
        y = self.ops.mlp_residual(h, r)
        self.pieces["mlp_res"] = _Piece([h, r], y)
        return y.detach()

    def build(self, names: Sequence[str]) -> None:
        """The pieces ``names`` (of one of the halves, attention or MLP) with their graphs,
        from the saved inputs: where the forward kept none."""
        if all(n in self.pieces for n in names):
            return
        with torch.enable_grad():
            if names[0] == "attn_norm":
                self.attention(no_slot)
                self.attn_residual(self.reduced["attn"], no_slot)
            else:
                self.mlp(no_slot)
                self.mlp_residual(self.reduced["mlp"])

    def drop(self) -> None:
        """Forget the pieces (recompute mode keeps only the inputs across the pass)."""
        self.pieces.clear()


class _Grads:
    """Differentiates pieces, summing the parameters' gradients."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.sums: list[Tensor | None] = [None] * len(self.params)

    def __call__(self, piece: _Piece, grad: Tensor) -> list[Tensor]:
        """The gradients of the piece's inputs; its parameters' are added to the sums."""
        wanted = [*piece.inputs, *(p for p in self.params if p.requires_grad)]
        got = torch.autograd.grad(piece.output, wanted, grad, allow_unused=True)
        n = len(piece.inputs)
        trained = (i for i, p in enumerate(self.params) if p.requires_grad)
        for i, g in zip(trained, got[n:]):
            if g is not None:
                s = self.sums[i]
                self.sums[i] = g if s is None else s + g
        return [torch.zeros_like(t) if g is None else g for t, g in zip(piece.inputs, got)]


class OverlappedTP(torch.autograd.Function):
    """``OverlappedTP.apply(x, ops, plan, keep_graphs, *params)``: the layer's output;
    ``params`` are every parameter the ops use (their gradients are returned)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ops: TPLayerOps, plan: LayerPlan, keep_graphs: bool,
                *params: Tensor) -> Tensor:
        dim = ops.batch_dim
        if x.shape[dim] < 2 or x.shape[dim] % 2:
            raise ValueError(f"the partitioned overlap splits the batch (dimension {dim}) "
                             f"into two nanobatches: it needs an even size, not "
                             f"{x.shape[dim]}")
        # a half along a dimension other than the first is strided: every op on it would
        # be slower (and copy); one copy each now instead
        nbs = [_Nanobatch(ops.nanobatch(i), half.contiguous())
               for i, half in enumerate(x.detach().chunk(2, dim=dim))]
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
        nbs: list[_Nanobatch] = ctx.nbs
        grads = _Grads(ctx.params)
        dys = tuple(half.contiguous() for half in dy.chunk(2, dim=ctx.dim))
        dx = _backward(nbs, _Collectives(ctx.ops, ctx.plan), ctx.plan, grads, dys, ctx.dim)
        _sum_partial_grads(ctx.ops, grads)
        ctx.nbs = None  # the graphs go with the pass
        return (dx, None, None, None, *grads.sums)


def _sum_partial_grads(ops: TPLayerOps, grads: _Grads) -> None:
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

    def __call__(self, tensor: Tensor, key: str) -> Pending:
        # reduced in place, as Megatron's row-parallel linears do: where the tensor is a
        # kept graph's output, its value is not used by that graph's backward (a linear
        # saves its input, not its output; were it saved, autograd's version check would
        # refuse the backward rather than compute a wrong gradient)
        return Pending("all_reduce", tensor.detach(), self.ops.group, self.plan.sms(key),
                       self.ops.groups_by_sms)


def _slot(pending: Pending | None, launch_op: str | None) -> Before:
    return lambda name: issue_before(pending, launch_op, name)


def _issue(pending: Pending | None) -> None:
    """Slot "none": after the partition's last compute op."""
    if pending is not None:
        pending.issue()


def _forward(nbs: list[_Nanobatch], collective: _Collectives, plan: LayerPlan, dim: int
             ) -> Tensor:
    nb0, nb1 = nbs
    attn_op, mlp_op = plan.launch_op("fwd_attn"), plan.launch_op("fwd_mlp")
    # P0: nb0.attn (solo)
    c0 = collective(nb0.attention(no_slot), "fwd_attn")
    # P1: nb1.attn + AR(nb0.attn)
    p1 = nb1.attention(_slot(c0, attn_op))
    _issue(c0)
    r0 = c0.wait()
    c1 = collective(p1, "fwd_mlp")
    # P2: nb0.mlp + AR(nb1.attn)
    before = _slot(c1, mlp_op)
    nb0.attn_residual(r0, before)
    m0 = nb0.mlp(before)
    _issue(c1)
    r1 = c1.wait()
    c2 = collective(m0, "fwd_mlp")
    # P3: nb1.mlp + AR(nb0.mlp)
    before = _slot(c2, mlp_op)
    nb1.attn_residual(r1, before)
    m1 = nb1.mlp(before)
    _issue(c2)
    r2 = c2.wait()
    r3 = collective(m1, "fwd_mlp").wait()  # exposed
    return torch.cat([nb0.mlp_residual(r2), nb1.mlp_residual(r3)], dim=dim)


def _backward(nbs: list[_Nanobatch], collective: _Collectives, plan: LayerPlan,
              grads: _Grads, dys: tuple[Tensor, ...], dim: int) -> Tensor:
    nb0, nb1 = nbs
    mlp_launch, attn_launch = plan.launch_op("bwd_mlp"), plan.launch_op("bwd_attn")
    # B0: nb0.mlp' (solo)
    db0, dh0 = _mlp_backward(nb0, dys[0], grads, None, None)
    c0 = collective(db0, "bwd_mlp")
    # B1: nb1.mlp' + AR(db0)
    db1, dh1 = _mlp_backward(nb1, dys[1], grads, c0, mlp_launch)
    _issue(c0)
    db0_full = c0.wait()
    c1 = collective(db1, "bwd_attn")
    # B2: nb0.attn' + AR(db1)
    dx0, da0 = _attn_backward(nb0, dh0, db0_full, grads, c1, attn_launch)
    _issue(c1)
    db1_full = c1.wait()
    c2 = collective(da0, "bwd_attn")
    # B3: nb1.attn' + AR(da0)
    dx1, da1 = _attn_backward(nb1, dh1, db1_full, grads, c2, attn_launch)
    _issue(c2)
    da0_full = c2.wait()
    da1_full = collective(da1, "bwd_attn").wait()  # exposed
    return torch.cat([_input_norm_backward(nb0, dx0, da0_full, grads),
                      _input_norm_backward(nb1, dx1, da1_full, grads)], dim=dim)


def _mlp_backward(nb: _Nanobatch, dy: Tensor, grads: _Grads, pending: Pending | None,
                  launch: str | None) -> tuple[Tensor, Tensor]:
    """nbX.mlp': the MLP residual and core backward -> partial d(MLP norm output) and the
    residual's d(h)."""
    nb.build(PIECES[3:])
    core = nb.pieces["mlp_core"]
    hook_backward_slot(core.taps, launch, pending)
    dh, dm = grads(nb.pieces["mlp_res"], dy)
    db, = grads(core, dm)
    return db, dh


def _attn_backward(nb: _Nanobatch, dh_res: Tensor, db_full: Tensor, grads: _Grads,
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
    da, = grads(core, dr)
    return dx, da


def _input_norm_backward(nb: _Nanobatch, dx_res: Tensor, da_full: Tensor, grads: _Grads
                         ) -> Tensor:
    gx, = grads(nb.pieces["attn_norm"], da_full)
    return dx_res + gx
