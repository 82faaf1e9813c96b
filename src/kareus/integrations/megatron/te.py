"""The Kareus layer on Megatron's Transformer Engine spec
(`get_gpt_layer_with_transformer_engine_spec`): its tensor-parallel linears are TE modules
(`TELayerNormColumnParallelLinear` for QKV and FC1, with the layer's norms fused into them;
`TERowParallelLinear` for the output projection and FC2).

Taking TE's communication out for a piece, the way Megatron builds communication-free TE
linears itself (megatron/core/extensions/transformer_engine.py, `TELinear.__init__`: with
``explicit_expert_comm`` it passes ``parallel_mode=None``). What this relies on, in
Transformer Engine 2.11's released sources (transformer_engine/pytorch/module/):

- ``parallel_mode`` is read at every forward (linear.py:1451, layernorm_linear.py:1568) and
  saved in the autograd context (linear.py:468, layernorm_linear.py:506). Only
  ``"row"`` all-reduces the forward output (linear.py:354-363, layernorm_linear.py:392-401)
  and only ``"column"`` all-reduces the input gradient in the backward (linear.py:744-754,
  layernorm_linear.py:760-770). So ``parallel_mode=None`` while a piece's forward runs
  takes both out, the backward's too, and changes no parameter or its layout;
- a fused `LayerNormLinear` runs its norm's backward on the all-reduced input gradient
  (layernorm_linear.py:959-989). Without that all-reduce its norm gets this rank's part:
  the layer input's gradient is still a partial sum (the schedule all-reduces it, as for
  the local modules), and so are the norm weights' (``layer_norm_weight``,
  ``layer_norm_bias``), which without sequence parallelism `partial_grad_params` names
  for the executor to sum over the TP group, once per layer backward
  (kareus.runtime.overlap_tp; under SP see below);
- a row-parallel linear that adds its bias itself (``apply_bias``: Megatron's
  ``skip_bias_add=False``) adds it after its all-reduce (``gemm_bias_unfused_add``,
  linear.py:1299-1303): without the all-reduce every rank would add it. Megatron's layer
  builds its row-parallel linears with ``skip_bias_add=True``; anything else is refused;
- under sequence parallelism a column-parallel linear all-gathers its input along the
  sequence (a fused one: its norm's output, ``ln_out``) only when ``parallel_mode ==
  "column"`` (linear.py:146, :213; layernorm_linear.py:151, :246-283), and again for its
  weight gradient in the backward (linear.py:381-383, :668; layernorm_linear.py:416-418,
  :688), where it reduce-scatters its input gradient instead of all-reducing it
  (linear.py:747-748, layernorm_linear.py:763-764); a row-parallel one reduce-scatters its
  output only when ``parallel_mode == "row"`` (linear.py:354-358, layernorm_linear.py:392-396)
  and all-gathers its output gradient (base.py:1113-1119). So ``parallel_mode=None`` takes
  these out too, and the SP schedule (kareus.runtime.overlap_sp) gathers the identity norm
  piece's output, i.e. the PRE-norm input: the core's fused norm then normalises the whole
  gathered sequence, token by token, which is what normalising each shard and gathering
  gives. Its weights' gradients are then each rank's share (the partial input gradient over
  the whole sequence), whose sum over the TP group is the full gradient; TE marks them
  ``sequence_parallel`` (layernorm_linear.py:1442-1444) and Megatron's
  `finalize_model_grads` sums exactly the parameters so marked, so under SP they are not
  summed here (that would count them twice);
- userbuffers (``ub_*``, ``tp_comm_overlap``) change what TE communicates and where;
  refused here (userbuffers are sized for the whole microbatch and fixed per GEMM).

So with TE's modules a layer's pieces are: an identity "norm" piece (``input_layernorm``
and ``pre_mlp_layernorm`` are `IdentityOp` in the TE spec) and a core piece that starts
with the fused norm. The schedule's boundaries, collectives and slots are unchanged.

Transformer Engine does not install or import without CUDA. The CPU tests run this adapter
on a stand-in with exactly these attributes and semantics
(tests/integrations/megatron/te_standin.py). It has not run on a GPU until
``scripts/gpu_check.py --megatron-te`` has (docs/megatron.md).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from kareus.errors import SpecError

NOT_RUN_ON_GPU = ("the Kareus layer's Transformer Engine path has not run on a GPU until "
                  "scripts/gpu_check.py --megatron-te has (docs/megatron.md)")
_warned = False

LINEARS = (("self_attention", "linear_qkv", "column"), ("self_attention", "linear_proj", "row"),
           ("mlp", "linear_fc1", "column"), ("mlp", "linear_fc2", "row"))
"""The layer's tensor-parallel linears and the ``parallel_mode`` Megatron builds them with."""

_UB_FLAGS = ("ub_overlap_rs_fprop", "ub_overlap_ag_dgrad", "ub_overlap_ag_fprop",
             "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_overlap_ag",
             "ub_overlap_rs")
"""TE's userbuffers flags (linear.py:1141-1166, layernorm_linear.py:1211-1237)."""


def is_te_linear(module: Any) -> bool:
    """A Transformer Engine linear (Megatron's TE wrappers subclass TE's `Linear` and
    `LayerNormLinear`, which have ``parallel_mode``; Megatron's local linears have not)."""
    return hasattr(module, "parallel_mode") and hasattr(module, "tp_size")


def is_te_attention(module: Any) -> bool:
    """Megatron's `TEDotProductAttention` (TE's `DotProductAttention` under Megatron's
    wrapper, megatron/core/extensions/transformer_engine.py): the wrapper's
    ``te_forward_mask_type`` (whether TE takes the mask type per call), which Megatron's
    local `DotProductAttention` and the CPU core attentions have not. By attribute, so
    that TE is never imported here (it does not import without CUDA)."""
    return hasattr(module, "te_forward_mask_type")


def check_config(config: Any) -> None:
    """What a plan cannot run on TE's modules, in one line with what it can."""
    problems = []
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        problems.append("FP8/FP4 (TE's scaling factors are reduced per GEMM call over the "
                        "TP group; per nanobatch they would change)")
    if getattr(config, "tp_comm_overlap", False):
        problems.append("tp_comm_overlap (TE's userbuffers are sized for the whole "
                        "microbatch and fixed per GEMM)")
    if problems:
        raise SpecError(f"a Kareus plan cannot run Transformer Engine's layer with "
                        f"{'; '.join(problems)}; supported: Transformer Engine's spec at TP "
                        f"with or without sequence parallelism, bf16/fp16/fp32, no or full "
                        f"recompute")


class TEAdapter:
    """A `KareusTransformerLayer`'s Transformer Engine linears: checked once, their
    communication taken out for the duration of a piece (`without_communication`)."""

    def __init__(self, layer: Any) -> None:
        check_config(layer.config)
        self.linears: list[tuple[str, Any, str]] = []
        wrong = []
        for parent, name, mode in LINEARS:
            module: Any = getattr(getattr(layer, parent, None), name, None)
            if not is_te_linear(module):
                wrong.append(f"{name} is {type(module).__name__}, not a Transformer Engine "
                             f"linear")
                continue
            if module.parallel_mode != mode:
                wrong.append(f"{name} has parallel_mode={module.parallel_mode!r}, not {mode!r}")
            ub = [f for f in _UB_FLAGS if getattr(module, f, False)]
            if ub:
                wrong.append(f"{name} uses userbuffers ({', '.join(ub)})")
            if mode == "row" and getattr(module, "apply_bias", False):
                wrong.append(f"{name} adds its bias after its all-reduce (skip_bias_add=False)")
            self.linears.append((name, module, mode))
        if wrong:
            raise SpecError(f"a Kareus plan cannot run on this layer's Transformer Engine "
                            f"modules ({'; '.join(wrong)}); supported: Megatron's TE spec "
                            f"(get_gpt_layer_with_transformer_engine_spec), dense MLP")
        norm_params: list[Any] = [
            p for _, m, mode in self.linears if mode == "column"
            for p in (getattr(m, "layer_norm_weight", None), getattr(m, "layer_norm_bias", None))
            if isinstance(p, torch.nn.Parameter) and p.requires_grad]
        self.sequence_parallel = any(getattr(m, "sequence_parallel", False)
                                     for _, m, _ in self.linears)
        if self.sequence_parallel:
            for p in norm_params:  # as TE marks them (layernorm_linear.py:1442-1444)
                p.sequence_parallel = True
        self.partial_grad_params: list[torch.nn.Parameter] = (
            [] if self.sequence_parallel else norm_params)
        """The fused norms' weights, whose gradients come out of a piece partial and
        nothing else sums: without SP (under SP each rank's is its share, which
        Megatron's `finalize_model_grads` sums over the TP group)."""
        global _warned
        if not _warned:
            _warned = True
            warnings.warn(NOT_RUN_ON_GPU, stacklevel=3)

    @contextlib.contextmanager
    def without_communication(self) -> Iterator[None]:
        """TE's linears with ``parallel_mode=None`` (no all-reduce, and under SP no
        all-gather or reduce-scatter, forward or backward: the backward follows the mode
        its forward saw); restored after the piece."""
        saved = [m.parallel_mode for _, m, _ in self.linears]
        try:
            for _, m, _ in self.linears:
                m.parallel_mode = None
            yield
        finally:
            for (_, m, _), mode in zip(self.linears, saved):
                m.parallel_mode = mode


def adapter(layer: Any) -> TEAdapter | None:
    """The TE adapter of ``layer`` (checked), or None where none of its tensor-parallel
    linears is a Transformer Engine module (Megatron's local spec)."""
    found = [getattr(getattr(layer, parent, None), name, None) for parent, name, _ in LINEARS]
    if not any(is_te_linear(m) for m in found):
        return None
    return TEAdapter(layer)
