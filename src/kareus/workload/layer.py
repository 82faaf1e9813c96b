"""Op lists of one Llama-style decoder layer, one nanobatch, one TP rank.

The layer is laid out as Megatron-Core with TransformerEngine runs it (docs/anchors.md §5):
RMSNorm -> QKV (column parallel) -> [q/k RMSNorm] -> rotary -> [CP all-gather of K, V] ->
causal flash attention (with p2p CP: Transformer Engine's ring, inside the op) -> output
projection (row parallel) -> TP all-reduce (or, with
sequence parallelism, reduce-scatter) -> residual + RMSNorm -> [SP all-gather] -> FC1
(gate and up, column parallel) -> SwiGLU -> FC2 (row parallel) -> TP all-reduce.

Conventions: bf16 (2 bytes per element); 2 FLOPs per multiply-add; causal attention counts
half of full attention (with CP the load-balanced chunks average to the same half); a
backward linear is 2x its forward (a data gradient GEMM, then a weight gradient GEMM,
two kernels); attention
backward is 2.5x its forward; a memory-bound backward op is 2x its forward in FLOPs and
bytes.

Placement of the residual adds: the residual add after each block runs after its
collective, so it opens the next segment; likewise the backward of a layer's input norm
opens the next (lower) layer's backward. Shifting them keeps every layer's op list the same
(so identical partitions share one key) and every op counted once per layer.
"""

from __future__ import annotations

from typing import Any

from kareus.job.spec import BYTES_PER_ELEMENT as E
from kareus.job.spec import JobSpec
from kareus.workload import training_ops as train
from kareus.workload.ops import Collective, CollectiveKind, ComputeOp, GemmShape, Op


def gemm(name: str, m: int, n: int, k: int) -> ComputeOp:
    return ComputeOp(
        name=name,
        kind="gemm",
        flops=2.0 * m * n * k,
        bytes_=float(m * k + k * n + m * n) * E,
        slot_class="linear",
        gemm_shapes=((m, n, k),),
    )


def linear_backward(fwd: ComputeOp) -> tuple[ComputeOp, ComputeOp]:
    """A linear's backward as the two kernels Megatron-Core / TransformerEngine run: the
    data gradient GEMM (m x k from m x n and n x k), then the weight gradient GEMM (n x k
    over m). One launch slot: the weight gradient continues the data gradient's slot."""
    (m, n, k), = fwd.gemm_shapes
    dgrad, wgrad = (m, k, n), (n, k, m)

    def op(name: str, shape: GemmShape, opens: bool) -> ComputeOp:
        a, b, c = shape
        return ComputeOp(f"{fwd.name}_{name}", "gemm", 2.0 * a * b * c,
                         float(a * c + c * b + a * b) * E, "linear", (shape,), opens)

    return op("dgrad", dgrad, True), op("wgrad", wgrad, False)


def weight_linear_backward(job: JobSpec, fwd: ComputeOp, per_nanobatch: bool = False
                           ) -> list[ComputeOp]:
    """A linear's backward GEMMs and, where gradient accumulation is not fused, the kernel
    adding the weight gradient to the main gradient (`training_ops.grad_accumulation`;
    ``per_nanobatch``: ``fwd`` is one nanobatch's of a split microbatch)."""
    dgrad, wgrad = linear_backward(fwd)
    return [dgrad, wgrad, *train.grad_accumulation(job, wgrad, per_nanobatch)]


def memory_op(name: str, slot_class, flops: float, bytes_: float) -> ComputeOp:
    return ComputeOp(name, "memory", float(flops), float(bytes_), slot_class)


def memory_backward(fwd: ComputeOp, name: str | None = None) -> ComputeOp:
    return ComputeOp(name or f"{fwd.name}_bwd", "memory", 2 * fwd.flops, 2 * fwd.bytes_,
                     fwd.slot_class)


def _rmsnorm(name: str, tokens: int, width: int) -> ComputeOp:
    # square, mean, rsqrt, scale, weight: ~4 FLOPs per element; read x, write y, read weight
    return memory_op(name, "norm", 4 * tokens * width, (2 * tokens * width + width) * E)


def _residual_add(name: str, tokens: int, width: int) -> ComputeOp:
    return memory_op(name, "norm", tokens * width, 3 * tokens * width * E)


def layer_sequences(job: JobSpec) -> int:
    """The sequences of the execution graph's layer op lists: one nanobatch; the whole
    microbatch where the job does not split it (`JobSpec.splits_into_nanobatches`)."""
    return job.nanobatch_size if job.splits_into_nanobatches else job.micro_batch_size


class LayerShapes:
    """Per-rank tensor sizes of nanobatch ``nanobatch`` (or of ``sequences`` whole
    sequences), derived once from the job.

    Under a sequence split (`JobSpec.sequence_split`) a nanobatch is one half of every
    sequence: ``s_local`` its tokens per sequence, and ``key_offset`` the keys before its
    first query (0 for the first half, seq/2 for the second, whose queries also attend to
    the first half's keys)."""

    def __init__(self, job: JobSpec, sequences: int | None = None, nanobatch: int = 0) -> None:
        m = job.model
        self.job = job
        self.b = sequences if sequences is not None else layer_sequences(job)
        half = job.sequence_split and sequences is None  # CP is refused with it
        self.s_local = job.local_seq_length // 2 if half else job.local_seq_length
        self.key_offset = self.s_local * nanobatch if half else 0
        self.s_full = job.seq_length
        # keys the longest query row of the attention sees (without CP)
        self.keys_seen = self.key_offset + self.s_local if half else self.s_full
        self.tokens = self.b * self.s_local  # tokens one rank computes GEMMs on
        # with sequence parallelism, norms and residuals run on a 1/tp shard of the tokens
        self.norm_tokens = self.tokens // job.tp if job.sequence_parallel else self.tokens
        self.h = m.hidden_size
        self.d = m.head_dim
        self.heads = job.local_heads
        self.kv_heads = job.local_kv_heads
        self.ffn = m.ffn_hidden_size // job.tp
        self.activation_bytes = float(self.tokens * self.h * E)
        # K and V of one CP rank, gathered across the CP group
        self.kv_shard_bytes = float(2 * self.s_local * self.b * self.kv_heads * self.d * E)


def _tp_closing(job: JobSpec, name: str, closes: str, sh: LayerShapes) -> Collective:
    """The collective after a row-parallel GEMM: all-reduce, or reduce-scatter with SP."""
    kind: CollectiveKind = "reduce_scatter" if job.sequence_parallel else "all_reduce"
    return Collective(name, kind, "tp", job.tp, sh.activation_bytes, closes)


def _sp_gather(job: JobSpec, name: str, closes: str, sh: LayerShapes) -> Collective:
    return Collective(name, "all_gather", "tp", job.tp, sh.activation_bytes, closes)


def _cp_gather(job: JobSpec, name: str, closes: str, sh: LayerShapes) -> Collective:
    return Collective(name, "all_gather", "cp", job.cp, sh.kv_shard_bytes * job.cp, closes)


def _cp_scatter(job: JobSpec, name: str, closes: str, sh: LayerShapes) -> Collective:
    return Collective(name, "reduce_scatter", "cp", job.cp, sh.kv_shard_bytes * job.cp, closes)


def ring_step_bytes(job: JobSpec, sh: LayerShapes, backward: bool) -> tuple[float, ...]:
    """Bytes one rank sends in each of the ``cp`` steps of Transformer Engine's ring
    attention (`AttnFuncWithCPAndKVP2P`, bf16), each sent while the step computes.
    Forward: the K/V part it holds (``kv_shard_bytes``) goes on to the next rank in steps
    0..cp-2, nothing in the last. Backward: K/V in step 0; K/V and the dK/dV partial sums
    (same size) in steps 1..cp-2; dK/dV alone in the last step, which brings each rank's
    sums home."""
    kv, n = sh.kv_shard_bytes, job.cp
    if not backward:
        return (kv,) * (n - 1) + (0.0,)
    return (kv,) + (2 * kv,) * (n - 2) + (kv,)


def attention_ops(job: JobSpec, sh: LayerShapes) -> list[ComputeOp]:
    """Causal flash attention of one rank: QK^T and PV, 2 FLOPs per MAC each.

    Without CP, one kernel over the rank's tokens (half of the score matrix: causal). In
    CP all-gather mode Megatron-Core / TransformerEngine cut the sequence into 2 x CP
    chunks, rank r holding chunks r and 2CP-1-r (load balance), and run attention once
    per local query chunk against the keys it needs: chunk c sees the c full chunks before
    it and its own diagonal block. We model rank 0 (chunks 0 and 2CP-1); every rank does
    the same total work. The two kernels share one launch slot.
    """
    d, hq, hkv = sh.d, sh.heads, sh.kv_heads
    if sh.key_offset:  # a sequence split's second half: a full block, then its diagonal
        return [_second_half_attention(sh)]
    if job.cp == 1:
        q = sh.tokens * hq * d
        kv = sh.b * sh.keys_seen * hkv * d
        return [ComputeOp("core_attn", "attention",
                          flops=2.0 * sh.b * sh.s_local * sh.keys_seen * hq * d,
                          bytes_=float(2 * q + 2 * kv) * E, slot_class="attn",
                          attn_keys=sh.keys_seen, attn_causal=True)]
    chunk = sh.s_full // (2 * job.cp)
    if job.cp_ring:
        return [_ring_attention(job, sh, chunk)]
    out = []
    for i, c in enumerate((0, 2 * job.cp - 1)):
        keys = (c + 1) * chunk  # keys read: full chunks before it and its own
        # full blocks against the c earlier chunks, half of the diagonal block
        flops = 4.0 * sh.b * chunk * hq * d * (c * chunk + chunk / 2)
        bytes_ = float(2 * sh.b * chunk * hq * d + 2 * sh.b * keys * hkv * d) * E
        # chunk 0 is a causal square; the last chunk is mostly full blocks (non-causal)
        out.append(ComputeOp("core_attn" if i == 0 else "core_attn_2", "attention", flops,
                             bytes_, "attn", opens_slot=i == 0, attn_keys=keys,
                             attn_causal=c == 0))
    return out


def _second_half_attention(sh: LayerShapes) -> ComputeOp:
    """The attention of a sequence split's second nanobatch: its ``s_local`` queries
    against the first half's keys (a full block) and its own (a causal diagonal block),
    three times the first half's causal square; like CP's last chunk, mostly full
    blocks (non-causal)."""
    d, hq, hkv, s = sh.d, sh.heads, sh.kv_heads, sh.s_local
    keys = sh.key_offset + s
    flops = 4.0 * sh.b * s * hq * d * (sh.key_offset + s / 2)
    bytes_ = float(2 * sh.b * s * hq * d + 2 * sh.b * keys * hkv * d) * E
    return ComputeOp("core_attn", "attention", flops, bytes_, "attn", attn_keys=keys,
                     attn_causal=False)


def _ring_attention(job: JobSpec, sh: LayerShapes, chunk: int) -> ComputeOp:
    """p2p CP: Transformer Engine's ring attention as one op. Its FLOPs are all-gather
    CP's (the rank's query chunks against the keys they see: 2 x CP full chunk blocks of
    the causal score matrix, half of the diagonal ones masked). The work is the same at
    every step of the ring: step 0 is the rank's own causal square (two half-masked
    diagonal blocks and one full block), step i > 0 both query chunks against the first
    K/V chunk received (i <= rank) or the second query chunk against both (i > rank): two
    full blocks each. Each step reads one rank's K/V part (``attn_keys``: its
    ``s_local`` keys, no causal mask but in step 0)."""
    d, hq, hkv, n = sh.d, sh.heads, sh.kv_heads, job.cp
    flops = 4.0 * sh.b * hq * d * chunk * chunk * (2 * n)  # 2n blocks of chunk x chunk
    # reads q and writes o once; reads one K/V part per step
    bytes_ = float(2 * sh.b * sh.s_local * hq * d + n * 2 * sh.b * sh.s_local * hkv * d) * E
    return ComputeOp("core_attn", "attention", flops, bytes_, "attn",
                     attn_keys=sh.s_local, attn_causal=False,
                     ring_step_bytes=ring_step_bytes(job, sh, backward=False))


def forward_ops(job: JobSpec, sequences: int | None = None, nanobatch: int = 0,
                grad: bool = True) -> list[Op]:
    """One layer's forward for nanobatch ``nanobatch`` (or ``sequences`` whole sequences)
    on one rank, collectives in place; ``grad`` false: run without gradients (the first
    forward under full recompute), which keeps nothing for a backward
    (`training_ops.with_dropout`)."""
    sh = LayerShapes(job, sequences, nanobatch)
    sp, cp = job.sequence_parallel, job.cp_partitions  # p2p CP: no CP collective
    t, h, d = sh.tokens, sh.h, sh.d
    qk_elems = t * (sh.heads + sh.kv_heads) * d

    residual_elems = sh.norm_tokens * h  # a block's output, dropped out in the residual add
    ops: list[Op] = [
        *train.with_dropout(job, _residual_add("residual_mlp", sh.norm_tokens, h), "mlp",
                            residual_elems, grad),
        _rmsnorm("input_norm", sh.norm_tokens, h),
    ]
    if sp:
        ops.append(_sp_gather(job, "ln1_ag", "ln1", sh))
    ops.append(gemm("qkv", t, (sh.heads + 2 * sh.kv_heads) * d, h))
    if job.model.qk_norm:
        ops.append(memory_op("qk_norm", "rope", 4 * qk_elems, 2 * qk_elems * E))
    ops += train.rope(job, t * sh.heads * d, t * sh.kv_heads * d)
    if cp:
        ops.append(_cp_gather(job, "kv_ag", "qkv", sh))
    ops += attention_ops(job, sh)
    ops.append(gemm("out_proj", t, h, sh.heads * d))
    ops.append(_tp_closing(job, "attn_ar" if not sp else "attn_rs", "ao" if cp else "attn", sh))
    ops += [
        *train.with_dropout(job, _residual_add("residual_attn", sh.norm_tokens, h), "attn",
                            residual_elems, grad),
        _rmsnorm("pre_mlp_norm", sh.norm_tokens, h),
    ]
    if sp:
        ops.append(_sp_gather(job, "ln2_ag", "ln2", sh))
    ops += [
        gemm("fc1", t, 2 * sh.ffn, h),
        *train.swiglu(job, t * sh.ffn),
        gemm("fc2", t, h, sh.ffn),
        _tp_closing(job, "mlp_ar" if not sp else "mlp_rs", "mlp", sh),
    ]
    return ops


def backward_ops(job: JobSpec, fwd: list[Op] | None = None, sequences: int | None = None,
                 nanobatch: int = 0) -> list[Op]:
    """One layer's backward for nanobatch ``nanobatch`` (or ``sequences`` whole sequences)
    on one rank, without the recomputed forward; ``fwd`` is its forward."""
    sh = LayerShapes(job, sequences, nanobatch)
    sp, cp = job.sequence_parallel, job.cp_partitions  # p2p CP: no CP collective
    f = {op.name: op for op in (fwd or forward_ops(job, sequences, nanobatch))
         if isinstance(op, ComputeOp)}
    # The gradient of a forward all-reduce is an all-reduce at the input of the column-parallel
    # GEMM; with SP, forward all-gather <-> backward reduce-scatter and vice versa.
    in_grad_kind: CollectiveKind = "reduce_scatter" if sp else "all_reduce"

    def grad_in(name: str, closes: str) -> Collective:
        return Collective(name, in_grad_kind, "tp", job.tp, sh.activation_bytes, closes,
                          overlaps_weight_grad=True)

    residual_elems = sh.norm_tokens * sh.h
    # one of a split microbatch's two nanobatches (the graph's op lists), not a whole one
    halves = sequences is None and job.splits_into_nanobatches

    def wlb(name: str) -> list[ComputeOp]:
        return weight_linear_backward(job, f[name], halves)

    ops: list[Op] = [
        memory_backward(f["input_norm"]),
        memory_backward(f["residual_mlp"]),  # the residual branch's gradient accumulation
        *train.dropout_backward(job, "mlp", residual_elems),
    ]
    if sp:
        ops.append(_sp_gather(job, "mlp_out_grad_ag", "ln1", sh))
    ops += [
        *wlb("fc2"),
        *[memory_backward(op) for op in reversed(f.values()) if op.slot_class == "activation"],
        *wlb("fc1"),
        grad_in("fc1_grad_ar" if not sp else "fc1_grad_rs", "mlp"),
        memory_backward(f["pre_mlp_norm"]),
        memory_backward(f["residual_attn"]),
        *train.dropout_backward(job, "attn", residual_elems),
    ]
    if sp:
        ops.append(_sp_gather(job, "attn_out_grad_ag", "ln2", sh))
    ops += wlb("out_proj")
    if cp:
        # K and V are gathered again for the attention backward (all-gather mode keeps only
        # the local shard), and dK, dV are reduce-scattered back to their owners.
        ops.append(_cp_gather(job, "kv_regather", "o", sh))
    # reads q, k, v, o, dO; writes dq, dk, dv
    ring = ring_step_bytes(job, sh, backward=True) if job.cp_ring else ()
    ops += [ComputeOp(f"{a.name}_bwd", "attention", 2.5 * a.flops, 2.0 * a.bytes_, "attn",
                      opens_slot=a.opens_slot, attn_keys=a.attn_keys, attn_causal=a.attn_causal,
                      ring_step_bytes=ring)
            for a in (op for op in f.values() if op.kind == "attention")]
    if cp:
        ops.append(_cp_scatter(job, "dkv_rs", "a", sh))
    ops += [memory_backward(op) for op in reversed(f.values())
            if op.slot_class == "rope" and op.name != "qk_norm"]
    if "qk_norm" in f:
        ops.append(memory_backward(f["qk_norm"]))
    ops += [
        *wlb("qkv"),
        grad_in("qkv_grad_ar" if not sp else "qkv_grad_rs", "qkv" if cp else "attn"),
    ]
    return ops


def cp_communication(job: JobSpec) -> dict[str, Any] | None:
    """How the job's CP communicates and whether that traffic is in Kareus's partitions
    (None without CP): what `kareus partitions` says."""
    if job.cp == 1:
        return None
    if job.cp_ring:
        note = (f"CP{job.cp} p2p: Transformer Engine's ring runs inside the attention op "
                f"(core_attn, core_attn_bwd; one compute op to the plan); its K/V traffic "
                f"is not a Kareus partition")
    else:
        note = (f"CP{job.cp} allgather: the K/V all-gathers and the dK/dV reduce-scatter "
                f"are the CP partitions' collectives")
    return {"cp": job.cp, "cp_comm_type": job.cp_comm_type,
            "in_partitions": job.cp_partitions, "note": note}
