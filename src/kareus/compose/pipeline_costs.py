"""What a pipeline solve needs besides the instruction options: its shape and the costs
outside instructions (transfers, end-of-iteration work, static power)."""

from __future__ import annotations

from dataclasses import dataclass

from kareus.compose.instruction import InstructionOption
from kareus.core import InstructionId
from kareus.plans.schedule import Compiled, compiled

Options = dict[tuple[int, str], list[InstructionOption]]
"""Per (stage, direction), its instructions' options, Pareto-sorted, fastest first."""


@dataclass(frozen=True)
class PipelineCosts:
    """Everything the pipeline needs besides the instruction options. ``pp`` is the number
    of pipeline ranks; with interleaved 1F1B (``vp > 1``) the per-stage tuples have one
    entry per virtual stage (``pp x vp``)."""

    pp: int
    microbatches: int
    gpus: int
    static_power_w: float
    send_activation_s: tuple[float, ...]
    send_grad_s: tuple[float, ...]
    end_s: tuple[float, ...]
    fixed_dynamic_j: tuple[float, ...]
    """Per stage, per GPU: transfers' and end-of-iteration dynamic energy."""
    vp: int = 1

    @property
    def stages(self) -> int:
        return self.pp * self.vp

    @property
    def shape(self) -> Compiled:
        """The pipeline's compiled dependency structure (kareus.plans.schedule)."""
        return compiled(self.pp, self.microbatches, self.vp)

    def instructions(self) -> tuple[InstructionId, ...]:
        return self.shape.ids
