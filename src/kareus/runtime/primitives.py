"""The tensor-parallel and context-parallel building blocks of the decoder layer.

Megatron's two autograd operators (copy-to-TP: identity forward, all-reduce of the gradient
backward; reduce-from-TP: all-reduce forward, identity backward), the sequence all-gather
and reduce-scatter of context and sequence parallelism (and the autograd operators pairing
them), RMSNorm
and its recomputed backward, rotary embeddings, and the world size and rank of a group
(1 and 0 without one, or outside torch.distributed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Group = Any
"""A torch.distributed process group, or None (no parallelism)."""


def world_size(group: Group) -> int:
    """Ranks in ``group``: 1 without a group or without torch.distributed."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def rank_in(group: Group) -> int:
    """This process's rank in ``group``: 0 without a group or without torch.distributed."""
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


class CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        if world_size(ctx.group) > 1:
            dist.all_reduce(g, group=ctx.group)
        return g, None


class ReduceFromTP(torch.autograd.Function):
    """All-reduce over the TP group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.clone()
        if world_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


def gather_seq(t: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """All-gather along the sequence (``dim``: 1 for [b, s, ...], 0 for Megatron's
    [s, b, ...]) across the group, rank-major."""
    parts = [torch.empty_like(t) for _ in range(world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def scatter_seq_sum(t: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along the sequence (``dim``): each rank gets the sum of its chunk
    (gloo has no reduce-scatter: there, an all-reduce and this rank's slice, the same
    numbers)."""
    n = world_size(group)
    if dist.get_backend(group) == "gloo":
        full = t.contiguous().clone()
        dist.all_reduce(full, group=group)
        return full.chunk(n, dim=dim)[rank_in(group)].contiguous()
    chunks = [c.contiguous() for c in t.chunk(n, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


class GatherSeq(torch.autograd.Function):
    """Gather along the sequence forward; reduce-scatter the gradient backward (CP
    all-gather mode: K and V; sequence parallelism: a norm's output, on the TP group).
    ``apply(t, group)`` along dim 1; ``apply(t, group, dim)`` along ``dim``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return gather_seq(t, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # one None per optional input too: autograd drops the trailing ones not given
        return scatter_seq_sum(g, ctx.group, ctx.dim), None, None


class ScatterSeqSum(torch.autograd.Function):
    """Sequence parallelism's row-parallel output: reduce-scatter along the sequence
    forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return scatter_seq_sum(t, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_seq(g, ctx.group), None


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def norm_backward(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    """Gradients of ``rmsnorm(x, w)`` with respect to x and w, recomputed from x."""
    with torch.enable_grad():
        xx = x.detach().requires_grad_(True)
        return torch.autograd.grad(rmsnorm(xx, w), [xx, w], grad)


def rotary(x: torch.Tensor, offset: int = 0, base: float = 10000.0) -> torch.Tensor:
    """x: [b, s, heads, d]."""
    s, d = x.shape[1], x.shape[3]
    pos = torch.arange(offset, offset + s, dtype=x.dtype, device=x.device)
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    ang = torch.outer(pos, inv)  # [s, d/2]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
