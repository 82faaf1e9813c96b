"""The execution graph of a job: per-layer op lists, the ops outside the layers, per stage.

All layer ops are for one nanobatch on one rank (both nanobatches' where a sequence split
makes their attention differ); ops outside the layers (embedding, LM
head, loss, pipeline send/recv) run once per microbatch; the data-parallel gradient sync
runs once per iteration. Totals are per GPU of each stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from kareus.job.spec import BYTES_PER_ELEMENT as E
from kareus.job.spec import JobSpec
from kareus.workload import training_ops as train
from kareus.workload.layer import (
    backward_ops,
    forward_ops,
    gemm,
    memory_backward,
    memory_op,
    weight_linear_backward,
)
from kareus.workload.ops import Collective, CollectiveKind, ComputeOp, Op, Segment


@dataclass(frozen=True)
class StageGraph:
    """What one pipeline stage runs besides its layers. With interleaved 1F1B a stage is a
    virtual stage (one model chunk of rank ``index % pp``); its end-of-iteration work is
    the chunk's share of the rank's (the rank's sum: `kareus.plans.schedule`)."""

    index: int
    num_layers: int
    forward_pre: tuple[Op, ...]
    """Per microbatch, before the first layer's forward (embedding on stage 0)."""
    forward_post: tuple[Op, ...]
    """Per microbatch, after the last layer (LM head and loss on the last stage)."""
    backward_pre: tuple[Op, ...]
    backward_post: tuple[Op, ...]
    iteration_end: tuple[Op, ...]
    """Once per iteration: the data-parallel gradient reduce-scatter and parameter gather."""
    params: int
    """Parameters held by one rank of this stage."""
    send_activation: Collective | None = None
    """Per microbatch, after its forward: the activation sent to the next stage."""
    send_grad: Collective | None = None
    """Per microbatch, after its backward: the input gradient sent to the previous stage.

    A transfer between adjacent stages is one batched isend/irecv in Megatron's 1F1B: the
    sender and the receiver both wait for it, so it appears once on any path of the
    pipeline (kareus.plans.schedule), never as an op inside either instruction."""

    @property
    def transfers(self) -> tuple[Collective, ...]:
        return tuple(t for t in (self.send_activation, self.send_grad) if t is not None)


def _sum_flops(ops) -> float:
    return float(sum(op.flops for op in ops))


def cut_segments(ops: list[Op], direction: str, layer: int = 0) -> list[Segment]:
    """Cut an op list at every collective into segments (the op list ends with one)."""
    segments: list[Segment] = []
    current: list[ComputeOp] = []
    for op in ops:
        if isinstance(op, Collective):
            segments.append(Segment(op.closes, direction, tuple(current), op, layer))
            current = []
        else:
            current.append(op)
    if current:
        segments.append(Segment("tail", direction, tuple(current), None, layer))
    return segments


@dataclass(frozen=True)
class ExecutionGraph:
    job: JobSpec
    layer_forward: tuple[Op, ...]
    """One layer's forward of nanobatch 0 (of the whole microbatch where it is not split)."""
    layer_backward: tuple[Op, ...]
    stages: tuple[StageGraph, ...]
    layer_forward_1: tuple[Op, ...] | None = None
    """Nanobatch 1's, where it differs from nanobatch 0's (a sequence split's attention)."""
    layer_backward_1: tuple[Op, ...] | None = None

    @classmethod
    def from_job(cls, job: JobSpec) -> ExecutionGraph:
        fwd = forward_ops(job)
        bwd = backward_ops(job, fwd)
        # with interleaved 1F1B, one StageGraph per virtual stage (rank = index % pp)
        stages = tuple(_stage(job, i) for i in range(job.virtual_stages))
        if not job.sequence_split:
            return cls(job, tuple(fwd), tuple(bwd), stages)
        fwd1 = forward_ops(job, nanobatch=1)
        bwd1 = backward_ops(job, fwd1, nanobatch=1)
        return cls(job, tuple(fwd), tuple(bwd), stages, tuple(fwd1), tuple(bwd1))

    def nanobatch_layer(self, nanobatch: int) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
        """One layer's (forward, backward) op lists of nanobatch 0 or 1."""
        if nanobatch == 1 and self.layer_forward_1 is not None:
            return self.layer_forward_1, self.layer_backward_1 or ()
        return self.layer_forward, self.layer_backward

    # Segments of a pass ------------------------------------------------------------------

    @cached_property
    def forward_segments(self) -> tuple[Segment, ...]:
        return self.segments("fwd", 0)

    @cached_property
    def backward_segments(self) -> tuple[Segment, ...]:
        return self.segments("bwd", 0)

    def segments(self, direction: str, nanobatch: int) -> tuple[Segment, ...]:
        """One layer's segments ("fwd" or "bwd") of nanobatch 0 or 1."""
        fwd, bwd = self.nanobatch_layer(nanobatch)
        return tuple(replace(s, nanobatch=nanobatch) for s in
                     cut_segments(list(fwd if direction == "fwd" else bwd), direction))

    def pass_segments(self, direction: str, num_layers: int, nanobatch: int = 0
                      ) -> list[Segment]:
        """One nanobatch's segments through ``num_layers`` layers in one pipeline instruction.

        A backward instruction recomputes each layer's forward just before its backward
        (full, uniform recompute of one layer) when recompute is on.
        """
        fwd, bwd = self.segments("fwd", nanobatch), self.segments("bwd", nanobatch)
        out: list[Segment] = []
        for layer in range(num_layers):
            if direction == "forward":
                out += [_at(s, layer) for s in fwd]
            else:
                if self.job.recompute:
                    out += [_at(s, layer) for s in fwd]
                out += [_at(s, layer) for s in bwd]
        return out

    def stream_segments(self, direction: str, num_layers: int) -> list[Segment]:
        """Both nanobatches' segments in the compute stream's order: segment i of one
        nanobatch, then of the other, then segment i+1, ... Nanobatch 0 goes first, but in
        a sequence split's backward segments (not its recomputed forward): the second
        half's attention gradient flows into the first half's K and V, so nanobatch 1's
        backward runs first (docs/workload.md)."""
        passes = [self.pass_segments(direction, num_layers, nb) for nb in (0, 1)]
        out: list[Segment] = []
        for s0, s1 in zip(*passes, strict=True):
            first_one = self.job.sequence_split and s0.direction == "bwd"
            out += [s1, s0] if first_one else [s0, s1]
        return out

    # Totals ------------------------------------------------------------------------------

    @cached_property
    def layer_flops(self) -> dict[str, float]:
        """FLOPs of one layer for one microbatch on one rank: the layer op lists are one
        nanobatch's, two per microbatch, or the whole microbatch's where it is not split
        (an odd micro-batch size)."""
        nanobatches = (0, 1) if self.job.splits_into_nanobatches else (0,)
        fwd = sum(_sum_flops(self.nanobatch_layer(nb)[0]) for nb in nanobatches)
        bwd = sum(_sum_flops(self.nanobatch_layer(nb)[1]) for nb in nanobatches)
        recompute = fwd if self.job.recompute else 0.0
        return {"forward": fwd, "recompute": recompute, "backward": bwd,
                "total": fwd + recompute + bwd}

    def stage_microbatch_flops(self, stage: StageGraph) -> float:
        outside = (stage.forward_pre, stage.forward_post, stage.backward_pre, stage.backward_post)
        return stage.num_layers * self.layer_flops["total"] + sum(_sum_flops(o) for o in outside)

    def stage_iteration_flops(self, stage: StageGraph) -> float:
        return (self.job.num_microbatches * self.stage_microbatch_flops(stage)
                + _sum_flops(stage.iteration_end))

    @property
    def per_gpu_iteration_flops(self) -> list[float]:
        return [self.stage_iteration_flops(s) for s in self.stages]

    @property
    def iteration_flops_total(self) -> float:
        """All GPUs of the job: each (virtual) stage's per-GPU FLOPs times the GPUs of its
        pipeline rank."""
        gpus_per_stage = self.job.num_gpus // self.job.pp
        return float(sum(self.per_gpu_iteration_flops) * gpus_per_stage)


def interleave(stream: list[Segment]) -> tuple[list[tuple[Segment, Collective | None]],
                                               Collective | None]:
    """Pair each compute segment with the collective issued just before it.

    ``stream``: both nanobatches' segments in compute-stream order
    (`ExecutionGraph.stream_segments`). Returns (segment, overlapped collective) in that
    order, and the last collective, which has nothing left to hide behind.
    """
    pairs: list[tuple[Segment, Collective | None]] = []
    prev: Collective | None = None
    for seg in stream:
        pairs.append((seg, prev))
        prev = seg.collective
    return pairs, prev


def differing_segments(graph: ExecutionGraph) -> set[str]:
    """Base keys of the segments whose ops differ between the two nanobatches (a sequence
    split's attention segments; none in a batch split): one partition key per nanobatch."""
    return {s0.base_key for d in ("fwd", "bwd")
            for s0, s1 in zip(graph.segments(d, 0), graph.segments(d, 1), strict=True)
            if s0.ops != s1.ops}


def model_flops_per_token(job: JobSpec) -> float:
    """NVIDIA's MFU numerator (NVIDIA/dgxc-benchmarking, docs/anchors.md §8):
    12 L h^2 (1 + G/H + s/h) + 18 L F h + 6 V h; causal attention not halved, recompute
    not counted, whatever the parallelism."""
    m = job.model
    L, h, s = m.num_layers, m.hidden_size, job.seq_length  # the formula's names
    return (12 * L * h * h * (1 + m.num_kv_heads / m.num_attention_heads + s / h)
            + 18 * L * m.ffn_hidden_size * h + 6 * m.vocab_size * h)


def mfu(job: JobSpec, iteration_s: float) -> float:
    """Model FLOPs utilisation of one iteration taking ``iteration_s``: the model FLOPs of
    its tokens over the job's GPUs at their dense bf16 peak."""
    peak = job.gpu_spec.peak_bf16_flops * job.num_gpus
    return model_flops_per_token(job) * job.tokens_per_iteration / (iteration_s * peak)


def _at(seg: Segment, layer: int) -> Segment:
    return replace(seg, layer=layer)


def layer_params(job: JobSpec) -> int:
    """Parameters of one decoder layer held by one TP rank."""
    m = job.model
    d, h = m.head_dim, m.hidden_size
    heads, kv = job.local_heads, job.local_kv_heads
    ffn = m.ffn_hidden_size // job.tp
    attn = h * (heads + 2 * kv) * d + heads * d * h
    mlp = h * 2 * ffn + ffn * h
    norms = 2 * h + (2 * d if m.qk_norm else 0)
    return attn + mlp + norms


def _optimizer_step(params: int, shards: int) -> ComputeOp:
    """Megatron's mixed-precision Adam over one rank's parameters, bytes per parameter. With
    bf16, Megatron-LM accumulates and reduces gradients in fp32 (its arguments.py forces
    `accumulate_allreduce_grads_in_fp32`), so the main gradient is the fp32 grad buffer:
    the gradient norm for clipping (4), Adam reading the main gradient, main parameter and
    both moments and writing the last three (28), the main parameters back to bf16
    (4 + 2); with the distributed optimizer each of ``shards`` ranks does 1/shards of it;
    then every rank zeroes its fp32 gradient buffer (4). ~15 FLOPs per parameter."""
    return memory_op("optimizer_step", "other", 15 * params / shards,
                     38 * params / shards + 4 * params)


def _send_crosses_nodes(job: JobSpec, index: int) -> bool:
    """Whether the pipeline sends between virtual stages ``index`` and ``index + 1`` leave
    the node. Megatron's rank order tp-cp-dp-pp puts pipeline rank r's n = tp x cp x dp GPUs
    at global ranks r n .. r n + n - 1, node by node; each GPU sends to its peer n x (the
    ranks' distance) away (interleaved: the last rank's chunk sends to rank 0's next)."""
    n, g = job.tp * job.cp * (job.dp or 1), job.gpus_per_node
    a, b = index % job.pp, (index + 1) % job.pp
    return any((a * n + i) // g != (b * n + i) // g for i in range(n))


def _stage(job: JobSpec, index: int) -> StageGraph:
    m = job.model
    first, last = index == 0, index == job.virtual_stages - 1
    layers = (job.layers_per_stage or ())[index]
    tokens = job.micro_batch_size * job.local_seq_length  # one microbatch on one rank
    h = m.hidden_size
    vocab_local = -(-m.vocab_size // job.tp)  # vocab-parallel, padded up
    act_bytes = float(tokens * h * E)
    # what each rank sends to the next stage: [s, b, h], its s / tp with SP (Megatron-Core's
    # get_tensor_shapes; anchors §9)
    p2p_bytes = act_bytes / job.tp if job.sequence_parallel else act_bytes
    tp_out_kind: CollectiveKind = "reduce_scatter" if job.sequence_parallel else "all_reduce"
    params = layers * layer_params(job)

    fwd_pre: list[Op] = []
    fwd_post: list[Op] = []
    bwd_pre: list[Op] = []
    bwd_post: list[Op] = []
    if first:
        # vocab-parallel embedding: each rank looks up its rows, then the partial sums reduce
        emb = memory_op("embedding", "other", 0, 2 * tokens * h * E)
        fwd_pre += [emb, Collective("embedding_ar", tp_out_kind, "tp", job.tp, act_bytes)]
        # its dropout, after the reduction (on the rank's shard of the tokens with SP)
        drop, drop_bwd = train.embedding_dropout(
            job, tokens * h // (job.tp if job.sequence_parallel else 1))
        fwd_pre += drop
        # backward: scatter-add of the output gradient into the embedding rows
        bwd_post += [*drop_bwd,
                     memory_op("embedding_bwd", "other", tokens * h, 3 * tokens * h * E)]
        params += vocab_local * h
    send_grad = None if first else Collective("send_grad", "send_recv", "pp", 2, p2p_bytes,
                                              crosses_nodes=_send_crosses_nodes(job, index - 1))
    if last:
        norm = memory_op("final_norm", "norm", 4 * tokens * h, (2 * tokens * h + h) * E)
        head = gemm("lm_head", tokens, vocab_local, h)
        logits = tokens * vocab_local
        loss, loss_bwd = train.cross_entropy_ops(job, logits)
        stats = Collective("loss_ar", "all_reduce", "tp", job.tp, float(3 * tokens * 4))
        fwd_post += [norm]
        if job.sequence_parallel:
            fwd_post.append(Collective("lm_head_ag", "all_gather", "tp", job.tp, act_bytes))
        fwd_post += [head, loss, stats]
        bwd_pre += [
            loss_bwd,
            *weight_linear_backward(job, head),
            Collective("lm_head_grad_ar", tp_out_kind, "tp", job.tp, act_bytes,
                       overlaps_weight_grad=True),
            memory_backward(norm),
        ]
        params += vocab_local * h + h
    send_act = None if last else Collective("send_activation", "send_recv", "pp", 2, p2p_bytes,
                                            crosses_nodes=_send_crosses_nodes(job, index))

    # Weights are replicated across DP and CP ranks, so gradients are reduced over both
    # (Megatron's data-parallel group includes the context-parallel ranks); distributed
    # optimizer: reduce-scatter the gradients, step, all-gather the updated bf16 parameters.
    end: list[Op] = []
    dp_group = (job.dp or 1) * job.cp
    if dp_group > 1:
        # fp32 gradients (see _optimizer_step), bf16 parameters
        end.append(Collective("grad_rs", "reduce_scatter", "dp", dp_group, float(params * 4)))
    end.append(_optimizer_step(params, dp_group))
    if dp_group > 1:
        end.append(Collective("param_ag", "all_gather", "dp", dp_group, float(params * E)))
    return StageGraph(
        index=index,
        num_layers=layers,
        forward_pre=tuple(fwd_pre),
        forward_post=tuple(fwd_post),
        backward_pre=tuple(bwd_pre),
        backward_post=tuple(bwd_post),
        iteration_end=tuple(end),
        params=params,
        send_activation=send_act,
        send_grad=send_grad,
    )
