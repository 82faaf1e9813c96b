"""From the options a pipeline solve picked to an ExecutionPlan."""

from __future__ import annotations

from collections.abc import Mapping

from kareus.compose.instruction import InstructionOption
from kareus.core import LAUNCH_FIRST, InstructionId, PartitionSetting
from kareus.execution import ExecutionPlan


def to_execution_plan(name: str, picks: Mapping[InstructionId, InstructionOption],
                      f_max: int, overlap: bool) -> ExecutionPlan:
    """An ExecutionPlan that runs each instruction with its chosen option."""
    freqs: dict[InstructionId, int] = {}
    settings: dict[InstructionId, dict[str, PartitionSetting]] = {}
    sequential: set[InstructionId] = set()
    for iid, opt in picks.items():
        freqs[iid] = opt.freq_mhz
        if opt.sequential:
            sequential.add(iid)
        elif opt.settings:
            settings[iid] = opt.setting_dict()
    return ExecutionPlan(name, overlap=overlap, default_freq_mhz=f_max,
                         instruction_freqs=freqs, instruction_knobs=settings,
                         default_slot=LAUNCH_FIRST if overlap else None,
                         sequential=frozenset(sequential) if overlap else frozenset())
