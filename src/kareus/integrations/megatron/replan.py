"""`Replanner`: a `MegatronPlan` re-planned while training runs (docs/runtime.md,
"Re-planning while training").

At each iteration boundary every rank calls `Replanner.boundary`, which
- reads the operator's control file on global rank 0 only and broadcasts what it holds
  (one ``broadcast_object_list``), so every rank sees the same request at the same
  iteration; a malformed file is a warning on rank 0, and training goes on;
- agrees the pace: ``own`` is the iteration time the rank observed over its running plan's
  planned time, max-reduced over the rank's replica (its model-parallel ranks: the replica
  is as slow as its slowest rank), ``slowest`` the max over every rank (two all-reduces of
  one scalar);
- hands both to the `PlanSwitcher` (the same inputs on every rank, so every rank of a
  replica decides alike), and applies its answer with `MegatronPlan.use`, which swaps the
  layers' settings and the controller's clocks and allocates nothing;
- marks the iteration in the frequency controller's log ("# iteration N plan ID").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kareus.errors import KareusError, SpecError
from kareus.integrations.megatron.order import rank_instructions
from kareus.integrations.megatron.plan import MegatronPlan
from kareus.plans.plan import Plan
from kareus.runtime.control import read_control_file
from kareus.runtime.plan_switcher import Pace, PlanSwitcher

log = logging.getLogger(__name__)


class Replanner:
    """Re-plans ``plan`` with ``switcher`` (whose plans are of ``plan``'s job) at every
    iteration boundary. ``control_file``: the operator's (None: no control file);
    ``replica_group``: the process group of this rank's data-parallel replica (None: the
    rank alone is its replica); ``device``: where the scalars of the all-reduces live
    (a CUDA device under NCCL)."""

    def __init__(self, plan: MegatronPlan, switcher: PlanSwitcher,
                 control_file: str | Path | None = None, replica_group: Any = None,
                 device: torch.device | str = "cpu") -> None:
        if plan.plan.id != switcher.current.id:
            raise KareusError(f"the switcher starts on plan {switcher.current.id}, the "
                              f"Megatron plan runs {plan.plan.id}")
        _check_switchable(plan, switcher)
        self.plan, self.switcher = plan, switcher
        self.control_file = control_file
        self.replica_group = replica_group
        self.device = device

    def boundary(self, iteration: int, observed_s: float | None = None) -> Plan | None:
        """At the start of iteration ``iteration`` (every rank, every iteration, the first
        too: it marks the clock log): ``observed_s`` is the time this rank observed for the
        previous iteration, its forwards and backwards WITHOUT the wait at the gradient
        sync (None: no pace, as before the first one): a time that includes the wait is
        the straggler's on every replica, and then no replica ever moves. The plan
        switched to, or None."""
        mp = self.plan
        if mp.position not in (0, len(mp.instructions)):
            raise KareusError(f"re-planning mid-iteration: stage {mp.stage} has run "
                              f"{mp.position} of plan {mp.plan.id}'s "
                              f"{len(mp.instructions)} instructions")
        # iteration 0 runs the start plan: switches happen between iterations
        control = (self._control() if self.control_file is not None and iteration > 0
                   else None)
        pace = self._pace(observed_s) if observed_s is not None else None
        new = self.switcher.boundary(iteration, control, pace)
        if new is not None:
            mp.use(new)
        if mp.controller is not None:
            mp.controller.mark_iteration(iteration, mp.plan.id)
        return new

    def _control(self) -> dict[str, Any] | None:
        """The control file's request on global rank 0 (None: none new), on every rank."""
        box: list[Any] = [None]
        if dist.get_rank() == 0 and self.control_file is not None:
            try:
                box[0] = read_control_file(self.control_file)
            except KareusError as exc:  # the operator's typo must not stop training
                log.warning("control file ignored, training goes on: %s", exc)
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _pace(self, observed_s: float) -> Pace:
        """This replica's and the slowest replica's iteration time over their plans'."""
        t = torch.tensor([observed_s / self.switcher.current.time_s], dtype=torch.float64,
                         device=self.device)
        if self.replica_group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.replica_group)
        own = float(t.item())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return Pace(slowest=float(t.item()), own=own)


def _check_switchable(plan: MegatronPlan, switcher: PlanSwitcher) -> None:
    """Every plan the switcher may choose runs this rank's instructions in the same order,
    and every SM count they give a collective has its communicator already (under NCCL):
    checked once at start, so that a switch never fails halfway through training (a rank
    that failed to switch would run other communicators than its peers)."""
    for other in switcher.plans.values():
        if rank_instructions(other, plan.job, plan.stage) != plan.instructions:
            raise SpecError(f"plan {other.id} runs stage {plan.stage}'s instructions in "
                            f"another order than plan {plan.plan.id}: the switcher's plans "
                            f"must be of one job and schedule")
    needed = sorted(switcher.sms_used(plan.default_sms))
    for layer in plan.layers:
        for name in ("kareus_groups_by_sms", "kareus_cp_groups_by_sms"):
            groups = getattr(layer, name, None)
            if groups is None:  # gloo, or NCCL's own choice: the layer's own group
                continue
            for sms in needed:
                try:
                    groups(sms)
                except KeyError:
                    raise SpecError(
                        f"no communicator for {sms} SMs ({name}), which the switcher's "
                        f"plans use: create the groups with groups_by_sms(group, "
                        f"switcher.sms_used(plan.default_sms)) before training"
                    ) from None
