"""The two kinds of work in an execution graph: compute kernels and collectives."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ComputeKind = Literal["gemm", "attention", "memory"]
CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
Group = Literal["tp", "cp", "pp", "dp"]
SlotClass = Literal["norm", "rope", "activation", "linear", "attn", "other"]
BreakdownRow = Literal["", "dropout", "grad_accumulation"]
"""Where `kareus simulate --breakdown` charges an op's time, when not to its kind's row:
the ops the job's training settings add (`kareus.job.training`)."""

GemmShape = tuple[int, int, int]
"""(m, n, k): output m x n, reduction length k; FLOPs = 2 m n k."""


@dataclass(frozen=True)
class ComputeOp:
    """One compute kernel (or a short fused run of them) on the compute stream.

    ``flops`` and ``bytes_`` (HBM bytes read + written) are for the whole op; GEMM ops keep
    their shapes so a backend can count thread-block tiles (a backward linear holds two
    GEMMs: data gradient, then weight gradient).
    """

    name: str
    kind: ComputeKind
    flops: float
    bytes_: float
    slot_class: SlotClass
    gemm_shapes: tuple[GemmShape, ...] = ()
    opens_slot: bool = True
    """False for a kernel that continues its predecessor's launch slot (a linear's weight
    gradient GEMM follows its data gradient GEMM in the same backward)."""
    attn_keys: int = 0
    """Attention only: the keys the longest query row attends to (the sequence length of a
    plain causal attention), which sets a flash-attention kernel's efficiency."""
    attn_causal: bool = False
    """Attention only: a causal square (the score matrix's upper triangle skipped)."""
    ring_step_bytes: tuple[float, ...] = ()
    """Attention only, CP ring (``cp_comm_type`` p2p): one entry per step of the ring, the
    bytes one rank sends to its neighbour (and receives) while that step computes; the
    op's work splits evenly over the steps (0 bytes: a step with nothing in flight).
    Empty: no communication inside the op."""
    fused: bool = False
    """The op runs inside the previous op's kernel (the extra work a fusion adds to it,
    e.g. a dropout's mask in the residual add): no launch of its own, its time and bytes
    the kernel's extra ones. Its ``opens_slot`` is False."""
    breakdown: BreakdownRow = ""
    """The breakdown row its time goes to (`BreakdownRow`; '': its kind's)."""

    def __post_init__(self) -> None:
        if self.fused and self.opens_slot:
            raise ValueError(f"fused op {self.name!r} runs in the previous kernel: it cannot "
                             f"open a launch slot")
        if self.kind == "attention" and self.attn_keys < 1:
            raise ValueError(f"attention op {self.name!r} needs attn_keys (the keys a query "
                             f"row attends to), got {self.attn_keys}")

    @property
    def is_collective(self) -> bool:
        return False

    def to_dict(self) -> dict:
        d: dict = {"name": self.name, "kind": self.kind, "flops": self.flops, "bytes": self.bytes_}
        if self.gemm_shapes:
            d["gemm_shapes"] = [list(s) for s in self.gemm_shapes]
        if self.attn_keys:
            d["attn_keys"], d["attn_causal"] = self.attn_keys, self.attn_causal
        if self.ring_step_bytes:
            d["ring_step_bytes"] = list(self.ring_step_bytes)
        if self.fused:  # only where set: the signatures of older ops stay as they were
            d["fused"] = True
        return d


_SUFFIX = {"all_reduce": "ar", "all_gather": "ag", "reduce_scatter": "rs", "send_recv": "p2p"}


@dataclass(frozen=True)
class Collective:
    """A communication kernel over a process group.

    ``bytes_`` follows the nccl-tests "size" convention: the whole buffer for all-reduce,
    the gathered output for all-gather, the full input for reduce-scatter, the message for
    send/recv. ``closes`` names the compute segment this collective ends (partitions are cut
    at collectives).
    """

    name: str
    kind: CollectiveKind
    group: Group
    group_size: int
    bytes_: float
    closes: str = ""

    flops: float = 0.0
    overlaps_weight_grad: bool = False
    """The input-gradient collective of a column-parallel linear: Megatron-Core issues it
    asynchronously after the data gradient GEMM and runs the weight gradient GEMM beside it
    (`allreduce_dgrad`; TransformerEngine's Linear does the same, anchors §6)."""
    crosses_nodes: bool = False
    """A pipeline send between stages on different nodes (the network, not NVLink)."""

    @property
    def is_collective(self) -> bool:
        return True

    @property
    def short_kind(self) -> str:
        return _SUFFIX[self.kind]

    def to_dict(self) -> dict:
        d: dict = {
            "name": self.name,
            "kind": self.kind,
            "group": self.group,
            "group_size": self.group_size,
            "flops": self.flops,
            "bytes": self.bytes_,
        }
        if self.crosses_nodes:  # only then: the signatures of all other ops stay as they were
            d["crosses_nodes"] = True
        return d


Op = ComputeOp | Collective


def ops_signature(ops: Sequence[Op]) -> str:
    """A stable name for a run of ops: their names and a digest of everything that makes
    them cost what they cost (kinds, FLOPs, bytes, shapes, groups). Journal key of
    measurements outside partitions. Cached: composition asks for the same runs of ops for
    every method and clock."""
    return _signature(tuple(ops))


@functools.lru_cache(maxsize=4096)
def _signature(ops: tuple[Op, ...]) -> str:
    names = "+".join(op.name for op in ops)
    text = json.dumps([op.to_dict() for op in ops], sort_keys=True)
    return f"{names}#{hashlib.sha256(text.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class Segment:
    """The compute ops of one nanobatch between two collectives, and the collective ending it.

    ``direction`` is "fwd" or "bwd" (a recomputed forward is "fwd"); ``layer`` is the layer's
    position within the pass, used only for counting; ``nanobatch`` its nanobatch.
    """

    name: str
    direction: str
    ops: tuple[ComputeOp, ...]
    collective: Collective | None
    layer: int = 0
    nanobatch: int = 0
    """Which nanobatch's segment (0 or 1): a sequence split's differ in attention."""

    @property
    def base_key(self) -> str:
        return f"{self.direction}_{self.name}"
