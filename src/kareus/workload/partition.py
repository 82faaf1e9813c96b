"""Partitions, their keys and launch slots, exactly as Kareus defines them.

Each microbatch is split into two nanobatches, along the batch or the sequence
(`JobSpec.nanobatch_split`; a job without a split has no partitions, `sequential_only`).
A pipeline instruction's op list is cut at every collective into segments; the compute
stream runs nanobatch 0's segment i, then nanobatch 1's segment i, then nanobatch 0's
segment i+1, ... (a sequence split's backward segments: nanobatch 1's first,
`ExecutionGraph.stream_segments`). A partition is the compute of
one such segment plus the collective that was issued just before it by the other
nanobatch, which runs on the communication stream while the segment computes. The first
segment of an instruction has no collective to hide ("solo"), and the last collective of
the instruction runs alone ("exposed").

Keys: ``{fwd|bwd}_{segment}`` (a recomputed forward is ``fwd``), with a suffix naming the
overlapped collective (``_ar`` all-reduce, ``_ag`` all-gather, ``_rs`` reduce-scatter)
only when the same segment meets collectives of more than one kind. With CP=1 this gives
``fwd_attn``, ``fwd_mlp``, ``bwd_attn``, ``bwd_mlp`` (also with p2p CP: its ring is inside
the attention op); with CP>1 the twelve published keys (segments ``qkv``/``ao``/``mlp``
forward, ``mlp``/``o``/``a``/``qkv`` backward). With
sequence parallelism the TP collectives become all-gather/reduce-scatter and the norms form
their own segments (``ln1``, ``ln2``), for example ``fwd_attn_ag``, ``fwd_attn_rs``,
``fwd_ln1_ag``; when TP and CP all-gathers meet the same segment, the suffix names the group
too (``_tpag``, ``_cpag``). Identical partitions across layers and stages share one key;
a segment whose ops differ by nanobatch (a sequence split's attention) has one key per
nanobatch, suffixed ``_nb0``/``_nb1`` (``fwd_attn_nb0``).

Launch slots (docs/anchors.md §4): consecutive memory-bound ops merge into one slot named by the
first (``norm``, ``rope``, ``activation``); every GEMM is a ``linear`` slot and attention an
``attn`` slot; slots are numbered per class in execution order. Launching "before slot X"
starts the collective when the compute stream reaches X; ``None`` means no overlap (the
collective starts after the partition's last compute op).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kareus import SCHEMA_VERSION
from kareus.core import DIRECTIONS, LAUNCH_FIRST
from kareus.errors import SpecError
from kareus.job.spec import JobSpec
from kareus.workload.graph import ExecutionGraph, StageGraph, differing_segments, interleave
from kareus.workload.layer import backward_ops, forward_ops
from kareus.workload.ops import Collective, ComputeOp, Op, Segment
from kareus.workload.slots import Slot, make_slots
from kareus.workload.training_ops import weight_grad_end


@dataclass(frozen=True)
class Partition:
    key: str
    direction: str
    """"forward" or "backward": the kind of compute (a recomputed forward is "forward")."""
    segment: str
    compute_ops: tuple[ComputeOp, ...]
    collective: Collective
    slots: tuple[Slot, ...]
    sm_choices: tuple[int, ...]
    count_per_layer: int
    """Occurrences per microbatch of one interior layer, in all its instructions."""
    count_forward: tuple[int, ...]
    """Occurrences per microbatch in the forward instruction of each stage."""
    count_backward: tuple[int, ...]
    """Occurrences per microbatch in the backward instruction of each stage."""
    nanobatch: int | None = None
    """The nanobatch whose compute this is, where the two differ (a sequence split's
    attention: key suffix ``_nb0``/``_nb1``); None: the same for both."""

    @property
    def count_per_stage(self) -> tuple[int, ...]:
        return tuple(f + b for f, b in zip(self.count_forward, self.count_backward, strict=True))

    @property
    def launch_options(self) -> tuple[str | None, ...]:
        return (*(s.name for s in self.slots), None)

    def launch_index(self, slot: str | None) -> int:
        """Index of the compute op before which the collective starts (len(ops) for None)."""
        if slot is None or slot == "none":
            return len(self.compute_ops)
        for s in self.slots:
            if s.name == slot:
                return s.op_index
        raise SpecError(
            f"partition {self.key} has no slot {slot!r}; slots: "
            f"{', '.join(s.name for s in self.slots)} or none"
        )

    def resolve_slot(self, slot: str | None) -> str | None:
        """A plan's slot for this partition: `LAUNCH_FIRST` is its first slot."""
        return self.slots[0].name if slot == LAUNCH_FIRST else slot

    def knob_space_size(self, num_freqs: int) -> int:
        return num_freqs * len(self.sm_choices) * len(self.launch_options)

    @property
    def compute_flops(self) -> float:
        return float(sum(op.flops for op in self.compute_ops))

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "direction": self.direction,
            "segment": self.segment,
            "count_per_layer": self.count_per_layer,
            "count_per_stage": list(self.count_per_stage),
            "count_per_instruction": {
                "forward": list(self.count_forward),
                "backward": list(self.count_backward),
            },
            **({"nanobatch": self.nanobatch} if self.nanobatch is not None else {}),
            "compute_ops": [op.to_dict() for op in self.compute_ops],
            "collective": self.collective.to_dict(),
            "slots": [s.name for s in self.slots],
            "sm_choices": list(self.sm_choices),
        }


StepKind = Literal["op", "solo", "partition", "exposed", "overlap"]


@dataclass(frozen=True)
class Step:
    """One step of an instruction: ops back to back (an outside op, a solo segment, an
    exposed collective), a searched partition (``key``), or an "overlap": a weight gradient
    GEMM with the input-gradient collective Megatron runs beside it (``unit``, measured as
    a partition at the backend's default SMs, never searched)."""

    kind: StepKind
    ops: tuple[Op, ...]
    key: str | None = None
    unit: Partition | None = None


def blocking_steps(ops: Sequence[Op], direction: str, one_step_per_op: bool = False
                   ) -> list[Step]:
    """Ops as Megatron-LM runs them: back to back, every collective blocking the compute
    stream, except an input-gradient collective (`overlaps_weight_grad`), issued after its
    data gradient GEMM and run beside the weight gradient GEMM (an "overlap" step). An
    unfused gradient accumulation after that GEMM runs once the collective is done: the
    linear's backward waits for it before it returns (``handle.wait()``, Megatron-Core
    tensor_parallel/layers.py), and the DDP hook's ``main_grad.add_`` runs after that
    (distributed_data_parallel.py), queued behind the wait. ``one_step_per_op``: each op
    its own step (outside)."""
    steps: list[Step] = []
    run: list[Op] = []

    def flush() -> None:
        if run:
            steps.extend([Step("op", (o,)) for o in run] if one_step_per_op
                         else [Step("op", tuple(run))])
            run.clear()

    i = 0
    while i < len(ops):
        j = weight_grad_end(ops, i)  # a weight gradient with its adds to the main gradient
        op, nxt = ops[i], (ops[j] if j < len(ops) else None)
        if (isinstance(op, ComputeOp) and not op.opens_slot and isinstance(nxt, Collective)
                and nxt.overlaps_weight_grad):
            flush()
            steps.append(Step("overlap", (op, nxt), None, _overlap_unit((op,), nxt, direction)))
            run.extend(ops[i + 1:j])  # the adds to the main gradient, after the wait
            i = j + 1
            continue
        run.append(op)
        i += 1
    flush()
    return steps


def _overlap_unit(compute: tuple[ComputeOp, ...], coll: Collective, direction: str) -> Partition:
    return Partition(key=f"overlap_{compute[0].name}_{coll.name}", direction=direction,
                     segment=compute[0].name, compute_ops=compute, collective=coll,
                     slots=make_slots(compute), sm_choices=(), count_per_layer=0,
                     count_forward=(), count_backward=())


@dataclass(frozen=True)
class InstructionLayout:
    """What one microbatch's forward or backward runs on one stage, in order."""

    stage: int
    direction: str
    steps: tuple[Step, ...]
    before: tuple[Step, ...] = ()
    """The steps outside the layers that open ``steps`` (embedding, received inputs)..."""
    after: tuple[Step, ...] = ()
    """... and those that close it (LM head and loss, their backward): shared with
    Megatron-LM's execution of the same instruction."""

    def partition_counts(self) -> Counter:
        return Counter(s.key for s in self.steps if s.kind == "partition")


@dataclass
class PartitionSet:
    job: JobSpec
    graph: ExecutionGraph
    partitions: dict[str, Partition]
    layouts: dict[tuple[int, str], InstructionLayout] = field(repr=False)
    sequential_layer: dict[str, tuple[Step, ...]] = field(default_factory=dict, repr=False)
    """Per direction: one layer as Megatron-LM runs it on a whole microbatch (not split;
    a backward recomputes the forward first when recompute is on)."""

    def sequential_steps(self, stage: int, direction: str) -> tuple[tuple[Step, ...], int,
                                                                    tuple[Step, ...]]:
        """Megatron-LM's instruction: (steps before the layers, number of layers, steps
        after them)."""
        layout = self.layouts[(stage, direction)]
        return layout.before, self.graph.stages[stage].num_layers, layout.after

    def __getitem__(self, key: str) -> Partition:
        try:
            return self.partitions[key]
        except KeyError:
            if not self.partitions:
                raise SpecError(f"no partition {key!r}: {self.none_reason}") from None
            raise SpecError(
                f"no partition {key!r} in this job; keys: {', '.join(self.partitions)}"
            ) from None

    @property
    def none_reason(self) -> str:
        """Why a job has no partitions (its microbatch is not split into nanobatches)."""
        return (f"this job has no partitions: they split each microbatch into two "
                f"nanobatches, which needs {self.job.nanobatch_requirement}; Megatron-LM and "
                f"Perseus run it whole")

    @property
    def keys(self) -> list[str]:
        return list(self.partitions)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "job": self.job.model_dump(mode="json"),
            "partitions": [p.to_dict() for p in self.partitions.values()],
        }


def _collective_tags(graph: ExecutionGraph) -> dict[tuple[str, str], str]:
    """Suffix for each (kind, group) of the layer collectives; the group is named only when
    one kind occurs in several groups."""
    colls = [op for op in (*graph.layer_forward, *graph.layer_backward)
             if isinstance(op, Collective)]
    groups_by_kind: dict[str, set[str]] = {}
    for c in colls:
        groups_by_kind.setdefault(c.kind, set()).add(c.group)
    return {
        (c.kind, c.group): (c.group + c.short_kind if len(groups_by_kind[c.kind]) > 1
                            else c.short_kind)
        for c in colls
    }


def build_partitions(graph: ExecutionGraph) -> PartitionSet:
    """The job's partitions and instruction layouts; a job whose microbatch is not split
    (`JobSpec.splits_into_nanobatches`) has no partitions (`sequential_only`)."""
    job = graph.job
    if not job.splits_into_nanobatches:
        return sequential_only(graph)
    tags = _collective_tags(graph)
    by_nanobatch = differing_segments(graph)

    # Which collectives each segment meets, seen on a three-layer pass (enough to reach the
    # steady state from both sides); a suffix is needed where a segment meets several.
    meets: dict[str, set[str]] = {}
    for direction in DIRECTIONS:
        pairs, _ = interleave(graph.stream_segments(direction, 3))
        for seg, coll in pairs:
            if coll is not None:
                meets.setdefault(seg.base_key, set()).add(tags[(coll.kind, coll.group)])

    def key_of(seg: Segment, coll: Collective) -> str:
        tag = tags[(coll.kind, coll.group)]
        key = seg.base_key if len(meets[seg.base_key]) == 1 else f"{seg.base_key}_{tag}"
        # one key per nanobatch where their segments differ (a sequence split's attention)
        return f"{key}_nb{seg.nanobatch}" if seg.base_key in by_nanobatch else key

    # Steady-state occurrences per layer: pairs whose compute belongs to the middle layer.
    per_layer: Counter = Counter()
    for direction in DIRECTIONS:
        pairs, _ = interleave(graph.stream_segments(direction, 3))
        per_layer.update(key_of(s, c) for s, c in pairs if c is not None and s.layer == 1)

    prototypes: dict[str, Partition] = {}
    layouts: dict[tuple[int, str], InstructionLayout] = {}
    counts: dict[str, dict[str, list[int]]] = {}
    for stage in graph.stages:
        for direction in DIRECTIONS:
            before, after = _outside_steps(stage, direction)
            steps = list(before)
            pairs, last = interleave(graph.stream_segments(direction, stage.num_layers))
            for seg, coll in pairs:
                if coll is None:
                    steps.append(Step("solo", seg.ops))
                    continue
                key = key_of(seg, coll)
                steps.append(Step("partition", (*seg.ops, coll), key))
                if key not in prototypes:
                    prototypes[key] = _prototype(job, key, seg, coll, per_layer[key],
                                                 seg.base_key in by_nanobatch)
                c = counts.setdefault(key, {d: [0] * len(graph.stages) for d in DIRECTIONS})
                c[direction][stage.index] += 1
            if last is not None:
                steps.append(Step("exposed", (last,)))
            steps += after
            layouts[(stage.index, direction)] = InstructionLayout(
                stage.index, direction, tuple(steps), before, after
            )

    order = {s.base_key: i for i, s in enumerate((*graph.forward_segments,
                                                   *graph.backward_segments))}
    partitions = {}
    for key in sorted(prototypes, key=lambda k: (k.startswith("bwd"),
                                                 order[_base(prototypes[k])], k)):
        p = prototypes[key]
        partitions[key] = Partition(
            **{**p.__dict__,
               "count_forward": tuple(counts[key]["forward"]),
               "count_backward": tuple(counts[key]["backward"])}
        )
    return PartitionSet(job, graph, partitions, layouts, _sequential_layer(job))


def _outside_steps(stage: StageGraph, direction: str) -> tuple[tuple[Step, ...],
                                                                tuple[Step, ...]]:
    """The steps before and after the layers of a stage's instruction, one per op."""
    pre = stage.forward_pre if direction == "forward" else stage.backward_pre
    post = stage.forward_post if direction == "forward" else stage.backward_post
    return (tuple(blocking_steps(pre, direction, one_step_per_op=True)),
            tuple(blocking_steps(post, direction, one_step_per_op=True)))


def sequential_only(graph: ExecutionGraph) -> PartitionSet:
    """A job whose microbatch is not split into nanobatches (an odd micro-batch size): no
    partitions, and each instruction's layout is Megatron-LM's execution of the whole
    microbatch (what the Megatron-LM and Perseus baselines run)."""
    job = graph.job
    layer = _sequential_layer(job)
    layouts: dict[tuple[int, str], InstructionLayout] = {}
    for stage in graph.stages:
        for direction in DIRECTIONS:
            before, after = _outside_steps(stage, direction)
            steps = (*before, *layer[direction] * stage.num_layers, *after)
            layouts[(stage.index, direction)] = InstructionLayout(
                stage.index, direction, steps, before, after)
    return PartitionSet(job, graph, {}, layouts, layer)


def _sequential_layer(job: JobSpec) -> dict[str, tuple[Step, ...]]:
    fwd = forward_ops(job, sequences=job.micro_batch_size)
    bwd = backward_ops(job, fwd, sequences=job.micro_batch_size)
    # under full recompute the forward instruction runs without gradients (Megatron-Core's
    # CheckpointFunction.forward under torch.no_grad); the backward's recompute with them
    first = (forward_ops(job, sequences=job.micro_batch_size, grad=False) if job.recompute
             else fwd)
    return {"forward": tuple(blocking_steps(first, "forward")),
            "backward": tuple(blocking_steps([*fwd, *bwd] if job.recompute else bwd,
                                             "backward"))}


def _base(p: Partition) -> str:
    return f"{'fwd' if p.direction == 'forward' else 'bwd'}_{p.segment}"


def _prototype(job: JobSpec, key: str, seg: Segment, coll: Collective, per_layer: int,
               per_nanobatch: bool) -> Partition:
    sm_choices = (job.sm_choices_all_reduce if coll.kind == "all_reduce"
                  else job.sm_choices_gather_scatter)
    return Partition(
        key=key,
        direction="forward" if seg.direction == "fwd" else "backward",
        segment=seg.name,
        compute_ops=seg.ops,
        collective=coll,
        slots=make_slots(seg.ops),
        sm_choices=tuple(sm_choices),
        count_per_layer=per_layer,
        count_forward=(),
        count_backward=(),
        nanobatch=seg.nanobatch if per_nanobatch else None,
    )
