"""What the overlapped layer needs of a plan: per partition key, the collective's setting
(SMs and launch slot) and the compute op each slot names.

Keys as in kareus.workload.partition (fwd_attn, fwd_mlp, bwd_mlp, bwd_attn; with CP fwd_qkv_ag,
bwd_o_ar, ...). A key without a setting runs its collective after the partition's compute
(no overlap) on the layer's own group. ``split`` says how the microbatch is cut into the
two nanobatches: along the batch ("batch"), or along the sequence ("sequence": micro-batch
size 1; kareus.runtime.pieces). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kareus.core import InstructionId, PartitionSetting
from kareus.errors import SpecError
from kareus.job.nanobatch import NANOBATCH_SPLITS
from kareus.plans.execution import ExecutionPlan
from kareus.workload.partition import Partition

NO_SETTING = PartitionSetting(0, None)
"""A key the plan does not set: no overlap, no SM-specific process group."""


@dataclass(frozen=True)
class LayerPlan:
    settings: dict[str, PartitionSetting]
    """Per partition key: the collective's SMs and launch slot (None: no overlap)."""
    slot_ops: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per key: slot name -> name of the compute op it starts with (from the partition)."""
    split: str = "batch"
    """The nanobatches' split: "batch" (halves of the batch) or "sequence" (the first and
    second half of the tokens, micro-batch size 1)."""
    recompute: bool = False
    """The job recomputes each layer's forward inside its backward: the planner then pairs
    a layer's last backward collective with the next layer's recomputed forward (its first
    partition), not with that layer's first backward one (`layer_end_backward`)."""

    def __post_init__(self) -> None:
        if self.split not in NANOBATCH_SPLITS:
            raise SpecError(f"nanobatch split {self.split!r}: expected one of "
                            f"{', '.join(NANOBATCH_SPLITS)}")

    def key(self, key: str, nanobatch: int) -> str:
        """``key`` for the partition whose compute is nanobatch ``nanobatch``'s: the
        planner's per-nanobatch key (``fwd_attn_nb1``, a sequence split's attention) where
        the plan has one, else ``key``."""
        per_nb = f"{key}_nb{nanobatch}"
        return per_nb if per_nb in self.settings or per_nb in self.slot_ops else key

    def layer_end_backward(self, forward_key: str, backward_key: str) -> str:
        """The key of the partition the planner gives a layer's last backward collective:
        the next layer's first forward partition (``forward_key``) under recompute, its
        first backward one (``backward_key``) without. A one-layer schedule runs that
        collective exposed at these SMs (its slot lies in the next layer)."""
        return forward_key if self.recompute else backward_key

    def setting(self, key: str) -> PartitionSetting:
        return self.settings.get(key, NO_SETTING)

    def launch_op(self, key: str) -> str | None:
        """The compute op before which ``key``'s collective is issued (None: after the
        partition's last op)."""
        slot = self.setting(key).slot
        if slot is None:
            return None
        return self.slot_ops.get(key, {}).get(slot, slot)

    def sms(self, key: str) -> int:
        return self.setting(key).sms

    @classmethod
    def from_partitions(cls, partitions: Mapping[str, Partition],
                        settings: Mapping[str, PartitionSetting], split: str = "batch"
                        ) -> LayerPlan:
        """``settings`` per key; a `LAUNCH_FIRST` slot becomes the partition's first."""
        resolved = {k: PartitionSetting(s.sms, partitions[k].resolve_slot(s.slot))
                    if k in partitions else s for k, s in settings.items()}
        slot_ops = {k: {s.name: p.compute_ops[s.op_index].name for s in p.slots}
                    for k, p in partitions.items()}
        # recompute: the planner's backward instructions hold forward partitions
        recompute = any(p.direction == "forward" and any(p.count_backward)
                        for p in partitions.values())
        return cls(resolved, slot_ops, split, recompute)

    @classmethod
    def from_plan(cls, plan: ExecutionPlan, partitions: Mapping[str, Partition],
                  instruction: InstructionId = (0, 0, "forward"), default_sms: int = 32,
                  split: str = "batch") -> LayerPlan:
        """The settings ``plan`` gives ``instruction`` (at its clock) for every partition
        key; ``default_sms`` for keys whose SMs the plan leaves to NCCL."""
        freq = plan.freq(*instruction)
        settings = {k: plan.choice(k, freq, default_sms, instruction) for k in partitions}
        return cls.from_partitions(partitions, settings, split)


def layer_plan_for(plan: ExecutionPlan, partitions: Mapping[str, Partition],
                   instruction: InstructionId, default_sms: int = 32, split: str = "batch"
                   ) -> LayerPlan | None:
    """What the layer runs for ``instruction``: its `LayerPlan`, or None where the plan runs
    the instruction Megatron-style (the plain layer, microbatch not split)."""
    stage, microbatch, direction = instruction
    if plan.runs_sequential(stage, direction, microbatch):
        return None
    return LayerPlan.from_plan(plan, partitions, instruction, default_sms, split)
