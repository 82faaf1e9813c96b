"""The overlapped schedule with context parallelism (all-gather mode).

Segments per nanobatch (docs/workload.md), forward: qkv [norm, QKV, rotary] -> CP
all-gather of K, V | ao [attention, output projection] -> TP all-reduce | mlp -> TP
all-reduce; backward: mlp' -> TP all-reduce | o' [norm backward, output projection
backward] -> CP all-gather of K, V again | a' [attention backward] -> CP reduce-scatter of
dK, dV | qkv' [rotary, QKV backward] -> TP all-reduce | input-norm backward. Partitions
pair each segment with the other nanobatch's previous collective, exactly as
kareus.partition keys them (fwd_qkv_ag, fwd_ao_ag, fwd_ao_ar, fwd_mlp, bwd_mlp, bwd_o_ar,
bwd_o_ag, bwd_a_ag, bwd_a_rs, bwd_qkv_rs, bwd_qkv_ar). Each collective is issued
asynchronously before the op its partition's slot names and waited for at the
partition's end.
"""

from __future__ import annotations

import torch

from kareus.runtime.layer import Pending, _hook, norm_backward, rmsnorm


class OverlappedCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer, plan, *params):
        xs = x.detach().chunk(2, dim=0)
        coll = _collectives(layer, plan)

        def at(key, name, pending):
            if pending is not None and plan.launch_op(key) == name:
                pending.issue()

        def seg_qkv(nb, key, pending):
            at(key, "residual_mlp", pending)
            at(key, "input_norm", pending)
            a = rmsnorm(xs[nb], layer.norm1)
            at(key, "qkv", pending)
            at(key, "rope", pending)  # QKV and rotary run inside qkv_core
            q, kv = layer.qkv_core(a)
            return q, kv

        attn_out = [None, None]

        def seg_ao(nb, key, q, kv_full, pending):
            at(key, "core_attn", pending)
            o = layer.attention(q, kv_full)
            attn_out[nb] = o  # kept for the output projection's weight gradient
            at(key, "out_proj", pending)
            return o @ layer.wo

        def seg_mlp(nb, key, reduced, pending):
            at(key, "residual_attn", pending)
            h = xs[nb] + reduced
            at(key, "pre_mlp_norm", pending)
            bn = rmsnorm(h, layer.norm2)
            at(key, "fc1", pending)
            gu = bn @ layer.w1
            gate, up = gu.chunk(2, dim=-1)
            at(key, "swiglu", pending)
            sw = torch.nn.functional.silu(gate) * up
            at(key, "fc2", pending)
            return h, sw @ layer.w2

        def done(pending):
            if pending is not None:
                pending.issue()  # "none": after the partition's compute

        with torch.no_grad():
            q0, kv0 = seg_qkv(0, "fwd_qkv_ag", None)                        # solo
            ag0 = coll("all_gather", kv0, "fwd_qkv_ag")
            q1, kv1 = seg_qkv(1, "fwd_qkv_ag", ag0)
            done(ag0)
            kv0f = ag0.wait()
            ag1 = coll("all_gather", kv1, "fwd_ao_ag")
            p0 = seg_ao(0, "fwd_ao_ag", q0, kv0f, ag1)
            done(ag1)
            kv1f = ag1.wait()
            ar0 = coll("all_reduce", p0, "fwd_ao_ar")
            p1 = seg_ao(1, "fwd_ao_ar", q1, kv1f, ar0)
            done(ar0)
            ar1 = coll("all_reduce", p1, "fwd_mlp")
            h0, m0 = seg_mlp(0, "fwd_mlp", ar0.wait(), ar1)
            done(ar1)
            ar2 = coll("all_reduce", m0, "fwd_mlp")
            h1, m1 = seg_mlp(1, "fwd_mlp", ar1.wait(), ar2)
            done(ar2)
            y0 = h0 + ar2.wait()
            y1 = h1 + coll("all_reduce", m1, "fwd_mlp").wait()                   # exposed
        ctx.layer, ctx.plan = layer, plan
        ctx.save_for_backward(*xs, h0, h1, *attn_out)
        return torch.cat([y0, y1], dim=0)

    @staticmethod
    def backward(ctx, dy):
        layer, plan = ctx.layer, ctx.plan
        coll = _collectives(layer, plan)
        x0, x1, h0, h1, o0, o1 = ctx.saved_tensors
        xs, hs, outs = (x0, x1), (h0, h1), (o0, o1)
        dys = dy.chunk(2, dim=0)
        order = [layer.wqkv, layer.wo, layer.w1, layer.w2, layer.norm1, layer.norm2]
        grads = {id(w): torch.zeros_like(w) for w in order}

        def acc(params, gs):
            for w, g in zip(params, gs):
                if g is not None:
                    grads[id(w)] += g

        def start(key, pending, names):
            """Slots at the very start of a backward partition."""
            if pending is not None and plan.launch_op(key) in names:
                pending.issue()

        def finish(pending):
            if pending is not None:
                pending.issue()

        def mlp_bwd(nb, key, pending):
            start(key, pending, ("input_norm_bwd", "residual_mlp_bwd"))
            with torch.enable_grad():
                bn = rmsnorm(hs[nb], layer.norm2).detach().requires_grad_(True)
                taps: dict = {}
                m = layer.mlp_core(bn, taps)
                _hook(taps, plan.launch_op(key), pending)
                g = torch.autograd.grad(m, [bn, layer.w1, layer.w2], dys[nb])
            acc([layer.w1, layer.w2], g[1:])
            finish(pending)
            return g[0]

        def o_bwd(nb, key, db_full, pending):
            """norm2 backward + residual, output projection backward -> dh, d(attention
            output); also recomputes q and this rank's K, V for what follows."""
            start(key, pending, ("pre_mlp_norm_bwd", "residual_attn_bwd"))
            gh, gn2 = norm_backward(hs[nb], layer.norm2, db_full)
            grads[id(layer.norm2)] += gn2
            dh = dys[nb] + gh
            start(key, pending, ("out_proj_bwd",))
            with torch.enable_grad():
                o = outs[nb].detach().requires_grad_(True)
                go, gwo = torch.autograd.grad(o @ layer.wo, [o, layer.wo], dh)
            grads[id(layer.wo)] += gwo
            with torch.no_grad():
                q, kv = layer.qkv_core(rmsnorm(xs[nb], layer.norm1))
            finish(pending)
            return dh, go, q, kv

        def a_bwd(nb, key, q, kv_full, do, pending):
            start(key, pending, ("core_attn_bwd",))
            with torch.enable_grad():
                qq = q.detach().requires_grad_(True)
                kk = kv_full.detach().requires_grad_(True)
                o = layer.attention(qq, kk)
                gq, gkv = torch.autograd.grad(o, [qq, kk], do)
            finish(pending)
            return gq, gkv

        def qkv_bwd(nb, key, dq, dkv_local, pending):
            start(key, pending, ("rope_bwd",))
            with torch.enable_grad():
                a = rmsnorm(xs[nb], layer.norm1).detach().requires_grad_(True)
                taps: dict = {}
                q, kv = layer.qkv_core(a, taps)
                _hook(taps, plan.launch_op(key), pending)
                g = torch.autograd.grad([q, kv], [a, layer.wqkv], [dq, dkv_local])
            grads[id(layer.wqkv)] += g[1]
            finish(pending)
            return g[0]

        db0 = mlp_bwd(0, "bwd_mlp", None)                                    # solo
        c = coll("all_reduce", db0, "bwd_mlp")
        db1 = mlp_bwd(1, "bwd_mlp", c)
        db0 = c.wait()
        c = coll("all_reduce", db1, "bwd_o_ar")
        dh0, do0, q0, kv0 = o_bwd(0, "bwd_o_ar", db0, c)
        db1 = c.wait()
        c = coll("all_gather", kv0, "bwd_o_ag")
        dh1, do1, q1, kv1 = o_bwd(1, "bwd_o_ag", db1, c)
        kv0f = c.wait()
        c = coll("all_gather", kv1, "bwd_a_ag")
        dq0, dkv0 = a_bwd(0, "bwd_a_ag", q0, kv0f, do0, c)
        kv1f = c.wait()
        c = coll("reduce_scatter", dkv0, "bwd_a_rs")
        dq1, dkv1 = a_bwd(1, "bwd_a_rs", q1, kv1f, do1, c)
        dkv0l = c.wait()
        c = coll("reduce_scatter", dkv1, "bwd_qkv_rs")
        da0 = qkv_bwd(0, "bwd_qkv_rs", dq0, dkv0l, c)
        dkv1l = c.wait()
        c = coll("all_reduce", da0, "bwd_qkv_ar")
        da1 = qkv_bwd(1, "bwd_qkv_ar", dq1, dkv1l, c)
        da0 = c.wait()
        da1 = coll("all_reduce", da1, "bwd_qkv_ar").wait()                          # exposed
        dxs = []
        for nb, dh, da in ((0, dh0, da0), (1, dh1, da1)):
            gx, gn1 = norm_backward(xs[nb], layer.norm1, da)
            grads[id(layer.norm1)] += gn1
            dxs.append(dh + gx)
        return (torch.cat(dxs, dim=0), None, None, *[grads[id(w)] for w in order])


def _collectives(layer, plan):
    """A factory of the partition collectives, on the TP or CP group (and, where given, the
    group for the plan's SM count of the partition that hides it)."""

    def make(kind: str, tensor, key: str) -> Pending:
        if kind == "all_reduce":
            return Pending(kind, tensor, layer.group, plan.sms(key), layer.groups_by_sms)
        return Pending(kind, tensor, layer.cp_group, plan.sms(key), layer.cp_groups_by_sms)

    return make
