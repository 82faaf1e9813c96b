"""Every public anchor, bounded. The bounds are the calibration we reached; tightening them
is welcome, loosening them needs a reason in the commit message."""

import pytest

from kareus.backends.emulator.kernel_anchors import (
    FA2_A100_FWD_BWD_TFLOPS,
    FA2_H100_FWD_BWD_CAUSAL_TFLOPS,
    XLA_H100_TFLOPS,
)
from kareus.workflows.anchors import ANCHOR_GROUPS, all_anchors

LFL_TIME = ("kareus-1 Perseus fastest plan, critical path of instruction windows "
            "(free edges)")
LFL_ENERGY = "kareus-1 Perseus fastest plan, instruction windows' energy (one GPU per stage)"
LFL_POWER = "kareus-1 Perseus fastest plan, mean power per GPU over the critical path"
LFL_MFU = "kareus-1 Perseus fastest plan, MFU (critical path of instruction windows)"
MEGATRON_PATH = ("kareus-1 Megatron at max clock, critical path of instruction windows "
                 "(free edges)")
MEGATRON_ENERGY = ("kareus-1 Megatron at max clock, instruction windows' energy "
                   "(one GPU per stage)")

NO_REFERENCE = {MEGATRON_PATH, MEGATRON_ENERGY,
                "kareus-1 Megatron wall-clock iteration time at max clock",
                "kareus-1 Megatron wall-clock mean power per GPU"}
"""Shown beside the rows they explain, with no public number to compare them with."""

BOUNDS = {
    "A100 bf16 GEMM 8192^3 at 1410 MHz, throughput": 0.03,
    "A100 bf16 GEMM 8192^3 at 1410 MHz, power": 0.03,
    "A100 bf16 GEMM 8192^3 at 1410 MHz, all-zero inputs (no throttling)": 0.03,
    "A100 bf16 GEMM, best of a shape sweep (MAMF)": 0.05,
    "H100 bf16 GEMM, best of a shape sweep (MAMF)": 0.10,
    "A100 memory-bound kernel, time at 900 / at 1410 MHz": 0.02,
    "A100 memory-bound kernel at full utilisation, power": 0.03,
    "A40 forward at 1740 MHz, mean power": 0.08,
    "A40 forward time, 1710 / 1740 MHz": 0.01,
    "A40 backward time, 1710 / 1740 MHz": 0.01,
    "A40 backward power, 1710 / 1740 MHz": 0.02,
    "A40 backward time, 690 / 1740 MHz": 0.15,
    "A40 backward energy, 690 / 1740 MHz": 0.03,
    "A40 backward energy, 660 / 690 MHz (rising again)": 0.01,
    "A100 8-GPU ReduceScatter 32 MiB, 8 CTAs": 0.03,
    "A100 8-GPU ReduceScatter 32 MiB, 16 CTAs": 0.03,
    "A100 8-GPU ReduceScatter 32 MiB, 32 CTAs": 0.03,
    "A100 8-GPU AllReduce 1 GiB, 24 CTAs (NCCL default), bus bandwidth": 0.072,
    "A100 communication-only power (AllReduce 96 MiB, 32 CTAs)": 0.35,
    "H100 132-CTA GEMM under a 24-CTA AllGather, slowdown": 0.05,
    "H200 8192x3072x3072 GEMM under SendRecv (8 CTAs), slowdown": 0.05,
    "H200 8192x3072x3072 GEMM under AllGather (24 CTAs), slowdown": 0.05,
    "H200 GEMM at a locked 1830 MHz, sustained clock at 700 W": 0.08,
    # issue 38's targets for the like-for-like rows (known misses until it closes)
    LFL_TIME: 0.07,
    LFL_ENERGY: 0.10,
    LFL_POWER: 0.10,
    LFL_MFU: 0.08,
    "Llama 3.1 8B on 8 H100 (CP2, MBS 1), Megatron step time": 0.10,
    "Llama 3.1 8B on 8 H100 (CP2, MBS 1), MFU": 0.10,
    "Llama 3.1 8B on 128 H100 (CP2, DP64, MBS 1), Megatron step time": 0.10,
    "Llama 3.1 70B on 64 H100 (TP4 PP4 CP2 VP5, SP, MBS 1), Megatron step time": 0.10,
    "Llama 3.1 70B on 64 H100 (TP4 PP4 CP2 VP5, SP, MBS 1), MFU": 0.10,
    **{f"H100 bf16 GEMM {b}x{m}x{n}x{k}": 0.10 for (b, m, n, k), _ in XLA_H100_TFLOPS},
    **{f"A100 FlashAttention-2 fwd+bwd, seq {s}, {mask}": 0.03
       for s in FA2_A100_FWD_BWD_TFLOPS for mask in ("causal", "non-causal")},
    **{f"H100 FlashAttention-2 fwd+bwd, seq {s}, causal": 0.03
       for s in FA2_H100_FWD_BWD_CAUSAL_TFLOPS},
    "A100 FlashAttention-2 forward at seq 4096, clock held at 400 W": 0.05,
    # the table has no batch or head-count dependence: that run reads +20%
    "A100 FlashAttention-2 forward, batch 1, seq 4096, 32 heads": 0.25,
    "A100-80GB read test, achieved bandwidth": 0.03,
    "H100 RMSNorm, rows of 8k, achieved bandwidth": 0.03,
}

KNOWN_MISSES = {
    "A40 backward time, 690 / 1740 MHz":
        "emulator v2 moved it from +13.2% to +15.4% (the limiter with memory no longer "
        "throttles the 1740 MHz backward, which the published 284 W says is right; the "
        "emulated backward is too clock-bound at 690 MHz), v3 to +16.1% (A40 attention "
        "at the A100's efficiency): docs/emulator.md, Known gaps",
    **{n: "issue 38: compared like for like (the emulator's own Perseus fastest plan, its "
          "instruction windows with free edges), with the host, dropout, unfused gradient "
          "accumulation and the node's links modelled from their public numbers, the "
          "emulator is 18.2% short of 5.113 s and 14.2% short of 2,814 J (its mean power, "
          "+4.9% against 275 W, is within bound); no public number closes the rest "
          "(docs/emulator.md, Calibration)"
       for n in (LFL_TIME, LFL_ENERGY, LFL_MFU)},
}


@pytest.fixture(scope="module")
def anchors():
    return {a.name: a for a in all_anchors()}


def test_every_anchor_has_a_bound(anchors):
    assert {n for n, a in anchors.items() if a.published is not None} == set(BOUNDS)
    assert {n for n, a in anchors.items() if a.published is None} == NO_REFERENCE


def test_kareus_1_is_compared_like_for_like(anchors):
    """The reference is Perseus's fastest plan, the critical path of in-training windows
    (5.113 s, 2,814 J over one GPU per stage, 275 W per GPU); Megatron-LM at max clock is
    beside it, unreferenced: the same path, more energy off it; its wall clock is longer
    (it has the transfers and the end-of-iteration work)."""
    assert (anchors[LFL_TIME].published, anchors[LFL_ENERGY].published,
            anchors[LFL_POWER].published) == (5.113, 2814.0, 275.0)
    wall = anchors["kareus-1 Megatron wall-clock iteration time at max clock"]
    assert wall.rel_error is None
    assert wall.emulated > anchors[LFL_TIME].emulated
    assert abs(anchors[MEGATRON_PATH].emulated - anchors[LFL_TIME].emulated) <= 1e-3
    assert anchors[MEGATRON_ENERGY].emulated > anchors[LFL_ENERGY].emulated
    p = anchors[LFL_POWER]
    assert p.emulated == pytest.approx(
        anchors[LFL_ENERGY].emulated / (2 * anchors[LFL_TIME].emulated))


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_MISSES[n], strict=True))
    if n in KNOWN_MISSES else n for n in BOUNDS])
def test_anchor_within_bound(anchors, name):
    a = anchors[name]
    assert abs(a.rel_error) <= BOUNDS[name], f"{name}: {a.emulated} vs {a.published}"


def test_energy_rises_again_at_the_bottom_and_power_falls_at_the_top(anchors):
    assert anchors["A40 backward energy, 660 / 690 MHz (rising again)"].emulated > 1.0
    assert anchors["A40 backward power, 1710 / 1740 MHz"].emulated <= 1.0


def test_groups_are_listed():
    assert {"gemm", "memory", "a40_profile", "nccl", "comm_power", "overlap", "hopper_clock",
            "kareus_1", "iteration", "gemm_shape", "attention", "memory_bandwidth"
            } == set(ANCHOR_GROUPS)


def test_small_k_hurts_more_than_small_n(anchors):
    """XLA's H100 table: at the same m and the same small size, a GEMM with k = 256 runs
    far slower than one with n = 256; the tile model plus a GEMM's fixed time agree."""
    small_k = anchors["H100 bf16 GEMM 4x4096x4096x256"].emulated
    small_n = anchors["H100 bf16 GEMM 2x4096x256x4096"].emulated
    assert small_k < small_n


def test_causal_attention_runs_below_full_and_short_below_long(anchors):
    def a(seq, mask):
        return anchors[f"A100 FlashAttention-2 fwd+bwd, seq {seq}, {mask}"].emulated

    for seq in FA2_A100_FWD_BWD_TFLOPS:
        assert a(seq, "causal") < a(seq, "non-causal")
    assert a(512, "causal") < a(4096, "causal") < a(16384, "causal") * 1.001
