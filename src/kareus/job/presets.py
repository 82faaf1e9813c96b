"""Named models and jobs.

Model shapes are the public Hugging Face configs (docs/anchors.md §5). Job presets `kareus-1` ...
`kareus-10` are the ten workloads evaluated in the Kareus paper, in the order docs/anchors.md §4
lists them: A100 SXM4 40GB, 2 AWS p4d.24xlarge nodes x 8 GPUs, PP=2 with 15/13 layers,
8 microbatches, bf16, no sequence parallelism, full uniform activation recompute, the
artifact's training settings (`ARTIFACT_TRAINING`: hidden dropout 0.1, unfused gradient
accumulation, Transformer Engine's fused cross-entropy). `llama3.1-8b-h100-mbs1` and
`llama3.3-70b-h100-mbs1` are micro-batch 1 (the sequence split) as close to NVIDIA's public
dgxc-benchmarking Llama 3.1 rows (docs/anchors.md §8) as Kareus runs: the comments below say
how each differs and why (`kareus compare --suite mbs1`, docs/comparison.md).
"""

from __future__ import annotations

from typing import Any

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama3.2-3b": dict(
        name="llama3.2-3b",
        hidden_size=3072,
        num_layers=28,
        num_attention_heads=24,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=8192,
        vocab_size=128256,
    ),
    "qwen3-1.7b": dict(
        name="qwen3-1.7b",
        hidden_size=2048,
        num_layers=28,
        num_attention_heads=16,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=6144,
        vocab_size=151936,
        qk_norm=True,
    ),
    "llama3.1-8b": dict(
        name="llama3.1-8b",
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=14336,
        vocab_size=128256,
    ),
    "llama3.3-70b": dict(
        name="llama3.3-70b",
        hidden_size=8192,
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=28672,
        vocab_size=128256,
    ),
}

_PAPER_CLUSTER: dict[str, Any] = dict(
    pp=2,
    layers_per_stage=(15, 13),
    num_microbatches=8,
    gpu="A100-40GB",
    gpus_per_node=8,
    nodes=2,
    node="p4d.24xlarge",  # 400 Gb/s EFA per node (docs/anchors.md §4, §9)
    recompute=True,
    sequence_parallel=False,
)


ARTIFACT_TRAINING: dict[str, Any] = dict(
    hidden_dropout=0.1,
    attention_dropout=0.0,
    bias_dropout_fusion=True,
    gradient_accumulation_fusion=False,
    apply_rope_fusion=True,
    bias_activation_fusion=True,
    cross_entropy_loss_fusion=True,
    cross_entropy_fusion_impl="te",
)
"""The training settings of the Kareus artifact's Megatron config (docs/anchors.md §4:
tests/artifact/conf/megatron_llama3.2_3b_config.yaml; it writes bias_dropout_add_fusion).
An assumption for all ten paper presets: that config is Llama 3.2 3B's (kareus-1's
shape), the only one cited; the others (Qwen3 1.7B, other TP/CP shapes) are assumed to
run with the same settings."""


def _paper_job(model: str, tp: int, cp: int, mbs: int, seq: int) -> dict[str, Any]:
    return dict(_PAPER_CLUSTER, model=model, tp=tp, cp=cp, micro_batch_size=mbs, seq_length=seq,
                training=ARTIFACT_TRAINING)


JOB_PRESETS: dict[str, dict[str, Any]] = {
    "kareus-1": _paper_job("llama3.2-3b", tp=8, cp=1, mbs=8, seq=4096),
    "kareus-2": _paper_job("llama3.2-3b", tp=4, cp=2, mbs=8, seq=4096),
    "kareus-3": _paper_job("llama3.2-3b", tp=4, cp=2, mbs=8, seq=8192),
    "kareus-4": _paper_job("llama3.2-3b", tp=4, cp=2, mbs=16, seq=4096),
    "kareus-5": _paper_job("qwen3-1.7b", tp=8, cp=1, mbs=8, seq=4096),
    "kareus-6": _paper_job("qwen3-1.7b", tp=8, cp=1, mbs=8, seq=8192),
    "kareus-7": _paper_job("qwen3-1.7b", tp=8, cp=1, mbs=16, seq=4096),
    "kareus-8": _paper_job("qwen3-1.7b", tp=4, cp=2, mbs=8, seq=4096),
    "kareus-9": _paper_job("qwen3-1.7b", tp=4, cp=2, mbs=8, seq=8192),
    "kareus-10": _paper_job("qwen3-1.7b", tp=4, cp=2, mbs=16, seq=4096),
    # The paper's large-model emulation; the exact setup is not published, so this is ours:
    # 64 H100, TP8 x PP8 (10 layers per stage), 32 microbatches of 2 x 4096 tokens.
    "llama3.3-70b-64gpu": dict(
        model="llama3.3-70b",
        tp=8,
        pp=8,
        micro_batch_size=2,
        seq_length=4096,
        num_microbatches=32,
        gpu="H100-SXM",
        gpus_per_node=8,
        nodes=8,
    ),
    # The scale a 70B run trains at: 1,024 H100, TP8 x PP16 (5 layers per stage) x DP8,
    # 64 microbatches of 2 x 4096 tokens (2,048 instructions per pipeline).
    "llama3.3-70b-1024gpu": dict(
        model="llama3.3-70b",
        tp=8,
        pp=16,
        dp=8,
        micro_batch_size=2,
        seq_length=4096,
        num_microbatches=64,
        gpu="H100-SXM",
        gpus_per_node=8,
        nodes=128,
    ),
    # Micro-batch 1, the sequence split (kareus.job.nanobatch), as close to the public
    # NVIDIA dgxc-benchmarking Llama 3.1 8B row (docs/anchors.md §8: 8x H100, GBS 128, MBS 1,
    # seq 8192, TP1 PP1 CP2 DP4, GA 32) as Kareus can run: the same GPUs, global batch,
    # data parallelism and 32 microbatches per iteration, with TP2 in place of CP2 (both
    # split each sequence's work over 2 GPUs; Kareus's sequence split refuses CP, and only
    # TP gives it collectives to overlap). No activation recompute: the row does not state
    # it, but at its 10,153 tokens/s/GPU a full recompute's GEMMs at the best shape's
    # 794.5 TFLOP/s and causal attention at H100's FlashAttention-2 308 TFLOP/s (§8) would
    # take 104% of the step (79% without recompute), so it cannot have recomputed every layer.
    "llama3.1-8b-h100-mbs1": dict(
        model="llama3.1-8b",
        tp=2,
        pp=1,
        dp=4,
        micro_batch_size=1,
        seq_length=8192,
        num_microbatches=32,
        recompute=False,
        gpu="H100-SXM",
        gpus_per_node=8,
        nodes=1,
    ),
    # The same for the dgxc-benchmarking Llama 3.1 70B row (docs/anchors.md §8: 64x H100,
    # GBS 128, MBS 1, seq 8192, TP4 PP4 CP2, VP5, GA 64, hence DP2): the same GPUs, pipeline,
    # interleaving (4 layers per chunk), DP2 and 64 microbatches, with TP8 in place of TP4 x
    # CP2. Llama 3.3 70B has Llama 3.1 70B's shape (their public configs). Full recompute:
    # without sequence parallelism (which the sequence split does not take) the activations
    # do not fit in 80 GB otherwise; the row's recompute is not stated.
    "llama3.3-70b-h100-mbs1": dict(
        model="llama3.3-70b",
        tp=8,
        pp=4,
        virtual_pipeline=5,
        dp=2,
        micro_batch_size=1,
        seq_length=8192,
        num_microbatches=64,
        recompute=True,
        gpu="H100-SXM",
        gpus_per_node=8,
        nodes=8,
    ),
}


def preset_names() -> list[str]:
    """Job presets first, then model names (a model name is a job with default settings)."""
    return [*JOB_PRESETS, *MODEL_PRESETS]
