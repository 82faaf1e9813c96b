"""Per-kernel anchors of emulator v3 (docs/anchors.md §8): GEMMs by shape, flash attention
by sequence length, memory-bound kernels' bandwidth. Each kernel runs in a loop, as the
public benchmarks run it: tiles planned for the whole GPU, the power limiter in its steady
state (`anchors.backend_for(..., loop=True)`).
"""

from __future__ import annotations

from pathlib import Path

from kareus.backends.emulator.anchor_base import Anchor, backend_for
from kareus.backends.emulator.attention import (
    A100_CAUSAL_TFLOPS,
    A100_FULL_TFLOPS,
    H100_CAUSAL_TFLOPS,
    SEQ_LENGTHS,
)
from kareus.job.hardware import get_gpu
from kareus.workload.layer import gemm
from kareus.workload.ops import ComputeOp

XLA_H100_TFLOPS: tuple[tuple[tuple[int, int, int, int], float], ...] = (
    ((1, 4096, 4096, 4096), 783.3), ((1, 4096, 4096, 256), 392.2),
    ((4, 4096, 4096, 256), 503.9), ((4, 4096, 4096, 512), 619.9),
    ((4, 4096, 512, 512), 441.5), ((4, 4096, 1024, 1024), 673.8),
    ((2, 4096, 512, 4096), 729.7), ((2, 4096, 256, 4096), 584.2),
    ((2, 4096, 1024, 256), 301.6),
)
"""Measured H100 bf16 TFLOP/s by (batch, m, n, k): XLA's matmul interpolator table
(anchors §8). A batch of b GEMMs runs as one of b x m rows (a strided batched GEMM has
the same tiles)."""

FA2_A100_FWD_BWD_TFLOPS = {  # seq -> (causal, non-causal): attention.py's published table
    seq: (causal, full) for seq, causal, full in zip(
        SEQ_LENGTHS, A100_CAUSAL_TFLOPS, A100_FULL_TFLOPS, strict=True)}
FA2_H100_FWD_BWD_CAUSAL_TFLOPS = H100_CAUSAL_TFLOPS


def gemm_shape_anchor(calibration: str | Path | None = None) -> list[Anchor]:
    b = backend_for("H100-SXM", calibration, loop=True)
    out = []
    for (batch, m, n, k), published in XLA_H100_TFLOPS:
        op = gemm("gemm", batch * m, n, k)
        tflops = op.flops / b.predict_ops((op,), b.gpu.max_freq_mhz).time_s / 1e12
        out.append(Anchor(f"H100 bf16 GEMM {batch}x{m}x{n}x{k}", "anchors §8 (XLA table)",
                          "TFLOP/s", published, tflops))
    return out


def attention_op(seq: int, causal: bool, backward: bool, tokens: int = 16384,
                 heads: int = 16, head_dim: int = 128) -> ComputeOp:
    """The FlashAttention-2 benchmark's kernel: ``tokens`` per batch, hidden 2048."""
    batch = tokens // seq
    flops = 4.0 * batch * seq * seq * heads * head_dim * (0.5 if causal else 1.0)
    qkvo = 4.0 * tokens * heads * head_dim * 2
    if backward:  # reads q, k, v, o, dO; writes dq, dk, dv
        return ComputeOp("core_attn_bwd", "attention", 2.5 * flops, 2.0 * qkvo, "attn",
                         attn_keys=seq, attn_causal=causal)
    return ComputeOp("core_attn", "attention", flops, qkvo, "attn", attn_keys=seq,
                     attn_causal=causal)


def _fwd_bwd_tflops(gpu: str, seq: int, causal: bool,
                    calibration: str | Path | None) -> float:
    """The benchmark's forward + backward throughput: each direction in its own loop."""
    b = backend_for(gpu, calibration, loop=True)
    f = b.gpu.max_freq_mhz
    fwd, bwd = attention_op(seq, causal, False), attention_op(seq, causal, True)
    t = b.predict_ops((fwd,), f).time_s + b.predict_ops((bwd,), f).time_s
    return (fwd.flops + bwd.flops) / t / 1e12


def attention_anchor(calibration: str | Path | None = None) -> list[Anchor]:
    src = "anchors §8 (FlashAttention-2 paper)"
    out = []
    for seq in SEQ_LENGTHS:
        for causal, published in zip((True, False), FA2_A100_FWD_BWD_TFLOPS[seq], strict=True):
            mask = "causal" if causal else "non-causal"
            out.append(Anchor(f"A100 FlashAttention-2 fwd+bwd, seq {seq}, {mask}", src,
                              "TFLOP/s", published,
                              _fwd_bwd_tflops("A100-80GB", seq, causal, calibration)))
    for seq, published in FA2_H100_FWD_BWD_CAUSAL_TFLOPS.items():
        out.append(Anchor(f"H100 FlashAttention-2 fwd+bwd, seq {seq}, causal", src,
                          "TFLOP/s", published,
                          _fwd_bwd_tflops("H100-SXM", seq, True, calibration)))
    b = backend_for("A100-80GB", calibration, loop=True)
    fwd = attention_op(4096, False, False)
    m = b.predict_ops((fwd,), 1410)
    out.append(Anchor("A100 FlashAttention-2 forward at seq 4096, clock held at 400 W",
                      "anchors §8 (public run: ~1200 MHz)", "MHz", 1200.0,
                      m.effective_freq_mhz))
    # the run that clock comes from: batch 1, 32 heads (the table has no batch dependence)
    one = attention_op(4096, False, False, tokens=4096, heads=32)
    t = b.predict_ops((one,), 1410).time_s
    out.append(Anchor("A100 FlashAttention-2 forward, batch 1, seq 4096, 32 heads",
                      "anchors §8 (public run)", "TFLOP/s", 184.0, one.flops / t / 1e12))
    return out


def memory_bandwidth_anchor(calibration: str | Path | None = None) -> list[Anchor]:
    out = []
    for gpu, published, what in (("A100-80GB", 1.80e12, "A100-80GB read test"),
                                 ("H100-SXM", 3.0e12, "H100 RMSNorm, rows of 8k")):
        b = backend_for(gpu, calibration)
        rows, width = 32768, 8192
        nbytes = float(2 * rows * width * 2)  # read x, write y (bf16)
        op = ComputeOp("rmsnorm", "memory", 4.0 * rows * width, nbytes, "norm")
        t = b.predict_ops((op,), get_gpu(gpu).max_freq_mhz).time_s
        out.append(Anchor(f"{what}, achieved bandwidth", "anchors §8", "TB/s",
                          published / 1e12, nbytes / t / 1e12))
    return out
