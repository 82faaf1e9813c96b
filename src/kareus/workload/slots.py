"""Launch slots: the places in a partition's compute where its collective may start
(docs/anchors.md §4). Consecutive memory-bound ops merge into one slot named by the first
(``norm``, ``rope``, ``activation``); every GEMM is a ``linear`` slot (a weight-gradient
GEMM shares its data-gradient GEMM's) and attention an ``attn`` slot; slots are numbered
per class in execution order (``linear_0``, ``linear_1``, ...).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kareus.workload.ops import ComputeOp


@dataclass(frozen=True)
class Slot:
    name: str
    op_index: int
    """Index in the partition's compute ops of the slot's first op."""


def make_slots(ops: tuple[ComputeOp, ...]) -> tuple[Slot, ...]:
    slots: list[Slot] = []
    numbers: Counter = Counter()
    prev_memory = False
    for i, op in enumerate(ops):
        is_memory = op.kind == "memory"
        if (is_memory and prev_memory) or (not op.opens_slot and slots):
            continue  # consecutive memory-bound ops share the first one's slot; so does a
            # weight gradient GEMM with its data gradient GEMM
        cls = op.slot_class
        slots.append(Slot(f"{cls}_{numbers[cls]}", i))
        numbers[cls] += 1
        prev_memory = is_memory
    return tuple(slots)
