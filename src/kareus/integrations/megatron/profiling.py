"""The ``megatron`` runtime of the nvml and fakegpu backends (kareus.gpu.runtimes): a
partition's compute measured with Megatron-Core's own modules, the kernels a Megatron-Core
training runs, instead of the project's own kernels.

One `KareusTransformerLayer` is built from Megatron's local GPT layer spec at the job's
per-rank shapes: tensor-parallel size 1 with the heads, query groups and FFN of one TP rank
(hidden/heads/TP ... exactly the GEMMs, attention and norms a rank of a TP group runs;
the collective is the backend's: real over the group under torchrun, a stand-in copy on one
GPU). A partition runs through the same pieces as the training executor
(`MegatronLayerOps`, kareus.runtime.overlap_tp) on one nanobatch (half the microbatch):

- a forward partition: its residual, norm and core under ``torch.no_grad()`` (a forward
  instruction under full recompute keeps no graph), with the slot hook launching the
  collective before the op the slot names;
- a backward partition: its pieces' graphs are built once, with grad, and differentiated
  again on every run (``retain_graph``): the norm backward it starts with (``bwd_mlp``:
  the next layer's input norm; ``bwd_attn``: the MLP norm), then its core; the residual
  backwards are additions of gradients, not run. The collective is launched by a gradient
  hook on the tensor whose backward the slot names, or at the start for a norm slot.

With sequence parallelism the norms form partitions of their own (``ln1``: the MLP
residual and the input norm; ``ln2``: the attention residual and the MLP norm), run on a
rank's part of the sequence (seq/TP tokens), and the cores (``attn``, ``mlp``) on the
whole sequence, as `OverlappedSP` runs them (kareus.runtime.overlap_sp).
The collective runs on a side stream on CUDA (`kareus.gpu.partition_runner.SideStream`),
in line on the CPU.

On the CPU (fakegpu), Megatron's attention and rotary embedding need CUDA, so the layer
uses `SDPACoreAttention` and the rotary tensor of `kareus.integrations.megatron.cpu`, and
fp32; on GPUs Megatron's own, in bf16. Megatron needs its parallel state: where
torch.distributed is not initialised (one process), a one-rank gloo group is made for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from kareus.errors import SpecError
from kareus.gpu.partition_runner import SideStream
from kareus.gpu.runtimes import Collective, Runner
from kareus.integrations.megatron.layer import KareusTransformerLayer
from kareus.integrations.megatron.ops import MegatronLayerOps
from kareus.integrations.megatron.order import check_job
from kareus.job.spec import JobSpec
from kareus.runtime.overlap import BACKWARD_TAPS, Taps
from kareus.runtime.overlap_tp import no_slot
from kareus.workload.partition import Partition

SEGMENTS = {False: ("attn", "mlp"), True: ("ln1", "attn", "ln2", "mlp")}
"""The segments partitions compute, without and with sequence parallelism."""


def _megatron_state(seed: int, cuda: bool) -> None:
    """Megatron's parallel state, at TP=1, once per process."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not cuda)


def rank_layer(job: JobSpec, device: str) -> KareusTransformerLayer:
    """One Kareus layer with the job's per-rank shapes (TP=1, a rank's heads and FFN)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus.integrations.megatron.cpu import SDPACoreAttention, with_core_attention
    from kareus.integrations.megatron.spec import kareus_layer_spec

    cuda = device.startswith("cuda")
    _megatron_state(0, cuda)
    m, tp = job.model, job.tp
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=m.qk_norm)
    if not cuda:
        spec = with_core_attention(spec, SDPACoreAttention)
    dtype = torch.bfloat16 if cuda else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=m.hidden_size,
        num_attention_heads=max(1, m.num_attention_heads // tp),
        num_query_groups=max(1, m.num_kv_heads // tp), kv_channels=m.head_dim,
        ffn_hidden_size=max(1, m.ffn_hidden_size // tp), normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=m.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=cuda, use_cpu_initialization=not cuda,
        tensor_model_parallel_size=1)
    layer = build_module(kareus_layer_spec(spec), config=config, layer_number=1)
    layer.to(device)
    layer.train()
    layer._hook_submodules()
    return layer


class MegatronRuntime:
    """Runners over one rank-shaped Megatron layer, its inputs allocated once."""

    name = "megatron"

    @staticmethod
    def check_job(job: JobSpec) -> None:
        check_job(job)
        if job.cp > 1:
            raise SpecError("the megatron runtime does not measure context parallelism's "
                            "partitions yet; use --runtime kernels")

    def __init__(self, job: JobSpec, device: str) -> None:
        check_job(job)
        self.job, self.device = job, device
        self.layer = rank_layer(job, device)
        dtype = next(self.layer.parameters()).dtype
        half = max(1, job.micro_batch_size // 2)
        g = torch.Generator().manual_seed(0)

        def new() -> Tensor:
            return torch.randn(job.seq_length, half, job.model.hidden_size, generator=g,
                               dtype=torch.float32).to(device=device, dtype=dtype)

        self.x, self.r, self.grad = new(), new(), new()
        # under SP, the norms' and residuals' tokens: this rank's part of the sequence
        shard = job.seq_length // job.tp if job.sequence_parallel else job.seq_length
        self.xs, self.rs, self.grads = (t[:shard] for t in (self.x, self.r, self.grad))
        self.sp = job.sequence_parallel
        from kareus.integrations.megatron.cpu import rotary_embedding

        emb = rotary_embedding(job.model.head_dim, job.seq_length).to(device)
        self.ops = MegatronLayerOps(self.layer, {"attention_mask": None,
                                                 "rotary_pos_emb": emb}, half)

    def runner(self, partition: Partition, slot: str | None, collective: Collective
               ) -> Runner:
        index = partition.launch_index(slot)
        launch_op = (partition.compute_ops[index].name
                     if index < len(partition.compute_ops) else None)
        segments = SEGMENTS[self.sp]
        if partition.segment not in segments:
            raise ValueError(f"the megatron runtime runs partitions of the segments "
                             f"{', '.join(segments)}, not {partition.key}")
        side = SideStream(collective, self.device)
        segment = partition.segment if self.sp else f"tp_{partition.segment}"
        if partition.direction == "forward":
            return _ForwardRunner(self, segment, launch_op, side)
        return _BackwardRunner(self, segment, launch_op, side)


class _ForwardRunner:
    """``segment``: "tp_attn", "tp_mlp" (norm and core), or under SP "ln1", "attn",
    "ln2", "mlp"."""

    def __init__(self, rt: MegatronRuntime, segment: str, launch_op: str | None,
                 side: SideStream) -> None:
        self.rt, self.segment, self.launch_op, self.side = rt, segment, launch_op, side
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
            if seg in ("tp_attn", "ln1"):
                x, r = (rt.x, rt.r) if seg == "tp_attn" else (rt.xs, rt.rs)
                self._before("residual_mlp")
                x = ops.mlp_residual(x, r)
                self._before("input_norm")
                a = ops.attn_norm(x)
                if seg == "tp_attn":
                    ops.attn_partial(a, self._before, taps)
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


class _BackwardRunner:
    """The partition's pieces built once with grad; each run differentiates them again."""

    def __init__(self, rt: MegatronRuntime, segment: str, launch_op: str | None,
                 side: SideStream) -> None:
        self.rt, self.segment, self.launch_op, self.side = rt, segment, launch_op, side
        ops = rt.ops
        self.params = [p for p in rt.layer.parameters() if p.requires_grad]
        self.launched = False
        tap = BACKWARD_TAPS.get(launch_op or "")
        self.norm: tuple[Tensor, Tensor] | None = None
        self.core: tuple[Tensor, Tensor] | None = None
        taps: Taps = {}
        with torch.enable_grad():
            if segment in ("tp_mlp", "ln1"):  # the (next layer's) input-norm backward
                r = rt.r if segment == "tp_mlp" else rt.rs
                x = r.detach().requires_grad_(True)
                self.norm = (x, ops.attn_norm(x))
            elif segment in ("tp_attn", "ln2"):  # the MLP norm's backward
                x = rt.x if segment == "tp_attn" else rt.xs
                h = x.detach().requires_grad_(True)
                self.norm = (h, ops.mlp_norm(h))
            if segment in ("tp_mlp", "mlp"):
                bn = (ops.mlp_norm(rt.x) if segment == "tp_mlp" else rt.x)
                bn = bn.detach().requires_grad_(True)
                self.core = (bn, ops.mlp_partial(bn, no_slot, taps))
            elif segment in ("tp_attn", "attn"):
                a = ops.attn_norm(rt.r) if segment == "tp_attn" else rt.x
                a = a.detach().requires_grad_(True)
                self.core = (a, ops.attn_partial(a, no_slot, taps))
        self.hooked = tap is not None and tap in taps
        if self.hooked:
            tapped = taps[str(tap)]
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
        if self.launch_op is not None and not self.hooked:  # a norm slot: at the start
            self._launch()
        if self.norm is not None:  # the norm backward the partition starts with
            x, normed = self.norm
            grad = self.rt.grad if x.shape == self.rt.grad.shape else self.rt.grads
            torch.autograd.grad(normed, [x, *self.params], grad, retain_graph=True,
                                allow_unused=True)
        if self.core is not None:
            core_in, core_out = self.core
            torch.autograd.grad(core_out, [core_in, *self.params], self.rt.grad,
                                retain_graph=True, allow_unused=True)
        self._launch()  # slot "none", or a tap this run did not reach: at the end
        self.side.join()

    def synchronize(self) -> None:
        self.side.synchronize()

