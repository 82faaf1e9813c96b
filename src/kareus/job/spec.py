"""The validated description of a training job (pydantic; its model: kareus.job.model).

A JobSpec is everything Kareus needs to build the execution graph: the model, the
parallelism, the batch shape, the pipeline split, activation recompute, the GPUs, and the
knob choices a search may use. Every rule that a real Megatron-LM run would reject is
checked here, with a message that says what to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kareus.errors import SpecError
from kareus.job import nanobatch
from kareus.job.hardware import DEFAULT_GPU, GPUSpec, get_gpu
from kareus.job.identity import job_identity
from kareus.job.limits import (
    MAX_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_KNOB_CHOICES,
    MAX_LAYERS,
    MAX_MICRO_BATCH_SIZE,
    MAX_MICROBATCHES,
    MAX_PIPELINE_INSTRUCTIONS,
    MAX_SEQ_LENGTH,
)
from kareus.job.model import ModelSpec
from kareus.job.nanobatch import NanobatchSplit
from kareus.job.nodes import NodeSpec, check_node, node_of
from kareus.job.training import TrainingSettings, misplaced
from kareus.job.validation import first_error_line

BYTES_PER_ELEMENT = 2  # bf16 activations, weights and gradients (docs/anchors.md §4)

DEFAULT_SM_CHOICES_ALL_REDUCE = tuple(range(3, 31, 3))  # Kareus artifact (docs/anchors.md §4)
DEFAULT_SM_CHOICES_GATHER_SCATTER = tuple(range(1, 21))  # Kareus artifact (docs/anchors.md §4)

CpCommType = Literal["allgather", "p2p"]
CP_COMM_TYPES: tuple[str, ...] = ("allgather", "p2p")
"""Megatron-LM's ``--cp-comm-type`` values Kareus models (docs/workload.md): ``allgather``
(Kareus's CP partitions; Megatron-Core and TE write ``all_gather``, accepted) and ``p2p``
(Megatron-LM's default: Transformer Engine's ring inside the attention op). Not ``a2a``."""


class JobSpec(BaseModel):
    """One training job: model x parallelism x batch shape x cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec
    tp: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE, description="tensor-parallel size")
    cp: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE, description="context-parallel size")
    cp_comm_type: CpCommType = Field(
        "allgather", description="how CP communicates (Megatron-LM's --cp-comm-type): "
        "'allgather' (Kareus's CP partitions) or 'p2p' (Transformer Engine's ring inside the "
        "attention op); normalised to 'allgather' when cp = 1 (no CP traffic either way)")
    pp: int = Field(1, ge=1, le=MAX_LAYERS, description="pipeline-parallel size")
    virtual_pipeline: int = Field(
        1, ge=1, le=MAX_LAYERS, description="model chunks per pipeline rank: interleaved "
        "1F1B when > 1 (Megatron's virtual pipeline); the workload has pp x virtual_pipeline "
        "stages")
    dp: int | None = Field(None, ge=1, le=MAX_GPUS,
                           description="data-parallel size; derived when omitted")
    sequence_parallel: bool = False
    micro_batch_size: int = Field(2, ge=1, le=MAX_MICRO_BATCH_SIZE,
                                  description="sequences per microbatch")
    nanobatch_split: NanobatchSplit | None = Field(
        None, description="how the methods that overlap split a microbatch in two "
        "(kareus.job.nanobatch): 'batch' (default at an even micro-batch size) or 'sequence' "
        "(default at 1); none at an odd size > 1")
    seq_length: int = Field(4096, ge=1, le=MAX_SEQ_LENGTH)
    num_microbatches: int = Field(8, ge=1, le=MAX_MICROBATCHES)
    layers_per_stage: tuple[int, ...] | None = Field(None, max_length=MAX_LAYERS)
    recompute: bool = Field(
        True, description="full activation recompute, uniform, one layer per checkpoint"
    )
    gpu: str = DEFAULT_GPU
    gpus_per_node: int = Field(8, ge=1, le=MAX_GPUS_PER_NODE)
    nodes: int = Field(1, ge=1, le=MAX_GPUS)
    node: str | None = Field(None, description="node type (kareus.job.hardware: its links "
                             "between nodes); default the GPU's, e.g. DGX-A100 for A100s")
    sm_choices_all_reduce: tuple[int, ...] = Field(DEFAULT_SM_CHOICES_ALL_REDUCE,
                                                   max_length=MAX_KNOB_CHOICES)
    sm_choices_gather_scatter: tuple[int, ...] = Field(DEFAULT_SM_CHOICES_GATHER_SCATTER,
                                                       max_length=MAX_KNOB_CHOICES)
    search_freqs_mhz: tuple[int, ...] | None = Field(None, max_length=MAX_KNOB_CHOICES)
    training: TrainingSettings = Field(default_factory=TrainingSettings, description="the "
                                       "settings that change the kernels (kareus.job.training)")

    @model_validator(mode="before")
    @classmethod
    def _training_in_its_section(cls, data: Any) -> Any:
        if (problem := misplaced(data)) is not None:
            raise ValueError(problem)
        return data

    @field_validator("cp_comm_type", mode="before")
    @classmethod
    def _known_cp_comm_type(cls, value: Any) -> Any:
        if value == "all_gather":  # Megatron-Core's TransformerConfig and TE spell it so
            return "allgather"
        if value not in CP_COMM_TYPES:  # one line naming the two Kareus models
            raise ValueError(
                f"{value!r} is not supported; Kareus models 'allgather' (its CP partitions) "
                f"and 'p2p' (Transformer Engine's ring inside the attention op)")
        return value

    @model_validator(mode="after")
    def _check_job(self) -> JobSpec:
        m = self.model
        if self.cp == 1 and self.cp_comm_type != "allgather":
            # no CP traffic at cp = 1: one job, one identity (`kareus.store.job_id`)
            object.__setattr__(self, "cp_comm_type", "allgather")
        object.__setattr__(self, "nanobatch_split",
                           nanobatch.resolve_split(self, self.nanobatch_split))
        gpu = get_gpu(self.gpu)  # raises for unknown names, listing the known ones
        if gpu.name != self.gpu:
            object.__setattr__(self, "gpu", gpu.name)
        if self.node is not None:  # None: the GPU's default node (one job, one identity)
            object.__setattr__(self, "node", check_node(self.node, gpu, self.gpus_per_node))
        if m.num_attention_heads % self.tp != 0:
            raise ValueError(
                f"tp={self.tp} must divide the {m.num_attention_heads} attention heads of "
                f"{m.name}"
            )
        if m.num_kv_heads % self.tp != 0 and self.tp % m.num_kv_heads != 0:
            raise ValueError(
                f"tp={self.tp} must divide the {m.num_kv_heads} KV heads of {m.name} or be a "
                f"multiple of them (then KV heads are replicated)"
            )
        if self.seq_length % self.cp != 0:
            raise ValueError(f"cp={self.cp} must divide the sequence length {self.seq_length}")
        if self.cp > 1 and self.seq_length % (2 * self.cp) != 0:
            raise ValueError(
                f"with cp={self.cp} the sequence length {self.seq_length} must be divisible by "
                f"2 x cp = {2 * self.cp} (load-balanced causal chunks)"
            )
        if self.sequence_parallel and (self.seq_length // self.cp) % self.tp != 0:
            raise ValueError(
                f"with sequence parallelism tp={self.tp} must divide the per-rank sequence "
                f"length {self.seq_length // self.cp}"
            )
        self._check_placement()
        instructions = self.virtual_stages * self.num_microbatches * 2
        if instructions > MAX_PIPELINE_INSTRUCTIONS:
            raise ValueError(
                f"{self.virtual_stages} stages x {self.num_microbatches} microbatches x 2 = "
                f"{instructions:,} pipeline instructions is over Kareus's limit of "
                f"{MAX_PIPELINE_INSTRUCTIONS:,}; use fewer microbatches or stages")
        self._check_stages()
        self._check_knobs(gpu)
        # named as it is validated: every command asks the name (the journal, the lock,
        # the result directory), and an immutable job's name never changes
        _ = self.id
        return self

    def _check_placement(self) -> None:
        """TP x CP inside a node; DP derived from (or consistent with) the GPU count."""
        total = self.gpus_per_node * self.nodes
        if total > MAX_GPUS:
            raise ValueError(f"{self.nodes} nodes x {self.gpus_per_node} GPUs = {total:,} GPUs "
                             f"is over Kareus's limit of {MAX_GPUS:,}")
        model_parallel = self.tp * self.cp * self.pp
        if self.tp * self.cp > self.gpus_per_node:
            raise ValueError(
                f"tp x cp = {self.tp * self.cp} must fit in one node of {self.gpus_per_node} GPUs"
            )
        if self.dp is None:
            if total % model_parallel != 0:
                raise ValueError(
                    f"tp x cp x pp = {model_parallel} must divide the {total} GPUs "
                    f"({self.nodes} nodes x {self.gpus_per_node})"
                )
            object.__setattr__(self, "dp", total // model_parallel)
        elif model_parallel * self.dp != total:
            raise ValueError(
                f"tp x cp x pp x dp = {model_parallel * self.dp} must equal the {total} GPUs "
                f"({self.nodes} nodes x {self.gpus_per_node})"
            )

    def _check_stages(self) -> None:
        m, v, n = self.model, self.virtual_pipeline, self.virtual_stages
        if v > 1 and (self.pp < 2 or self.num_microbatches % self.pp != 0):
            # Megatron-Core 0.16 runs microbatches in groups of pp per model chunk and
            # raises on a last group smaller than pp (schedules.py)
            raise ValueError(
                f"virtual_pipeline={v} (interleaved 1F1B) needs pp >= 2 and num_microbatches "
                f"a multiple of pp; got pp={self.pp}, {self.num_microbatches} microbatches")
        what = f"pp={self.pp}" if v == 1 else f"pp x virtual_pipeline = {n}"
        if n > m.num_layers:
            raise ValueError(f"{what} exceeds the {m.num_layers} layers of {m.name}")
        if self.layers_per_stage is None:
            if v > 1 and m.num_layers % n != 0:  # Megatron: equal chunks unless given
                raise ValueError(
                    f"{what} must divide the {m.num_layers} layers of {m.name}, or give "
                    f"layers_per_stage ({n} entries, one per virtual stage)")
            base, extra = divmod(m.num_layers, n)
            split = tuple(base + (1 if i < extra else 0) for i in range(n))
            object.__setattr__(self, "layers_per_stage", split)
        else:
            if len(self.layers_per_stage) != n:
                raise ValueError(
                    f"layers_per_stage has {len(self.layers_per_stage)} entries but {what}"
                    + (" (one per virtual stage)" if v > 1 else ""))
            if any(k < 1 for k in self.layers_per_stage):
                raise ValueError("every pipeline stage needs at least one layer")
            if sum(self.layers_per_stage) != m.num_layers:
                raise ValueError(
                    f"layers_per_stage {list(self.layers_per_stage)} sums to "
                    f"{sum(self.layers_per_stage)}, but {m.name} has {m.num_layers} layers"
                )

    def _check_knobs(self, gpu: GPUSpec) -> None:
        for label, choices in (
            ("sm_choices_all_reduce", self.sm_choices_all_reduce),
            ("sm_choices_gather_scatter", self.sm_choices_gather_scatter),
        ):
            if not choices:
                raise ValueError(f"{label} must not be empty")
            bad = [n for n in choices if n < 1 or n >= gpu.sm_count]
            if bad:
                raise ValueError(
                    f"{label}: {bad} outside 1..{gpu.sm_count - 1} SMs of {gpu.name}"
                )
        if self.search_freqs_mhz is not None:
            if not self.search_freqs_mhz:
                raise ValueError("search_freqs_mhz must not be empty")
            for f in self.search_freqs_mhz:
                gpu.check_freq(f)

    # Derived quantities used throughout -------------------------------------------------

    @property
    def gpu_spec(self) -> GPUSpec:
        return get_gpu(self.gpu)

    @property
    def node_spec(self) -> NodeSpec:
        return node_of(self.gpu_spec, self.node)

    @property
    def virtual_stages(self) -> int:
        """The stages the workload is built with: pp x virtual_pipeline (virtual stage v
        runs on pipeline rank v % pp); ``layers_per_stage`` has one entry per each."""
        return self.pp * self.virtual_pipeline

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False
                   ) -> JobSpec:
        """A copy; one with fields updated is another job, named anew (`id` is cached
        from the fields, and pydantic copies the cache with them)."""
        copy = super().model_copy(update=update, deep=deep)
        if update:
            copy.__dict__.pop("id", None)
        return copy

    @cached_property
    def id(self) -> str:
        """The job's stable identity, its journal key (kareus.job.identity)."""
        return job_identity(self)

    @property
    def tokens_per_iteration(self) -> int:
        """Tokens one iteration trains on: every data-parallel replica's microbatches."""
        return self.micro_batch_size * self.num_microbatches * self.seq_length * (self.dp or 1)

    @property
    def splits_into_nanobatches(self) -> bool:
        """Each microbatch is split into two nanobatches (`nanobatch_split`): what Kareus's
        partitions and the Nanobatching methods need. Megatron-LM and Perseus run the whole
        microbatch, of any size."""
        return self.nanobatch_split is not None

    @property
    def sequence_split(self) -> bool:
        return self.nanobatch_split == "sequence"

    @property
    def nanobatch_requirement(self) -> str:
        """Why a job that does not split has no nanobatches, for messages."""
        return nanobatch.requirement(self)

    @property
    def nanobatch_size(self) -> int:
        """Sequences per nanobatch (a sequence split: all, each half as long); SpecError
        for a job whose microbatch is not split."""
        if not self.splits_into_nanobatches:
            raise SpecError(f"this job has no nanobatches: splitting a microbatch in two "
                            f"needs {self.nanobatch_requirement}")
        return self.micro_batch_size if self.sequence_split else self.micro_batch_size // 2

    @property
    def cp_ring(self) -> bool:
        """CP runs as Transformer Engine's ring inside the attention op (``cp_comm_type``
        p2p, cp > 1): no CP collective in the graph, the TP-only partition keys."""
        return self.cp > 1 and self.cp_comm_type == "p2p"

    @property
    def cp_partitions(self) -> bool:
        """CP's K/V all-gather and dK/dV reduce-scatter are the CP partitions' collectives."""
        return self.cp > 1 and self.cp_comm_type == "allgather"

    @property
    def local_seq_length(self) -> int:
        """Tokens of one sequence held by one CP rank."""
        return self.seq_length // self.cp

    @property
    def kv_heads_replicated(self) -> bool:
        return self.model.num_kv_heads < self.tp

    @property
    def local_heads(self) -> int:
        return self.model.num_attention_heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        """KV heads held by one TP rank (1 when KV heads are replicated across ranks)."""
        return max(1, self.model.num_kv_heads // self.tp)

    @property
    def freqs_mhz(self) -> tuple[int, ...]:
        """Frequencies a search visits: the job's override or the GPU's default list."""
        if self.search_freqs_mhz is not None:
            return tuple(sorted(self.search_freqs_mhz, reverse=True))
        return self.gpu_spec.search_freqs_mhz

    def describe(self) -> str:
        m = self.model
        parts = [f"{m.name}", f"TP{self.tp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}" if not self.cp_ring
                         else f"CP{self.cp} (p2p: ring inside the attention op)")
        parts.append(f"PP{self.pp}")
        if self.virtual_pipeline > 1:
            parts.append(f"VP{self.virtual_pipeline}")
        parts.append(f"DP{self.dp}")
        if self.sequence_parallel:
            parts.append("SP")
        parts += [
            f"mbs {self.micro_batch_size}" + (" (sequence split)" if self.sequence_split else ""),
            f"seq {self.seq_length}",
            f"{self.num_microbatches} microbatches",
            f"layers {'/'.join(map(str, self.layers_per_stage or ()))}",
            f"{self.nodes}x{self.gpus_per_node} {self.gpu}{f' ({self.node})' if self.node else ''}",
        ]
        if self.kv_heads_replicated:
            parts.append(f"KV heads replicated x{self.tp // m.num_kv_heads}")
        parts += [t for t in (self.training.describe(),) if t]
        return ", ".join(parts)


def validate_job(data: dict[str, Any]) -> JobSpec:
    """Build a JobSpec from plain data, turning validation failures into one SpecError."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"invalid job: {first_error_line(exc)}") from None
