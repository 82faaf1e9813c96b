"""The Kareus layer on Megatron's Transformer Engine spec against Megatron's own TE layer,
on one GPU (scripts/gpu_check.py --megatron-te; docs/gpu-check.md, docs/megatron.md).

At TP=1 with a rank's shapes of the job (the heads, query groups and FFN of one TP rank):

- numerics, in fp32 (TF32 off): Megatron's `TransformerLayer` from
  `get_gpt_layer_with_transformer_engine_spec()` against the Kareus layer from the same
  spec and seed, without a plan, with a plan that overlaps nothing and with one at every
  partition's middle slot: the largest relative error of the output, the input gradient
  and every parameter gradient;
- time, in bf16: forward and backward of Megatron's TE layer, of the Kareus layer without
  a plan and of the Kareus layer with the plan that overlaps nothing (every collective at
  its partition's end, so only the nanobatch split, the hooks and the piecewise backward
  differ), alternating run by run, medians; the overhead target is under 3%.

Transformer Engine needs CUDA; on the CPU (tests, ``--fake-device``) the caller passes a
spec of stand-in modules and the numbers only show that the code runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from kareus.core import PartitionSetting
from kareus.errors import KareusError
from kareus.integrations.megatron.overhead import median_times_s
from kareus.integrations.megatron.profiling import _megatron_state
from kareus.job.spec import JobSpec
from kareus.runtime.layer_plan import LayerPlan
from kareus.workload.workload import Workload


def te_spec_or_refuse(qk_layernorm: bool) -> Any:
    """Megatron's TE layer spec, or one line where Transformer Engine does not import."""
    from megatron.core.models.gpt import gpt_layer_specs

    if not gpt_layer_specs.HAVE_TE:
        raise KareusError("--megatron-te needs Transformer Engine, which does not import "
                          "here (pip install transformer-engine[pytorch] on a CUDA machine)")
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
        qk_layernorm=qk_layernorm)


def _config(job: JobSpec, dtype: torch.dtype, cuda: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, tp = job.model, job.tp
    return TransformerConfig(
        num_layers=1, hidden_size=m.hidden_size,
        num_attention_heads=max(1, m.num_attention_heads // tp),
        num_query_groups=max(1, m.num_kv_heads // tp), kv_channels=m.head_dim,
        ffn_hidden_size=max(1, m.ffn_hidden_size // tp), normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=m.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=not cuda,
        tensor_model_parallel_size=1, bias_dropout_fusion=False,
        transformer_impl="transformer_engine")


def _pair(spec: Any, job: JobSpec, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """Megatron's layer and the Kareus layer from ``spec``, the same seed."""
    from megatron.core.transformer.spec_utils import build_module

    from kareus.integrations.megatron.spec import kareus_layer_spec

    cfg = _config(job, dtype, device.startswith("cuda"))
    layers = []
    for s in (spec, kareus_layer_spec(spec)):
        torch.manual_seed(0)
        if device.startswith("cuda"):
            torch.cuda.manual_seed(0)
        layers.append(build_module(s, config=cfg, layer_number=1).to(device).train())
    return layers[0], layers[1]


def _plans(job: JobSpec) -> dict[str, LayerPlan]:
    parts = Workload.build(job).partitions.partitions
    return {"no overlap": LayerPlan.from_partitions(
                parts, {k: PartitionSetting(0, None) for k in parts}),
            "middle slots": LayerPlan.from_partitions(
                parts, {k: PartitionSetting(0, p.slots[len(p.slots) // 2].name)
                        for k, p in parts.items()})}


def _inputs(job: JobSpec, device: str, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    from kareus.integrations.megatron.cpu import rotary_embedding

    g = torch.Generator().manual_seed(1)
    shape = (job.seq_length, job.micro_batch_size, job.model.hidden_size)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    emb = rotary_embedding(job.model.head_dim, job.seq_length).to(device)
    return x, dy, emb


def _run(layer: Any, x: Any, dy: Any, emb: Any) -> list[Any]:
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out, _ = layer(xi, attention_mask=None, rotary_pos_emb=emb)
    out.backward(dy)
    return [out.detach(), xi.grad] + [p.grad for p in layer.parameters()
                                      if p.grad is not None]


def _rel(a: Any, b: Any) -> float:
    return float(((a.float() - b.float()).abs().max()
                  / b.float().abs().max().clamp_min(1e-30)).item())


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def te_layer_check(job: JobSpec, device: str, reps: int = 20, warmup: int = 3,
                   spec: Any = None) -> dict[str, Any]:
    """Numerics (fp32) and forward+backward medians (bf16 on CUDA, fp32 on the CPU) of
    Megatron's TE layer and the Kareus layer on the same spec (`te_spec_or_refuse`'s when
    ``spec`` is None)."""
    cuda = device.startswith("cuda")
    _megatron_state(0, cuda)
    if spec is None:
        spec = te_spec_or_refuse(job.model.qk_norm)
    plans = _plans(job)

    with _no_tf32():
        plain, kareus = _pair(spec, job, device, torch.float32)
        same_params = all(torch.equal(a, b) for a, b in
                          zip(plain.parameters(), kareus.parameters()))
        x, dy, emb = _inputs(job, device, torch.float32)
        ref = _run(plain, x, dy, emb)
        errors = {"no plan": max(_rel(a, b) for a, b in zip(_run(kareus, x, dy, emb), ref))}
        for name, p in plans.items():
            kareus.set_kareus_plan(p)
            errors[name] = max(_rel(a, b) for a, b in zip(_run(kareus, x, dy, emb), ref))
        kareus.set_kareus_plan(None)
    del plain, kareus, ref

    dtype = torch.bfloat16 if cuda else torch.float32
    plain, kareus = _pair(spec, job, device, dtype)
    x, dy, emb = _inputs(job, device, dtype)

    def arm(layer: Any, plan: LayerPlan | None) -> Callable[[], None]:
        def go() -> None:
            if layer is kareus:
                layer.set_kareus_plan(plan)
            _run(layer, x, dy, emb)
        return go

    arms = {"megatron": arm(plain, None), "kareus_no_plan": arm(kareus, None),
            "kareus_plan": arm(kareus, plans["no overlap"])}
    med = {k: s * 1e3 for k, s in median_times_s(arms, device, reps, warmup).items()}
    kareus.set_kareus_plan(None)
    return {"same_params": same_params, "errors_fp32": errors,
            "megatron_ms": med["megatron"], "kareus_no_plan_ms": med["kareus_no_plan"],
            "kareus_plan_ms": med["kareus_plan"],
            "overhead": med["kareus_plan"] / med["megatron"] - 1.0,
            "overhead_no_plan": med["kareus_no_plan"] / med["megatron"] - 1.0,
            "reps": reps, "dtype": str(dtype).removeprefix("torch."),
            "tokens": job.seq_length * job.micro_batch_size,
            "modules": sorted({type(m).__name__ for m in kareus.modules()
                               if hasattr(m, "parallel_mode")})}
