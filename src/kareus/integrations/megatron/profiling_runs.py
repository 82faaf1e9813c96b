"""The runs of one partition in the ``megatron`` runtime (kareus.integrations.megatron.
profiling): its pieces through the executor's ops on the runtime's inputs, with its
collective launched at the plan's slot on a side stream. A forward partition runs under
``torch.no_grad()``; a backward one differentiates its pieces' graphs, built once, on every
run. What each segment runs is the runtime module's docstring.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from kareus.gpu.partition_runner import SideStream
from kareus.integrations.megatron.layer import KareusTransformerLayer
from kareus.integrations.megatron.ops import MegatronCPOps, MegatronLayerOps
from kareus.runtime.overlap import BACKWARD_TAPS, Taps
from kareus.runtime.overlap_cp_ops import pair_kv, unpair_kv
from kareus.runtime.pieces import Before


class MegatronRuntime(Protocol):
    """What the runs read of `kareus.integrations.megatron.profiling.MegatronRuntime`:
    its layer and ops, and its inputs, allocated once at a nanobatch's shapes."""

    layer: KareusTransformerLayer
    ops: MegatronLayerOps
    seq: bool
    """A sequence split: the attention partitions are per nanobatch."""
    x: Tensor
    r: Tensor
    grad: Tensor
    xs: Tensor
    """Under SP: ``x``'s rows of this rank's part of the sequence (``rs``, ``grads`` too)."""
    rs: Tensor
    grads: Tensor
    past: tuple[Tensor, Tensor]
    """A sequence split: nanobatch 0's kept key and value (``past_grad``: their gradients
    from nanobatch 1's backward)."""
    past_grad: tuple[Tensor, Tensor]
    q: Tensor
    """Under CP: this rank's query, the gathered key and value (``kv_full``) and the
    gradients the backward takes (``dq``, ``do``, ``dkv``)."""
    kv_full: Tensor
    dq: Tensor
    do: Tensor
    dkv: Tensor

    def attention(self, a: Tensor, nanobatch: int | None, before: Before, taps: Taps,
                  past: tuple[Tensor, Tensor] | None = None
                  ) -> tuple[Tensor, Tensor, Tensor] | Tensor: ...


class ForwardRunner:
    """``segment``: "tp_attn", "tp_mlp" (norm and core), under SP "ln1", "attn", "ln2",
    "mlp", under CP "cp_qkv", "cp_ao", "tp_mlp". ``nanobatch``: the partition's, where
    the nanobatches' compute differs (a sequence split's attention)."""

    def __init__(self, rt: MegatronRuntime, segment: str, launch_op: str | None,
                 side: SideStream, nanobatch: int | None = None) -> None:
        self.rt, self.segment, self.launch_op, self.side = rt, segment, launch_op, side
        self.nanobatch = nanobatch
        self.ops_run: list[str] = []
        """The ops' names as the pieces announce them, in order (for checking)."""

    def _before(self, name: str) -> None:
        self.ops_run.append(name)
        if name == self.launch_op:
            self.side.launch()

    def run(self) -> None:
        ops, rt = self.rt.ops, self.rt
        taps: Taps = {}
        seg = self.segment
        with torch.no_grad():
            if seg in ("tp_attn", "ln1", "cp_qkv"):
                x, r = (rt.xs, rt.rs) if seg == "ln1" else (rt.x, rt.r)
                self._before("residual_mlp")
                x = ops.mlp_residual(x, r)
                self._before("input_norm")
                a = ops.attn_norm(x)
                if seg == "tp_attn":
                    rt.attention(a, self.nanobatch, self._before, taps)
                elif seg == "cp_qkv":
                    _cp(ops).qkv_partial(a, self._before, taps)
            elif seg == "cp_ao":  # this rank's query, the gathered key and value
                cp = _cp(ops)
                o = cp.attention(rt.q, *unpair_kv(rt.kv_full), self._before, {})
                cp.proj_partial(o, self._before, taps)
            elif seg in ("tp_mlp", "ln2"):
                x, r = (rt.x, rt.r) if seg == "tp_mlp" else (rt.xs, rt.rs)
                self._before("residual_attn")
                h = ops.attn_residual(x, r)
                self._before("pre_mlp_norm")
                bn = ops.mlp_norm(h)
                if seg == "tp_mlp":
                    ops.mlp_partial(bn, self._before, taps)
            elif seg == "attn":  # SP: the gathered norm output, the whole sequence
                ops.attn_partial(rt.x, self._before, taps)
            else:
                ops.mlp_partial(rt.x, self._before, taps)
        if self.launch_op is None:
            self.side.launch()
        self.side.join()

    def synchronize(self) -> None:
        self.side.synchronize()


def _cp(ops: MegatronLayerOps) -> MegatronCPOps:
    assert isinstance(ops, MegatronCPOps)
    return ops


class BackwardRunner:
    """The partition's pieces built once with grad; each run differentiates them again
    (CP's ``a``: the core attention is rebuilt on every run, as the executor rebuilds it)."""

    def __init__(self, rt: MegatronRuntime, segment: str, launch_op: str | None,
                 side: SideStream, nanobatch: int | None = None) -> None:
        self.rt, self.segment, self.launch_op, self.side = rt, segment, launch_op, side
        ops = rt.ops
        self.params = [p for p in rt.layer.parameters() if p.requires_grad]
        self.launched = False
        self.tap = BACKWARD_TAPS.get(launch_op or "")
        self.norm: tuple[Tensor, Tensor] | None = None
        self.core: tuple[Tensor, Tensor | tuple[Tensor, ...]] | None = None
        self.past: tuple[Tensor, ...] = ()
        """A sequence split's nanobatch 1: nanobatch 0's key and value its attention
        reads (leaves: its backward gives their gradients)."""
        self.ops_run: list[str] = []
        """The forward ops whose backward each run differentiates: the norm's, then the
        ops the core's pieces announce (for checking)."""
        self._ops: list[str] = []
        built = self._ops.append
        taps: Taps = {}
        with torch.enable_grad():
            if segment in ("tp_mlp", "ln1"):  # the (next layer's) input-norm backward
                r = rt.r if segment == "tp_mlp" else rt.rs
                x = r.detach().requires_grad_(True)
                self.norm = (x, ops.attn_norm(x))
                built("input_norm")
            elif segment in ("tp_attn", "ln2", "cp_o"):  # the MLP norm's backward
                x = rt.x if segment != "ln2" else rt.xs
                h = x.detach().requires_grad_(True)
                self.norm = (h, ops.mlp_norm(h))
                built("pre_mlp_norm")
            if segment in ("tp_mlp", "mlp"):
                bn = (ops.mlp_norm(rt.x) if segment == "tp_mlp" else rt.x)
                bn = bn.detach().requires_grad_(True)
                self.core = (bn, ops.mlp_partial(bn, built, taps))
            elif segment == "tp_attn":
                a = ops.attn_norm(rt.r).detach().requires_grad_(True)
                if rt.seq and nanobatch == 1:
                    self.past = tuple(t.detach().requires_grad_(True) for t in rt.past)
                    k0, v0 = self.past
                    self.core = (a, rt.attention(a, 1, built, taps, (k0, v0)))
                else:  # a sequence split's nanobatch 0: out, and its key and value
                    self.core = (a, rt.attention(a, nanobatch, built, taps))
            elif segment == "attn":
                a = rt.x.detach().requires_grad_(True)
                self.core = (a, ops.attn_partial(a, built, taps))
            elif segment == "cp_o":  # the output projection's backward
                o = rt.q.flatten(2).detach().requires_grad_(True)
                self.core = (o, _cp(ops).proj_partial(o, built, taps))
            elif segment == "cp_qkv":  # rotary and QKV backward
                a = ops.attn_norm(rt.r).detach().requires_grad_(True)
                self.core = (a, _cp(ops).qkv_partial(a, built, taps))
        # CP's a': its tap is on the attention rebuilt at every run
        self.hooked = self.tap is not None and (self.tap in taps or segment == "cp_a")
        if self.hooked and segment != "cp_a":
            self._hook(taps)

    def _hook(self, taps: Taps) -> None:
        tapped = taps[str(self.tap)]
        for t in tapped if isinstance(tapped, tuple) else (tapped,):
            t.register_hook(self._on_gradient)

    def _on_gradient(self, grad: Tensor) -> None:
        self._launch()

    def _launch(self) -> None:
        if not self.launched:
            self.launched = True
            self.side.launch()

    def run(self) -> None:
        self.launched = False
        rt = self.rt
        self.ops_run.extend(self._ops)
        if self.launch_op is not None and not self.hooked:  # a norm slot: at the start
            self._launch()
        if self.norm is not None:  # the norm backward the partition starts with
            x, normed = self.norm
            grad = rt.grad if x.shape == rt.grad.shape else rt.grads
            torch.autograd.grad(normed, [x, *self.params], grad, retain_graph=True,
                                allow_unused=True)
        if self.core is not None:
            core_in, core_out = self.core
            grad_out: Tensor | tuple[Tensor, ...] = rt.grad
            if self.segment == "cp_qkv":  # the reduce-scattered key and value gradients
                dk, dv = unpair_kv(rt.dkv)
                grad_out = (rt.dq, dk.contiguous(), dv.contiguous())
            elif isinstance(core_out, tuple):  # a sequence split's nanobatch 0: its key
                # and value's gradients from nanobatch 1's backward, added here
                grad_out = (rt.grad, *rt.past_grad)
            # a sequence split's nanobatch 1: with the gradients of nanobatch 0's key
            # and value (the executor hands them to nanobatch 0's backward)
            torch.autograd.grad(core_out, [core_in, *self.past, *self.params], grad_out,
                                retain_graph=True, allow_unused=True)
        if self.segment == "cp_a":
            self._attention_backward()
        self._launch()  # slot "none", or a tap this run did not reach: at the end
        self.side.join()

    def _attention_backward(self) -> None:
        """CP's a': the core attention rebuilt on the gathered key and value and
        differentiated -> d(query) and d(key, value) of the whole sequence."""
        rt = self.rt
        with torch.enable_grad():
            q = rt.q.detach().requires_grad_(True)
            k, v = (t.detach().requires_grad_(True) for t in unpair_kv(rt.kv_full))
            taps: Taps = {}
            o = _cp(rt.ops).attention(q, k, v, self.ops_run.append, taps)
            if self.hooked:
                self._hook(taps)
            _dq, dk, dv = torch.autograd.grad(o, [q, k, v], rt.do)
        # timed with the partition: the executor builds this one tensor for the
        # reduce-scatter
        self.dkv_out = pair_kv(dk, dv)

    def synchronize(self) -> None:
        self.side.synchronize()
