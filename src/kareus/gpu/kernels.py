"""A partition's real kernels in PyTorch, at the job's shapes (one TP rank, one nanobatch).

Every compute op of a partition becomes one callable in the partition's order: GEMMs
(each GEMM of the op, data gradient and weight gradient for a backward linear), causal
scaled-dot-product attention (GQA), RMSNorm, rotary, SwiGLU, residual adds; backward
memory-bound ops are elementwise kernels moving the op's bytes. Attention backward runs
the fused attention forward and backward through autograd (flash attention needs the
forward's statistics), so it does about 3.5x the forward's work where the graph counts
2.5x: a documented overestimate of one kernel.

Each op's kernel is sized by the shapes the graph built the op with (`op_shapes`): a
nanobatch's (a partition's nanobatch, kareus.workload.layer.LayerShapes) or the whole
microbatch's (the unsplit layer of the Megatron-LM and Perseus baselines, the ops before
and after a stage's layers). With a sequence split (micro-batch size 1) a nanobatch is
half of the sequence: its per-token kernels run on seq/2 tokens, and its attention on the
keys the op reads (``ComputeOp.attn_keys``) with its queries the last seq/2 of them:
nanobatch 0's a causal square, nanobatch 1's the first half's keys in full and its own
causally (a lower-right aligned causal mask, ~3x nanobatch 0's work).

torch is imported lazily (`import_torch`); on the "meta" device nothing is computed, only
shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from kareus.errors import KareusError
from kareus.job.spec import JobSpec
from kareus.workload.layer import LayerShapes
from kareus.workload.ops import ComputeOp
from kareus.workload.partition import Partition

if TYPE_CHECKING:
    import torch as torch_types


@dataclass
class Kernel:
    name: str
    kind: str
    run: Callable[[], object]
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of the kernel's main inputs (GEMMs: each (m, k) x (k, n))."""


TORCH_MISSING = (
    "real kernels need PyTorch: from a clone, pip install -e '.[gpu]' (a CUDA build); "
    "for the CPU first pip install torch --index-url https://download.pytorch.org/whl/cpu "
    "(docs/gpu.md)")
"""The one line a missing PyTorch gives (`import_torch`)."""


def import_torch() -> ModuleType:
    """PyTorch, or a one-line error saying how to install it."""
    try:
        import torch
    except ImportError:
        raise KareusError(TORCH_MISSING) from None
    return torch


def build_kernels(partition: Partition, job: JobSpec, device: str = "cpu",
                  dtype_name: str = "bfloat16") -> list[Kernel]:
    """The partition's compute ops as kernels, in order, at its nanobatch's shapes."""
    torch = import_torch()
    dtype = getattr(torch, dtype_name)
    sh = LayerShapes(job, nanobatch=partition.nanobatch or 0)
    return [build_kernel(op, sh, device, dtype) for op in partition.compute_ops]


def op_shapes(job: JobSpec) -> Callable[[ComputeOp], LayerShapes]:
    """The shapes each of ``job``'s compute ops was built with, for ops measured outside
    partitions (`build_kernel` of a run of ops): a nanobatch layer's op at that
    nanobatch's shapes; anything else (the unsplit layer, the ops around the layers:
    their tokens are the whole microbatch's) at the microbatch's."""
    from kareus.workload.layer import backward_ops, forward_ops

    whole = LayerShapes(job, sequences=job.micro_batch_size)
    by_op: dict[ComputeOp, LayerShapes] = {}
    if job.splits_into_nanobatches:
        for nb in (1, 0):  # an op both nanobatches share: nanobatch 0's shapes
            sh = LayerShapes(job, nanobatch=nb)
            fwd = forward_ops(job, nanobatch=nb)
            for op in (*fwd, *backward_ops(job, fwd, nanobatch=nb)):
                if isinstance(op, ComputeOp):
                    by_op[op] = sh
    return lambda op: by_op.get(op, whole)


def build_kernel(op: ComputeOp, shapes: LayerShapes, device: str,
                 dtype: torch_types.dtype) -> Kernel:
    """One compute op as a kernel on ``device``, its inputs allocated once (random)."""
    torch = import_torch()

    def new(*shape: int) -> torch_types.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    if op.kind == "gemm":
        return _gemm(op, new)
    if op.kind == "attention":
        return _attention(op, shapes, new, device)
    return _memory_bound(op, shapes, new)


_New = Callable[..., "torch_types.Tensor"]


def _gemm(op: ComputeOp, new: _New) -> Kernel:
    pairs = [(new(m, k), new(k, n)) for m, n, k in op.gemm_shapes]

    def run_gemm() -> object:
        return [a @ b for a, b in pairs]

    shapes = tuple(s for a, b in pairs for s in (tuple(a.shape), tuple(b.shape)))
    return Kernel(op.name, "gemm", run_gemm, shapes)


def attention_lengths(op: ComputeOp, sh: LayerShapes) -> tuple[int, int]:
    """(queries, keys) per sequence of an attention op built at ``sh``. A sequence split's
    nanobatch: the op's keys (``attn_keys``; nanobatch 1 reads nanobatch 0's too), its
    ``s_local`` queries the last of them. Otherwise a rank's queries against the whole
    sequence's keys (with CP the local queries see a longer history)."""
    if sh.job.sequence_split:
        return sh.s_local, op.attn_keys
    return sh.s_local, sh.s_full


def _attention(op: ComputeOp, sh: LayerShapes, new: _New, device: str) -> Kernel:
    torch = import_torch()
    b, d = sh.b, sh.d
    queries, keys = attention_lengths(op, sh)
    q = new(b, sh.heads, queries, d)
    k = new(b, sh.kv_heads, keys, d)
    v = new(b, sh.kv_heads, keys, d)
    causal = queries == keys
    mask: torch_types.Tensor | None = None
    if sh.job.sequence_split and not causal:
        # the queries are the last rows: causal aligned to the lower right (SDPA's
        # is_causal is aligned to the upper left); torch's CausalBias keeps the fused
        # kernels where they take it, else it is an explicit mask
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(queries, keys)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = sh.heads != sh.kv_heads
    shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))

    if op.name.endswith("_bwd"):
        qg, kg, vg = (t.detach().requires_grad_(device != "meta") for t in (q, k, v))

        def run_attn_bwd() -> object:
            out = sdpa(qg, kg, vg, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            return out

        return Kernel(op.name, "attention", run_attn_bwd, shapes)

    def run_attn() -> object:
        return sdpa(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)

    return Kernel(op.name, "attention", run_attn, shapes)


def _memory_bound(op: ComputeOp, sh: LayerShapes, new: _New) -> Kernel:
    torch = import_torch()
    tokens, h = sh.norm_tokens, sh.h
    name = op.name
    if name.startswith("residual") and not name.endswith("_bwd"):
        x, y = new(tokens, h), new(tokens, h)
        return Kernel(name, "memory", lambda: x + y, ((tokens, h), (tokens, h)))
    if name.endswith("norm") and not name.endswith("_bwd"):
        width = sh.d if name == "qk_norm" else h
        rows = (sh.tokens * (sh.heads + sh.kv_heads)) if name == "qk_norm" else tokens
        xn, w = new(rows, width), new(width)

        def rmsnorm() -> object:
            return xn * torch.rsqrt(xn.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(
                xn.dtype) * w

        return Kernel(name, "memory", rmsnorm, ((rows, width),))
    if name == "rope":
        rows = sh.tokens * (sh.heads + sh.kv_heads)
        xr = new(rows, sh.d)
        cos, sin = new(rows, sh.d // 2), new(rows, sh.d // 2)

        def rotary() -> object:
            x1, x2 = xr[:, : sh.d // 2], xr[:, sh.d // 2:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        return Kernel(name, "memory", rotary, ((rows, sh.d),))
    if name == "swiglu":
        g, u = new(sh.tokens, sh.ffn), new(sh.tokens, sh.ffn)
        return Kernel(name, "memory", lambda: torch.nn.functional.silu(g) * u,
                      ((sh.tokens, sh.ffn), (sh.tokens, sh.ffn)))
    # anything else memory-bound (backward elementwise ops): read two, write one, moving
    # the op's bytes
    n = max(1, int(op.bytes_ // (3 * 2)))
    a, c = new(n), new(n)
    return Kernel(name, "memory", lambda: a * c + a, ((n,), (n,)))


def stand_in_collective(nbytes: float, device: str = "cpu", dtype_name: str = "bfloat16"
                        ) -> Callable[[], object]:
    """Single-GPU stand-in for a collective: moves the collective's bytes through memory
    (a copy of nbytes/2 in, nbytes/2 out). It does not reproduce the link, and plain
    PyTorch cannot pin a copy to a number of thread blocks: the SM setting only matters
    for the real NCCL collective (multi-GPU)."""
    torch = import_torch()
    dtype = getattr(torch, dtype_name)
    n = max(1, int(nbytes // 2 // 2))
    src = torch.empty(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)
