"""The pieces the TP and SP overlapped schedules run (kareus.runtime.overlap_tp,
kareus.runtime.overlap_sp), over any layer that offers its ops without their
communication (`TPLayerOps`).

A nanobatch's layer is cut into six pieces at the points where a collective sits: the
attention norm, the attention core (QKV to the partial output projection), the attention
residual, and the same three for the MLP. With tensor parallelism alone, the core takes
the norm's output as it is (its input gradient is all-reduced before the norm's backward)
and the residual takes the all-reduced core output; with sequence parallelism the norm
runs on this rank's part of the sequence, the core on the all-gathered norm output (its
input gradient reduce-scattered), and the residual on the reduce-scattered core output
(its gradient all-gathered). The schedules differentiate the pieces one by one, in their
order. Where the pieces' autograd graphs come from is the caller's choice
(``keep_graphs``):
- kept from the forward (run with grad enabled): nothing is computed twice. This is what
  Megatron's full recompute needs: its checkpoint re-runs the layer's forward before the
  backward, and that re-run keeps the graphs;
- rebuilt in the backward from the saved piece inputs (the layer's own full recompute:
  `LlamaLayer`): the collectives' results are saved with them, so nothing is communicated
  again.

The microbatch splits along the batch (``LayerPlan.split`` "batch") or, at micro-batch
size 1, along the sequence ("sequence": the first and the second half of the tokens).
Every piece but the attention core is per token, so only the core differs: nanobatch 1's
attends to nanobatch 0's keys and values (kept from nanobatch 0's forward, not computed
again) before its own, causally at its positions (offset by nanobatch 0's length); its
backward gives the gradients of nanobatch 0's keys and values, added to nanobatch 0's core
backward, so the schedules run the backward nanobatch 1 first (`backward_order`). The
layer offers the core for this as `SequenceSplitOps.attn_partial_kv`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from torch import Tensor

from kareus.errors import SpecError
from kareus.runtime.layer_plan import LayerPlan
from kareus.runtime.overlap import GroupsBySms, Taps
from kareus.runtime.primitives import Group

Before = Callable[[str], None]
"""Called with a compute op's name just before it runs (the forward's slot hook)."""


def no_slot(_name: str) -> None:
    """A `Before` that does nothing (a piece run outside a partition's slot)."""


class TPLayerOps(Protocol):
    """A decoder layer's ops as the TP and SP schedules run them: none communicates. The
    two cores return this rank's partial sums (row-parallel linears without their
    all-reduce or reduce-scatter) and take a norm output (all-gathered along the sequence
    under SP) whose gradient they return partial (column-parallel linears without their
    backward all-reduce or reduce-scatter)."""

    group: Group
    """The tensor-parallel group."""
    groups_by_sms: GroupsBySms | None
    """The group whose NCCL communicator runs a collective on that many SMs (None: the
    layer's own group for every collective)."""
    batch_dim: int
    """The batch dimension of the layer's input (split into the two nanobatches)."""

    def attn_norm(self, x: Tensor) -> Tensor: ...

    def attn_partial(self, a: Tensor, before: Before, taps: Taps) -> Tensor:
        """Norm output -> partial output projection; calls ``before`` with "qkv", "rope",
        "core_attn", "out_proj" and fills ``taps`` with the tensors of those names."""
        ...

    def attn_residual(self, x: Tensor, reduced: Tensor) -> Tensor: ...

    def mlp_norm(self, h: Tensor) -> Tensor: ...

    def mlp_partial(self, bn: Tensor, before: Before, taps: Taps) -> Tensor:
        """Norm output -> partial FC2 output; calls ``before`` with "fc1", "swiglu",
        "fc2" and fills ``taps`` with the tensors of those names."""
        ...

    def mlp_residual(self, h: Tensor, reduced: Tensor) -> Tensor: ...

    def nanobatch(self, index: int) -> TPLayerOps:
        """The ops of nanobatch ``index`` (0 or 1) of a batch split: inputs given per batch
        element (an attention mask per sample) cut to that half; self where there are
        none."""
        ...


class SequenceSplitOps(TPLayerOps, Protocol):
    """`TPLayerOps` of a layer whose microbatch the schedules can split along the
    sequence (``LayerPlan.split`` "sequence")."""

    seq_dim: int
    """The sequence dimension of the layer's input (split into the two nanobatches)."""

    def attn_partial_kv(self, a: Tensor, past: tuple[Tensor, Tensor] | None, before: Before,
                        taps: Taps) -> tuple[Tensor, Tensor, Tensor]:
        """`attn_partial` of one nanobatch of a sequence split: ``a`` (its norm output)
        holds the positions that follow ``past``'s (None: the sequence's first). Its
        queries attend to ``past``'s keys and values (the earlier nanobatch's, as this
        returned them) and then its own, causally at their positions (rotary too).
        Returns the partial output projection and this nanobatch's own key and value, as
        the attention core reads them."""
        ...


class SPLayerOps(TPLayerOps, Protocol):
    """`TPLayerOps` of a sequence-parallel layer: its norms and residuals run on this
    rank's part of the sequence."""

    seq_dim: int
    """The sequence dimension (all-gathered and reduce-scattered)."""


PIECES = ("attn_norm", "attn_core", "attn_res", "mlp_norm", "mlp_core", "mlp_res")


@dataclass
class Piece:
    """One piece of one nanobatch: its leaf inputs and output(s) (a graph when built with
    grad enabled) and its tapped intermediates."""

    inputs: list[Tensor]
    output: Tensor | tuple[Tensor, ...]
    taps: Taps = field(default_factory=dict)


def leaf(t: Tensor) -> Tensor:
    return t.detach().requires_grad_(torch.is_grad_enabled())


class Nanobatch:
    """The six pieces of one nanobatch, built in the forward and, where they were not
    kept, again in the backward from the saved inputs (`build`)."""

    def __init__(self, ops: TPLayerOps, x: Tensor) -> None:
        self.ops, self.x = ops, x
        self.index = 0
        """Which nanobatch of the microbatch this is (0 or 1; the plan's per-nanobatch
        keys)."""
        self.past: Nanobatch | None = None
        """Sequence split: the earlier nanobatch whose keys and values this one's attention
        reads (None: the first, or a batch split)."""
        self.sequence = False
        """Split along the sequence (the attention core is `attn_partial_kv`)."""
        self.read_later = False
        """Sequence split: a later nanobatch reads this one's keys and values (its core
        piece then outputs them too, and their gradients come from that nanobatch)."""
        self.kv: tuple[Tensor, Tensor] | None = None
        """Sequence split: this nanobatch's key and value (detached), kept for the next."""
        self.kv_grad: tuple[Tensor, ...] | None = None
        """Sequence split: the later nanobatch's gradients of this one's key and value."""
        self.pieces: dict[str, Piece] = {}
        self.reduced: dict[str, Tensor] = {}
        """Per half ("attn", "mlp"): the core's output after its collective (the
        residual's second input)."""
        self.gathered: dict[str, Tensor] = {}
        """Per half, under SP: the all-gathered norm output (the core's input)."""

    def attn_norm(self, before: Before) -> Tensor:
        """The attention norm piece: its output."""
        before("residual_mlp")
        before("input_norm")
        return self._norm("attn", self.x, self.ops.attn_norm)

    def attn_core(self, a: Tensor, before: Before, gathered: bool = False) -> Tensor:
        """The attention core piece on ``a`` (the norm output, ``gathered`` under SP):
        the partial output projection."""
        if not self.sequence:
            return self._core("attn", a, self.ops.attn_partial, before, gathered)
        ops = cast(SequenceSplitOps, self.ops)  # checked by `split`
        a_in = leaf(a)
        past: tuple[Tensor, Tensor] | None = None
        if self.past is not None:
            k0, v0 = self._past_kv()
            past = (leaf(k0), leaf(v0))
        taps: Taps = {}
        out, k, v = ops.attn_partial_kv(a_in, past, before, taps)
        # kept for the next nanobatch: its attention reads them, nothing computes them again
        self.kv = (k.detach(), v.detach())
        self.pieces["attn_core"] = Piece([a_in, *(past or ())],
                                         (out, k, v) if self.read_later else out, taps)
        return out

    def _past_kv(self) -> tuple[Tensor, Tensor]:
        assert self.past is not None and self.past.kv is not None, \
            "a sequence split runs nanobatch 0's attention first"
        return self.past.kv

    def attn_core_backward(self, grads: Grads, dr: Tensor) -> Tensor:
        """The attention core piece's backward from the gradient of its output -> the
        partial gradient of its input. Sequence split: the gradients of the earlier
        nanobatch's keys and values go to it, and this one's (from the later nanobatch,
        whose backward ran first) are added here."""
        core = self.pieces["attn_core"]
        if self.read_later:
            assert self.kv_grad is not None, "a sequence split runs nanobatch 1's backward first"
            da, *dpast = grads(core, (dr, *self.kv_grad))
            self.kv_grad = None
        else:
            da, *dpast = grads(core, dr)
        if self.past is not None:
            self.past.kv_grad = tuple(dpast)
        return da

    def attention(self, before: Before) -> Tensor:
        """The attention norm and core (TP: no collective between them)."""
        return self.attn_core(self.attn_norm(before), before)

    def _norm(self, half: str, x: Tensor, norm: Callable[[Tensor], Tensor]) -> Tensor:
        x_in = leaf(x)
        n = norm(x_in)
        self.pieces[f"{half}_norm"] = Piece([x_in], n)
        return n

    def _core(self, half: str, a: Tensor, core: Callable[[Tensor, Before, Taps], Tensor],
              before: Before, gathered: bool) -> Tensor:
        """``half``'s core piece (cut from its norm: the core's input gradient is partial
        and reduced before the norm's backward)."""
        if gathered:
            self.gathered[half] = a.detach()
        a_in = leaf(a)
        taps: Taps = {}
        out = core(a_in, before, taps)
        self.pieces[f"{half}_core"] = Piece([a_in], out, taps)
        return out

    def attn_residual(self, reduced: Tensor, before: Before) -> Tensor:
        self.reduced["attn"] = reduced
        before("residual_attn")
        x, r = leaf(self.x), leaf(reduced)
        h = self.ops.attn_residual(x, r)
        self.pieces["attn_res"] = Piece([x, r], h)
        self.h = h.detach()
        return self.h

    def mlp_norm(self, before: Before) -> Tensor:
        """The MLP norm piece: its output."""
        before("pre_mlp_norm")
        return self._norm("mlp", self.h, self.ops.mlp_norm)

    def mlp_core(self, bn: Tensor, before: Before, gathered: bool = False) -> Tensor:
        """The MLP core piece on ``bn``: the partial FC2 output."""
        return self._core("mlp", bn, self.ops.mlp_partial, before, gathered)

    def mlp(self, before: Before) -> Tensor:
        """The MLP norm and core (TP)."""
        return self.mlp_core(self.mlp_norm(before), before)

    def mlp_residual(self, reduced: Tensor) -> Tensor:
        self.reduced["mlp"] = reduced
        h, r = leaf(self.h), leaf(reduced)
        y = self.ops.mlp_residual(h, r)
        self.pieces["mlp_res"] = Piece([h, r], y)
        return y.detach()

    def build(self, names: Sequence[str]) -> None:
        """The pieces ``names`` (of one of the halves, attention or MLP) with their graphs,
        from the saved inputs: where the forward kept none. The core runs on the saved
        gathered input where there is one (nothing is communicated again)."""
        if all(n in self.pieces for n in names):
            return
        with torch.enable_grad():
            if names[0] == "attn_norm":
                a = self.attn_norm(no_slot)
                self.attn_core(self.gathered.get("attn", a), no_slot, "attn" in self.gathered)
                self.attn_residual(self.reduced["attn"], no_slot)
            else:
                bn = self.mlp_norm(no_slot)
                self.mlp_core(self.gathered.get("mlp", bn), no_slot, "mlp" in self.gathered)
                self.mlp_residual(self.reduced["mlp"])

    def drop(self) -> None:
        """Forget the pieces (recompute mode keeps only the inputs across the pass)."""
        self.pieces.clear()


class Grads:
    """Differentiates pieces, summing the parameters' gradients."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.sums: list[Tensor | None] = [None] * len(self.params)

    def __call__(self, piece: Piece, grad: Tensor | tuple[Tensor, ...]) -> list[Tensor]:
        """The gradients of the piece's inputs (``grad``: of its output, or one per output);
        its parameters' are added to the sums."""
        wanted = [*piece.inputs, *(p for p in self.params if p.requires_grad)]
        got = torch.autograd.grad(piece.output, wanted, grad, allow_unused=True)
        n = len(piece.inputs)
        trained = (i for i, p in enumerate(self.params) if p.requires_grad)
        for i, g in zip(trained, got[n:]):
            if g is not None:
                s = self.sums[i]
                self.sums[i] = g if s is None else s + g
        return [torch.zeros_like(t) if g is None else g for t, g in zip(piece.inputs, got)]


def split_dim(ops: TPLayerOps, mode: str = "batch") -> int:
    """The dimension of the layer's input that ``mode`` splits."""
    return ops.batch_dim if mode == "batch" else getattr(ops, "seq_dim", 1)


def split(x: Tensor, ops: TPLayerOps, mode: str = "batch") -> list[Nanobatch]:
    """The two nanobatches of ``x`` along the ops' batch dimension (``mode`` "batch") or
    its sequence dimension ("sequence": the first and the second half of the tokens;
    nanobatch 1 reads nanobatch 0's keys and values). The split size must be even."""
    dim = split_dim(ops, mode)
    what = "batch" if mode == "batch" else "sequence"
    if mode == "sequence" and not hasattr(ops, "attn_partial_kv"):
        raise SpecError(f"{type(ops).__name__} offers no attention core over an earlier "
                        "nanobatch's keys (attn_partial_kv): it runs a batch split only")
    if x.shape[dim] < 2 or x.shape[dim] % 2:
        raise SpecError(f"the partitioned overlap splits the {what} (dimension {dim}) "
                        f"into two nanobatches: it needs an even size, not "
                        f"{x.shape[dim]}")
    # a half along a dimension other than the first is strided: every op on it would be
    # slower (and copy); one copy each now instead
    halves = [half.contiguous() for half in x.detach().chunk(2, dim=dim)]
    nbs = [Nanobatch(ops.nanobatch(i) if mode == "batch" else ops, half)
           for i, half in enumerate(halves)]
    for i, nb in enumerate(nbs):
        nb.index = i
    if mode == "batch":
        return nbs
    for nb in nbs:
        nb.sequence = True
    nbs[1].past, nbs[0].read_later = nbs[0], True
    return nbs


def backward_order(plan: LayerPlan) -> tuple[int, int]:
    """The nanobatches in the order the backward runs them: a sequence split's second
    first (its attention backward gives the gradients of the first's keys and values)."""
    return (1, 0) if plan.split == "sequence" else (0, 1)


def refuse_sequence_split(plan: LayerPlan, schedule: str, why: str) -> None:
    """One line where a schedule runs no sequence split."""
    if plan.split == "sequence":
        raise SpecError(f"{schedule} runs no sequence split of the microbatch ({why}): "
                        "use a batch split (an even micro-batch size)")
