"""A Llama-style decoder layer, tensor parallel, that runs a Kareus plan's partitioned
overlap — forward and backward — and computes exactly what the plain layer computes.

Shards (Megatron): QKV and FC1 column parallel, output projection and FC2 row parallel,
norms replicated. The plain layer uses Megatron's two autograd operators (copy-to-TP:
identity forward, all-reduce of the gradient backward; reduce-from-TP: all-reduce forward,
identity backward) and blocking collectives.

The overlapped layer splits the microbatch into two nanobatches and runs Kareus's
partitions (docs/workload.md): forward nb0.attn | nb1.attn + AR(nb0) | nb0.mlp + AR(nb1) |
nb1.mlp + AR(nb0) | AR(nb1); backward nb0.mlp' | nb1.mlp' + AR(dnb0) | nb0.attn' +
AR(dnb1) | nb1.attn' + AR(dnb0) | AR(dnb1) | input-norm backward. Each collective is
issued asynchronously (NCCL runs it on its own stream; with the plan's SM count when a
group per SM setting is given) just before the compute op named by the plan's slot, and
waited for at the end of its partition. One custom autograd Function owns the whole
schedule: its backward recomputes each segment from its saved input (full recompute, as
Kareus runs) and walks the backward partitions in order, launching each gradient
all-reduce from a gradient hook on the tensor whose backward the slot names.

The overlap changes when things run, never what they compute (tested: outputs and every
gradient equal the plain layer's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        if _world(ctx.group) > 1:
            dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        if _world(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def gather_seq(t, group):
    """All-gather along the sequence (dim 1) across the CP group."""
    parts = [torch.empty_like(t) for _ in range(_world(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def scatter_seq_sum(t, group):
    """Reduce-scatter along the sequence: each rank gets the sum of its chunk (gloo has
    no reduce-scatter: there, an all-reduce and this rank's slice, the same numbers)."""
    n = _world(group)
    if dist.get_backend(group) == "gloo":
        full = t.contiguous().clone()
        dist.all_reduce(full, group=group)
        return full.chunk(n, dim=1)[_rank(group)].contiguous()
    chunks = [c.contiguous() for c in t.chunk(n, dim=1)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _GatherSeq(torch.autograd.Function):
    """CP all-gather mode: gather K, V forward; reduce-scatter their gradients backward."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return gather_seq(t, group)

    @staticmethod
    def backward(ctx, g):
        return scatter_seq_sum(g, ctx.group), None


def rmsnorm(x, w, eps: float = 1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def norm_backward(x, w, grad):
    """Gradients of ``rmsnorm(x, w)`` with respect to x and w, recomputed from x."""
    with torch.enable_grad():
        xx = x.detach().requires_grad_(True)
        return torch.autograd.grad(rmsnorm(xx, w), [xx, w], grad)


def rotary(x, offset: int = 0, base: float = 10000.0):
    """x: [b, s, heads, d]."""
    s, d = x.shape[1], x.shape[3]
    pos = torch.arange(offset, offset + s, dtype=x.dtype, device=x.device)
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    ang = torch.outer(pos, inv)  # [s, d/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass(frozen=True)
class LayerPlan:
    """Per partition key: (collective SMs, launch slot or None). Keys as in
    kareus.partition (fwd_attn, fwd_mlp, bwd_mlp, bwd_attn)."""

    knobs: dict[str, tuple[int, str | None]]
    slot_ops: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per key: slot name -> name of the compute op it starts with (from the partition)."""

    def launch_op(self, key: str) -> str | None:
        slot = self.knobs.get(key, (0, None))[1]
        if slot is None:
            return None
        return self.slot_ops.get(key, {}).get(slot, slot)

    def sms(self, key: str) -> int:
        return self.knobs.get(key, (0, None))[0]

    @classmethod
    def from_partitions(cls, partitions, knobs: dict[str, tuple[int, str | None]]
                        ) -> LayerPlan:
        slot_ops = {k: {s.name: p.compute_ops[s.op_index].name for s in p.slots}
                    for k, p in partitions.items()}
        return cls(dict(knobs), slot_ops)


class LlamaLayer(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                 tp_group=None, seed: int = 0, dtype=torch.float32,
                 groups_by_sms: Callable[[int], object] | None = None, cp_group=None,
                 cp_groups_by_sms: Callable[[int], object] | None = None) -> None:
        super().__init__()
        self.group = tp_group
        self.cp_group = cp_group
        self.cp = _world(cp_group)
        self.cp_rank = _rank(cp_group)
        tp, r = _world(tp_group), _rank(tp_group)
        if heads % tp or ffn % tp or (kv_heads % tp and tp % kv_heads):
            raise ValueError(f"tp={tp} must divide heads ({heads}) and FFN ({ffn}), and "
                             f"divide or be a multiple of the KV heads ({kv_heads})")
        self.h, self.d = hidden, head_dim
        self.heads = heads // tp
        self.kv = max(1, kv_heads // tp)
        self.ffn = ffn // tp
        self.groups_by_sms = groups_by_sms
        self.cp_groups_by_sms = cp_groups_by_sms
        g = torch.Generator().manual_seed(seed)

        def full(*shape):
            return torch.randn(*shape, generator=g, dtype=dtype) / shape[0] ** 0.5

        # full matrices from the seed, this rank's shard kept: every TP size computes the
        # same function
        wq, wk, wv = full(hidden, heads * head_dim), full(hidden, kv_heads * head_dim), full(
            hidden, kv_heads * head_dim)
        # this rank's first KV head (with fewer KV heads than ranks they are replicated)
        kv_rank = r * kv_heads // tp
        q_cols = slice(r * self.heads * head_dim, (r + 1) * self.heads * head_dim)
        kv_cols = slice(kv_rank * head_dim, kv_rank * head_dim + self.kv * head_dim)
        self.wqkv = torch.nn.Parameter(torch.cat([wq[:, q_cols], wk[:, kv_cols],
                                                  wv[:, kv_cols]], dim=1))
        self.wo = torch.nn.Parameter(full(heads * head_dim, hidden)[q_cols, :].contiguous())
        gate, up = full(hidden, ffn), full(hidden, ffn)
        f_cols = slice(r * self.ffn, (r + 1) * self.ffn)
        self.w1 = torch.nn.Parameter(torch.cat([gate[:, f_cols], up[:, f_cols]], dim=1))
        self.w2 = torch.nn.Parameter(full(ffn, hidden)[f_cols, :].contiguous())
        self.norm1 = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.norm2 = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))

    # The two segments as functions of their inputs -------------------------------------------

    def qkv_core(self, a, taps: dict | None = None):
        """a (norm output) -> q and this rank's k, v (rotary at their global positions)."""
        b, s, _ = a.shape
        qkv = a @ self.wqkv
        q, k, v = torch.split(qkv, [self.heads * self.d, self.kv * self.d,
                                    self.kv * self.d], dim=-1)
        offset = self.cp_rank * s
        q = rotary(q.reshape(b, s, self.heads, self.d), offset)
        k = rotary(k.reshape(b, s, self.kv, self.d), offset)
        v = v.reshape(b, s, self.kv, self.d)
        if taps is not None:
            taps.update(qkv=qkv, rope=(q, k))
        return q, torch.cat([k, v], dim=-1)

    def attention(self, q, kv, taps: dict | None = None):
        """Local queries over the whole sequence's k, v (causal at global positions)."""
        b, s = q.shape[:2]
        k, v = kv.split(self.d, dim=-1)
        if self.cp > 1:
            total = k.shape[1]
            pos_q = torch.arange(self.cp_rank * s, (self.cp_rank + 1) * s, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= pos_q[:, None]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), attn_mask=mask,
                                               enable_gqa=self.heads != self.kv)
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True,
                                               enable_gqa=self.heads != self.kv)
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.d)
        if taps is not None:
            taps.update(core_attn=o)
        return o

    def attn_core(self, a, taps: dict | None = None):
        """a (norm output) -> partial output projection (CP=1); ``taps`` collects
        intermediates."""
        q, kv = self.qkv_core(a, taps)
        o = self.attention(q, kv, taps)
        p = o @ self.wo
        if taps is not None:
            taps.update(out_proj=p)
        return p

    def mlp_core(self, bn, taps: dict | None = None):
        gu = bn @ self.w1
        gate, up = gu.chunk(2, dim=-1)
        sw = F.silu(gate) * up
        m = sw @ self.w2
        if taps is not None:
            taps.update(fc1=gu, swiglu=sw, fc2=m)
        return m

    # Plain layer ----------------------------------------------------------------------------

    def forward(self, x, plan: LayerPlan | None = None):
        if plan is None:
            g = self.group
            a = _CopyToTP.apply(rmsnorm(x, self.norm1), g)
            q, kv = self.qkv_core(a)
            if self.cp > 1:
                kv = _GatherSeq.apply(kv, self.cp_group)
            h = x + _ReduceFromTP.apply(self.attention(q, kv) @ self.wo, g)
            bn = _CopyToTP.apply(rmsnorm(h, self.norm2), g)
            return h + _ReduceFromTP.apply(self.mlp_core(bn), g)
        params = [self.wqkv, self.wo, self.w1, self.w2, self.norm1, self.norm2]
        if self.cp > 1:
            from kareus.runtime.layer_cp import OverlappedCP

            return OverlappedCP.apply(x, self, plan, *params)
        return _Overlapped.apply(x, self, plan, *params)


class Pending:
    """One asynchronous collective of a partition: issued once (before the slot's op),
    waited for once (at the partition's end). With ``groups_by_sms``, it runs on the
    process group for its SM count (NCCL min_ctas = max_ctas = SMs)."""

    def __init__(self, kind: str, tensor, group, sms: int = 0, groups_by_sms=None) -> None:
        self.kind, self.tensor, self.group = kind, tensor, group
        if groups_by_sms is not None and sms > 0 and _world(group) > 1:
            self.group = groups_by_sms(sms)
        self.work = None
        self.result = None
        self.issued = False

    def issue(self) -> None:
        if self.issued:
            return
        self.issued = True
        t, g = self.tensor, self.group
        if _world(g) <= 1:
            self.result = t
            return
        if self.kind == "all_reduce":
            self.result = t
            self.work = dist.all_reduce(t, group=g, async_op=True)
        elif self.kind == "all_gather":
            self._parts = [torch.empty_like(t) for _ in range(_world(g))]
            self.work = dist.all_gather(self._parts, t.contiguous(), group=g, async_op=True)
        elif self.kind == "reduce_scatter":  # all-reduce, then this rank's chunk (gloo has
            self.result = t.contiguous().clone()  # no reduce-scatter; same numbers)
            self.work = dist.all_reduce(self.result, group=g, async_op=True)
        else:
            raise ValueError(f"unknown collective {self.kind}")

    def wait(self):
        self.issue()
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.kind == "all_gather":
                self.result = torch.cat(self._parts, dim=1)
            elif self.kind == "reduce_scatter":
                n = _world(self.group)
                self.result = self.result.chunk(n, dim=1)[_rank(self.group)].contiguous()
        return self.result


def _tp_reduce(tensor, layer, plan, key) -> Pending:
    return Pending("all_reduce", tensor, layer.group, plan.sms(key), layer.groups_by_sms)


def _run_forward_segment(layer, kind, inp, launch_op, pending):
    """Run one forward segment of one nanobatch, issuing ``pending`` before ``launch_op``.
    Ops (names as in the execution graph) are run one by one so the launch point is
    exact."""
    def at(name):
        if pending is not None and launch_op == name:
            pending.issue()

    if kind == "attn":
        at("residual_mlp")
        at("input_norm")
        a = rmsnorm(inp, layer.norm1)
        at("qkv")
        b, s, _ = a.shape
        qkv = a @ layer.wqkv
        q, k, v = torch.split(qkv, [layer.heads * layer.d, layer.kv * layer.d,
                                    layer.kv * layer.d], dim=-1)
        at("rope")
        q = rotary(q.reshape(b, s, layer.heads, layer.d))
        k = rotary(k.reshape(b, s, layer.kv, layer.d))
        v = v.reshape(b, s, layer.kv, layer.d)
        at("core_attn")
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           enable_gqa=layer.heads != layer.kv)
        o = o.transpose(1, 2).reshape(b, s, layer.heads * layer.d)
        at("out_proj")
        out = o @ layer.wo
    else:
        x, reduced = inp
        at("residual_attn")
        h = x + reduced
        at("pre_mlp_norm")
        bn = rmsnorm(h, layer.norm2)
        at("fc1")
        gu = bn @ layer.w1
        gate, up = gu.chunk(2, dim=-1)
        at("swiglu")
        sw = F.silu(gate) * up
        at("fc2")
        out = sw @ layer.w2
        inp = h
    if pending is not None:
        pending.issue()  # launch "none": after the last compute op
    return inp, out


# Backward slot -> the forward tensor whose gradient marks that op's backward start.
_BWD_TAPS = {"fc2_bwd": "fc2", "swiglu_bwd": "swiglu", "fc1_bwd": "fc1",
             "out_proj_bwd": "out_proj", "core_attn_bwd": "core_attn", "rope_bwd": "rope",
             "qkv_bwd": "qkv"}


class _Overlapped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer: LlamaLayer, plan: LayerPlan, *params):
        x0, x1 = x.detach().chunk(2, dim=0)
        with torch.no_grad():
            # P0: nb0.attn (solo)
            _, p0 = _run_forward_segment(layer, "attn", x0, None, None)
            c0 = _tp_reduce(p0, layer, plan, "fwd_attn")
            # P1: nb1.attn + AR(p0)
            _, p1 = _run_forward_segment(layer, "attn", x1, plan.launch_op("fwd_attn"), c0)
            c0.wait()
            c1 = _tp_reduce(p1, layer, plan, "fwd_mlp")
            # P2: nb0.mlp + AR(p1)
            h0, m0 = _run_forward_segment(layer, "mlp", (x0, c0.result),
                                          plan.launch_op("fwd_mlp"), c1)
            c1.wait()
            c2 = _tp_reduce(m0, layer, plan, "fwd_mlp")
            # P3: nb1.mlp + AR(m0)
            h1, m1 = _run_forward_segment(layer, "mlp", (x1, c1.result),
                                          plan.launch_op("fwd_mlp"), c2)
            c2.wait()
            c3 = _tp_reduce(m1, layer, plan, "fwd_mlp")
            c3.wait()  # exposed
            y = torch.cat([h0 + c2.result, h1 + c3.result], dim=0)
        ctx.layer, ctx.plan = layer, plan
        ctx.save_for_backward(x0, x1, h0, h1)
        return y

    @staticmethod
    def backward(ctx, dy):
        layer, plan = ctx.layer, ctx.plan
        x0, x1, h0, h1 = ctx.saved_tensors
        weights = [layer.wqkv, layer.wo, layer.w1, layer.w2]
        grads = {id(w): torch.zeros_like(w) for w in (*weights, layer.norm1, layer.norm2)}
        dy0, dy1 = dy.chunk(2, dim=0)

        def acc(params, gs):
            for w, g in zip(params, gs):
                if g is not None:
                    grads[id(w)] += g

        def mlp_bwd(h, dy_nb, pending, launch):
            """nbX.mlp': fc2, swiglu, fc1 backward -> partial d(norm2 output)."""
            with torch.enable_grad():
                bn = rmsnorm(h, layer.norm2).detach().requires_grad_(True)
                taps: dict = {}
                m = layer.mlp_core(bn, taps)
                _hook(taps, launch, pending)
                g = torch.autograd.grad(m, [bn, layer.w1, layer.w2], dy_nb)
            acc([layer.w1, layer.w2], g[1:])
            return g[0]

        def attn_bwd(x, h, dy_nb, db_full, pending, launch):
            """nbX.attn': norm2 backward + residual, then out_proj, attention, rope, qkv
            backward -> d(h) and partial d(norm1 output)."""
            if pending is not None and launch in ("pre_mlp_norm_bwd", "residual_attn_bwd"):
                pending.issue()
            gh, gn2 = norm_backward(h, layer.norm2, db_full)
            dh = dy_nb + gh
            grads[id(layer.norm2)] += gn2
            with torch.enable_grad():
                a = rmsnorm(x, layer.norm1).detach().requires_grad_(True)
                taps: dict = {}
                p = layer.attn_core(a, taps)
                _hook(taps, launch, pending)
                g = torch.autograd.grad(p, [a, layer.wqkv, layer.wo], dh)
            acc([layer.wqkv, layer.wo], g[1:])
            return dh, g[0]

        def norm1_bwd(x, dh, da_full):
            gx, gn1 = norm_backward(x, layer.norm1, da_full)
            grads[id(layer.norm1)] += gn1
            return dh + gx

        mlp_launch = plan.launch_op("bwd_mlp")
        attn_launch = plan.launch_op("bwd_attn")
        # B0: nb0.mlp' (solo)
        db0 = mlp_bwd(h0, dy0, None, None)
        c0 = _tp_reduce(db0, layer, plan, "bwd_mlp")
        # B1: nb1.mlp' + AR(db0)
        db1 = mlp_bwd(h1, dy1, c0, mlp_launch)
        c0.wait()
        c1 = _tp_reduce(db1, layer, plan, "bwd_attn")
        # B2: nb0.attn' + AR(db1)
        dh0, da0 = attn_bwd(x0, h0, dy0, c0.result, c1, attn_launch)
        c1.wait()
        c2 = _tp_reduce(da0, layer, plan, "bwd_attn")
        # B3: nb1.attn' + AR(da0)
        dh1, da1 = attn_bwd(x1, h1, dy1, c1.result, c2, attn_launch)
        c2.wait()
        c3 = _tp_reduce(da1, layer, plan, "bwd_attn")
        c3.wait()  # exposed
        dx = torch.cat([norm1_bwd(x0, dh0, c2.result), norm1_bwd(x1, dh1, c3.result)], dim=0)
        order = [layer.wqkv, layer.wo, layer.w1, layer.w2, layer.norm1, layer.norm2]
        return (dx, None, None, *[grads[id(w)] for w in order])


def _hook(taps: dict, launch: str | None, pending) -> None:
    """Issue ``pending`` when autograd reaches the backward op named ``launch``."""
    if pending is None:
        return
    name = _BWD_TAPS.get(launch or "")
    if name is None:
        if launch is not None:  # a norm/residual slot: the start of the partition
            pending.issue()
        return
    if name not in taps:  # the slot's op is not in this piece of the partition
        return
    tensors = taps[name] if isinstance(taps[name], tuple) else (taps[name],)
    for t in tensors:
        t.register_hook(lambda g: (pending.issue(), None)[1])
