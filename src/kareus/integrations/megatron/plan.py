"""`MegatronPlan`: a Kareus plan on one pipeline stage of a Megatron-Core model, following
the instructions Megatron's own 1F1B schedule runs, without any patch to Megatron.

Megatron's schedules (`pipeline_parallel/schedules.py`) have no per-instruction hook, so the
plan watches the model chunk itself:
- a forward pre-hook on the chunk marks a forward instruction: the next one of the stage's
  1F1B order (the plan's timeline for that stage, by start time);
- a gradient hook on that forward's output marks the start of the same microbatch's
  backward (it fires when autograd reaches the chunk's output, before any of its layers'
  backward, and before Megatron's full recompute re-runs their forward).
At each, every `KareusTransformerLayer` of the chunk gets the instruction's `LayerPlan`
(`MegatronPlan._layer_plan`: at a forward, its partitions at the forward's clock and the
backward partitions at the backward's; at a backward, the backward instruction's own,
whose forward partitions run Megatron's full recompute), and the frequency controller gets
the instruction's clock. An instruction the plan does not
have next (another microbatch count, an interleaved schedule, a forward where a backward
is due) raises at once: the plan is never applied to the wrong instruction. Forwards
without gradients (evaluation) run Megatron's plain layer and are not counted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from kareus.core.jsonfile import read_json_object
from kareus.errors import KareusError, SpecError
from kareus.job.spec import JobSpec, validate_job
from kareus.plans.plan import Plan
from kareus.plans.schedule import one_f_one_b
from kareus.results.resultdir import ResultDir
from kareus.runtime.frequency_controller import FrequencyController
from kareus.runtime.layer_plan import LayerPlan, layer_plan_for
from kareus.workload.partition import Partition
from kareus.workload.workload import Workload

Instruction = tuple[int, str]
"""(microbatch, "forward" | "backward") on this stage."""


def stage_order(plan: Plan, pp: int, microbatches: int, stage: int) -> list[Instruction]:
    """The stage's instructions in the order the plan's timeline runs them (plain 1F1B
    where the plan has no timeline); a timeline that is not a 1F1B order of ``stage`` is
    refused."""
    expected = one_f_one_b(pp, microbatches, stage)
    bars = sorted((e for e in plan.timeline
                   if e.stage == stage and e.kind in ("forward", "backward")),
                  key=lambda e: (e.start_s, e.kind != "backward"))
    if not bars:
        return expected
    order = [(e.microbatch, e.kind) for e in bars]
    if sorted(order) != sorted(expected):
        raise SpecError(f"plan {plan.id}'s timeline of stage {stage} does not hold the "
                        f"{len(expected)} instructions of {microbatches} microbatches")
    return order


def check_job(job: JobSpec) -> None:
    """What a plan can run inside Megatron-Core: TP with or without sequence parallelism,
    without context parallelism (kareus.integrations.megatron.layer.SUPPORTED), on plain
    1F1B (the plan follows one model chunk per stage, not the interleaved schedule's
    chunks)."""
    problems = [what for what, hit in (("context parallelism", job.cp > 1),
                                       (f"interleaved 1F1B (virtual_pipeline "
                                        f"{job.virtual_pipeline})", job.virtual_pipeline > 1))
                if hit]
    if problems:
        raise SpecError(f"the plan's job uses {' and '.join(problems)}, which the Kareus "
                        f"layer for Megatron-Core does not run; supported: tensor "
                        f"parallelism with or without sequence parallelism, plain 1F1B, on "
                        f"Megatron-Core's local modules")


class MegatronPlan:
    """A plan for ``stage`` of its job: per instruction, the layers' `LayerPlan` and the
    clock (given to ``controller``, a `FrequencyController` of the same plan and stage).
    ``attach(chunk)`` starts following the schedule."""

    def __init__(self, plan: Plan, job: JobSpec, stage: int,
                 controller: FrequencyController | None = None, default_sms: int = 32
                 ) -> None:
        check_job(job)
        if not 0 <= stage < job.pp:
            raise SpecError(f"stage {stage} is not a pipeline stage of the plan's job "
                            f"(pp={job.pp})")
        self.plan, self.job, self.stage = plan, job, stage
        self.partitions: dict[str, Partition] = dict(Workload.build(job).partitions
                                                     .partitions)
        self.order = stage_order(plan, job.pp, job.num_microbatches, stage)
        self.controller = controller
        self.default_sms = default_sms
        self.layers: list[Any] = []
        self.position = 0
        """Instructions of the current iteration run so far."""
        self.iterations = 0
        self.log: list[tuple[int, str, LayerPlan | None]] = []
        """Every instruction marked: (microbatch, direction, the layers' LayerPlan)."""
        self._handles: list[Any] = []
        self._current = 0
        self._plans = {(m, d): self._layer_plan(m, d) for m in range(job.num_microbatches)
                       for d in ("forward", "backward")}

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

    def _layer_plan(self, microbatch: int, direction: str) -> LayerPlan | None:
        """What the layers run from the mark of ``direction`` of ``microbatch`` on.

        At the forward: the forward partitions at the forward's clock, and the backward
        ones at the backward's (without recompute the forward is the only one, and its
        settings drive the backward too); None where the plan runs the forward
        Megatron-style. At the backward: the backward instruction's own plan, forward
        partitions included: under full recompute the forward is re-run inside the
        backward instruction, at its clock, and that re-run's settings drive the
        backward; None where the plan runs the backward Megatron-style."""
        ex, stage = self.plan.execution, self.stage
        bwd = layer_plan_for(ex, self.partitions, (stage, microbatch, "backward"),
                             self.default_sms)
        if direction == "backward":
            return bwd
        fwd = layer_plan_for(ex, self.partitions, (stage, microbatch, "forward"),
                             self.default_sms)
        if fwd is None:
            return None
        backward_keys = {k for k, p in self.partitions.items() if p.direction == "backward"}
        settings = {k: s for k, s in fwd.settings.items() if k not in backward_keys}
        if bwd is not None:
            settings.update({k: s for k, s in bwd.settings.items() if k in backward_keys})
        return LayerPlan(settings, fwd.slot_ops)

    def sms_used(self) -> set[int]:
        """Every SM count the layers' plans give a collective (their groups, under NCCL:
        kareus.integrations.megatron.groups)."""
        return {s.sms for lp in self._plans.values() if lp is not None
                for s in lp.settings.values() if s.sms > 0}

    def layer_plan(self, microbatch: int, direction: str = "forward") -> LayerPlan | None:
        """What the layers run from the mark of that instruction on (None: Megatron's)."""
        return self._plans[(microbatch, direction)]

    # Following the schedule -------------------------------------------------------------

    def attach(self, chunk: torch.nn.Module | Sequence[torch.nn.Module]) -> MegatronPlan:
        """Follow the instructions ``chunk`` (the stage's model: a GPTModel, or the
        DDP/Float16Module wrapping it) runs. Its `KareusTransformerLayer`s must match the
        plan's job (hidden size, heads, query groups, FFN, TP)."""
        from kareus.integrations.megatron.layer import KareusTransformerLayer

        if isinstance(chunk, Sequence):
            if len(chunk) != 1:
                raise SpecError(f"{len(chunk)} model chunks: Kareus plans plain 1F1B (one "
                                f"chunk per stage), not interleaved pipelines")
            chunk = chunk[0]
        self.layers = [m for m in chunk.modules() if isinstance(m, KareusTransformerLayer)]
        if not self.layers:
            raise SpecError("the model has no KareusTransformerLayer: build it with "
                            "kareus.integrations.megatron.spec.kareus_layer_spec(...)")
        for layer in self.layers:
            self._check_layer(layer)
        self._handles = [chunk.register_forward_pre_hook(self._on_forward),
                         chunk.register_forward_hook(self._after_forward)]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._set(None)

    def _check_layer(self, layer: Any) -> None:
        cfg, m, tp = layer.config, self.job.model, self.job.tp
        want = {"hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
                "num_query_groups": m.num_kv_heads, "ffn_hidden_size": m.ffn_hidden_size,
                "kv_channels": m.head_dim, "tensor_model_parallel_size": tp}
        got = {k: getattr(cfg, k, None) for k in want}
        if got["num_query_groups"] is None:  # Megatron: no GQA means one group per head
            got["num_query_groups"] = got["num_attention_heads"]
        wrong = [f"{k} {got[k]} (the plan's job: {v})" for k, v in want.items()
                 if got[k] != v]
        full = getattr(cfg, "recompute_granularity", None) == "full"
        if full != self.job.recompute:  # the plan's instruction times assume one or other
            wrong.append(f"recompute_granularity {getattr(cfg, 'recompute_granularity', None)}"
                         f" (the plan's job: {'full' if self.job.recompute else 'none'} "
                         f"recompute)")
        sp = bool(getattr(cfg, "sequence_parallel", False))
        if sp != self.job.sequence_parallel:  # other collectives, other partitions
            wrong.append(f"sequence_parallel {sp} (the plan's job: "
                         f"{'' if self.job.sequence_parallel else 'no '}sequence parallelism)")
        if wrong:
            raise SpecError(f"the model is not the plan's job: {', '.join(wrong)}")

    def _set(self, plan: LayerPlan | None) -> None:
        for layer in self.layers:
            layer.set_kareus_plan(plan)

    def _expect(self, microbatch: int | None, direction: str) -> int:
        """The next instruction of the order, checked; its microbatch."""
        if self.position >= len(self.order):
            self.position = 0
            self.iterations += 1
        want_m, want_d = self.order[self.position]
        if want_d != direction or (microbatch is not None and microbatch != want_m):
            got = f"{direction} of microbatch {microbatch}" if microbatch is not None \
                else f"a {direction}"
            raise KareusError(
                f"the pipeline schedule ran {got} where plan {self.plan.id} has the "
                f"{want_d} of microbatch {want_m} next (stage {self.stage}, instruction "
                f"{self.position + 1} of {len(self.order)}): the plan is for plain 1F1B "
                f"with {self.job.num_microbatches} microbatches, not another microbatch "
                f"count or an interleaved schedule")
        self.position += 1
        return want_m

    def _on_forward(self, module: torch.nn.Module, _args: tuple[Any, ...]) -> None:
        if not (torch.is_grad_enabled() and module.training):
            self._set(None)  # evaluation: Megatron's layer, not an instruction
            return
        m = self._expect(None, "forward")
        self._current = m
        self._mark(m, "forward")

    def _after_forward(self, module: torch.nn.Module, _args: tuple[Any, ...],
                       output: Any) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return
        tensor = next((t for t in _tensors(output) if t.requires_grad), None)
        if tensor is None:
            raise KareusError("the model's output needs no gradient: its backward cannot "
                              "be followed")
        fired: list[bool] = []
        tensor.register_hook(functools.partial(self._on_backward, self._current, fired))

    def _on_backward(self, microbatch: int, fired: list[bool], grad: torch.Tensor) -> None:
        if fired:
            return
        fired.append(True)
        self._expect(microbatch, "backward")
        self._mark(microbatch, "backward")

    def _mark(self, microbatch: int, direction: str) -> None:
        plan = self._plans[(microbatch, direction)]
        self._set(plan)
        self.log.append((microbatch, direction, plan))
        if self.controller is not None:
            send: Callable[[int], None] = (self.controller.before_forward
                                           if direction == "forward"
                                           else self.controller.before_backward)
            send(microbatch)

    def check_complete(self) -> None:
        """After a training step: every instruction of the iteration ran (as Zeus's
        ``on_step_end`` checks); the next forward starts a new iteration."""
        if self.position != len(self.order):
            raise KareusError(f"the step ran {self.position} of plan {self.plan.id}'s "
                              f"{len(self.order)} instructions on stage {self.stage}")
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
