"""Named models and jobs.

Model shapes are the public Hugging Face configs (docs/anchors.md §5). Job presets `kareus-1` ...
`kareus-10` are the ten workloads evaluated in the Kareus paper, in the order docs/anchors.md §4
lists them: A100 SXM4 40GB, 2 nodes x 8 GPUs, PP=2 with 15/13 layers, 8 microbatches,
bf16, no sequence parallelism, full uniform activation recompute.
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
    recompute=True,
    sequence_parallel=False,
)


def _paper_job(model: str, tp: int, cp: int, mbs: int, seq: int) -> dict[str, Any]:
    return dict(_PAPER_CLUSTER, model=model, tp=tp, cp=cp, micro_batch_size=mbs, seq_length=seq)


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
}


def preset_names() -> list[str]:
    """Job presets first, then model names (a model name is a job with default settings)."""
    return [*JOB_PRESETS, *MODEL_PRESETS]
