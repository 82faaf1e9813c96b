"""`KareusTransformerLayer`: Megatron-Core's `TransformerLayer`, which runs a Kareus plan's
partitioned overlap when it is given one (`kareus_plan`), and is Megatron's own layer when
it is not.

With a plan, the layer's forward is `kareus.runtime.overlap_tp.OverlappedTP` (with
``config.sequence_parallel``: `kareus.runtime.overlap_sp.OverlappedSP`) over
`MegatronLayerOps`: the microbatch is split into two nanobatches along the batch dimension
(Megatron's hidden states are [s, b, h]: dimension 1), and every piece runs Megatron's own
modules through their own forward code (`input_layernorm`, the whole `self_attention`,
`self_attn_bda`, `pre_mlp_layernorm`, the whole `mlp`, `mlp_bda`). Two things change, only
while a piece runs, and never the parameters or their layout:

- the four tensor-parallel linears do not communicate: the column-parallel ones
  (`linear_qkv`, `linear_fc1`) with `disable_grad_reduce` (a public constructor argument of
  Megatron's `ColumnParallelLinear`; no backward all-reduce of the input gradient), the
  row-parallel ones (`linear_proj`, `linear_fc2`) with `explicit_expert_comm` (Megatron's
  `RowParallelLinear` then returns its partial sums, as it does for MoE experts, whose
  communication is explicit). The schedule issues those four all-reduces itself,
  asynchronously, on the process group for the plan's SMs. Under sequence parallelism
  the column-parallel linears' all-gather of their input (and its reduce-scatter
  backward) is taken out too, by their ``sequence_parallel`` attribute (`disable_grad_reduce`
  alone does not stop it), and the row-parallel ones' reduce-scatter by the same
  ``explicit_expert_comm``; the SP schedule issues the all-gathers and reduce-scatters
  along the sequence (dimension 0) itself. The norms' parameters are marked
  ``sequence_parallel``, as Megatron's own SP norms mark theirs, so that Megatron's
  `finalize_model_grads` sums their gradients over the TP group;
- forward hooks on those submodules (and on `core_attention`) say when each compute op the
  plan's slots name is about to run, and tap the tensors whose gradients mark the backward
  slots: the fused QKV, the rotated query and key, the core attention's output, the output
  projection, FC1's output, the activation (FC2's input) and FC2's output.

The fused QKV layout (interleaved per query group) and SwiGLU's concatenated FC1 are
Megatron's own business: its modules split them, the schedule never looks inside.

Megatron's full recompute (`recompute_granularity="full"`) re-runs the layer's forward
before its backward; that re-run keeps the pieces' graphs and the backward uses them, so
nothing is computed or communicated a third time (kareus.runtime.pieces).

With context parallelism and Kareus's CP core attention
(kareus.integrations.megatron.cp_attention), the forward is
`kareus.runtime.overlap_cp_ops.OverlappedCPOps` over `MegatronCPOps`
(kareus.integrations.megatron.ops): the key and value all-gathered over the CP group and
their gradients reduce-scattered are the CP partitions' collectives. Transformer Engine's
own CP attention (its ring, ``cp_comm_type="p2p"``) is left whole: one compute op to the
plan, whose partitions are then the TP ones.

At micro-batch size 1 (or where the plan's job chooses it: ``kareus_nanobatch_split``)
the two nanobatches are the sequence's halves instead (dimension 0): the schedule is the
runtime's `OverlappedTP` with ``LayerPlan.split`` "sequence" over
`kareus.integrations.megatron.seq_split.MegatronSeqOps`, nanobatch 1's core attention
reading nanobatch 0's kept key and value; tensor parallelism only for now (with sequence
or context parallelism it is refused in one line).

Supported with a plan: tensor parallelism with or without sequence parallelism on
Megatron's local modules (`get_gpt_layer_local_spec`) or Transformer Engine's
(kareus.integrations.megatron.te: under SP the schedule gathers the pre-norm input of TE's
fused norm; not run on a GPU yet), context parallelism as above, dense MLP,
self-attention, no or full recompute, in training. Anything else is refused in one line
(`check_config`); without a plan the layer is exactly Megatron's, whatever the
configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

from kareus.errors import SpecError
from kareus.integrations.megatron import te
from kareus.integrations.megatron.ops import (
    CP_SUPPORTED,
    MegatronCPOps,
    MegatronLayerOps,
    check_cp_attention,
    cp_size,
    cut_attention_problems,
    runs_cp_partitions,
)
from kareus.integrations.megatron.seq_split import MegatronSeqOps, nanobatch_split
from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import GroupsBySms, Taps
from kareus.runtime.overlap_cp_ops import OverlappedCPOps
from kareus.runtime.overlap_sp import OverlappedSP
from kareus.runtime.overlap_tp import Before, OverlappedTP

_UNSUPPORTED_KWARGS = ("context", "context_mask", "inference_context", "inference_params",
                       "packed_seq_params", "sequence_len_offset", "rotary_pos_cos",
                       "rotary_pos_sin", "rotary_pos_cos_sin")
"""Forward arguments the partitioned overlap does not run (cross-attention, inference,
packed sequences, fused-RoPE inference inputs): refused when set."""

SUPPORTED = ("tensor parallelism with or without sequence parallelism on Megatron-Core's "
             "local modules (get_gpt_layer_local_spec) or Transformer Engine's, "
             f"{CP_SUPPORTED}, a dense MLP, no or full recompute")


def check_config(config: Any) -> None:
    """One line naming what is supported, for a configuration a plan cannot run on."""
    problems = []
    if getattr(config, "num_moe_experts", None):
        problems.append("mixture-of-experts MLPs")
    if getattr(config, "recompute_granularity", None) not in (None, "full"):
        problems.append(f"{config.recompute_granularity} recompute")
    if getattr(config, "tp_comm_overlap", False):
        problems.append("Transformer Engine's TP communication overlap")
    if problems:
        raise SpecError(f"a Kareus plan cannot run with {', '.join(problems)}; supported: "
                        f"{SUPPORTED}")


def check_modules(layer: TransformerLayer) -> None:
    """The tensor-parallel linears must be Megatron's local ones: Transformer Engine's fuse
    the norm into the linear and communicate inside their own kernels."""
    attn, mlp = layer.self_attention, layer.mlp
    found = {"linear_qkv": getattr(attn, "linear_qkv", None),
             "linear_proj": getattr(attn, "linear_proj", None),
             "linear_fc1": getattr(mlp, "linear_fc1", None),
             "linear_fc2": getattr(mlp, "linear_fc2", None)}
    wrong = [f"{n} is {type(m).__name__}" for n, m in found.items()
             if not isinstance(m, RowParallelLinear if n in ("linear_proj", "linear_fc2")
                               else ColumnParallelLinear)]
    if wrong:
        raise SpecError(f"a Kareus plan cannot run on this layer ({'; '.join(wrong)}: "
                        f"Transformer Engine's and other fused modules communicate inside "
                        f"their own kernels, which the plan cannot schedule); supported: "
                        f"{SUPPORTED}")


class _Call:
    """What the submodule hooks report to during one piece: the slot hook and the taps."""

    def __init__(self, before: Before, taps: Taps) -> None:
        self.before, self.taps = before, taps


class KareusTransformerLayer(TransformerLayer):
    """Megatron's `TransformerLayer`, plus `kareus_plan`: None (Megatron's forward) or the
    `LayerPlan` of the instruction running (set by `kareus.integrations.megatron.plan`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kareus_plan: LayerPlan | None = None
        self.kareus_groups_by_sms: GroupsBySms | None = None
        """The process group for a number of SMs (NCCL min_ctas = max_ctas); None: the
        layer's own TP group for every collective (gloo, or NCCL's own choice)."""
        self.kareus_cp_groups_by_sms: GroupsBySms | None = None
        """The same for the context-parallel group (the CP schedule's all-gathers and
        reduce-scatters)."""
        self.kareus_nanobatch_split: str | None = None
        """How a microbatch splits into the two nanobatches: "batch" or "sequence" (the
        plan's job's); None: the batch where it is even, the sequence at micro-batch 1
        (kareus.integrations.megatron.seq_split)."""
        self._kareus_call: _Call | None = None
        self._kareus_hooked = False
        if self.config.sequence_parallel:
            mark_sequence_parallel_norms(self)
        self._kareus_te: te.TEAdapter | None = None  # KAREUS-TE: Transformer Engine's linears

    # Plan ---------------------------------------------------------------------------------

    def set_kareus_plan(self, plan: LayerPlan | None) -> None:
        """Run ``plan`` from the next forward on (None: Megatron's own forward). The
        first plan is checked against the layer (`check_config`, `check_modules`) and
        hooks its submodules; MegatronPlan sets one at every instruction."""
        if plan is not None:
            self._hook_submodules()
        self.kareus_plan = plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.kareus_plan
        if plan is None or not self.training:
            return super().forward(*args, **kwargs)
        hidden_states, kwargs = _hidden_states(args, kwargs)
        for name in _UNSUPPORTED_KWARGS:
            if kwargs.get(name) is not None:
                raise SpecError(f"a Kareus plan cannot run a layer called with {name}; "
                                f"supported: {SUPPORTED}")
        params = [p for p in self.parameters() if p.requires_grad]
        batch = hidden_states.shape[1]
        if nanobatch_split(self, batch, plan) == "sequence":
            self._check_sequence_split()
            if plan.split != "sequence":  # chosen by the layer (micro-batch 1, the job)
                plan = dataclasses.replace(plan, split="sequence")
            out = OverlappedTP.apply(hidden_states, MegatronSeqOps(self, kwargs, batch),
                                     plan, torch.is_grad_enabled(), *params)
        elif runs_cp_partitions(self):
            out = OverlappedCPOps.apply(hidden_states, MegatronCPOps(self, kwargs, batch),
                                        plan, torch.is_grad_enabled(), *params)
        else:
            schedule = OverlappedSP if sequence_parallel(self) else OverlappedTP
            out = schedule.apply(hidden_states, MegatronLayerOps(self, kwargs, batch), plan,
                                 torch.is_grad_enabled(), *params)
        return out, kwargs.get("context")

    def _check_sequence_split(self) -> None:
        """One line where the sequence split cannot run: TP alone, and the attention its
        cut (`MegatronCutOps`) reproduces."""
        problems = [what for what, on in (("context parallelism", cp_size(self) > 1),
                                          ("sequence parallelism", sequence_parallel(self)))
                    if on]
        problems += cut_attention_problems(self)
        if problems:
            raise SpecError(f"a Kareus plan cannot split the sequence into nanobatches "
                            f"with {', '.join(problems)}; supported: tensor parallelism "
                            f"alone, causal self-attention with rotary or none")

    # Hooks on Megatron's submodules --------------------------------------------------------

    def _hook_submodules(self) -> None:
        if self._kareus_hooked:
            return
        check_config(self.config)
        self._kareus_te = te.adapter(self)  # KAREUS-TE: None on Megatron's local modules
        if self._kareus_te is None:
            check_modules(self)
        if cp_size(self) > 1:
            check_cp_attention(self, te_attention=self._kareus_te is not None)
        self._kareus_hooked = True
        attn, mlp = self.self_attention, self.mlp
        self._pre(attn.linear_qkv, "qkv")
        self._post(attn.linear_qkv, "qkv", then="rope")
        self._pre(attn.core_attention, "core_attn", tap="rope")
        self._post(attn.core_attention, "core_attn")
        self._pre(attn.linear_proj, "out_proj")
        self._post(attn.linear_proj, "out_proj")
        self._pre(mlp.linear_fc1, "fc1")
        self._post(mlp.linear_fc1, "fc1", then="swiglu")
        self._pre(mlp.linear_fc2, "fc2", tap="swiglu")
        self._post(mlp.linear_fc2, "fc2")

    def _pre(self, module: torch.nn.Module, op: str, tap: str | None = None) -> None:
        """Before ``module`` runs: the slot hook of ``op``; ``tap``: its inputs (the first
        two: query and key for the core attention, the activation for FC2)."""

        def hook(_m: torch.nn.Module, args: tuple[Any, ...]) -> None:
            call = self._kareus_call
            if call is None:
                return
            if tap is not None:
                tensors = tuple(a for a in args[:2] if isinstance(a, Tensor))
                call.taps[tap] = tensors if len(tensors) > 1 else tensors[0]
            call.before(op)

        module.register_forward_pre_hook(hook)

    def _post(self, module: torch.nn.Module, op: str, then: str | None = None) -> None:
        """After ``module`` ran: its output tapped as ``op``; ``then``: the slot hook of the
        op that follows (rotary after QKV, the activation after FC1)."""

        def hook(_m: torch.nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            call = self._kareus_call
            if call is None:
                return
            out = output[0] if isinstance(output, tuple) else output
            call.taps[op] = out
            if then is not None:
                call.before(then)

        module.register_forward_hook(hook)

    @contextlib.contextmanager
    def _kareus_piece(self, before: Before, taps: Taps) -> Iterator[None]:
        """One piece: the hooks report to it, and the TP linears do not communicate."""
        if self._kareus_te is not None:  # KAREUS-TE: Transformer Engine's linears (te.py)
            self._kareus_call = _Call(before, taps)
            try:
                with self._kareus_te.without_communication():
                    yield
            finally:
                self._kareus_call = None
            return
        attn, mlp = self.self_attention, self.mlp
        cols = (attn.linear_qkv, mlp.linear_fc1)
        rows = (attn.linear_proj, mlp.linear_fc2)
        saved = ([(c.disable_grad_reduce, c.allreduce_dgrad) for c in cols],
                 [r.explicit_expert_comm for r in rows])
        call = _Call(before, taps)
        self._kareus_call = call
        try:
            for c in cols:
                c.disable_grad_reduce, c.allreduce_dgrad = True, False
            for r in rows:
                r.explicit_expert_comm = True  # no all-reduce, no SP reduce-scatter
            with _without_sequence_parallel_gather(cols):
                yield
        finally:
            self._kareus_call = None
            for c, (grad_reduce, dgrad) in zip(cols, saved[0]):
                c.disable_grad_reduce, c.allreduce_dgrad = grad_reduce, dgrad
            for r, explicit in zip(rows, saved[1]):
                r.explicit_expert_comm = explicit


# Sequence parallelism ------------------------------------------------------------------------


def sequence_parallel(layer: TransformerLayer) -> bool:
    """Whether ``layer`` runs Megatron's sequence parallelism: its hidden states are this
    rank's part of the sequence (Megatron turns it off at TP=1)."""
    return bool(getattr(layer.self_attention.linear_qkv, "sequence_parallel", False))


def mark_sequence_parallel_norms(layer: TransformerLayer) -> None:
    """Mark the layer norms' parameters ``sequence_parallel``, as Megatron's own
    sequence-parallel norms (FusedLayerNorm, TENorm) mark theirs: each rank's gradient is
    its part of the sequence's, which Megatron's `finalize_model_grads` sums over the TP
    group for exactly the parameters so marked."""
    for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
        for p in norm.parameters():
            p.sequence_parallel = True


@contextlib.contextmanager
def _without_sequence_parallel_gather(cols: tuple[Any, ...]) -> Iterator[None]:
    """Column-parallel linears that neither all-gather their input along the sequence nor
    reduce-scatter its gradient (Megatron's ``sequence_parallel`` attribute, read at every
    forward: the SP schedule gathers and scatters itself)."""
    saved = [c.sequence_parallel for c in cols]
    try:
        for c in cols:
            c.sequence_parallel = False
        yield
    finally:
        for c, sp in zip(cols, saved):
            c.sequence_parallel = sp


def _hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[Tensor, dict[str, Any]]:
    """The hidden states and the other arguments by name (TransformerLayer's forward
    takes hidden_states, attention_mask, context, context_mask, rotary_pos_emb, ... in
    that order)."""
    names = ("hidden_states", "attention_mask", "context", "context_mask", "rotary_pos_emb")
    if len(args) > len(names):
        raise SpecError(f"a Kareus plan cannot run a layer called with {len(args)} "
                        f"positional arguments; supported: {SUPPORTED}")
    merged = {**dict(zip(names, args)), **kwargs}
    hidden = merged.pop("hidden_states")
    return hidden, merged
