"""A Llama-style decoder layer, tensor parallel (and optionally context parallel), that
runs a Kareus plan's partitioned overlap — forward and backward — and computes exactly what
the plain layer computes.

Shards (Megatron): QKV and FC1 column parallel, output projection and FC2 row parallel,
norms replicated. With ``sequence_parallel`` (Megatron's sequence parallelism), the
layer's input and output are this rank's part of the sequence: the norms and residuals run
on it, the norm outputs are all-gathered along the sequence before QKV and FC1, and the
row-parallel outputs reduce-scattered. The plain layer (``layer(x)``) uses Megatron's two
autograd operators and blocking collectives (kareus.runtime.primitives). With a
`LayerPlan` (``layer(x, plan)``) it splits the microbatch into two nanobatches and runs
Kareus's partitions: one custom autograd Function owns the whole schedule
(kareus.runtime.overlap_tp over the layer's ops, overlap_sp with sequence parallelism,
overlap_cp_ops with context parallelism: the same schedules Megatron-Core's layer runs).
Each collective is issued asynchronously (NCCL runs it on its own stream; with the plan's
SM count when a group per SM setting is given) just before the compute op named by the
plan's slot, and waited for at the end of its partition.

The overlap changes when things run, never what they compute (tested: outputs and every
gradient equal the plain layer's). At micro-batch size 1 a plan splits the sequence
(``LayerPlan.split`` "sequence", TP only): the second half's attention reads the first
half's keys and values (`attn_partial_kv`; kareus.runtime.pieces).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import GroupsBySms, Taps
from kareus.runtime.overlap_cp_ops import CPLayerOps, OverlappedCPOps
from kareus.runtime.overlap_sp import OverlappedSP
from kareus.runtime.overlap_tp import Before, OverlappedTP, no_slot
from kareus.runtime.primitives import (
    CopyToTP,
    GatherSeq,
    Group,
    ReduceFromTP,
    ScatterSeqSum,
    rank_in,
    rmsnorm,
    rotary,
    world_size,
)


class LlamaLayer(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                 tp_group: Group = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                 groups_by_sms: GroupsBySms | None = None, cp_group: Group = None,
                 cp_groups_by_sms: GroupsBySms | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        if sequence_parallel and world_size(cp_group) > 1:
            raise ValueError("LlamaLayer runs sequence parallelism without context "
                             "parallelism")
        # one rank's part of the sequence is the whole sequence without TP (as Megatron
        # turns sequence parallelism off at TP=1)
        self.sequence_parallel = sequence_parallel and world_size(tp_group) > 1
        self.group = tp_group
        self.cp_group = cp_group
        self.cp = world_size(cp_group)
        self.cp_rank = rank_in(cp_group)
        tp, r = world_size(tp_group), rank_in(tp_group)
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

        def full(*shape: int) -> torch.Tensor:
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

    # The segments' ops, none communicating: the attention's three are the CP schedule's
    # (kareus.runtime.overlap_cp_ops.CPLayerOps), attn_partial chains them ------------------

    def qkv_partial(self, a: torch.Tensor, before: Before = no_slot, taps: Taps | None = None,
                    offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """a (norm output) -> q and this rank's k, v ([b, s, heads, d]; rotary at their
        global positions: this rank's chunk of the sequence is ``cp_rank * s`` on, plus
        ``offset``, a sequence split's second half); ``before``: called with "qkv" and
        "rope" before those ops."""
        b, s, _ = a.shape
        before("qkv")
        qkv = a @ self.wqkv
        q, k, v = torch.split(qkv, [self.heads * self.d, self.kv * self.d,
                                    self.kv * self.d], dim=-1)
        before("rope")
        offset += self.cp_rank * s
        q = rotary(q.reshape(b, s, self.heads, self.d), offset)
        k = rotary(k.reshape(b, s, self.kv, self.d), offset)
        v = v.reshape(b, s, self.kv, self.d)
        if taps is not None:
            taps.update(qkv=qkv, rope=(q, k))
        return q, k, v

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  before: Before = no_slot, taps: Taps | None = None, offset: int = 0
                  ) -> torch.Tensor:
        """Local queries over the whole sequence's k, v (causal at global positions; the
        queries ``offset`` further on: a sequence split's second half)."""
        b, s = q.shape[:2]
        before("core_attn")
        first = self.cp_rank * s + offset
        if first or k.shape[1] != s:
            total = k.shape[1]
            pos_q = torch.arange(first, first + s, device=q.device)
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

    def proj_partial(self, o: torch.Tensor, before: Before = no_slot,
                     taps: Taps | None = None) -> torch.Tensor:
        """Attention output -> this rank's partial output projection."""
        before("out_proj")
        p = o @ self.wo
        if taps is not None:
            taps.update(out_proj=p)
        return p

    def mlp_core(self, bn: torch.Tensor, taps: Taps | None = None,
                 before: Before = no_slot) -> torch.Tensor:
        """bn (MLP norm output) -> this rank's partial FC2 output."""
        before("fc1")
        gu = bn @ self.w1
        gate, up = gu.chunk(2, dim=-1)
        before("swiglu")
        sw = F.silu(gate) * up
        before("fc2")
        m = sw @ self.w2
        if taps is not None:
            taps.update(fc1=gu, swiglu=sw, fc2=m)
        return m

    # The ops of the TP schedule (kareus.runtime.overlap_tp.TPLayerOps) ------------------------

    batch_dim = 0
    seq_dim = 1  # the sequence under SP and CP

    def attn_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.norm1)

    def attn_partial(self, a: torch.Tensor, before: Before, taps: Taps) -> torch.Tensor:
        q, k, v = self.qkv_partial(a, before, taps)
        return self.proj_partial(self.attention(q, k, v, before, taps), before, taps)

    def attn_partial_kv(self, a: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None,
                        before: Before, taps: Taps
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sequence split's attention core (kareus.runtime.pieces.SequenceSplitOps): this
        half's queries over ``past``'s keys and values, then its own."""
        offset = 0 if past is None else past[0].shape[1]
        q, k, v = self.qkv_partial(a, before, taps, offset)
        k_all, v_all = (k, v) if past is None else (torch.cat([past[0], k], dim=1),
                                                    torch.cat([past[1], v], dim=1))
        o = self.attention(q, k_all, v_all, before, taps, offset)
        return self.proj_partial(o, before, taps), k, v

    def attn_residual(self, x: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
        return x + reduced

    def mlp_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rmsnorm(h, self.norm2)

    def mlp_partial(self, bn: torch.Tensor, before: Before, taps: Taps) -> torch.Tensor:
        return self.mlp_core(bn, taps, before)

    def mlp_residual(self, h: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
        return h + reduced

    def nanobatch(self, index: int) -> LlamaLayer:
        return self  # no per-sample inputs

    # Entry point -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, plan: LayerPlan | None = None) -> torch.Tensor:
        """The plain layer without a plan; the plan's partitioned overlap with one."""
        if plan is None:
            return self.plain(x)
        # the layer's own full recompute (keep_graphs False): the backward rebuilds each
        # piece from its saved inputs
        ops: CPLayerOps = self  # the ops every schedule takes (checked by mypy)
        params = tuple(self.parameters())
        if self.cp > 1:
            return OverlappedCPOps.apply(x, ops, plan, False, *params)
        schedule = OverlappedSP if self.sequence_parallel else OverlappedTP
        return schedule.apply(x, ops, plan, False, *params)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """Blocking collectives, ordinary autograd."""
        g = self.group
        if self.sequence_parallel:
            return self._plain_sp(x)
        a = CopyToTP.apply(rmsnorm(x, self.norm1), g)
        q, k, v = self.qkv_partial(a)
        if self.cp > 1:
            k, v = (GatherSeq.apply(t, self.cp_group) for t in (k, v))
        h = x + ReduceFromTP.apply(self.proj_partial(self.attention(q, k, v)), g)
        bn = CopyToTP.apply(rmsnorm(h, self.norm2), g)
        return h + ReduceFromTP.apply(self.mlp_core(bn), g)

    def _plain_sp(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence parallelism: ``x`` is this rank's part of the sequence."""
        g = self.group
        q, k, v = self.qkv_partial(GatherSeq.apply(rmsnorm(x, self.norm1), g))
        h = x + ScatterSeqSum.apply(self.proj_partial(self.attention(q, k, v)), g)
        bn = GatherSeq.apply(rmsnorm(h, self.norm2), g)
        return h + ScatterSeqSum.apply(self.mlp_core(bn), g)
