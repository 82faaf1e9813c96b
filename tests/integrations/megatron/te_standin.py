"""A CPU stand-in for Megatron's Transformer Engine linears (Transformer Engine does not
import without CUDA), with exactly the attributes and semantics the Kareus TE adapter
(kareus.integrations.megatron.te) relies on, taken from Transformer Engine 2.11's released
sources (transformer_engine/pytorch/module/linear.py, layernorm_linear.py) and Megatron-Core
0.16.1's wrappers (megatron/core/extensions/transformer_engine.py):

- ``parallel_mode`` ("column" / "row" / None) is read at each forward and saved in the
  autograd context (linear.py:1451, :468; layernorm_linear.py:1568, :506); "row" all-reduces
  the output in the forward (linear.py:354-363), "column" the input gradient in the
  backward (linear.py:744-754; layernorm_linear.py:760-770);
- the fused norm's backward runs on the (all-reduced) gradient of its output
  (layernorm_linear.py:959-989), so its weights' gradients are full on every rank;
- ``apply_bias = bias and not return_bias``; a row-parallel linear adds an applied bias
  after the all-reduce (``gemm_bias_unfused_add``, linear.py:1299-1303);
- ``tp_size``, ``tp_group``, ``sequence_parallel = tp_size > 1 and sequence_parallel``
  (linear.py:1138, layernorm_linear.py:1209), the ``ub_*`` flags (False without
  userbuffers);
- under sequence parallelism (saved as ``ctx.sequence_parallel``, linear.py:465,
  layernorm_linear.py:503), "column" all-gathers its input along the first dimension, a
  fused norm's output ``ln_out`` (layernorm_linear.py:151, :246-283; linear.py:146, :213),
  uses the gathered input for the weight gradient (layernorm_linear.py:416-418, :667-696;
  linear.py:381-383, :668) and reduce-scatters the input gradient instead of all-reducing
  it (layernorm_linear.py:763-764, linear.py:747-748), before the norm's backward; "row"
  reduce-scatters its output instead of all-reducing it (linear.py:357-358) and
  all-gathers the output gradient (base.py:1113-1119, ``grad_output_preprocess``);
- the fused norm's parameters are marked ``sequence_parallel`` with the module's value
  (layernorm_linear.py:1442-1444), and so is a row-parallel linear's bias
  (linear.py:1341-1342);
- Megatron's wrappers: ``te_return_bias = skip_bias_add and bias``, forward returns
  ``(out, bias or None)`` (transformer_engine.py:669-685, :890-907), ``parallel_mode``
  "column" for `TELayerNormColumnParallelLinear` and `TEColumnParallelLinear`, "row" for
  `TERowParallelLinear`; parameter names ``layer_norm_weight``, ``layer_norm_bias``,
  ``weight``, ``bias``.

The attention (`TEDotProductAttention`, `te_attention`): TE 2.11's `DotProductAttention`
mask types at CP=1 (``causal`` top-left aligned, ``causal_bottom_right`` bottom-right
aligned when there are fewer queries than keys; transformer_engine/pytorch/attention/
dot_product_attention/utils.py, `get_full_mask`), and TE's ring CP as an op that
communicates inside itself.

The numerics are plain fp32 matmuls and norms, not TE's kernels: the tests compare the
Kareus layer with a plan against the same stand-in layer's own communicating forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _gather(t: torch.Tensor, group: Any) -> torch.Tensor:
    """TE's ``gather_along_first_dim``."""
    t = t.contiguous()
    out = t.new_empty((t.shape[0] * dist.get_world_size(group), *t.shape[1:]))
    dist.all_gather_into_tensor(out, t, group=group)
    return out


def _reduce_scatter(t: torch.Tensor, group: Any) -> torch.Tensor:
    """TE's ``reduce_scatter_along_first_dim``."""
    t = t.contiguous()
    out = t.new_empty((t.shape[0] // dist.get_world_size(group), *t.shape[1:]))
    # torch 2.13 has reduce_scatter_single (reduce_scatter_tensor warns it is deprecated)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, t, group=group)
    return out


def _norm(x, weight, bias, normalization: str, eps: float, zero_centered: bool):
    w = weight + 1 if zero_centered else weight
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return F.layer_norm(x, x.shape[-1:], w, bias, eps)


class _LinearFn(torch.autograd.Function):
    """TE's `_Linear` / `_LayerNormLinear` as far as communication goes: the mode the
    forward saw decides the backward's all-reduce; a fused norm's backward runs after it."""

    @staticmethod
    def forward(ctx, x, weight, bias, ln_weight, ln_bias, module):
        mode, tp = module.parallel_mode, module.tp_size
        ctx.mode, ctx.tp, ctx.group, ctx.module = mode, tp, module.tp_group, module
        ctx.sp = module.sequence_parallel
        ctx.save_for_backward(x, weight, ln_weight, ln_bias)
        ctx.has_bias = bias is not None
        inp = x
        if module.fused_norm:
            inp = _norm(x, ln_weight, ln_bias, *module.norm_args)
        if mode == "column" and ctx.sp:
            inp = _gather(inp, module.tp_group)
        out = inp @ weight.t()
        if bias is not None and not module.gemm_bias_unfused_add:
            out = out + bias
        if mode == "row" and tp > 1:
            out = (_reduce_scatter(out, module.tp_group) if ctx.sp
                   else _all_reduce(out, module.tp_group))
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight, ln_weight, ln_bias = ctx.saved_tensors
        module = ctx.module
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            lw = ln_weight.detach().requires_grad_(True) if ln_weight is not None else None
            lb = ln_bias.detach().requires_grad_(True) if ln_bias is not None else None
            inp = _norm(xr, lw, lb, *module.norm_args) if module.fused_norm else xr
        column_sp = ctx.mode == "column" and ctx.sp
        if ctx.mode == "row" and ctx.sp:
            g = _gather(g, ctx.group)
        dgrad = g @ weight
        if ctx.mode == "column" and ctx.tp > 1:
            dgrad = (_reduce_scatter(dgrad, ctx.group) if column_sp
                     else _all_reduce(dgrad, ctx.group))
        total = _gather(inp.detach(), ctx.group) if column_sp else inp.detach()
        wgrad = g.reshape(-1, g.shape[-1]).t() @ total.reshape(-1, total.shape[-1])
        bgrad = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        dx, dlw, dlb = dgrad, None, None
        if module.fused_norm:  # the norm's backward, on the (all-reduced) gradient
            wanted = [xr] + [t for t in (lw, lb) if t is not None]
            got = torch.autograd.grad(inp, wanted, dgrad)
            dx = got[0]
            dlw = got[1] if lw is not None else None
            dlb = got[2] if lb is not None else None
        return dx, wgrad, bgrad, dlw, dlb, None


class StandInTELinear(torch.nn.Module):
    """TE's `Linear` under Megatron's `TELinear` wrapper (column or row)."""

    fused_norm = False

    def __init__(self, input_size: int, output_size: int, *, parallel_mode: str | None,
                 config: Any, init_method: Any, bias: bool, skip_bias_add: bool,
                 tp_group: Any = None, **_: Any) -> None:
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.parallel_mode = parallel_mode
        self.sequence_parallel = self.tp_size > 1 and config.sequence_parallel
        for flag in ("ub_overlap_rs_fprop", "ub_overlap_ag_dgrad", "ub_overlap_ag_fprop",
                     "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"):
            setattr(self, flag, False)
        self.te_return_bias = skip_bias_add and bias
        self.return_bias = self.te_return_bias
        self.apply_bias = bias and not self.return_bias
        self.gemm_bias_unfused_add = parallel_mode == "row" and self.apply_bias
        self.is_first_microbatch = True
        out_f = output_size // self.tp_size if parallel_mode == "column" else output_size
        in_f = input_size // self.tp_size if parallel_mode == "row" else input_size
        self.norm_args = (config.normalization, config.layernorm_epsilon,
                          config.layernorm_zero_centered_gamma)
        self._norm_params(in_f)
        # this rank's slice of one full weight, as Megatron's CPU initialisation does (the
        # same draw on every rank); biases drawn (Megatron zeroes them) so that one added
        # twice shows
        rank = dist.get_rank(tp_group) if tp_group is not None else 0
        full = torch.empty(output_size, input_size)
        init_method(full)
        full_bias = 0.1 * torch.randn(output_size)
        if parallel_mode == "column":
            self.weight = torch.nn.Parameter(full.chunk(self.tp_size, 0)[rank].clone())
            bias_value = full_bias.chunk(self.tp_size)[rank].clone()
        else:
            self.weight = torch.nn.Parameter(full.chunk(self.tp_size, 1)[rank].clone()
                                             if parallel_mode == "row" else full)
            bias_value = full_bias
        assert self.weight.shape == (out_f, in_f)
        self.bias = torch.nn.Parameter(bias_value) if bias else None
        if self.bias is not None and parallel_mode == "row":
            self.bias.sequence_parallel = self.sequence_parallel
        for name in ("layer_norm_weight", "layer_norm_bias"):
            p = getattr(self, name, None)
            if p is not None:
                p.sequence_parallel = self.sequence_parallel

    def _norm_params(self, in_f: int) -> None:
        pass

    def forward(self, x):
        lw, lb = getattr(self, "layer_norm_weight", None), getattr(self, "layer_norm_bias",
                                                                    None)
        out = _LinearFn.apply(x, self.weight, self.bias, lw, lb, self)
        if self.gemm_bias_unfused_add:
            out = out + self.bias
        self.is_first_microbatch = False
        if self.te_return_bias:
            return out, self.bias
        return out, None


class TELayerNormColumnParallelLinear(StandInTELinear):
    """TE's `LayerNormLinear`, column-parallel, under Megatron's wrapper."""

    fused_norm = True

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kw: Any) -> None:
        super().__init__(input_size, output_size, parallel_mode="column", config=config, **kw)

    def _norm_params(self, in_f: int) -> None:
        g = torch.Generator().manual_seed(in_f)  # not ones, so a norm gradient shows
        self.layer_norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(in_f, generator=g))
        self.layer_norm_bias = (torch.nn.Parameter(0.1 * torch.randn(in_f, generator=g))
                                if self.config.normalization == "LayerNorm" else None)


class TERowParallelLinear(StandInTELinear):
    def __init__(self, input_size: int, output_size: int, *, config: Any, **kw: Any) -> None:
        kw.pop("input_is_parallel", None)
        super().__init__(input_size, output_size, parallel_mode="row", config=config, **kw)


def te_spec(core_attention: type) -> ModuleSpec:
    """`get_gpt_layer_with_transformer_engine_spec()`'s shape (megatron/core/models/gpt/
    gpt_layer_specs.py) with the stand-ins, and ``core_attention`` (TE's needs CUDA)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=TELayerNormColumnParallelLinear, core_attention=core_attention,
                    linear_proj=TERowParallelLinear, q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp)),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=TERowParallelLinear)),
            mlp_bda=get_bias_dropout_add))


def te_attention(query, key, value, attention_mask, kind: AttnMaskType,
                 scale: float | None = None, mask_with_causal: str = "ignored"):
    """Transformer Engine 2.11's `DotProductAttention` at CP=1 (no dropout, no bias, sbhd):
    query [sq, b, heads, d], key and value [skv, b, groups, d] -> [sq, b, heads*d]. Its
    mask types as TE defines them (transformer_engine/pytorch/attention/
    dot_product_attention/utils.py, `get_full_mask`: the window (-1, 0) of a causal type,
    ``swa_left``/``swa_right``), query i seeing key j where:

    - ``no_mask``: every j;
    - ``causal``: j <= i, the diagonal at the top left of the [sq, skv] matrix, whatever
      sq and skv are ("always top left");
    - ``causal_bottom_right``: j <= i + skv - sq, the diagonal at the bottom right
      ("always bottom right");
    - ``arbitrary``: where ``attention_mask`` (broadcastable to [b, heads, sq, skv], True:
      masked out) is False; the mask is required.

    A mask given with ``no_mask`` or a causal type: TE reads a mask only with the padding
    and arbitrary types (`DotProductAttention.forward`'s docstring), which is what its
    flash-attention and cuDNN backends do ("ignored", the default); its unfused backend
    adds it to the causal mask instead (`get_full_mask` ORs it in: "added"). The padding
    types (which read sequence lengths from the mask or cu_seqlens) are not stood in:
    refused."""
    if mask_with_causal not in ("ignored", "added"):
        raise ValueError(f"mask_with_causal is 'ignored' or 'added', not {mask_with_causal!r}")
    sq, b, heads, d = query.shape
    skv, groups = key.shape[0], key.shape[2]
    i = torch.arange(sq, device=query.device)[:, None]
    j = torch.arange(skv, device=query.device)[None, :]
    if kind == AttnMaskType.no_mask:
        allowed = torch.ones(sq, skv, dtype=torch.bool, device=query.device)
    elif kind == AttnMaskType.causal:
        allowed = j <= i
    elif kind == AttnMaskType.causal_bottom_right:
        allowed = j <= i + skv - sq
    elif kind == AttnMaskType.arbitrary:
        if attention_mask is None:
            raise ValueError("TE's arbitrary mask type needs an attention mask")
        allowed = torch.ones(sq, skv, dtype=torch.bool, device=query.device)
    else:
        raise ValueError(f"the TE attention stand-in runs no_mask, causal, "
                         f"causal_bottom_right and arbitrary, not {kind.name}")
    allowed = allowed[None, None]
    if attention_mask is not None and (kind == AttnMaskType.arbitrary
                                       or mask_with_causal == "added"):
        allowed = allowed & ~attention_mask.bool()
    if heads != groups:  # a group's query heads are contiguous, as Megatron lays them out
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


class TEDotProductAttention(torch.nn.Module):
    """Stand-in for Megatron's `TEDotProductAttention` (TE 2.11's `DotProductAttention`
    under Megatron's wrapper, megatron/core/extensions/transformer_engine.py), with its
    ``te_forward_mask_type`` (TE takes the mask type per call: TE >= 0.12) and
    ``qkv_format`` "sbhd".

    At CP=1: `te_attention`, TE's mask types (``mask_with_causal``: what a mask given with
    a causal type does, "ignored" as TE's flash and cuDNN backends or "added" as its
    unfused one; an attribute the tests set).

    Under context parallelism with ``cp_comm_type="p2p"``: the CP communication happens
    inside the op (TE passes K/V chunks around the ring, context_parallel.py
    ``AttnFuncWithCPAndKVP2P``); here the key and value are gathered inside the op, which
    gives the same numbers; causal only. It has no ``kv_gathered``: a plan cannot take its
    communication out, so the attention is one compute op to the plan.

    No dropout, sliding window, attention bias, packed sequences or softmax variants:
    refused."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", cp_comm_type: str | None = None,
                 softmax_scale: float | None = None, pg_collection: Any = None,
                 **_: Any) -> None:
        super().__init__()
        from megatron.core import parallel_state

        if getattr(config, "attention_dropout", 0.0):
            raise ValueError("the TE attention stand-in runs without attention dropout")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("the TE attention stand-in runs no sliding window")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("the TE attention stand-in runs the vanilla softmax")
        self.te_forward_mask_type = True
        self.qkv_format = "sbhd"
        self.attn_mask_type = attn_mask_type
        self.mask_with_causal = "ignored"
        self.cp_group = parallel_state.get_context_parallel_group()
        self.softmax_scale = softmax_scale
        self.cp_comm_type = cp_comm_type

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        from kareus.integrations.megatron.cp_attention import cp_causal_attention
        from kareus.runtime.primitives import GatherSeq

        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("the TE attention stand-in takes no attention bias or packed "
                             "sequences")
        kind = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        if cp == 1:
            return te_attention(query, key, value, attention_mask, kind,
                                self.softmax_scale, self.mask_with_causal)
        if kind != AttnMaskType.causal:
            raise ValueError(f"the TE attention stand-in runs causal CP attention, not "
                             f"{kind.name}")
        key, value = (GatherSeq.apply(t, self.cp_group, 0) for t in (key, value))
        return cp_causal_attention(query, key, value, cp, rank, self.softmax_scale)
