"""The overlapped schedule with tensor parallelism only (CP=1).

Two nanobatches; forward nb0.attn | nb1.attn + AR(nb0) | nb0.mlp + AR(nb1) | nb1.mlp +
AR(nb0) | AR(nb1); backward nb0.mlp' | nb1.mlp' + AR(dnb0) | nb0.attn' + AR(dnb1) |
nb1.attn' + AR(dnb0) | AR(dnb1) | input-norm backward (docs/workload.md). Each all-reduce
is issued before the compute op the plan's slot names and waited for at the end of its
partition. The backward recomputes each segment from its saved input (full recompute, as
Kareus runs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import (
    GradientSums,
    OverlapLayer,
    PartitionCollectives,
    Pending,
    Taps,
    hook_backward_slot,
    issue_at_end,
    issue_before,
    layer_params,
)
from kareus.runtime.primitives import norm_backward, rmsnorm, rotary


def attn_segment(layer: OverlapLayer, x: torch.Tensor, launch_op: str | None,
                 pending: Pending | None) -> torch.Tensor:
    """One nanobatch's attention segment (input norm to output projection), op by op so
    that ``pending`` is issued exactly before ``launch_op``; the partial projection."""
    issue_before(pending, launch_op, "residual_mlp")
    issue_before(pending, launch_op, "input_norm")
    a = rmsnorm(x, layer.norm1)
    issue_before(pending, launch_op, "qkv")
    b, s, _ = a.shape
    qkv = a @ layer.wqkv
    q, k, v = torch.split(qkv, [layer.heads * layer.d, layer.kv * layer.d,
                                layer.kv * layer.d], dim=-1)
    issue_before(pending, launch_op, "rope")
    q = rotary(q.reshape(b, s, layer.heads, layer.d))
    k = rotary(k.reshape(b, s, layer.kv, layer.d))
    v = v.reshape(b, s, layer.kv, layer.d)
    issue_before(pending, launch_op, "core_attn")
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), is_causal=True,
                                       enable_gqa=layer.heads != layer.kv)
    o = o.transpose(1, 2).reshape(b, s, layer.heads * layer.d)
    issue_before(pending, launch_op, "out_proj")
    out = o @ layer.wo
    issue_at_end(pending)
    return out


def mlp_segment(layer: OverlapLayer, x: torch.Tensor, reduced: torch.Tensor,
                launch_op: str | None, pending: Pending | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One nanobatch's MLP segment (residual to FC2): the residual stream h and the
    partial FC2 output."""
    issue_before(pending, launch_op, "residual_attn")
    h = x + reduced
    issue_before(pending, launch_op, "pre_mlp_norm")
    bn = rmsnorm(h, layer.norm2)
    issue_before(pending, launch_op, "fc1")
    gu = bn @ layer.w1
    gate, up = gu.chunk(2, dim=-1)
    issue_before(pending, launch_op, "swiglu")
    sw = F.silu(gate) * up
    issue_before(pending, launch_op, "fc2")
    out = sw @ layer.w2
    issue_at_end(pending)
    return h, out


class OverlappedTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: OverlapLayer, plan: LayerPlan,
                *params: torch.Tensor) -> torch.Tensor:
        x0, x1 = x.detach().chunk(2, dim=0)
        coll = PartitionCollectives(layer, plan)
        with torch.no_grad():
            # P0: nb0.attn (solo)
            p0 = attn_segment(layer, x0, None, None)
            c0 = coll("all_reduce", p0, "fwd_attn")
            # P1: nb1.attn + AR(p0)
            p1 = attn_segment(layer, x1, plan.launch_op("fwd_attn"), c0)
            r0 = c0.wait()
            c1 = coll("all_reduce", p1, "fwd_mlp")
            # P2: nb0.mlp + AR(p1)
            h0, m0 = mlp_segment(layer, x0, r0, plan.launch_op("fwd_mlp"), c1)
            r1 = c1.wait()
            c2 = coll("all_reduce", m0, "fwd_mlp")
            # P3: nb1.mlp + AR(m0)
            h1, m1 = mlp_segment(layer, x1, r1, plan.launch_op("fwd_mlp"), c2)
            r2 = c2.wait()
            r3 = coll("all_reduce", m1, "fwd_mlp").wait()  # exposed
            y = torch.cat([h0 + r2, h1 + r3], dim=0)
        ctx.layer, ctx.plan = layer, plan
        ctx.save_for_backward(x0, x1, h0, h1)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x0, x1, h0, h1 = ctx.saved_tensors
        run = _Backward(ctx.layer, ctx.plan)
        dx = run(x0, x1, h0, h1, dy)
        return (dx, None, None, *run.grads.ordered())


class _Backward:
    """The backward partitions of `OverlappedTP` in order, summing parameter gradients."""

    def __init__(self, layer: OverlapLayer, plan: LayerPlan) -> None:
        self.layer, self.plan = layer, plan
        self.coll = PartitionCollectives(layer, plan)
        self.grads = GradientSums(layer_params(layer))

    def __call__(self, x0: torch.Tensor, x1: torch.Tensor, h0: torch.Tensor,
                 h1: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        coll, plan = self.coll, self.plan
        dy0, dy1 = dy.chunk(2, dim=0)
        mlp_launch = plan.launch_op("bwd_mlp")
        attn_launch = plan.launch_op("bwd_attn")
        # B0: nb0.mlp' (solo)
        db0 = self.mlp(h0, dy0, None, None)
        c0 = coll("all_reduce", db0, "bwd_mlp")
        # B1: nb1.mlp' + AR(db0)
        db1 = self.mlp(h1, dy1, c0, mlp_launch)
        db0_full = c0.wait()
        c1 = coll("all_reduce", db1, "bwd_attn")
        # B2: nb0.attn' + AR(db1)
        dh0, da0 = self.attn(x0, h0, dy0, db0_full, c1, attn_launch)
        db1_full = c1.wait()
        c2 = coll("all_reduce", da0, "bwd_attn")
        # B3: nb1.attn' + AR(da0)
        dh1, da1 = self.attn(x1, h1, dy1, db1_full, c2, attn_launch)
        da0_full = c2.wait()
        da1_full = coll("all_reduce", da1, "bwd_attn").wait()  # exposed
        return torch.cat([self.input_norm(x0, dh0, da0_full),
                          self.input_norm(x1, dh1, da1_full)], dim=0)

    def mlp(self, h: torch.Tensor, dy: torch.Tensor, pending: Pending | None,
            launch: str | None) -> torch.Tensor:
        """nbX.mlp': fc2, swiglu, fc1 backward -> partial d(norm2 output)."""
        layer = self.layer
        with torch.enable_grad():
            bn = rmsnorm(h, layer.norm2).detach().requires_grad_(True)
            taps: Taps = {}
            m = layer.mlp_core(bn, taps)
            hook_backward_slot(taps, launch, pending)
            g = torch.autograd.grad(m, [bn, layer.w1, layer.w2], dy)
        self.grads.add([layer.w1, layer.w2], g[1:])
        return g[0]

    def attn(self, x: torch.Tensor, h: torch.Tensor, dy: torch.Tensor,
             db_full: torch.Tensor, pending: Pending | None, launch: str | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """nbX.attn': norm2 backward + residual, then out_proj, attention, rope, qkv
        backward -> d(h) and partial d(norm1 output)."""
        layer = self.layer
        if pending is not None and launch in ("pre_mlp_norm_bwd", "residual_attn_bwd"):
            pending.issue()
        gh, gn2 = norm_backward(h, layer.norm2, db_full)
        dh = dy + gh
        self.grads.add([layer.norm2], [gn2])
        with torch.enable_grad():
            a = rmsnorm(x, layer.norm1).detach().requires_grad_(True)
            taps: Taps = {}
            p = layer.attn_core(a, taps)
            hook_backward_slot(taps, launch, pending)
            g = torch.autograd.grad(p, [a, layer.wqkv, layer.wo], dh)
        self.grads.add([layer.wqkv, layer.wo], g[1:])
        return dh, g[0]

    def input_norm(self, x: torch.Tensor, dh: torch.Tensor, da_full: torch.Tensor
                   ) -> torch.Tensor:
        gx, gn1 = norm_backward(x, self.layer.norm1, da_full)
        self.grads.add([self.layer.norm1], [gn1])
        return dh + gx
