"""Public anchors (docs/anchors.md) next to the emulator's values: `kareus calibrate`.

Each anchor names its source, the published value, the emulated value and the relative
error; tests bound every error (tests/backends/emulator/test_anchors.py). These are the
groups the emulator computes alone; kareus-1's like-for-like rows compose a Perseus plan
first, and `kareus.workflows.anchors.all_anchors` lists every group.
"""

from __future__ import annotations

from collections.abc import Callable

from kareus.backends.emulator import iteration_anchors, kernel_anchors
from kareus.backends.emulator.anchor_base import Anchor, backend_for, for_gpu
from kareus.backends.emulator.backend import EmulatorBackend
from kareus.backends.emulator.iteration import IterationSimulator
from kareus.job.sources import build_job
from kareus.plans.execution import ExecutionPlan
from kareus.workload.layer import gemm
from kareus.workload.ops import Collective, ComputeOp
from kareus.workload.workload import Workload

MiB = 2**20


def gemm_anchor(calibration=None) -> list[Anchor]:
    b = backend_for("A100-40GB", calibration)
    op = gemm("gemm_8192", 8192, 8192, 8192)
    m = b.predict_ops((op,), 1410)
    ph = b.physics
    unthrottled = ph.compute_rate(op, 1410, ph.n_sm, ph.hbm_bw).duration_s  # no power limit
    h100 = backend_for("H100-SXM", calibration)
    src = "anchors §1 (mamf-finder table)"
    return [
        Anchor("A100 bf16 GEMM 8192^3 at 1410 MHz, throughput", "anchors §1 (random inputs)",
               "TFLOP/s", 258.0, op.flops / m.time_s / 1e12),
        Anchor("A100 bf16 GEMM 8192^3 at 1410 MHz, power", "anchors §1 (at the 400 W limit)",
               "W", 400.0, m.avg_power_w),
        Anchor("A100 bf16 GEMM 8192^3 at 1410 MHz, all-zero inputs (no throttling)",
               "anchors §1", "TFLOP/s", 295.0, op.flops / unthrottled / 1e12),
        Anchor("A100 bf16 GEMM, best of a shape sweep (MAMF)", src, "TFLOP/s", 270.0,
               _best_of_sweep(b, 1410)),
        Anchor("H100 bf16 GEMM, best of a shape sweep (MAMF)", src, "TFLOP/s", 793.0,
               _best_of_sweep(h100, 1980)),
    ]


MAMF_DIMS = (1024, 2048, 4096, 8192, 12288, 16384)
MAMF_K = (4096, 8192, 16384)


def _best_of_sweep(b: EmulatorBackend, freq_mhz: int) -> float:
    """Highest emulated TFLOP/s over m, n in MAMF_DIMS and k in MAMF_K (power-limited), as
    the maximum-achievable-matmul-FLOPS finder searches shapes for the best."""
    best = 0.0
    for m in MAMF_DIMS:
        for n in MAMF_DIMS:
            for k in MAMF_K:
                op = gemm("gemm", m, n, k)
                best = max(best, op.flops / b.predict_ops((op,), freq_mhz).time_s / 1e12)
    return best


def memory_anchor(calibration=None) -> list[Anchor]:
    b = backend_for("A100-40GB", calibration)
    op = ComputeOp("stream_1GiB", "memory", 0.0, float(1024 * MiB), "other")
    hi, lo = b.predict_ops((op,), 1410), b.predict_ops((op,), 900)
    return [
        Anchor("A100 memory-bound kernel, time at 900 / at 1410 MHz", "anchors §2 (flat)",
               "ratio", 1.0, lo.time_s / hi.time_s),
        Anchor("A100 memory-bound kernel at full utilisation, power", "anchors §1 (~327 W)",
               "W", 327.0, hi.avg_power_w),
    ]


def a40_profile_anchor(calibration=None) -> list[Anchor]:
    """The Perseus A40 stage profile, compared as ratios (the published model is not ours)."""
    job = build_job(overrides=dict(model="llama3.2-3b", tp=1, pp=4, micro_batch_size=2,
                                   seq_length=2048, recompute=False, gpu="A40",
                                   gpus_per_node=4, nodes=1, num_microbatches=4))
    ps = Workload.build(job).partitions
    b = EmulatorBackend(job, calibration=calibration if for_gpu(calibration, "A40") else None)
    sim = IterationSimulator(ps, b)
    plan = ExecutionPlan("megatron", overlap=False, default_freq_mhz=1740)

    def instr(direction: str, f: int):
        return sim.instruction(plan, 1, direction, f)

    f1740, f1710 = instr("forward", 1740), instr("forward", 1710)
    b1740, b1710 = instr("backward", 1740), instr("backward", 1710)
    b690, b660 = instr("backward", 690), instr("backward", 660)
    src = "anchors §2, Perseus A40 profile"
    return [
        Anchor("A40 forward at 1740 MHz, mean power", src, "W", 304.0, f1740.avg_power_w),
        Anchor("A40 forward time, 1710 / 1740 MHz", src, "ratio", 0.0938 / 0.0937,
               f1710.time_s / f1740.time_s),
        Anchor("A40 backward time, 1710 / 1740 MHz", src, "ratio", 0.2455 / 0.2453,
               b1710.time_s / b1740.time_s),
        Anchor("A40 backward power, 1710 / 1740 MHz", src, "ratio", 281 / 284,
               b1710.avg_power_w / b1740.avg_power_w),
        Anchor("A40 backward time, 690 / 1740 MHz", src, "ratio", 0.4185 / 0.2453,
               b690.time_s / b1740.time_s),
        Anchor("A40 backward energy, 690 / 1740 MHz", src, "ratio", 68.12 / 69.57,
               b690.energy_j / b1740.energy_j),
        Anchor("A40 backward energy, 660 / 690 MHz (rising again)", src, "ratio",
               69.40 / 68.12, b660.energy_j / b690.energy_j),
    ]


def nccl_anchor(calibration=None) -> list[Anchor]:
    b = backend_for("A100-40GB", calibration)
    rs = Collective("rs_32MiB", "reduce_scatter", "tp", 8, float(32 * MiB))
    out = []
    for ctas, published in ((8, 105.0), (16, 181.0), (32, 206.0)):
        m = b.predict_ops((rs,), 1410, sms=ctas)
        out.append(Anchor(f"A100 8-GPU ReduceScatter 32 MiB, {ctas} CTAs", "anchors §3",
                          "GB/s algbw", published, rs.bytes_ / m.time_s / 1e9))
    ar = Collective("ar_1GiB", "all_reduce", "tp", 8, float(1024 * MiB))
    m = b.predict_ops((ar,), 1410, sms=24)
    out.append(Anchor("A100 8-GPU AllReduce 1 GiB, 24 CTAs (NCCL default), bus bandwidth",
                      "anchors §1 (nccl-tests, 208-240: the middle)", "GB/s busbw", 224.0,
                      b.physics.coll_bus_bytes(ar) / m.time_s / 1e9))
    return out


def comm_power_anchor(calibration=None) -> list[Anchor]:
    b = backend_for("A100-40GB", calibration)
    ar = Collective("ar_96MiB", "all_reduce", "tp", 8, float(96 * MiB))
    m = b.predict_ops((ar,), 1410, sms=32)
    return [Anchor("A100 communication-only power (AllReduce 96 MiB, 32 CTAs)",
                   "anchors §3 (close to the 85 W static power)", "W", 85.0, m.avg_power_w)]


def overlap_anchor(calibration=None) -> list[Anchor]:
    out = []
    h100 = backend_for("H100-SXM", calibration, loop=True)
    # 12 x 11 tiles of 128 x 256: exactly 132 CTAs, one wave
    g = gemm("gemm_132_ctas", 12 * 128, 11 * 256, 8192)
    ag = Collective("ag", "all_gather", "tp", 8, float(256 * MiB))
    alone = h100.predict_ops((g,), 1980)
    gemm_time = _compute_stream_time(h100, (g,), ag, 24)
    out.append(Anchor("H100 132-CTA GEMM under a 24-CTA AllGather, slowdown", "anchors §3",
                      "x", 2.0, gemm_time / alone.time_s))
    h200 = backend_for("H200", calibration, loop=True)
    g = gemm("gemm_8192x3072x3072", 8192, 3072, 3072)
    alone_s = h200.predict_ops((g,), 1980).time_s
    sr = Collective("sendrecv", "send_recv", "pp", 2, float(256 * MiB))
    ag = Collective("ag", "all_gather", "tp", 8, float(256 * MiB))
    for name, coll, ctas, published in (("SendRecv (8 CTAs)", sr, 8, 1.155),
                                        ("AllGather (24 CTAs)", ag, 24, 1.287)):
        t = _compute_stream_time(h200, (g,), coll, ctas)
        out.append(Anchor(f"H200 8192x3072x3072 GEMM under {name}, slowdown", "anchors §3",
                          "x", published, t / alone_s))
    return out


def _compute_stream_time(b: EmulatorBackend, ops, coll: Collective, sms: int) -> float:
    """When the compute stream finishes with ``coll`` launched alongside from the start."""
    return b.timeline.run(ops, b.gpu.max_freq_mhz, side=coll, side_sms=sms,
                          launch_index=0).compute_end_s


def hopper_clock_anchor(calibration=None) -> list[Anchor]:
    b = backend_for("H200", calibration)
    m = b.predict_ops((gemm("gemm_8192", 8192, 8192, 8192),), 1830)
    return [Anchor("H200 GEMM at a locked 1830 MHz, sustained clock at 700 W", "anchors §1",
                   "MHz", 1500.0, m.effective_freq_mhz)]


ANCHOR_GROUPS: dict[str, Callable[..., list[Anchor]]] = {
    "gemm": gemm_anchor,
    "memory": memory_anchor,
    "a40_profile": a40_profile_anchor,
    "nccl": nccl_anchor,
    "comm_power": comm_power_anchor,
    "overlap": overlap_anchor,
    "hopper_clock": hopper_clock_anchor,
    "iteration": iteration_anchors.iteration_anchor,
    "gemm_shape": kernel_anchors.gemm_shape_anchor,
    "attention": kernel_anchors.attention_anchor,
    "memory_bandwidth": kernel_anchors.memory_bandwidth_anchor,
}

