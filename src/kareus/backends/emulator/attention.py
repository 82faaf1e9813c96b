"""Flash-attention efficiency by sequence length, causal masking and direction.

A flash-attention kernel streams the keys of its query block through on-chip memory; its
fixed work per query block (loading Q, the softmax rescaling, writing O and, backward, the
dQ accumulation and the dO.O preprocessing) is spread over the keys it attends to, so it
runs nearer its peak on longer sequences, and a causal kernel, whose rows see half the keys
on average and whose diagonal blocks are half masked, runs below a full one. Rather than
model the kernel's internals, the emulator takes the throughput FlashAttention-2's authors
published (docs/anchors.md §8):

- A100, head dim 128, forward + backward, by sequence length, causal and not;
- the forward / backward split at 4k (non-causal: 224 and 193 TFLOP/s against 201
  combined), applied at every length and to causal kernels too (inferred: the published
  causal backward at 4k / 8k / 16k, 165 / 175 / 186, is within 6% of it);
- H100, head dim 128, causal forward + backward at 4k / 8k / 16k; other lengths and the
  non-causal kernel follow the A100's curve relative to its causal 4k point (inferred).

The published runs are measured on GPUs at their power limit (a public A100 run of the
same kernel held about 1200 of 1410 MHz), and a kernel's clock there depends on its own
power. So the efficiency at the set clock is the one that, at the clock the kernel holds
in a loop under the power limit, gives the published throughput: `GPUPhysics` solves for
that clock (the highest at which the kernel's power fits TDP) with its own power model,
and `kareus calibrate` checks the result in the emulator's loop, limiter included.
Counting: causal FLOPs halved, backward 2.5 x
forward (the paper's convention and kareus.workload.layer's).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kareus.job.hardware import GPUSpec

SEQ_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
A100_CAUSAL_TFLOPS = (99.0, 131.0, 155.0, 182.0, 189.0, 189.0)
A100_FULL_TFLOPS = (131.0, 181.0, 196.0, 201.0, 203.0, 203.0)
A100_FWD_OF_COMBINED = 224.0 / 201.0  # forward, backward over forward + backward, 4k
A100_BWD_OF_COMBINED = 193.0 / 201.0
H100_CAUSAL_TFLOPS = {4096: 294.0, 8192: 308.0, 16384: 328.0}

_LOG_SEQ = np.log2(np.array(SEQ_LENGTHS, dtype=float))


def _a100_combined(keys: int, causal: bool) -> float:
    """Published A100 forward + backward TFLOP/s at ``keys`` (log-interpolated; held at
    the table's ends)."""
    table = A100_CAUSAL_TFLOPS if causal else A100_FULL_TFLOPS
    return float(np.interp(np.log2(max(1, keys)), _LOG_SEQ, table))


def _h100_combined(keys: int, causal: bool) -> float:
    """Published H100 causal points, carried to other lengths and to the non-causal kernel
    by the A100's curve."""
    points = sorted(H100_CAUSAL_TFLOPS)
    x = np.log2(np.array(points, dtype=float))
    if keys >= points[0]:
        causal_tflops = float(np.interp(np.log2(keys), x,
                                        [H100_CAUSAL_TFLOPS[p] for p in points]))
    else:
        causal_tflops = (H100_CAUSAL_TFLOPS[points[0]] * _a100_combined(keys, True)
                         / _a100_combined(points[0], True))
    if causal:
        return causal_tflops
    return causal_tflops * _a100_combined(keys, False) / _a100_combined(keys, True)


_PUBLISHED: dict[str, Callable[[int, bool], float]] = {
    "ampere": _a100_combined, "hopper": _h100_combined}
"""Forward + backward TFLOP/s by `GPUSpec.flash_attention`: whose published runs."""


def published_tflops(gpu: GPUSpec, keys: int, causal: bool, backward: bool) -> float:
    """The published throughput of one direction of a flash-attention kernel, TFLOP/s, on
    a GPU whose kernels follow published runs (`GPUSpec.flash_attention`: the A100's or the
    H100's, which the H200 runs too; others have none of their own, see `efficiency`)."""
    combined = _PUBLISHED[gpu.flash_attention or ""](keys, causal)
    return combined * (A100_BWD_OF_COMBINED if backward else A100_FWD_OF_COMBINED)


def has_published_runs(gpu: GPUSpec) -> bool:
    """Whether FlashAttention-2's throughput was published for this GPU or one whose
    kernels it runs (`GPUSpec.flash_attention`)."""
    return gpu.flash_attention in _PUBLISHED


def published_fraction(gpu: GPUSpec, peak_tflops: float, keys: int, causal: bool,
                       backward: bool) -> float:
    """The published throughput over ``peak_tflops`` (this GPU's peak at max clock)."""
    if not has_published_runs(gpu):
        raise ValueError(f"no published flash-attention runs on {gpu.name}")
    return published_tflops(gpu, keys, causal, backward) / peak_tflops
