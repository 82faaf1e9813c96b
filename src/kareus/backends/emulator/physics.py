"""Rates and power of kernels sharing one GPU during one interval of the timeline.

An interval is a stretch of time in which the set of running kernels does not change: at
most one compute kernel (or a launch gap) on the compute stream and at most one collective
on the communication stream. Given the set clock, this module answers: how long would
each kernel take at the current rates, and how much power does the GPU draw; and if that
power exceeds TDP, at which (lower) clock does it actually run.

Equations and constants: docs/emulator.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kareus.backends.emulator import attention
from kareus.backends.emulator.gemm import GemmModel, tile_catalog
from kareus.backends.emulator.params import MEMORY_SM_SHARE, EmulatorParams, default_params
from kareus.job.hardware import ATTENTION_STAND_IN, GPUSpec, get_gpu
from kareus.job.nodes import get_node
from kareus.workload.ops import Collective, ComputeOp

REFERENCE_GEMM_EFFICIENCY = 0.96
"""The best GEMM's efficiency at which `activity_gemm` = 1 draws the SMs' full dynamic power:
attention's power follows its tensor work relative to it (a fixed reference, so that a
calibration fitting `gemm_efficiency` does not move attention's power)."""

_SHARE_X = np.array([x for x, _ in MEMORY_SM_SHARE])
_SHARE_Y = np.array([y for _, y in MEMORY_SM_SHARE])


def bus_factor(kind: str, ranks: int) -> float:
    """nccl-tests bus bandwidth / algorithm bandwidth (docs/anchors.md §3)."""
    if kind == "all_reduce":
        return 2.0 * (ranks - 1) / ranks
    if kind in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks
    return 1.0


def ring_steps(kind: str, ranks: int) -> int:
    if kind == "all_reduce":
        return 2 * (ranks - 1)
    if kind in ("all_gather", "reduce_scatter"):
        return ranks - 1
    return 1


@dataclass(frozen=True)
class KernelRate:
    """A kernel's full duration at the interval's rates, and what it draws meanwhile."""

    duration_s: float
    hbm_bytes_s: float
    sm_power_w: float
    link_power_w: float = 0.0


class GPUPhysics:
    """Kernel rates and power for one GPU model and one parameter set."""

    def __init__(self, gpu: GPUSpec, params: EmulatorParams,
                 internode_bytes_s: float | None = None) -> None:
        """``internode_bytes_s``: each GPU's share of its node's network when traffic leaves
        the node (`kareus.backends.emulator.backend.network_share_bytes_s`); default one
        adapter of the GPU's default node."""
        self.gpu = gpu
        self.p = params
        self.n_sm = gpu.sm_count
        self.f_max = float(gpu.max_freq_mhz)
        self.hbm_bw = gpu.hbm_bandwidth_bytes_s * params.hbm_efficiency
        self.clock_table = np.array(gpu.clock_table_mhz[::-1], dtype=float)  # ascending
        self.intra_link = params.coll_link_busbw_bytes_s
        if internode_bytes_s is None:
            internode_bytes_s = get_node(gpu.default_node).internode_share_bytes_s(1)
        self.inter_link = 0.9 * internode_bytes_s  # achieved: 0.9 of the line rate
        self.gemm = GemmModel(tile_catalog(gpu), params.gemm_efficiency, params.gemm_k0,
                              params.gemm_tile_plan_sms)
        self._attention_eff: dict[tuple[int, bool, bool], float] = {}

    # Voltage and per-SM dynamic power ------------------------------------------------------

    def voltage(self, f_mhz: float) -> float:
        """V(f) / V(f_max): flat below the knee, rising quadratically to 1 at max clock."""
        p = self.p
        knee = p.voltage_knee_fraction * self.f_max
        if f_mhz <= knee:
            return p.voltage_floor
        x = min(1.0, (f_mhz - knee) / (self.f_max - knee))
        return p.voltage_floor + (1.0 - p.voltage_floor) * x * x

    def sm_power_scale(self, f_mhz: float) -> float:
        """Dynamic power of one fully active SM at f, relative to max clock: V(f)^2 f."""
        v = self.voltage(f_mhz)
        return v * v * f_mhz / self.f_max

    # Compute kernels -------------------------------------------------------------------------

    def compute_time(self, op: ComputeOp, f_mhz: float, sms: int) -> float:
        """Time the op's arithmetic (or instruction issue) needs on ``sms`` SMs at f."""
        p = self.p
        flop_rate_per_sm = self.gpu.flop_per_clock_per_sm * f_mhz * 1e6
        if op.kind == "gemm":  # tile chosen by shape and SMs, waves x tile time (gemm.py)
            return self.gemm.plan(op.gemm_shapes, sms).work_flop / flop_rate_per_sm
        if op.kind == "attention":  # published flash-attention throughput (attention.py)
            return op.flops / (flop_rate_per_sm * sms * self.attention_efficiency(op))
        # memory-bound: instruction issue, clock- and SM-bound, a fraction of its memory time
        return (p.memory_issue_fraction * op.bytes_ / self.hbm_bw
                * (self.f_max / f_mhz) * (self.n_sm / sms))

    def attention_efficiency(self, op: ComputeOp) -> float:
        """Fraction of peak at the set clock of a flash-attention kernel (attention.py)."""
        key = (op.attn_keys, op.attn_causal, op.name.endswith("_bwd"))
        hit = self._attention_eff.get(key)
        if hit is None:
            if attention.has_published_runs(self.gpu):
                eff = self._held_clock_efficiency(*key)
            else:  # the A100's efficiency at the set clock: the same kernel (inferred)
                eff = _a100_physics().attention_efficiency(op)
            hit = self._attention_eff[key] = min(0.95, eff * self.p.attention_efficiency_scale)
        return hit

    def _held_clock_efficiency(self, keys: int, causal: bool, backward: bool) -> float:
        """The published throughput was measured at the clock the kernel held at the power
        limit: the highest table clock at which the kernel, running at the efficiency that
        gives that throughput there, draws at most TDP (all SMs, HBM power left out); the
        published fraction itself where no clock fits (not throttled: the cap binds)."""
        p = self.p
        peak = self.gpu.flop_per_clock_per_sm * self.n_sm * self.f_max * 1e-6  # TFLOP/s
        fraction = attention.published_fraction(self.gpu, peak, keys, causal, backward)
        static = self.gpu.static_power_w * p.static_power_scale
        for f in self.clock_table[::-1]:  # from max clock down
            eff = fraction * self.f_max / f
            if eff > 0.95:
                break
            busy = p.activity_attention * eff / REFERENCE_GEMM_EFFICIENCY
            power = static + p.sm_dynamic_power_w * self.sm_power_scale(f) * (
                p.sm_base_activity + busy)
            if power <= self.gpu.tdp_w:
                return eff
        return fraction

    def active_sms(self, op: ComputeOp, sms: int) -> float:
        """Mean number of SMs a kernel keeps busy (a GEMM's last wave is partial)."""
        if op.kind != "gemm":
            return float(sms)
        return self.gemm.plan(op.gemm_shapes, sms).active_sms

    def memory_bandwidth(self, op: ComputeOp, sms: int) -> float:
        """HBM bandwidth the op can pull with ``sms`` SMs (memory-level parallelism)."""
        if op.kind != "memory" or sms >= self.n_sm:
            return self.hbm_bw
        return self.hbm_bw * float(np.interp(sms / self.n_sm, _SHARE_X, _SHARE_Y))

    def contention_slowdown(self, traffic_bytes_s: float) -> float:
        """Stretch of a compute kernel's SM time beside a collective moving
        ``traffic_bytes_s`` HBM bytes/s: 1 + c (traffic / BW_hbm)^e (docs/emulator.md,
        "Interference beyond SM loss")."""
        if traffic_bytes_s <= 0.0 or self.p.interference_coefficient <= 0.0:
            return 1.0
        x = min(1.0, traffic_bytes_s / self.hbm_bw)
        return 1.0 + self.p.interference_coefficient * x ** self.p.interference_exponent

    def compute_rate(self, op: ComputeOp, f_mhz: float, sms: int, hbm_alloc: float,
                     contention: float = 1.0) -> KernelRate:
        """``contention``: `contention_slowdown` of a concurrent collective. It stretches the
        SM time (loads stall), not the arithmetic: the busy fraction, hence the arithmetic
        energy, is that of the unstalled time."""
        t_comp = self.compute_time(op, f_mhz, sms)
        bw = min(hbm_alloc, self.memory_bandwidth(op, sms))
        t_mem = op.bytes_ / bw if op.bytes_ > 0 else 0.0
        duration = max(t_comp * contention, t_mem, 1e-9)
        if op.kind == "gemm":  # each kernel's ramp and drain, SMs mostly idle (params.py)
            duration += self.p.gemm_fixed_s * len(op.gemm_shapes)
        link_power = 0.0
        if op.ring_step_bytes:  # a CP ring inside the op: steps wait for their transfers
            work_s = duration
            duration = self.ring_time(work_s, op.ring_step_bytes)
            sent = sum(op.ring_step_bytes)
            link_power = self.p.link_power_w * sent / (duration * self.intra_link)
        busy = t_comp / duration
        if op.kind == "gemm":  # prologue, epilogue and operand stalls draw less (gemm.py)
            busy *= self.gemm.plan(op.gemm_shapes, sms).tensor_busy
        elif op.kind == "attention":  # tensor work per second relative to the best GEMM
            busy *= self.attention_efficiency(op) / REFERENCE_GEMM_EFFICIENCY
        activity = {"gemm": self.p.activity_gemm, "attention": self.p.activity_attention,
                    "memory": self.p.activity_memory}[op.kind]
        sm_power = (self.p.sm_dynamic_power_w * self.active_sms(op, sms) / self.n_sm
                    * self.sm_power_scale(f_mhz) * (self.p.sm_base_activity + activity * busy))
        return KernelRate(duration, op.bytes_ / duration, sm_power, link_power)

    def ring_time(self, work_s: float, step_bytes: tuple[float, ...]) -> float:
        """Transformer Engine's ring attention (p2p CP, docs/workload.md): ``work_s`` of
        attention split evenly over the ring's steps, each step taking the longer of its
        share of the work and its transfer to the next CP rank, which runs beside it
        (``p2p_latency_s`` plus the bytes at the link's bandwidth). CP ranks share a node
        (`JobSpec` keeps TP x CP inside one), so the link is NVLink's. The SMs NCCL's
        send/recv take from the attention are not modelled."""
        step_s = work_s / len(step_bytes)
        return sum(max(step_s, self.p.p2p_latency_s + b / self.intra_link) if b > 0
                   else step_s for b in step_bytes)

    def compute_hbm_demand(self, op: ComputeOp, f_mhz: float, sms: int) -> float:
        return self.compute_rate(op, f_mhz, sms, self.hbm_bw).hbm_bytes_s

    # Collectives -------------------------------------------------------------------------------

    def coll_latency(self, coll: Collective) -> float:
        if coll.kind == "send_recv":
            return self.p.p2p_latency_s
        return ring_steps(coll.kind, coll.group_size) * self.p.coll_step_latency_s

    def coll_busbw(self, coll: Collective, f_mhz: float, sms: int, internode: bool) -> float:
        """Bus bandwidth: concave in CTAs, saturating at the link (smooth minimum)."""
        p = self.p
        link = self.inter_link if internode else self.intra_link
        cta = sms * p.coll_cta_busbw_bytes_s * (f_mhz / self.f_max) ** p.coll_clock_exponent
        q = p.coll_smoothness
        return (cta ** -q + link ** -q) ** (-1.0 / q)

    def hbm_per_bus_byte(self, coll: Collective) -> float:
        reducing = coll.kind in ("all_reduce", "reduce_scatter")
        return self.p.coll_hbm_per_bus_byte if reducing else 2.0

    def coll_bus_bytes(self, coll: Collective) -> float:
        return coll.bytes_ * bus_factor(coll.kind, coll.group_size)

    def coll_rate(self, coll: Collective, f_mhz: float, sms: int, hbm_alloc: float,
                  internode: bool) -> KernelRate:
        """Rate of the transfer phase (the latency phase is a fixed-duration gap)."""
        busbw = self.coll_busbw(coll, f_mhz, sms, internode)
        k = self.hbm_per_bus_byte(coll)
        busbw = min(busbw, hbm_alloc / k)
        bus_bytes = self.coll_bus_bytes(coll)
        duration = max(bus_bytes / busbw, 1e-9)
        sm_power = (self.p.sm_dynamic_power_w * sms / self.n_sm * self.sm_power_scale(f_mhz)
                    * self.p.activity_collective)
        link = self.inter_link if internode else self.intra_link
        return KernelRate(duration, k * busbw, sm_power, self.p.link_power_w * busbw / link)

    def coll_hbm_demand(self, coll: Collective, f_mhz: float, sms: int, internode: bool
                        ) -> float:
        return self.hbm_per_bus_byte(coll) * self.coll_busbw(coll, f_mhz, sms, internode)

    def coll_latency_power(self, sms: int, f_mhz: float) -> float:
        return (self.p.sm_dynamic_power_w * sms / self.n_sm * self.sm_power_scale(f_mhz)
                * self.p.activity_collective)

    # HBM sharing and throttling ------------------------------------------------------------------

    def share_hbm(self, demand_a: float, demand_b: float) -> tuple[float, float]:
        """Max-min fair split of HBM bandwidth between two kernels."""
        total = self.hbm_bw
        if demand_a + demand_b <= total:
            return total, total  # no contention: each is limited only by itself
        half = total / 2
        if demand_a <= half:
            return demand_a, total - demand_a
        if demand_b <= half:
            return total - demand_b, demand_b
        return half, half

    def hbm_power(self, hbm_bytes_s: float) -> float:
        return self.p.hbm_power_w * min(1.0, hbm_bytes_s / self.gpu.hbm_bandwidth_bytes_s)


@functools.lru_cache(maxsize=1)
def _a100_physics() -> GPUPhysics:
    """The A100 with its default constants: flash attention's efficiency on GPUs without
    published runs of their own (`ATTENTION_STAND_IN`)."""
    a100 = get_gpu(ATTENTION_STAND_IN)
    return GPUPhysics(a100, default_params(a100))
