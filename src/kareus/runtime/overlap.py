"""What the TP, SP and CP overlapped schedules share: their asynchronous partition
collectives and the hooks that issue a collective at its slot.

A partition's collective is issued once, just before the compute op its slot names
(forward: checked op by op; backward: from a gradient hook on the forward tensor whose
backward the slot names), and waited for once, at the partition's end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from kareus.runtime.primitives import Group, world_size

GroupsBySms = Callable[[int], Group]
"""The process group whose NCCL communicator runs a collective on that many SMs."""

Taps = dict[str, "torch.Tensor | tuple[torch.Tensor, ...]"]
"""Intermediate tensors of a segment by the name of the op producing them."""


class Pending:
    """One asynchronous collective of a partition: issued once (before the slot's op),
    waited for once (at the partition's end). With ``groups_by_sms``, it runs on the
    process group for its SM count (NCCL min_ctas = max_ctas = SMs). An all-gather
    concatenates the ranks' tensors along ``dim``; a reduce-scatter sums them and keeps
    this rank's part along ``dim`` (the sequence: 1 for [b, s, ...], 0 for Megatron's
    [s, b, h])."""

    def __init__(self, kind: str, tensor: torch.Tensor, group: Group, sms: int = 0,
                 groups_by_sms: GroupsBySms | None = None, dim: int = 1) -> None:
        if kind not in ("all_reduce", "all_gather", "reduce_scatter"):
            raise ValueError(f"unknown collective {kind}")
        self.kind, self.tensor, self.group, self.dim = kind, tensor, group, dim
        if groups_by_sms is not None and sms > 0 and world_size(group) > 1:
            self.group = groups_by_sms(sms)
        self.work: dist.Work | None = None
        self.result: torch.Tensor | None = None
        self.issued = False
        self._src: torch.Tensor | None = None

    def issue(self) -> None:
        if self.issued:
            return
        self.issued = True
        t, g = self.tensor, self.group
        n = world_size(g)
        if n <= 1:
            self.result = t
            return
        if self.kind == "all_reduce":
            self.result = t
            self.work = dist.all_reduce(t, group=g, async_op=True)
            return
        # both run on the first dimension: the sequence moved there (a view where it is
        # already first, as in Megatron's [s, b, h])
        self._src = t.movedim(self.dim, 0).contiguous()
        rows = self._src.shape[0]
        if self.kind == "all_gather":
            self.result = self._src.new_empty((rows * n, *self._src.shape[1:]))
            self.work = _all_gather(self.result, self._src, g)
        else:
            if rows % n:
                raise ValueError(f"a reduce-scatter over {n} ranks needs a sequence "
                                 f"divisible by {n}, not {rows}")
            self.result = self._src.new_empty((rows // n, *self._src.shape[1:]))
            self.work = _reduce_scatter(self.result, self._src, g)

    def wait(self) -> torch.Tensor:
        self.issue()
        if self.work is not None:
            self.work.wait()
            self.work = None
            self._src = None
            if self.kind != "all_reduce" and self.result is not None and self.dim != 0:
                self.result = self.result.movedim(0, self.dim).contiguous()
        assert self.result is not None
        return self.result


def _all_gather(out: torch.Tensor, src: torch.Tensor, group: Group) -> dist.Work:
    """Asynchronous all-gather along the first dimension (torch's newer name where it has
    it: ``all_gather_into_tensor`` warns that it is deprecated)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = fn(out, src, group=group, async_op=True)
    assert work is not None
    return work


def _reduce_scatter(out: torch.Tensor, src: torch.Tensor, group: Group) -> dist.Work:
    """Asynchronous reduce-scatter along the first dimension (torch's newer name where it
    has it: ``reduce_scatter_tensor`` warns that it is deprecated)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = fn(out, src, group=group, async_op=True)
    assert work is not None
    return work


def issue_before(pending: Pending | None, launch_op: str | None, name: str) -> None:
    """Forward slot hook: issue ``pending`` if its launch op is ``name`` (about to run)."""
    if pending is not None and launch_op == name:
        pending.issue()


def issue_at_end(pending: Pending | None) -> None:
    """Slot "none": issue ``pending`` after the partition's last compute op."""
    if pending is not None:
        pending.issue()


BACKWARD_TAPS = {"fc2_dgrad": "fc2", "swiglu_bwd": "swiglu", "fc1_dgrad": "fc1",
                 "out_proj_dgrad": "out_proj", "core_attn_bwd": "core_attn",
                 "rope_bwd": "rope", "qkv_dgrad": "qkv"}
"""Backward slot -> the forward tensor whose gradient marks that op's backward start."""


def hook_backward_slot(taps: Taps, launch: str | None, pending: Pending | None) -> None:
    """Backward slot hook: issue ``pending`` when autograd reaches the backward op named
    ``launch`` (a norm or residual slot: at once, the start of the partition)."""
    if pending is None:
        return
    name = BACKWARD_TAPS.get(launch or "")
    if name is None:
        if launch is not None:  # a norm/residual slot: the start of the partition
            pending.issue()
        return
    if name not in taps:  # the slot's op is not in this piece of the partition
        return
    issue = pending.issue

    def on_gradient(grad: torch.Tensor) -> None:
        issue()

    tapped = taps[name]
    for t in tapped if isinstance(tapped, tuple) else (tapped,):
        t.register_hook(on_gradient)
