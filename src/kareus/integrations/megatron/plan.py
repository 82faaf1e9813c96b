"""`MegatronPlan`: a Kareus plan on one pipeline rank of a Megatron-Core model, following
the instructions Megatron's own 1F1B schedule runs, plain or interleaved, without any
patch to Megatron.

Megatron's schedules (`pipeline_parallel/schedules.py`) have no per-instruction hook, so the
plan watches the model chunks themselves (one per rank in plain 1F1B; ``virtual_pipeline``
of them in the interleaved schedule, chunk ``c`` of rank ``r`` being virtual stage
``c x pp + r``):
- a forward pre-hook on each chunk marks a forward instruction: the next one of the rank's
  order (the plan's timeline for the rank's stages, by start time), which must be a
  forward of that chunk;
- a gradient hook on that forward's output marks the start of the same microbatch's
  backward on the same chunk (it fires when autograd reaches the chunk's output, before
  any of its layers' backward, and before Megatron's full recompute re-runs their forward).
At each, every `KareusTransformerLayer` of the chunk gets the instruction's `LayerPlan`
(`MegatronPlan._layer_plan`: at a forward, its partitions at the forward's clock and the
backward partitions at the backward's; at a backward, the backward instruction's own,
whose forward partitions run Megatron's full recompute), and the frequency controller gets
the instruction's clock. An instruction the plan does not have next (another microbatch
count, another schedule, a forward where a backward is due, another chunk) raises at once:
the plan is never applied to the wrong instruction. Forwards without gradients
(evaluation) run Megatron's plain layer and are not counted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from kareus.core import InstructionId
from kareus.core.jsonfile import read_json_object
from kareus.errors import KareusError, SpecError
from kareus.integrations.megatron.job_match import model_mismatch
from kareus.integrations.megatron.order import (
    Instruction,
    check_job,
    describe,
    rank_instructions,
)
from kareus.job.spec import JobSpec, validate_job
from kareus.plans.plan import Plan
from kareus.results.resultdir import ResultDir
from kareus.runtime.frequency_controller import FrequencyController
from kareus.runtime.layer_plan import LayerPlan, layer_plan_for
from kareus.workload.partition import Partition
from kareus.workload.workload import Workload


class MegatronPlan:
    """A plan for pipeline rank ``stage`` of its job: per instruction, the layers'
    `LayerPlan` and the clock (given to ``controller``, a `FrequencyController` of the same
    plan and rank; with interleaved 1F1B made with ``pp=job.pp``). ``attach(model)``
    starts following the schedule."""

    def __init__(self, plan: Plan, job: JobSpec, stage: int,
                 controller: FrequencyController | None = None, default_sms: int = 32
                 ) -> None:
        check_job(job)
        if not 0 <= stage < job.pp:
            raise SpecError(f"stage {stage} is not a pipeline stage of the plan's job "
                            f"(pp={job.pp})")
        self.plan, self.job, self.stage = plan, job, stage
        self.pp, self.vp = job.pp, job.virtual_pipeline
        self.partitions: dict[str, Partition] = dict(Workload.build(job).partitions
                                                     .partitions)
        self.instructions: list[InstructionId] = rank_instructions(plan, job, stage)
        """The rank's instructions in order: (virtual stage, microbatch, direction); the
        virtual stage of model chunk c is c x pp + stage (the stage itself in plain
        1F1B)."""
        self.order: list[Instruction] = [(m, d) for _s, m, d in self.instructions]
        """The same order without the virtual stages."""
        self.controller = controller
        self.default_sms = default_sms
        self.chunks: list[list[Any]] = [[] for _ in range(self.vp)]
        """Per model chunk, its `KareusTransformerLayer`s (once attached)."""
        self._attached: set[int] = set()
        self.layers: list[Any] = []
        """Every chunk's layers."""
        self.position = 0
        """Instructions of the current iteration run so far."""
        self.iterations = 0
        self.log: list[tuple[int, str, LayerPlan | None]] = []
        """Every instruction marked: (microbatch, direction, the layers' LayerPlan); entry
        i is ``instructions[i % len(instructions)]``."""
        self._handles: list[Any] = []
        self._current = [0] * self.vp
        """Per chunk, the microbatch of its latest forward."""
        self._plans = self._layer_plans(plan)

    @classmethod
    def from_file(cls, path: str | Path, stage: int, **kwargs: Any) -> MegatronPlan:
        """From a plan file (`kareus plan export --format json`, or a result's
        plans/ID.json): the plan and its job."""
        doc = read_json_object(path, "plan")
        if not isinstance(doc.get("job"), dict):
            raise SpecError(f"{path} holds no job: export it with `kareus plan export "
                            f"--format json`")
        return cls(Plan.from_dict(doc), validate_job(dict(doc["job"])), stage, **kwargs)

    @classmethod
    def from_result(cls, result: str | Path, plan_id: str, stage: int, **kwargs: Any
                    ) -> MegatronPlan:
        """From a result directory and a plan id (`kareus plan list`)."""
        plan, job = ResultDir(result).read_plan(plan_id)
        return cls(plan, validate_job(dict(job)), stage, **kwargs)

    def _layer_plans(self, plan: Plan) -> dict[InstructionId, LayerPlan | None]:
        return {(c * self.pp + self.stage, m, d): self._layer_plan(plan, c * self.pp
                                                                   + self.stage, m, d)
                for c in range(self.vp) for m in range(self.job.num_microbatches)
                for d in ("forward", "backward")}

    def use(self, plan: Plan) -> None:
        """Run ``plan``, another plan of the same job, from the next instruction on: only
        at an iteration boundary (a switch mid-iteration would run one iteration on two
        plans' schedules). It swaps the layers' settings and the controller's clocks; the
        SM counts' communicators exist from the start (`PlanSwitcher.sms_used`)."""
        if self.position not in (0, len(self.instructions)):
            raise KareusError(f"plan {plan.id} cannot start mid-iteration: stage "
                              f"{self.stage} has run {self.position} of plan {self.plan.id}'s"
                              f" {len(self.instructions)} instructions; switch plans "
                              f"between iterations")
        if rank_instructions(plan, self.job, self.stage) != self.instructions:
            raise SpecError(f"plan {plan.id} runs stage {self.stage}'s instructions in "
                            f"another order than plan {self.plan.id}: not a plan of the "
                            f"same job and schedule")
        self._plans, self.plan = self._layer_plans(plan), plan
        if self.controller is not None:
            self.controller.plan = plan.execution

    def _layer_plan(self, plan: Plan, stage: int, microbatch: int, direction: str
                    ) -> LayerPlan | None:
        """What the layers of virtual stage ``stage`` run from the mark of ``direction``
        of ``microbatch`` on.

        At the forward: the forward partitions at the forward's clock, and the backward
        ones at the backward's (without recompute the forward is the only one, and its
        settings drive the backward too); None where the plan runs the forward
        Megatron-style. At the backward: the backward instruction's own plan, forward
        partitions included: under full recompute the forward is re-run inside the
        backward instruction, at its clock, and that re-run's settings drive the
        backward; None where the plan runs the backward Megatron-style."""
        ex = plan.execution
        split = self.split
        bwd = layer_plan_for(ex, self.partitions, (stage, microbatch, "backward"),
                             self.default_sms, split)
        if direction == "backward":
            return bwd
        fwd = layer_plan_for(ex, self.partitions, (stage, microbatch, "forward"),
                             self.default_sms, split)
        if fwd is None:
            return None
        backward_keys = {k for k, p in self.partitions.items() if p.direction == "backward"}
        settings = {k: s for k, s in fwd.settings.items() if k not in backward_keys}
        if bwd is not None:
            settings.update({k: s for k, s in bwd.settings.items() if k in backward_keys})
        return LayerPlan(settings, fwd.slot_ops, split, fwd.recompute)

    @property
    def split(self) -> str:
        """The layers' nanobatch split: the plan's job's ("batch" where it has none)."""
        return self.job.nanobatch_split or "batch"

    def sms_used(self) -> set[int]:
        """Every SM count the layers' plans give a collective (their groups, under NCCL:
        kareus.integrations.megatron.groups)."""
        return {s.sms for lp in self._plans.values() if lp is not None
                for s in lp.settings.values() if s.sms > 0}

    def layer_plan(self, microbatch: int, direction: str = "forward", chunk: int = 0
                   ) -> LayerPlan | None:
        """What model chunk ``chunk``'s layers run from the mark of that instruction on
        (None: Megatron's)."""
        return self._plans[(chunk * self.pp + self.stage, microbatch, direction)]

    # Following the schedule -------------------------------------------------------------

    def attach(self, model: torch.nn.Module | Sequence[torch.nn.Module],
               chunk: int | None = None) -> MegatronPlan:
        """Follow the instructions ``model`` runs: the rank's model (a GPTModel, or the
        DDP/Float16Module wrapping it), or the list of its model chunks as Megatron's
        schedules take it (one per virtual stage of the rank, in order). Under
        interleaved 1F1B the chunks may also be attached one at a time, where each is
        built: ``attach(chunk_model, chunk=vp_stage)`` (``chunk`` defaults to the model's
        own ``vp_stage``, which Megatron's GPTModel has); every chunk must be attached
        before the first forward. The chunks and their `KareusTransformerLayer`s must
        match the plan's job: its virtual_pipeline, its layers per virtual stage, and per
        layer hidden size, heads, query groups, FFN, TP and recompute."""
        from kareus.integrations.megatron.layer import KareusTransformerLayer

        vp = self.vp
        if isinstance(model, Sequence):
            if len(model) != vp:
                what = "interleaved 1F1B" if vp > 1 else "plain 1F1B"
                raise SpecError(f"{len(model)} model chunks, but the plan's job runs {vp} per "
                                f"pipeline rank ({what}, virtual_pipeline {vp})")
            pairs = list(enumerate(model))
        else:
            if chunk is None:
                chunk = 0 if vp == 1 else getattr(model, "vp_stage", None)
            if chunk is None:
                raise SpecError(f"the plan's job interleaves {vp} model chunks per pipeline "
                                f"rank: attach the list of the rank's chunks, or each chunk "
                                f"with attach(chunk_model, chunk=its vp_stage)")
            if not 0 <= chunk < vp:
                raise SpecError(f"model chunk {chunk} is not one of the {vp} per pipeline "
                                f"rank of the plan's job (virtual_pipeline {vp})")
            pairs = [(chunk, model)]
        again = sorted(c for c, _m in pairs if c in self._attached)
        if again:
            raise SpecError(f"model chunk {again[0]} is attached already")
        per_chunk = {c: [m for m in chunk_model.modules()
                         if isinstance(m, KareusTransformerLayer)]
                     for c, chunk_model in pairs}
        if not any(per_chunk.values()):
            raise SpecError("the model has no KareusTransformerLayer: build it with "
                            "kareus.integrations.megatron.spec.kareus_layer_spec(...)")
        self._check_chunks(per_chunk)
        for layers in per_chunk.values():
            for layer in layers:
                self._check_layer(layer)
                layer.kareus_nanobatch_split = getattr(self.job, "nanobatch_split", None)
        self._check_controller()
        for c, chunk_model in pairs:
            self.chunks[c] = per_chunk[c]
            self._attached.add(c)
            self._handles += [
                chunk_model.register_forward_pre_hook(functools.partial(self._on_forward, c)),
                chunk_model.register_forward_hook(functools.partial(self._after_forward, c))]
        self.layers = [layer for layers in self.chunks for layer in layers]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for c in range(self.vp):
            self._set(c, None)
        self._attached.clear()

    def _check_chunks(self, per_chunk: dict[int, list[Any]]) -> None:
        """Each chunk has the layers of its virtual stage in the plan's job: the plan's
        instruction times are for that many."""
        want = self.job.layers_per_stage or ()
        wrong = []
        for c, layers in sorted(per_chunk.items()):
            stage = c * self.pp + self.stage
            if len(layers) != want[stage]:
                where = (f"model chunk {c} has {len(layers)} Kareus layers (the plan's job: "
                         f"{want[stage]} on virtual stage {stage})" if self.vp > 1 else
                         f"the model has {len(layers)} Kareus layers (the plan's job: "
                         f"{want[stage]} on stage {stage})")
                wrong.append(where)
        if wrong:
            raise SpecError(f"the model is not the plan's job: {', '.join(wrong)}")

    def _check_controller(self) -> None:
        """The controller's clocks are the plan's for this rank's stages."""
        ctl = self.controller
        if ctl is None:
            return
        if ctl.stage != self.stage:
            raise SpecError(f"the frequency controller is for stage {ctl.stage}, the plan "
                            f"follows stage {self.stage}")
        if self.vp > 1 and ctl.pp != self.pp:
            raise SpecError(f"the frequency controller was made with pp={ctl.pp}, but the "
                            f"plan's job interleaves {self.vp} chunks over pp={self.pp}: "
                            f"FrequencyController(..., pp={self.pp})")

    def _check_layer(self, layer: Any) -> None:
        wrong = model_mismatch(layer, self.job)
        if wrong:
            raise SpecError(f"the model is not the plan's job: {', '.join(wrong)}")

    def _set(self, chunk: int, plan: LayerPlan | None) -> None:
        for layer in self.chunks[chunk]:
            layer.set_kareus_plan(plan)

    def _expect(self, chunk: int, microbatch: int | None, direction: str) -> InstructionId:
        """The next instruction of the order, checked against what ran."""
        if self.position >= len(self.instructions):
            self.position = 0
            self.iterations += 1
        want = self.instructions[self.position]
        want_s, want_m, want_d = want
        if (want_d != direction or want_s // self.pp != chunk
                or (microbatch is not None and microbatch != want_m)):
            raise KareusError(self._out_of_order(chunk, microbatch, direction, want))
        self.position += 1
        return want

    def _out_of_order(self, chunk: int, microbatch: int | None, direction: str,
                      want: InstructionId) -> str:
        where = (f"instruction {self.position + 1} of {len(self.instructions)}")
        if self.vp == 1:
            got = (f"{direction} of microbatch {microbatch}" if microbatch is not None
                   else f"a {direction}")
            return (f"the pipeline schedule ran {got} where plan {self.plan.id} has the "
                    f"{want[2]} of microbatch {want[1]} next (stage {self.stage}, {where}): "
                    f"the plan is for plain 1F1B with {self.job.num_microbatches} "
                    f"microbatches, not another microbatch count or an interleaved schedule")
        got = (f"the {direction} of microbatch {microbatch} on model chunk {chunk}"
               if microbatch is not None else f"a {direction} of model chunk {chunk}")
        return (f"the pipeline schedule ran {got} where plan {self.plan.id} has "
                f"{describe(want, self.pp)} next (pipeline rank {self.stage}, {where}): "
                f"the plan is for Megatron's interleaved 1F1B over {self.vp} model chunks "
                f"with {self.job.num_microbatches} microbatches, not another microbatch "
                f"count, chunk count or schedule")

    def _on_forward(self, chunk: int, module: torch.nn.Module, _args: tuple[Any, ...]
                    ) -> None:
        if not (torch.is_grad_enabled() and module.training):
            self._set(chunk, None)  # evaluation: Megatron's layer, not an instruction
            return
        if len(self._attached) != self.vp:
            missing = sorted(set(range(self.vp)) - self._attached)
            raise KareusError(f"model chunk {missing[0]} of pipeline rank {self.stage} is "
                              f"not attached to plan {self.plan.id}: attach every chunk "
                              f"before training")
        iid = self._expect(chunk, None, "forward")
        self._current[chunk] = iid[1]
        self._mark(iid)

    def _after_forward(self, chunk: int, module: torch.nn.Module, _args: tuple[Any, ...],
                       output: Any) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return
        tensor = next((t for t in _tensors(output) if t.requires_grad), None)
        if tensor is None:
            raise KareusError("the model's output needs no gradient: its backward cannot "
                              "be followed")
        fired: list[bool] = []
        tensor.register_hook(functools.partial(self._on_backward, chunk,
                                               self._current[chunk], fired))

    def _on_backward(self, chunk: int, microbatch: int, fired: list[bool],
                     grad: torch.Tensor) -> None:
        if fired:
            return
        fired.append(True)
        self._mark(self._expect(chunk, microbatch, "backward"))

    def _mark(self, iid: InstructionId) -> None:
        stage, microbatch, direction = iid
        chunk = stage // self.pp
        plan = self._plans[iid]
        self._set(chunk, plan)
        self.log.append((microbatch, direction, plan))
        if self.controller is not None:
            send: Callable[[int, int], None] = (self.controller.before_forward
                                                if direction == "forward"
                                                else self.controller.before_backward)
            send(microbatch, chunk)

    def check_complete(self) -> None:
        """After a training step: every instruction of the iteration ran (as Zeus's
        ``on_step_end`` checks); the next forward starts a new iteration."""
        if self.position != len(self.instructions):
            raise KareusError(f"the step ran {self.position} of plan {self.plan.id}'s "
                              f"{len(self.instructions)} instructions on stage {self.stage}")
        self.position = 0
        self.iterations += 1


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o)
