"""The baseline datacenters run under a power budget today: Megatron-LM at its highest
clock with every GPU's board power limit lowered (`nvidia-smi -pl`), and the iso-power
comparison against it (issue 26).

Under a lower limit the GPU's power limiter holds the clock down wherever the averaged
power would exceed it, so clocks fluctuate with the kernels. The emulator runs the
Megatron-LM iteration through its limiter at each limit of `LIMIT_FRACTIONS` (of the TDP)
as one continuous whole iteration (kareus.backends.emulator.iteration), noise-free. The
nvml backend does not set power limits: on real GPUs this baseline is not measured (a
CPU machine can show neither its time nor its energy).

Iso-power: at a cluster power level (Megatron-LM's own mean power at max clock, and 80% of
it), each method's fastest plan whose mean power stays at or under it; for the
power-limited baseline, its time at that mean power, interpolated linearly in mean power
between the two limits around it (the limits are a coarse grid).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kareus.backends.registry import BackendSpec
from kareus.plans.methods import ISO_REFERENCE, PROPOSED, THROUGHPUT_BASELINE, by_role
from kareus.plans.plan import Plan
from kareus.workload.workload import Workload

LIMIT_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
"""Board power limits, as fractions of the GPU's TDP."""
ISO_POWER_LEVELS = (1.0, 0.8)
"""Cluster power levels, as fractions of Megatron-LM's mean power at max clock."""


@dataclass(frozen=True)
class LimitedRun:
    limit_fraction: float
    limit_w: float
    """Per GPU."""
    time_s: float
    energy_j: float

    @property
    def mean_power_w(self) -> float:
        return self.energy_j / self.time_s

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "mean_power_w": self.mean_power_w}


def power_limited_megatron(workload: Workload, backend: BackendSpec,
                           fractions: tuple[float, ...] = LIMIT_FRACTIONS
                           ) -> list[LimitedRun] | None:
    """Megatron-LM at max clock under each board power limit (None: the backend cannot
    simulate it)."""
    job = workload.job
    limits = [job.gpu_spec.tdp_w * frac for frac in fractions]
    sims = [backend.power_limited_simulator(workload, limit) for limit in limits]
    if any(sim is None for sim in sims):
        return None
    plan = by_role("throughput_baseline").baseline_plan(job)
    runs = [sim.run(plan) for sim in sims if sim is not None]
    return [LimitedRun(frac, limit, r.time_s, r.energy_j)
            for frac, limit, r in zip(fractions, limits, runs, strict=True)]


def _fastest_under(plans: list[Plan], level_w: float) -> Plan | None:
    ok = [p for p in plans if p.power is not None and p.power.mean_w <= level_w]
    return min(ok, key=lambda p: (p.time_s, p.energy_j)) if ok else None


def limited_time_at(runs: list[LimitedRun], level_w: float) -> float | None:
    """The power-limited baseline's time at mean cluster power ``level_w``: interpolated
    between the limits around it; None below the lowest limit's mean power."""
    pts = sorted((r.mean_power_w, r.time_s) for r in runs)
    if level_w < pts[0][0]:
        return None
    if level_w >= pts[-1][0]:
        return pts[-1][1]
    return float(np.interp(level_w, [p[0] for p in pts], [p[1] for p in pts]))


def iso_power(plans: dict[str, list[Plan]], runs: list[LimitedRun] | None,
              levels: tuple[float, ...] = ISO_POWER_LEVELS) -> list[dict[str, Any]]:
    """Per level (a fraction of Megatron-LM's mean cluster power at max clock): the level
    in W, each method's fastest time at or under it, the power-limited baseline's, and
    Kareus's time saving against that baseline and against Perseus."""
    megatron = plans.get(THROUGHPUT_BASELINE)
    if not megatron or megatron[0].power is None:
        return []
    reference_w = min(megatron, key=lambda p: p.time_s).power.mean_w  # type: ignore[union-attr]
    out = []
    for frac in levels:
        level = reference_w * frac
        times: dict[str, float | None] = {}
        for method, ps in plans.items():
            best = _fastest_under(ps, level)
            times[method] = best.time_s if best is not None else None
        limited = limited_time_at(runs, level) if runs else None
        kareus, perseus = times.get(PROPOSED), times.get(ISO_REFERENCE)
        out.append({
            "level_fraction": frac, "level_w": level, "time_s": times,
            "megatron_power_limited_time_s": limited,
            "kareus_time_saving_vs_power_limited": (
                1 - kareus / limited if kareus is not None and limited else None),
            "kareus_time_saving_vs_perseus": (
                1 - kareus / perseus if kareus is not None and perseus else None)})
    return out
