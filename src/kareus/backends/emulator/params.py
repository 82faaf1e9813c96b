"""Constants of the emulator's kernel, collective and power models, per GPU.

Public hardware facts live in `kareus.job.hardware`; this module holds the *model* constants
fitted to the public measurements in docs/anchors.md (each with its source) and documented in
docs/emulator.md. A calibration file (`--calibration FILE`) can override any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kareus.core.jsonfile import read_json_object
from kareus.errors import SpecError
from kareus.job.hardware import GPUSpec

# NanoFlow (anchors §3): a memory-bound GEMV given a share of the GPU's SMs runs at this share
# of its full speed.
MEMORY_SM_SHARE = ((0.0, 0.0), (0.1, 0.25), (0.2, 0.40), (0.3, 0.50), (0.5, 0.70),
                   (0.7, 0.85), (0.9, 0.95), (1.0, 1.0))

# The A100 link saturation (220 GB/s, `coll_link_busbw_bytes_s`) over the catalog's achieved
# 8-GPU AllReduce bus bandwidth (224 GB/s, the middle of the public 208-240): other GPUs'
# saturation is their catalog value times the same ratio (docs/emulator.md).
LINK_OF_ACHIEVED_ALLREDUCE = 220.0 / 224.0


@dataclass(frozen=True)
class EmulatorParams:
    # Compute kernels ----------------------------------------------------------------------
    gemm_efficiency: float = 0.96
    """Fraction of peak tensor throughput at the set clock of the best GEMM tile over a long
    reduction (gemm.py: eff = this x tile reuse x k / (k + gemm_k0)). Solved so an A100
    bf16 8192^3 GEMM on all-zero inputs, i.e. without power throttling, runs at 295 of 312
    TFLOP/s (anchors §1): 0.96 x 8192 / (8192 + 128) x 19 waves' 0.998 fill = 0.944. Not
    re-solved when k0 became 160 (0.940: 293 TFLOP/s, -0.7%, within the anchor's bound)."""
    gemm_k0: float = 160.0
    """Prologue + epilogue of one tile in units of reduction length: eff ~ k / (k + k0): a
    3-4 stage pipeline of 32-64 deep k-blocks to fill, and the output tile to write, before
    and after the mainloop. Fitted with ``gemm_fixed_s`` to XLA's H100 shape table
    (docs/anchors.md §8; docs/emulator.md, "GEMM tiles"); 128 before, inferred."""
    gemm_tile_plan_sms: int = 0
    """SM count cuBLAS's tile heuristic plans for. 0: the SMs the GEMM actually gets
    (cuBLASLt's SM-count target set to what a collective leaves, as a system that
    partitions SMs does); N > 0: always N (plain cuBLAS plans for the whole GPU, as in the
    published interference measurements, anchors §3)."""
    gemm_fixed_s: float = 2.5e-6
    """Time of a GEMM kernel that does not scale with its tiles: the grid's ramp-up and the
    drain of its last wave. Fitted, with ``gemm_k0`` = 160, to XLA's table of measured H100
    bf16 GEMMs by shape, each emulated in a loop under the power limit (docs/anchors.md §8):
    all nine within 8% (`kareus calibrate`). No A100 table is public: the same time is used
    there (inferred), varied 1-6.5 us by `kareus compare --sensitivity`."""
    attention_efficiency_scale: float = 1.0
    """Multiplies the flash-attention efficiency at the set clock (attention.py), after the
    held-clock solve; 1 by default, set by `kareus calibrate --fit` from a real GPU's
    measurements (a calibration file from before emulator v3 has `attention_efficiency`
    instead: `load_params` turns it into this scale)."""
    hbm_efficiency: float = 0.88
    """Achieved fraction of the HBM datasheet bandwidth for streaming kernels: a public
    A100-80GB read test reached 1.80 of 2.04 TB/s (88%); H100 RMSNorm / softmax /
    cross-entropy kernels hold ~90% of 3.35 TB/s once rows exceed 4k elements
    (docs/anchors.md §8)."""
    memory_issue_fraction: float = 0.35
    """A memory-bound kernel's instruction-issue time at max clock, as a fraction of its
    memory time: it becomes clock-bound only below ~35% of max clock, so its time is nearly
    independent of the clock in the search range (anchors §2)."""
    launch_overhead_s: float = 4e-6
    """GPU-side gap between two back-to-back kernels on one stream. No authoritative public
    number ("a couple of microseconds" per launch is anecdotal, docs/anchors.md §8): a model
    choice, varied 1-10 us by `kareus compare --sensitivity`."""

    # The host issuing the kernels (host.py) --------------------------------------------------
    host_module_s: float = 115e-6
    """Host time of one module call (a linear's or an attention's first kernel):
    TransformerEngine's TEColumnParallelLinear forward, 115 us (140 before TE PR 1191;
    Megatron-Core's own ColumnParallelLinear 74 us; TP=1, BF16; docs/anchors.md §10).
    The emulator's layer is Megatron-Core with TransformerEngine. No public figure for an
    attention module: the Linear's (an assumption). Varied 74-140 us by --sensitivity."""
    host_basic_op_s: float = 1e-6
    """Host time of one memory-bound kernel (norm, RoPE, activation, residual, loss) or a
    module's further kernel: "many basic PyTorch operations ... involve O(1 us) overhead"
    (TE issue 2053, docs/anchors.md §10). No public per-module figure for these kinds: an
    assumption, varied 1-13.5 us (13.5: a torch Linear's whole forward on an H100 DGX)."""
    host_backward_scale: float = 1.0
    """A backward kernel's host time over its forward's. No public backward figure: 1 (an
    assumption), varied 0.5-2 by --sensitivity."""

    # Collectives ---------------------------------------------------------------------------
    coll_cta_busbw_bytes_s: float = 12.8e9
    """Bus bandwidth one NCCL channel (CTA) moves at max clock. Fit of the six 8-GPU A100
    ReduceScatter points (anchors §3) with the link saturation fixed at 220 GB/s (below):
    bus bandwidth ((n b)^-6 + B^-6)^(-1/6) with b = 12.8 GB/s plus 24.9 us latency fits
    them within 2.6% (bus = algorithm x 7/8)."""
    coll_link_busbw_bytes_s: float = 220e9
    """Saturation bus bandwidth of the NVLink fabric (docs/emulator.md, "Collective
    saturation"). Public achieved 8-GPU A100 AllReduce bus bandwidth (nccl-tests) is
    208-240 GB/s (anchors §1), so the saturation is at least 208; the ReduceScatter points
    bound it from above (re-fitting b and the latency for each value, they stay within 2.6%
    up to 220 GB/s, 3.1% at 224, 4.1% at 231). 220 is that upper end; an emulated 1 GiB
    AllReduce on NCCL's 24 default channels then reaches 214 GB/s, inside the range."""
    coll_smoothness: float = 6.0
    """Exponent p of the smooth minimum between CTA-limited and link-limited bandwidth."""
    coll_step_latency_s: float = 24.9e-6 / 7
    """Latency per ring step (the fit's 24.9 us over the 7 steps of an 8-GPU reduce-scatter;
    an all-reduce has 2(n-1) steps). NCCL's own base latencies are 6.6-14 us (anchors §3)."""
    coll_clock_exponent: float = 0.6
    """Per-CTA rate ~ (f / f_max)^g. No public data; anchors §3 bounds g to 0.5..1."""
    coll_hbm_per_bus_byte: float = 3.0
    """HBM bytes per bus byte for reducing collectives (write received, read received and
    local); gathers and P2P move 2 (write received, read to forward)."""
    default_comm_sms: int = 32
    """NCCL channels a collective uses when nobody tunes it: the GPU catalog's
    `nccl_channels` (what NCCL picks inside an NVSwitch node, anchors §3)."""
    p2p_latency_s: float = 10e-6

    # Interference beyond SM loss -----------------------------------------------------------
    interference_coefficient: float = 0.25
    """c in the compute slowdown 1 + c (x / BW_hbm)^e beside a collective moving x HBM
    bytes/s: its traffic queues at the L2 and memory controllers and stalls the kernel's
    loads. Fitted to the H200 GEMM under SendRecv and AllGather (anchors §3); used for
    every GPU without its own fit. H100: 0.75 (`_architecture_params`, docs/emulator.md)."""
    interference_exponent: float = 0.5
    """e in the same slowdown (< 1: the first bytes of collective traffic cost the most;
    same H200 fit)."""

    # Power -----------------------------------------------------------------------------------
    sm_dynamic_power_w: float = 385.0
    """Dynamic power of all SMs running tensor-core GEMM at max clock and max voltage.
    Solved so an A100 bf16 GEMM at 1410 MHz throttles at 400 W to ~258 TFLOP/s (anchors §1).
    Re-checked with the GEMM tile model (gemm.py), whose 8192^3 tile efficiency 0.945 and
    tensor-busy share 0.985 leave it at ~260 TFLOP/s and ~394 W: not re-solved."""
    hbm_power_w: float = 50.0
    """DRAM + memory-controller power at full HBM bandwidth."""
    link_power_w: float = 3.0
    """NVLink power at the link's saturation bandwidth."""
    sm_base_activity: float = 0.15
    """Fraction of an SM's full dynamic power drawn when it runs a kernel but stalls."""
    activity_gemm: float = 1.0
    activity_attention: float = 1.3
    """Per unit of tensor work relative to the best GEMM's (physics.py scales it by the
    kernel's efficiency over ``gemm_efficiency``): softmax's exponentials and the on-chip
    rescaling draw on top of the MMAs. Solved so that FlashAttention-2's forward at 4k run
    in a loop on an A100 holds ~1200 MHz at 400 W, as a public run did (anchors §8)."""
    activity_memory: float = 1.05
    """Scaled by the issue-busy fraction (~0.35 at max clock): an A100 memory-bound kernel
    at full utilisation then draws ~327 W (anchors §1)."""
    activity_collective: float = 0.05
    """Collective CTAs mostly spin on flags: communication-only intervals stay close to
    static power (anchors §3)."""
    voltage_floor: float = 0.7
    """V(f) / V(f_max) below the knee: voltage is flat at ~0.7 V (anchors §2)."""
    limiter_tau_s: float = 0.01
    """Time constant of the board power limiter's averaging: power is averaged
    exponentially over it, and the clock moves one table step per tau / 5 while the
    average is above the limit (up again 2% below it). NVIDIA does not publish the
    limiter's dynamics; nvidia-smi reports power averaged over 1 s and its instantaneous
    reading separately (docs/anchors.md §1), so tau is a model choice: 10 ms, varied
    1-100 ms by `kareus compare --sensitivity`. 0 gives the memoryless limiter (every
    interval at the highest clock that fits the limit, at once)."""
    voltage_knee_fraction: float = 0.45
    """Knee of the V-f curve as a fraction of max clock; above it V rises quadratically to
    1 at max clock, so dynamic power ~ V^2 f is convex in f."""
    static_power_scale: float = 1.0
    """Multiplies the GPU catalog's static power (`GPUSpec.static_power_w`: 85 W on A100, the
    Perseus/Kareus constant, anchors §1). 1 is the catalog value; `kareus compare
    --sensitivity` varies it 0.85..1.15 (docs/emulator.md, "Sensitivity of the headline")."""


def default_params(gpu: GPUSpec) -> EmulatorParams:
    """Per-architecture defaults (`GPUSpec.arch`): sm80's (A100) constants are the fitted
    ones; others are scaled by
    their public numbers (documented in docs/emulator.md). Collectives nobody tunes get
    the channels NCCL picks on this GPU's node."""
    return replace(_architecture_params(gpu), default_comm_sms=gpu.nccl_channels)


def _architecture_params(gpu: GPUSpec) -> EmulatorParams:
    """The constants of ``gpu``'s architecture (`GPUSpec.arch`), with its own interference
    fit where the catalog gives one."""
    of_arch = _ARCHITECTURES.get(gpu.arch)
    if of_arch is None:
        raise SpecError(f"no emulator parameters for {gpu.name} ({gpu.arch}); the emulator "
                        f"knows {', '.join(_ARCHITECTURES)}")
    params = of_arch(gpu)
    if gpu.interference_coefficient is not None:
        params = replace(params, interference_coefficient=gpu.interference_coefficient)
    return params


def _ampere(gpu: GPUSpec) -> EmulatorParams:
    """sm80 (A100): the fitted defaults."""
    return EmulatorParams()


def _hopper(gpu: GPUSpec) -> EmulatorParams:
    """sm90 (H100, H200): scaled by their public numbers."""
    return EmulatorParams(
        # NCCL cost model per-channel caps: Hopper 36.7 vs Ampere 20 GB/s (anchors §3)
        coll_cta_busbw_bytes_s=12.8e9 * 36.7 / 20,
        coll_link_busbw_bytes_s=LINK_OF_ACHIEVED_ALLREDUCE * gpu.allreduce_busbw_bytes_s,
        # solved so a GEMM at 700 W sustains ~1500 MHz (anchors §1, H200 report)
        sm_dynamic_power_w=950.0,
        hbm_efficiency=0.90,  # H100 RMSNorm / softmax kernels (anchors §8)
        hbm_power_w=90.0,
        link_power_w=15.0,
        # the H200 fit; a GPU of its own fit sets `GPUSpec.interference_coefficient`
        interference_coefficient=0.25,
    )


def _sm86(gpu: GPUSpec) -> EmulatorParams:
    """sm86 (A40): scaled by its public numbers."""
    return EmulatorParams(
        coll_cta_busbw_bytes_s=2.5e9,
        coll_link_busbw_bytes_s=LINK_OF_ACHIEVED_ALLREDUCE * gpu.allreduce_busbw_bytes_s,
        # solved so the Perseus A40 stage runs at its 300 W limit at 1740 MHz (anchors §2)
        sm_dynamic_power_w=380.0,
        hbm_power_w=35.0,
        link_power_w=5.0,
    )


_ARCHITECTURES: dict[str, Callable[[GPUSpec], EmulatorParams]] = {
    "sm80": _ampere, "sm86": _sm86, "sm90": _hopper}


LEGACY_ATTENTION_EFFICIENCY = {"attention_efficiency": 0.62, "attention_bwd_efficiency": 0.50}
"""Emulator v2's flat flash-attention efficiencies (forward, backward), which calibration
files written before v3 override."""


def _from_legacy(values: dict[str, Any]) -> dict[str, Any]:
    """A calibration file's constants with v2's attention efficiencies turned into v3's
    scale: the fitted value over v2's default (the forward's where both are given)."""
    out = {k: v for k, v in values.items() if k not in LEGACY_ATTENTION_EFFICIENCY}
    for key, default in LEGACY_ATTENTION_EFFICIENCY.items():
        value = values.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            out.setdefault("attention_efficiency_scale", value / default)
    return out


def load_params(gpu: GPUSpec, path: str | Path | None) -> EmulatorParams:
    """Defaults for ``gpu``, overridden by a calibration file's ``emulator_params``."""
    params = default_params(gpu)
    if path is None:
        return params
    p = Path(path)
    doc = read_json_object(p, "calibration file")
    if not isinstance(doc.get("emulator_params"), dict):
        raise SpecError(f"calibration file {p} has no 'emulator_params' object")
    if doc.get("gpu") not in (None, gpu.name):
        raise SpecError(f"calibration file {p} is for {doc.get('gpu')}, not {gpu.name}")
    known = {f.name: f.type for f in fields(EmulatorParams)}
    overrides: dict[str, Any] = {}  # field name -> int or float, per the field's type
    for key, value in _from_legacy(doc["emulator_params"]).items():
        if key not in known:
            raise SpecError(f"calibration file {p}: unknown parameter {key!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise SpecError(f"calibration file {p}: {key} must be a non-negative number")
        overrides[key] = int(value) if known[key] in ("int", int) else float(value)
    return replace(params, **overrides)
