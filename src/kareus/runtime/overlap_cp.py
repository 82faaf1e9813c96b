"""The overlapped schedule with context parallelism (all-gather mode).

Segments per nanobatch (docs/workload.md), forward: qkv [norm, QKV, rotary] -> CP
all-gather of K, V | ao [attention, output projection] -> TP all-reduce | mlp -> TP
all-reduce; backward: mlp' -> TP all-reduce | o' [norm backward, output projection
backward] -> CP all-gather of K, V again | a' [attention backward] -> CP reduce-scatter of
dK, dV | qkv' [rotary, QKV backward] -> TP all-reduce | input-norm backward. Partitions
pair each segment with the other nanobatch's previous collective, exactly as
kareus.workload.partition keys them (fwd_qkv_ag, fwd_ao_ag, fwd_ao_ar, fwd_mlp, bwd_mlp, bwd_o_ar,
bwd_o_ag, bwd_a_ag, bwd_a_rs, bwd_qkv_rs, bwd_qkv_ar). Each collective is issued
asynchronously before the op its partition's slot names and waited for at the
partition's end.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

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
from kareus.runtime.primitives import norm_backward, rmsnorm


class OverlappedCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: OverlapLayer, plan: LayerPlan,
                *params: Tensor) -> Tensor:
        xs = x.detach().chunk(2, dim=0)
        run = _Forward(layer, plan, (xs[0], xs[1]))
        with torch.no_grad():
            y, (h0, h1) = run()
        ctx.layer, ctx.plan = layer, plan
        ctx.save_for_backward(*xs, h0, h1, run.attn_out[0], run.attn_out[1])
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x0, x1, h0, h1, o0, o1 = ctx.saved_tensors
        dys = dy.chunk(2, dim=0)
        run = _Backward(ctx.layer, ctx.plan, (x0, x1), (h0, h1), (o0, o1), (dys[0], dys[1]))
        return (run(), None, None, *run.grads.ordered())


Pair = tuple[Tensor, Tensor]


class _Forward:
    """The forward partitions in order."""

    def __init__(self, layer: OverlapLayer, plan: LayerPlan, xs: Pair) -> None:
        self.layer, self.plan, self.xs = layer, plan, xs
        self.coll = PartitionCollectives(layer, plan)
        self.attn_out: dict[int, Tensor] = {}
        """Per nanobatch: the attention output (for the output projection's weight
        gradient)."""

    def at(self, key: str, name: str, pending: Pending | None) -> None:
        issue_before(pending, self.plan.launch_op(key), name)

    def __call__(self) -> tuple[Tensor, Pair]:
        coll = self.coll
        q0, kv0 = self.qkv(0, "fwd_qkv_ag", None)                              # solo
        ag0 = coll("all_gather", kv0, "fwd_qkv_ag")
        q1, kv1 = self.qkv(1, "fwd_qkv_ag", ag0)
        issue_at_end(ag0)
        kv0f = ag0.wait()
        ag1 = coll("all_gather", kv1, "fwd_ao_ag")
        p0 = self.ao(0, "fwd_ao_ag", q0, kv0f, ag1)
        issue_at_end(ag1)
        kv1f = ag1.wait()
        ar0 = coll("all_reduce", p0, "fwd_ao_ar")
        p1 = self.ao(1, "fwd_ao_ar", q1, kv1f, ar0)
        issue_at_end(ar0)
        ar1 = coll("all_reduce", p1, "fwd_mlp")
        h0, m0 = self.mlp(0, "fwd_mlp", ar0.wait(), ar1)
        issue_at_end(ar1)
        ar2 = coll("all_reduce", m0, "fwd_mlp")
        h1, m1 = self.mlp(1, "fwd_mlp", ar1.wait(), ar2)
        issue_at_end(ar2)
        y0 = h0 + ar2.wait()
        y1 = h1 + coll("all_reduce", m1, "fwd_mlp").wait()                     # exposed
        return torch.cat([y0, y1], dim=0), (h0, h1)

    def qkv(self, nb: int, key: str, pending: Pending | None) -> Pair:
        layer = self.layer
        self.at(key, "residual_mlp", pending)
        self.at(key, "input_norm", pending)
        a = rmsnorm(self.xs[nb], layer.norm1)
        self.at(key, "qkv", pending)
        self.at(key, "rope", pending)  # QKV and rotary run inside qkv_core
        return layer.qkv_core(a)

    def ao(self, nb: int, key: str, q: Tensor, kv_full: Tensor, pending: Pending | None
           ) -> Tensor:
        self.at(key, "core_attn", pending)
        o = self.layer.attention(q, kv_full)
        self.attn_out[nb] = o
        self.at(key, "out_proj", pending)
        return o @ self.layer.wo

    def mlp(self, nb: int, key: str, reduced: Tensor, pending: Pending | None) -> Pair:
        layer = self.layer
        self.at(key, "residual_attn", pending)
        h = self.xs[nb] + reduced
        self.at(key, "pre_mlp_norm", pending)
        bn = rmsnorm(h, layer.norm2)
        self.at(key, "fc1", pending)
        gu = bn @ layer.w1
        gate, up = gu.chunk(2, dim=-1)
        self.at(key, "swiglu", pending)
        sw = torch.nn.functional.silu(gate) * up
        self.at(key, "fc2", pending)
        return h, sw @ layer.w2


class _Backward:
    """The backward partitions in order, recomputing each segment from its saved input
    and summing parameter gradients."""

    def __init__(self, layer: OverlapLayer, plan: LayerPlan, xs: Pair, hs: Pair,
                 outs: Pair, dys: Pair) -> None:
        self.layer, self.plan = layer, plan
        self.xs, self.hs, self.outs, self.dys = xs, hs, outs, dys
        self.coll = PartitionCollectives(layer, plan)
        self.grads = GradientSums(layer_params(layer))

    def __call__(self) -> Tensor:
        coll = self.coll
        db0 = self.mlp(0, "bwd_mlp", None)                                     # solo
        c = coll("all_reduce", db0, "bwd_mlp")
        db1 = self.mlp(1, "bwd_mlp", c)
        db0 = c.wait()
        c = coll("all_reduce", db1, "bwd_o_ar")
        dh0, do0, q0, kv0 = self.o(0, "bwd_o_ar", db0, c)
        db1 = c.wait()
        c = coll("all_gather", kv0, "bwd_o_ag")
        dh1, do1, q1, kv1 = self.o(1, "bwd_o_ag", db1, c)
        kv0f = c.wait()
        c = coll("all_gather", kv1, "bwd_a_ag")
        dq0, dkv0 = self.a("bwd_a_ag", q0, kv0f, do0, c)
        kv1f = c.wait()
        c = coll("reduce_scatter", dkv0, "bwd_a_rs")
        dq1, dkv1 = self.a("bwd_a_rs", q1, kv1f, do1, c)
        dkv0l = c.wait()
        c = coll("reduce_scatter", dkv1, "bwd_qkv_rs")
        da0 = self.qkv(0, "bwd_qkv_rs", dq0, dkv0l, c)
        dkv1l = c.wait()
        c = coll("all_reduce", da0, "bwd_qkv_ar")
        da1 = self.qkv(1, "bwd_qkv_ar", dq1, dkv1l, c)
        da0 = c.wait()
        da1 = coll("all_reduce", da1, "bwd_qkv_ar").wait()                     # exposed
        dxs = []
        for nb, dh, da in ((0, dh0, da0), (1, dh1, da1)):
            gx, gn1 = norm_backward(self.xs[nb], self.layer.norm1, da)
            self.grads.add([self.layer.norm1], [gn1])
            dxs.append(dh + gx)
        return torch.cat(dxs, dim=0)

    def start(self, key: str, pending: Pending | None, names: tuple[str, ...]) -> None:
        """Slots at the very start of a backward partition (or of a piece of it)."""
        if pending is not None and self.plan.launch_op(key) in names:
            pending.issue()

    def mlp(self, nb: int, key: str, pending: Pending | None) -> Tensor:
        layer = self.layer
        self.start(key, pending, ("input_norm_bwd", "residual_mlp_bwd"))
        with torch.enable_grad():
            bn = rmsnorm(self.hs[nb], layer.norm2).detach().requires_grad_(True)
            taps: Taps = {}
            m = layer.mlp_core(bn, taps)
            hook_backward_slot(taps, self.plan.launch_op(key), pending)
            g = torch.autograd.grad(m, [bn, layer.w1, layer.w2], self.dys[nb])
        self.grads.add([layer.w1, layer.w2], g[1:])
        issue_at_end(pending)
        return g[0]

    def o(self, nb: int, key: str, db_full: Tensor, pending: Pending | None
          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """norm2 backward + residual, output projection backward -> dh, d(attention
        output); also recomputes q and this rank's K, V for what follows."""
        layer = self.layer
        self.start(key, pending, ("pre_mlp_norm_bwd", "residual_attn_bwd"))
        gh, gn2 = norm_backward(self.hs[nb], layer.norm2, db_full)
        self.grads.add([layer.norm2], [gn2])
        dh = self.dys[nb] + gh
        self.start(key, pending, ("out_proj_dgrad",))
        with torch.enable_grad():
            o = self.outs[nb].detach().requires_grad_(True)
            go, gwo = torch.autograd.grad(o @ layer.wo, [o, layer.wo], dh)
        self.grads.add([layer.wo], [gwo])
        with torch.no_grad():
            q, kv = layer.qkv_core(rmsnorm(self.xs[nb], layer.norm1))
        issue_at_end(pending)
        return dh, go, q, kv

    def a(self, key: str, q: Tensor, kv_full: Tensor, do: Tensor, pending: Pending | None
          ) -> Pair:
        self.start(key, pending, ("core_attn_bwd",))
        with torch.enable_grad():
            qq = q.detach().requires_grad_(True)
            kk = kv_full.detach().requires_grad_(True)
            o = self.layer.attention(qq, kk)
            gq, gkv = torch.autograd.grad(o, [qq, kk], do)
        issue_at_end(pending)
        return gq, gkv

    def qkv(self, nb: int, key: str, dq: Tensor, dkv_local: Tensor, pending: Pending | None
            ) -> Tensor:
        layer = self.layer
        self.start(key, pending, ("rope_bwd",))
        with torch.enable_grad():
            a = rmsnorm(self.xs[nb], layer.norm1).detach().requires_grad_(True)
            taps: Taps = {}
            q, kv = layer.qkv_core(a, taps)
            hook_backward_slot(taps, self.plan.launch_op(key), pending)
            g = torch.autograd.grad([q, kv], [a, layer.wqkv], [dq, dkv_local])
        self.grads.add([layer.wqkv], [g[1]])
        issue_at_end(pending)
        return g[0]
