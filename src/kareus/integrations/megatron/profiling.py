"""The ``megatron`` runtime of the nvml and fakegpu backends (kareus.gpu.runtimes): a
partition's compute measured with Megatron-Core's own modules, the kernels a Megatron-Core
training runs, instead of the project's own kernels.

One `KareusTransformerLayer` is built from Megatron's local GPT layer spec at the job's
per-rank shapes: tensor-parallel size 1 with the heads, query groups and FFN of one TP rank
(hidden/heads/TP ... exactly the GEMMs, attention and norms a rank of a TP group runs;
the collective is the backend's: real over the group under torchrun, a stand-in copy on one
GPU). A partition runs through the same pieces as the training executor
(`MegatronLayerOps`, kareus.runtime.overlap_tp) on one nanobatch (half the microbatch's
samples, or of its sequence):

- a forward partition: its residual, norm and core under ``torch.no_grad()`` (a forward
  instruction under full recompute keeps no graph), with the slot hook launching the
  collective before the op the slot names;
- a backward partition: its pieces' graphs are built once, with grad, and differentiated
  again on every run (``retain_graph``): the norm backward it starts with (``bwd_mlp``:
  the next layer's input norm; ``bwd_attn``: the MLP norm), then its core; the residual
  backwards are additions of gradients, not run. The collective is launched by a gradient
  hook on the tensor whose backward the slot names, or at the start for a norm slot.

With a sequence split (micro-batch size 1, issue 37) a nanobatch is the sample's half of
the sequence (seq/2 tokens, `LayerShapes`), and the attention partitions are per
nanobatch (``Partition.nanobatch``), run through `MegatronSeqOps.attn_partial_kv` as the
executor runs them: nanobatch 0's causal over its half (its core also outputs its key and
value, whose gradients, from nanobatch 1's backward, its backward takes), nanobatch 1's
against nanobatch 0's kept key and value and its own (causal shifted by seq/2; its
backward differentiates into nanobatch 0's key and value too).

With sequence parallelism the norms form partitions of their own (``ln1``: the MLP
residual and the input norm; ``ln2``: the attention residual and the MLP norm), run on a
rank's part of the sequence (seq/TP tokens), and the cores (``attn``, ``mlp``) on the
whole sequence, as `OverlappedSP` runs them (kareus.runtime.overlap_sp).

With context parallelism (all-gather CP), the partitions are those of
`kareus.runtime.overlap_cp_ops` run through `MegatronCPOps`, at the shapes of CP rank 0:
its hidden states are its two load-balanced chunks (seq/CP tokens, with their rotary
positions), the key and value the core attention sees the whole sequence's (seq tokens, as
the all-gather gives them; `KareusCPCoreAttention.kv_gathered`). The load balancing gives
every rank the same attention work, so rank 0's is every rank's. Forward: ``qkv`` (the MLP
residual, the input norm, QKV and rotary), ``ao`` (the core attention on the gathered key
and value, the output projection), ``mlp`` (as TP's). Backward: ``mlp`` (as TP's), ``o``
(the MLP norm's and the output projection's backward), ``a`` (the core attention rebuilt on
the gathered key and value and differentiated, on every run, as the executor does: the
forward does not keep it) and ``qkv`` (rotary and QKV backward on the reduce-scattered key
and value gradients).

The collective runs on a side stream on CUDA (`kareus.gpu.partition_runner.SideStream`),
in line on the CPU.

On the CPU (fakegpu), Megatron's attention and rotary embedding need CUDA, so the layer
uses `SDPACoreAttention` and the rotary tensor of `kareus.integrations.megatron.cpu`, and
fp32; on GPUs Megatron's own, in bf16. Under CP the core attention is Kareus's CP one
(`KareusCPCoreAttention`) on every device, as Megatron-Core training with Kareus's spec
runs it. Megatron needs its parallel state: where
torch.distributed is not initialised (one process), a one-rank gloo group is made for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from kareus.errors import SpecError
from kareus.gpu.partition_runner import SideStream
from kareus.gpu.runtimes import Collective, KernelRuntime, Runner
from kareus.integrations.megatron.layer import KareusTransformerLayer
from kareus.integrations.megatron.ops import MegatronCPOps, MegatronLayerOps
from kareus.integrations.megatron.order import check_job
from kareus.integrations.megatron.profiling_runs import BackwardRunner, ForwardRunner
from kareus.integrations.megatron.seq_split import MegatronSeqOps
from kareus.job.spec import JobSpec
from kareus.runtime.overlap import Taps
from kareus.runtime.overlap_tp import no_slot
from kareus.runtime.pieces import Before
from kareus.workload.layer import LayerShapes
from kareus.workload.partition import Partition

SEGMENTS = {False: ("attn", "mlp"), True: ("ln1", "attn", "ln2", "mlp")}
"""The segments partitions compute, without and with sequence parallelism."""
CP_SEGMENTS = {"forward": ("qkv", "ao", "mlp"), "backward": ("mlp", "o", "a", "qkv")}
"""The segments of context parallelism's partitions (kareus.runtime.overlap_cp_ops)."""


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
    """One Kareus layer with the job's per-rank shapes (TP=1, a rank's heads and FFN);
    under CP its core attention computes as CP rank 0 of the job's CP group."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from kareus.integrations.megatron.cp_attention import KareusCPCoreAttention
    from kareus.integrations.megatron.cpu import SDPACoreAttention, with_core_attention
    from kareus.integrations.megatron.spec import kareus_layer_spec

    cuda = device.startswith("cuda")
    _megatron_state(0, cuda)
    m, tp = job.model, job.tp
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=m.qk_norm)
    if job.cp_partitions:
        spec = with_core_attention(spec, KareusCPCoreAttention)
    elif not cuda:
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
    if job.cp_partitions:
        # one process has no CP group (the module sees size 1): the core attention
        # computes as rank 0 of the job's, on the key and value the schedule hands it
        # (only inside kv_gathered(), where the group itself is never used)
        core = layer.self_attention.core_attention
        core.cp, core.cp_rank = job.cp, 0
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
        if job.cp_ring:
            raise SpecError("the megatron runtime measures all-gather context parallelism "
                            "(cp_comm_type allgather, Kareus's CP core attention); "
                            "Transformer Engine's ring (p2p) does not run in one process; "
                            "use --runtime kernels")

    def __init__(self, job: JobSpec, device: str) -> None:
        self.check_job(job)
        self.job, self.device = job, device
        self._kernels: KernelRuntime | None = None
        self.layer = rank_layer(job, device)
        dtype = next(self.layer.parameters()).dtype
        # a nanobatch's shapes, as the planner's graph has them: half of the microbatch's
        # samples, or (a sequence split, micro-batch size 1) its one sample's half of the
        # sequence; under CP a rank's two load-balanced chunks (seq/CP tokens)
        shapes = LayerShapes(job)
        half, tokens = shapes.b, shapes.s_local
        self.cp = job.cp if job.cp_partitions else 1
        self.seq = job.sequence_split
        g = torch.Generator().manual_seed(0)

        def new(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float32).to(
                device=device, dtype=dtype)

        h = job.model.hidden_size
        self.x, self.r, self.grad = new(tokens, half, h), new(tokens, half, h), new(
            tokens, half, h)
        # under SP, the norms' and residuals' tokens: this rank's part of the sequence
        shard = tokens // job.tp if job.sequence_parallel else tokens
        self.xs, self.rs, self.grads = (t[:shard] for t in (self.x, self.r, self.grad))
        self.sp = job.sequence_parallel
        from kareus.integrations.megatron.cp_attention import load_balanced
        from kareus.integrations.megatron.cpu import rotary_embedding

        # CP rank 0's positions, as Megatron's RotaryEmbedding gives a CP rank its own
        emb = load_balanced(rotary_embedding(job.model.head_dim, job.seq_length),
                            self.cp, 0).to(device)
        kwargs = {"attention_mask": None, "rotary_pos_emb": emb}
        self.ops: MegatronLayerOps
        if self.seq:
            # the whole sequence's ops: each nanobatch's attention cuts the rotary
            # embedding to its rows (MegatronSeqOps.attn_partial_kv)
            self.ops = seq_ops = MegatronSeqOps(self.layer, kwargs, half)
            with torch.no_grad():  # nanobatch 0's key and value, which nanobatch 1 reads
                _, k0, v0 = seq_ops.attn_partial_kv(seq_ops.attn_norm(self.x), None,
                                                    no_slot, {})
            self.past = (k0.detach(), v0.detach())
            # their gradients, which nanobatch 1's backward gives nanobatch 0's
            self.past_grad = (new(*k0.shape), new(*v0.shape))
            return
        if self.cp == 1:
            self.ops = MegatronLayerOps(self.layer, kwargs, half)
            return
        self.ops = cp_ops = MegatronCPOps(self.layer, kwargs, half)
        with torch.no_grad():  # this rank's query, key and value at their shapes
            q, k, v = cp_ops.qkv_partial(cp_ops.attn_norm(self.x), no_slot, {})
        self.q = q.detach()
        # the key and value as the all-gather gives them (one tensor: the executor
        # gathers both in one collective), the whole sequence's
        self.kv_full = torch.cat([new(job.seq_length, *k.shape[1:]),
                                  new(job.seq_length, *v.shape[1:])], dim=-1)
        self.dq = new(*q.shape)
        self.do = new(*q.flatten(2).shape)  # the core attention output's gradient
        # this rank's key and value gradients, as the reduce-scatter gives them
        self.dkv = torch.cat([new(*k.shape), new(*v.shape)], dim=-1)

    def runner(self, partition: Partition, slot: str | None, collective: Collective
               ) -> Runner:
        if partition.key.startswith("overlap_"):
            # the unsplit layer's weight-gradient GEMM beside its gradient's collective
            # (a unit outside partitions, kareus.workload.partition): one GEMM, no
            # layer piece of Megatron's runs it alone; the project's kernel at its shape
            if self._kernels is None:
                self._kernels = KernelRuntime(self.job, self.device)
            return self._kernels.runner(partition, slot, collective)
        index = partition.launch_index(slot)
        launch_op = (partition.compute_ops[index].name
                     if index < len(partition.compute_ops) else None)
        if self.cp > 1:
            segments = CP_SEGMENTS[partition.direction]
            segment = f"cp_{partition.segment}" if partition.segment != "mlp" else "tp_mlp"
        else:
            segments = SEGMENTS[self.sp]
            segment = partition.segment if self.sp else f"tp_{partition.segment}"
        if partition.segment not in segments:
            raise ValueError(f"the megatron runtime runs partitions of the segments "
                             f"{', '.join(segments)}, not {partition.key}")
        nanobatch = partition.nanobatch
        if self.seq and segment == "tp_attn" and nanobatch is None:
            raise ValueError(f"a sequence split's attention partitions are per nanobatch "
                             f"(fwd_attn_nb0, fwd_attn_nb1, ...), not {partition.key}")
        side = SideStream(collective, self.device)
        if partition.direction == "forward":
            return ForwardRunner(self, segment, launch_op, side, nanobatch)
        return BackwardRunner(self, segment, launch_op, side, nanobatch)

    def attention(self, a: Tensor, nanobatch: int | None, before: Before, taps: Taps,
                  past: tuple[Tensor, Tensor] | None = None
                  ) -> tuple[Tensor, Tensor, Tensor] | Tensor:
        """The attention core (QKV to the partial output projection) of ``nanobatch`` on
        ``a``, as the executor runs it. A sequence split: nanobatch 0's returns its key
        and value too (nanobatch 1 reads them); nanobatch 1's reads ``past`` (nanobatch
        0's kept key and value; default: this runtime's)."""
        if not self.seq:
            return self.ops.attn_partial(a, before, taps)
        ops = self.ops
        assert isinstance(ops, MegatronSeqOps)
        if nanobatch == 1:
            out, _k, _v = ops.attn_partial_kv(a, past or self.past, before, taps)
            return out
        return ops.attn_partial_kv(a, None, before, taps)
