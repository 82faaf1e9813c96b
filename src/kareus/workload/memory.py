"""Does the job fit? Memory per GPU of each pipeline rank under Megatron-LM's execution.

- Weights: bf16, 2 bytes per parameter the rank holds (its layers; the embedding on the
  first stage, the final norm and LM head on the last).
- Gradients and optimizer: Megatron-LM with the distributed optimizer, bf16 parameters and
  fp32 gradients: 6 + 12/d bytes per parameter, d the data-parallel group (DP x CP ranks,
  which hold the same weights): 2 (bf16 weight) + 4 (fp32 gradient) + 12/d (fp32 master
  weight and Adam's two moments, sharded). Megatron-LM's distributed-optimizer
  documentation tabulates this (docs/anchors.md §7).
- Activations, per layer and microbatch (Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", 2022; flash attention keeps no score
  matrix): s b h (10 + 24/t) bytes with TP t, s b h 34/t with sequence parallelism, s the
  rank's sequence (seq/CP), b the microbatch size. Their coefficients are for a GPT block
  (4h MLP); for SwiGLU blocks they are an approximation. With full recompute a layer keeps
  only its input (2 s b h bytes, /t with SP) and one layer's activations are live while it
  is recomputed. 1F1B keeps min(PP - stage, microbatches) microbatches in flight.
  Interleaved 1F1B (V model chunks per rank): the memory is per rank, summed over its
  chunks, and rank r holds min(2 (PP - r - 1) + (V - 1) PP + 1, V x microbatches) chunk
  forwards in flight (its warm-up plus one, Megatron-Core's schedule), each of a chunk's
  layers (the rank's mean).
- The last stage's logits for one microbatch: bf16 logits and the fp32 softmax of the
  vocab-parallel loss, s b (vocab/t) x 6 bytes.
- A reserve for the CUDA context, NCCL buffers and allocator fragmentation: 2 GiB
  (an assumption, not a measurement).
"""

from __future__ import annotations

from dataclasses import dataclass

from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.workload.graph import ExecutionGraph

RESERVE_BYTES = 2 * 2**30
_GIB = 2**30


@dataclass(frozen=True)
class StageMemory:
    stage: int
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    logits_bytes: float
    reserve_bytes: float = RESERVE_BYTES

    @property
    def total_bytes(self) -> float:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.logits_bytes + self.reserve_bytes)

    def describe(self) -> str:
        parts = (("weights", self.weights_bytes), ("gradients", self.gradients_bytes),
                 ("optimizer", self.optimizer_bytes), ("activations", self.activations_bytes),
                 ("logits", self.logits_bytes), ("reserve", self.reserve_bytes))
        return ", ".join(f"{n} {b / _GIB:,.1f}" for n, b in parts if b > 0)


def layer_activation_bytes(job: JobSpec) -> float:
    """One layer's activations for one microbatch on one rank (Korthikanti et al.)."""
    s, b, h, t = job.local_seq_length, job.micro_batch_size, job.model.hidden_size, job.tp
    return s * b * h * (34 / t if job.sequence_parallel else 10 + 24 / t)


def stage_memory(graph: ExecutionGraph) -> list[StageMemory]:
    """Per pipeline rank (one stage each, or V virtual stages with interleaved 1F1B)."""
    job = graph.job
    d = (job.dp or 1) * job.cp
    s, b, h, t = job.local_seq_length, job.micro_batch_size, job.model.hidden_size, job.tp
    layer = layer_activation_bytes(job)
    layer_input = 2 * s * b * h / (t if job.sequence_parallel else 1)
    vocab_local = -(-job.model.vocab_size // t)
    pp, v, last = job.pp, job.virtual_pipeline, job.virtual_stages - 1
    out = []
    for rank in range(pp):
        chunks = graph.stages[rank::pp]
        warmup = 2 * (pp - rank - 1) + (v - 1) * pp if v > 1 else pp - rank - 1
        in_flight = min(warmup + 1, v * job.num_microbatches)  # chunk forwards held
        chunk_layers = sum(g.num_layers for g in chunks) / v
        if job.recompute:
            act = chunk_layers * in_flight * layer_input + layer
        else:
            act = chunk_layers * in_flight * layer
        logits = s * b * vocab_local * 6.0 if any(g.index == last for g in chunks) else 0.0
        params = sum(g.params for g in chunks)
        out.append(StageMemory(rank, 2.0 * params, 4.0 * params, 12.0 * params / d, act,
                               logits))
    return out


def check_fits(graph: ExecutionGraph) -> None:
    """SpecError, with the numbers, when a pipeline rank does not fit its GPUs' memory."""
    gpu = graph.job.gpu_spec
    where = "stage" if graph.job.virtual_pipeline == 1 else "pipeline rank"
    for m in stage_memory(graph):
        if m.total_bytes > gpu.memory_bytes:
            raise SpecError(
                f"the job does not fit: {where} {m.stage} needs {m.total_bytes / _GIB:,.1f} GiB "
                f"per GPU ({m.describe()} GiB) but a {gpu.name} has "
                f"{gpu.memory_bytes / _GIB:,.1f} GiB; use more TP/PP/CP, a smaller "
                f"microbatch or sequence{'' if graph.job.recompute else ', or --recompute'}")
