"""The ops a job's training settings add or change (`kareus.job.training`, docs/workload.md).

Hand counts of what Megatron-Core runs, bf16 activations (``E`` bytes per element), per
rank; every op is timed by the emulator's existing models (memory-bound: its bytes).

- Hidden dropout, in the bias-dropout-add after each block (``fused_bias_dropout.py``) and
  on the embedding's output (``LanguageModelEmbedding.embedding_dropout``). The mask is
  drawn in the kernel and kept for the backward as one byte per element (torch's dropout
  keeps a bool mask). Fused: the residual add's kernel also writes the mask (1 byte per
  element more, no launch of its own); unfused: a dropout kernel of its own before the add
  (reads x, writes the output and the mask: 2E + 1). A forward without gradients (the
  first forward under full recompute: ``CheckpointFunction.forward`` runs under
  ``torch.no_grad``, tensor_parallel/random.py) has no mask to keep: the layer runs the
  bias-dropout-add under ``torch.enable_grad`` (transformer_layer.py,
  ``bias_dropout_add_exec_handler``), but neither of its inputs there needs a gradient
  with respect to the dropped tensor (the block's output was computed without
  gradients), so the fused function (``jit_fuser``, torch.compile, jit.py) is compiled
  without a backward and draws the mask in registers: the add's kernel alone. The unfused
  path's eager ``F.dropout`` (torch's native dropout kernel) writes its mask whatever the
  grad mode. The recomputed forward inside the backward writes it, as a forward without
  recompute does. Backward, fused or not: a kernel that
  scales the incoming gradient by the mask (reads the gradient and the mask, writes the
  gradient: 2E + 1), where no dropout passes the gradient through with no kernel.
- Unfused gradient accumulation (``gradient_accumulation_fusion`` false): each weight
  gradient GEMM writes a bf16 gradient (already in its bytes) and Megatron-Core's DDP hook
  adds it to the fp32 main gradient (``main_grad.add_``, distributed_data_parallel.py):
  reads E + 4, writes 4 bytes per weight element of the rank, one kernel per weight and
  microbatch, after the linear's backward returned (`kareus.workload.partition.blocking_steps`
  places it after the input-gradient collective that backward waits for). With the
  microbatch split in two nanobatches (Kareus's executor) each nanobatch's weight gradient
  is a gradient of its own (``torch.autograd.grad`` per piece), the two are summed in bf16
  (``Grads``, kareus/runtime/pieces.py: ``s + g``, reads 2E, writes E), and the layer's
  autograd function returns the sum, which the DDP hook adds once: two kernels per weight,
  3E + E + 8 bytes per weight element, not two main-gradient adds. The nanobatch op lists
  carry half of that each (one kernel, (4E + 8) / 2 bytes per weight element), so the two
  nanobatches keep one op list and one partition key; the totals (kernels, bytes) are
  what runs, the placement is approximate (the sum runs after nanobatch 1's weight
  gradient, the hook's add after the layer's backward).
- Unfused RoPE (``apply_rope_fusion`` false): ``_apply_rotary_pos_emb_bshd`` per tensor
  (q, then k): negate half, concatenate, two multiplies, add, concatenate with the (empty)
  pass-through part: six kernels, 12 element reads and writes per element (fused: 2).
- Unfused SwiGLU (``bias_activation_fusion`` false): SiLU of the gate (reads one, writes
  one), then the multiply by the up half (reads two, writes one): two kernels, 5 element
  reads and writes per output (fused: 3).
- Cross-entropy (`cross_entropy_ops`).

Backward ops of a forward memory-bound op are 2x it, the layer's convention
(`kareus.workload.layer`), but the dropout's, counted above.
"""

from __future__ import annotations

from collections.abc import Sequence

from kareus.job.spec import BYTES_PER_ELEMENT as E
from kareus.job.spec import JobSpec
from kareus.workload.ops import ComputeOp, Op

MASK_BYTES = 1
"""A dropout mask element: torch keeps it as bool."""
MAIN_GRAD_BYTES = 4
"""Megatron-LM accumulates gradients in fp32 with bf16 (`kareus.workload.graph`)."""


def with_dropout(job: JobSpec, residual: ComputeOp, block: str, elems: int,
                 grad: bool = True) -> list[ComputeOp]:
    """The residual add after block ``block`` ("attn", "mlp") with its hidden dropout over
    ``elems`` elements: the add alone without dropout; the add, then the dropout's extra
    work in its kernel (fused); or a dropout kernel, then the add (unfused). ``grad``
    false: a forward without gradients, whose fused kernel keeps no mask (module
    docstring)."""
    t = job.training
    if not t.dropout:
        return [residual]
    if t.bias_dropout_fusion:
        if not grad:
            return [residual]  # the mask is drawn and used in registers: nothing more moves
        mask = ComputeOp(f"dropout_{block}", "memory", 2.0 * elems, float(MASK_BYTES * elems),
                         "norm", opens_slot=False, fused=True, breakdown="dropout")
        return [residual, mask]
    return [_dropout_kernel(f"dropout_{block}", elems), residual]


def dropout_backward(job: JobSpec, block: str, elems: int) -> list[ComputeOp]:
    """The gradient of block ``block``'s hidden dropout: scaled by the mask (none without
    dropout)."""
    return [_dropout_kernel(f"dropout_{block}_bwd", elems)] if job.training.dropout else []


def embedding_dropout(job: JobSpec, elems: int) -> tuple[list[ComputeOp], list[ComputeOp]]:
    """The embedding's dropout (torch.nn.Dropout, unfused): (forward, backward) ops."""
    if not job.training.dropout:
        return [], []
    return ([_dropout_kernel("embedding_dropout", elems)],
            [_dropout_kernel("embedding_dropout_bwd", elems)])


def _dropout_kernel(name: str, elems: int) -> ComputeOp:
    # draw (or read) the mask, scale: ~2 FLOPs per element; the RNG's integer work is
    # not a FLOP and the kernel is timed by its bytes
    return ComputeOp(name, "memory", 2.0 * elems, float((2 * E + MASK_BYTES) * elems), "norm",
                     breakdown="dropout")


def grad_accumulation(job: JobSpec, wgrad: ComputeOp, per_nanobatch: bool = False
                      ) -> list[ComputeOp]:
    """After a weight gradient GEMM: the kernel adding its bf16 gradient to the fp32 main
    gradient when gradient accumulation is not fused (none when it is: the GEMM
    accumulates in place, as the emulator assumed before). ``per_nanobatch``: ``wgrad`` is
    one of the two nanobatches' of a split microbatch, which carries half of the
    nanobatch sum and of the one main-gradient add (module docstring)."""
    if job.training.gradient_accumulation_fusion:
        return []
    (n, k, _), = wgrad.gemm_shapes  # the weight gradient: n x k over the tokens
    weights = n * k
    add = E + 2 * MAIN_GRAD_BYTES  # the DDP hook's main_grad.add_, once per microbatch
    if per_nanobatch:
        flops, bytes_ = weights, (3 * E + add) / 2  # with Grads' sum of the two, halved
    else:
        flops, bytes_ = weights, float(add)
    return [ComputeOp(f"{wgrad.name.removesuffix('_wgrad')}_grad_acc", "memory",
                      float(flops), bytes_ * weights, "other",
                      breakdown="grad_accumulation")]


def rope(job: JobSpec, q_elems: int, k_elems: int) -> list[ComputeOp]:
    """Rotary embedding of q and k: one fused op, or Megatron-Core's unfused kernels."""
    if job.training.apply_rope_fusion:
        # two multiplies and an add per element of q and k; cos/sin tables are tiny
        qk = q_elems + k_elems
        return [ComputeOp("rope", "memory", 3.0 * qk, float(2 * qk * E), "rope")]
    out = []
    for tensor, n in (("q", q_elems), ("k", k_elems)):
        # (kernel, FLOPs per element, element reads + writes per element of the tensor)
        for kernel, flops, moves in (("neg", 0.5, 1), ("cat", 0, 2), ("mul_cos", 1, 2),
                                     ("mul_sin", 1, 2), ("add", 1, 3), ("cat_pass", 0, 2)):
            out.append(ComputeOp(f"rope_{tensor}_{kernel}", "memory", flops * n,
                                 float(moves * n * E), "rope"))
    return out


def swiglu(job: JobSpec, elems: int) -> list[ComputeOp]:
    """SwiGLU over ``elems`` outputs: one fused op, or SiLU then the multiply."""
    if job.training.bias_activation_fusion:
        # silu(gate) * up, ~5 FLOPs per output; read gate and up, write one
        return [ComputeOp("swiglu", "memory", 5.0 * elems, float(3 * elems * E), "activation")]
    return [ComputeOp("silu", "memory", 4.0 * elems, float(2 * elems * E), "activation"),
            ComputeOp("swiglu_mul", "memory", 1.0 * elems, float(3 * elems * E), "activation")]


def cross_entropy_ops(job: JobSpec, logits: int) -> tuple[ComputeOp, ComputeOp]:
    """The vocab-parallel cross-entropy over one rank's logits, (forward, backward), bytes
    per logit:

    - unfused (Megatron-Core ``tensor_parallel/cross_entropy.py``): forward: cast to fp32
      (2 read + 4 written), max (4), subtract the max in place (8), exp in place (8), sum
      (4), divide by the sum in place (8) = 38; backward: scale the saved softmax by the
      loss gradient in place (8), cast to bf16 for the LM head's backward GEMMs (6) = 14
      (the target logit's one-hot update touches one entry per row);
    - ``native`` fused (``fusions/fused_cross_entropy.py``, three fused functions): cast
      and max (2 + 4), subtract, exp and sum (4 + 4), divide (4 + 4) = 22; backward: the
      gradient from the fp32 softmax, written in bf16 (4 + 2) = 6;
    - ``te`` (Transformer Engine's ``parallel_cross_entropy``, Triton): an online-softmax
      pass reading the bf16 logits (2), then a pass reading them again and writing the
      gradient in their place (2 + 2) = 6; backward: that gradient scaled by the loss
      gradient in place (2 + 2) = 4.
    """
    t = job.training
    if not t.cross_entropy_loss_fusion:
        fwd_b, bwd_b, fwd_f, bwd_f = 38, 14, 5, 2
    elif t.cross_entropy_fusion_impl == "native":
        fwd_b, bwd_b, fwd_f, bwd_f = 22, 6, 5, 2
    else:
        fwd_b, bwd_b, fwd_f, bwd_f = 6, 4, 5, 2
    return (ComputeOp("cross_entropy", "memory", float(fwd_f * logits),
                      float(fwd_b * logits), "other"),
            ComputeOp("cross_entropy_bwd", "memory", float(bwd_f * logits),
                      float(bwd_b * logits), "other"))


def weight_grad_end(ops: Sequence[Op], i: int) -> int:
    """Where the run from ``ops[i]`` through the adds to the main gradient after it ends
    (``i + 1`` when none follows): a weight gradient GEMM and its accumulation."""
    j = i + 1
    while j < len(ops) and getattr(ops[j], "breakdown", "") == "grad_accumulation":
        j += 1
    return j
